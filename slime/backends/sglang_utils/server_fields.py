"""What the installed SGLang accepts on its command line: one `ServerField` per flag name.

Two sources, both SGLang's own:
- the fields of `sglang.srt.server_args.ServerArgs` (a dataclass in older releases, a msgspec Struct with fields
  annotated `Annotated[T, help | Arg(...)]` in 0.5.2x): their types, choices and CLI metadata;
- the option strings `ServerArgs.add_cli_args(parser)` registers: aliases (`--expert-parallel-size` and `--ep`
  for `ep_size`), flags whose name differs from their field (`--fp8-gemm-backend`), flags added by hand
  (`--reasoning-parser`, `--sampling-backend`) and deprecated ones (`--enable-dp-attention`, `--cuda-graph-bs`
  in 0.5.16), each mapped to the field it sets.

`server_fields()` returns `{name: ServerField}` where `name` is a flag without its dashes, in field spelling
(`expert_parallel_size`), plus every field name; `ServerField.name` is the field a value is stored under.

Simplification: a flag that sets its field to something other than the value given (`--no-x` of an
`--x/--no-x` pair, a store-const alias such as 0.5.16's `--enable-breakable-cuda-graph`) is not mapped onto
that field: it is an entry of its own, named and rendered as the flag itself, so SGLang applies its meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import logging
import sys
import typing
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

SGLANG_REQUIREMENT = "sglang==0.5.23"
INSTALL_HINT = (f"install SGLang where the engines run: pip install {SGLANG_REQUIREMENT} "
                "(or use the docker/Dockerfile image), or use --rollout-backend hf")

# Flags SGLang renamed, with the release that still takes the old name (as a deprecated alias of the new one)
# and the value meaning the same. slime's launch scripts use the old names (slime pins SGLang 0.5.15); where the
# installed SGLang knows only one of a pair, a flag given by the other name is forwarded under the one it knows.
RENAMED_FLAGS: dict[str, tuple[str, str]] = {
    # old name: (new name, a release that accepts both)
    "cuda_graph_bs": ("cuda_graph_bs_decode", "0.5.16"),
    "cuda_graph_max_bs": ("cuda_graph_max_bs_decode", "0.5.16"),
    "piecewise_cuda_graph_tokens": ("cuda_graph_bs_prefill", "0.5.16"),
    "piecewise_cuda_graph_max_tokens": ("cuda_graph_max_bs_prefill", "0.5.16"),
    "piecewise_cuda_graph_compiler": ("cuda_graph_tc_compiler", "0.5.16"),
    "nsa_prefill_backend": ("dsa_prefill_backend", "0.5.16"),
    "nsa_decode_backend": ("dsa_decode_backend", "0.5.16"),
    "mamba_scheduler_strategy": ("mamba_radix_cache_strategy", "0.5.16"),
    "stream_output": ("incremental_streaming_output", "0.5.16"),
    "speculative_dflash_draft_window_size": ("speculative_draft_window_size", "0.5.16"),
}

# argparse actions that store the value given (or True for a bare flag) in their dest: an alias of one of
# these sets the same field as the field's own flag. sglang's deprecated aliases are matched by class name.
_STORING_ACTIONS = (argparse._StoreAction, argparse._StoreTrueAction)
_STORING_ACTION_NAMES = {"DeprecatedAliasStoreAction", "DeprecatedStoreTrueAction"}


@dataclass(frozen=True)
class ServerField:
    """One field of `ServerArgs` (or one flag of SGLang's that stands alone) as far as forwarding needs it."""

    name: str  # the field the value is stored under (argparse's dest), or the flag's own name
    annotation: Any  # `Annotated[...]` stripped
    cli_flag: str | None  # the flag rendered for it; None: SGLang has no command-line flag for it
    negatable: bool = False  # an `--x / --no-x` boolean
    own_parser: bool = False  # SGLang parses the string itself (type_parser, or an action of its own)
    choices: tuple | None = None  # the CLI's allowed values, when SGLang lists them


def flag_of(field: str) -> str:
    return "--sglang-" + field.replace("_", "-")


def name_of(flag: str) -> str:
    """`--expert-parallel-size` -> `expert_parallel_size`."""
    return flag.lstrip("-").replace("-", "_")


def strip_annotated(tp: Any) -> tuple[Any, tuple]:
    if typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        return args[0], tuple(args[1:])
    return tp, ()


def _field_of(name: str, annotation: Any) -> ServerField:
    tp, meta = strip_annotated(annotation)
    cli_flag, negatable, own_parser, choices = "--" + name.replace("_", "-"), False, False, None
    for m in meta:  # sglang's `Arg(...)` CLI metadata, read by attribute so any release's shape works
        if getattr(m, "no_cli", False):
            cli_flag = None
        elif getattr(m, "cli_name", None):
            cli_flag = m.cli_name
        action = getattr(m, "action", None)
        negatable = negatable or getattr(action, "__name__", "") == "BooleanOptionalAction"
        own_parser = own_parser or getattr(m, "type_parser", None) is not None
        if getattr(m, "choices", None):
            choices = tuple(m.choices)
    return ServerField(name, tp, cli_flag, negatable, own_parser, choices)


def fields_of(server_args_cls: type) -> dict[str, ServerField]:
    """Public fields of a `ServerArgs` class (dataclass or msgspec Struct), by field name."""
    if dataclasses.is_dataclass(server_args_cls):
        try:
            hints = typing.get_type_hints(server_args_cls, include_extras=True)
        except Exception:  # noqa: BLE001 (unresolvable forward refs: fall back to the raw annotations)
            hints = {}
        pairs = [(f.name, hints.get(f.name, f.type)) for f in dataclasses.fields(server_args_cls)]
    else:
        import msgspec

        pairs = [(f.name, f.type) for f in msgspec.structs.fields(server_args_cls)]
    return {name: _field_of(name, tp) for name, tp in pairs if not name.startswith("_")}


def _annotation_of(action: argparse.Action) -> tuple[Any, bool]:
    """(annotation, own_parser) for a flag that is no field of ServerArgs, from its argparse action."""
    if action.nargs == 0:
        return bool, False
    item = action.type or str
    own_parser = item not in (int, float, str)
    if own_parser:
        item = Any
    if action.nargs in ("+", "*") or isinstance(action.nargs, int) and action.nargs > 1:
        return list[item], own_parser
    return (Optional[item] if action.nargs == "?" else item), own_parser  # noqa: UP045


def _stores_value(action: argparse.Action) -> bool:
    return isinstance(action, _STORING_ACTIONS) or type(action).__name__ in _STORING_ACTION_NAMES


def with_cli_options(fields: dict[str, ServerField], actions: list[argparse.Action]) -> dict[str, ServerField]:
    """`fields` (by field name) plus an entry per long option string of SGLang's parser `actions`. The parser
    is the authority on flags: a field none of its options sets has no command-line flag."""
    table = {name: dataclasses.replace(field, cli_flag=None) for name, field in fields.items()}
    for action in actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        dest = action.dest
        negatable = isinstance(action, argparse.BooleanOptionalAction)
        setting = [f for f in flags if not (negatable and f.startswith("--no-"))]
        if not (_stores_value(action) or negatable or all(name_of(f) == dest for f in setting)):
            setting = [f for f in setting if name_of(f) == dest]  # an alias with a meaning of its own
        field = table.get(dest)
        if field is None:
            annotation, own_parser = _annotation_of(action)
            field = ServerField(dest, annotation, None, own_parser=own_parser)
        if setting:
            choices = field.choices or (tuple(action.choices) if action.choices and action.nargs != 0 else None)
            field = dataclasses.replace(field, cli_flag=field.cli_flag or setting[0], choices=choices,
                                        negatable=field.negatable or negatable)
            table[dest] = field
        for flag in flags:
            name = name_of(flag)
            if name in fields and name != dest:
                continue  # a field's own name wins over another field's alias
            if flag in setting:
                table[name] = field
            elif name not in table:
                annotation, own_parser = _annotation_of(action) if not negatable else (bool, False)
                choices = tuple(action.choices) if action.choices and action.nargs != 0 else None
                table[name] = ServerField(name, annotation, flag, own_parser=own_parser, choices=choices)
    return table


@functools.lru_cache(maxsize=1)
def server_fields() -> dict[str, ServerField] | None:
    """The installed sglang's flags and fields, or None when sglang cannot be imported here (said once)."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as e:  # noqa: BLE001 (a broken install is as good as none: say why, check nothing)
        logger.warning("--sglang-<field> flags are not checked against SGLang's ServerArgs: sglang does not import "
                       "here (%s: %s); %s", type(e).__name__, e, INSTALL_HINT)
        return None
    fields = fields_of(ServerArgs)
    parser = argparse.ArgumentParser(add_help=False)
    try:
        ServerArgs.add_cli_args(parser)
    except Exception as e:  # noqa: BLE001 (its flags' aliases are a refinement: the fields still check)
        logger.warning("SGLang %s: ServerArgs.add_cli_args failed (%s: %s); --sglang-<flag> aliases and "
                       "deprecated flags are not recognised, only field names", sglang_version(), type(e).__name__, e)
        return fields
    return with_cli_options(fields, parser._actions)


def sglang_version() -> str:
    """The version of the sglang this process imported (else of the one installed), for messages."""
    imported = getattr(sys.modules.get("sglang"), "__version__", None)
    if imported:
        return str(imported)
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def renamed(name: str, known: dict[str, ServerField]) -> tuple[str, str] | None:
    """(the name `known` has, a release taking both) for a flag SGLang renamed; None when not a rename."""
    for old, (new, both) in RENAMED_FLAGS.items():
        if name == old and new in known:
            return new, both
        if name == new and old in known:
            return old, both
    return None
