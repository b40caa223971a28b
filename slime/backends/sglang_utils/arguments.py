"""`--sglang-<field>` forwarding, checked against SGLang's own `ServerArgs`.

The accepted fields are read from the installed sglang (`sglang.srt.server_args.ServerArgs`), so an option
added to SGLang works here without a code change. `ServerArgs` is a dataclass in older releases and a
msgspec Struct (fields annotated `Annotated[T, help | Arg(...)]`) in 0.5.2x; both are read. A forwarded
value arrives from the command line as a string (a bare flag is True, several values a list) or from
`--custom-config-path` YAML already typed; `convert_sglang_args` types it by the field's annotation
(bool, int, float, str, Literal choices, Optional/Union, lists, JSON dicts) and `sglang_cli_args` turns the
typed values back into `sglang.launch_server` flags.

Simplifications:
- fields whose CLI value SGLang parses with a parser of its own (JSON lists, "16k"-style integers; the
  `type_parser` of their `Arg`) are checked for existence only and handed over as given;
- annotations we cannot type (callables, SGLang classes) keep the value as given;
- without sglang importable in this process nothing is checked: values stay as given and flags are
  rendered as `--<field-with-dashes>` (the SGLang backend refuses to launch without sglang anyway).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import types
import typing
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SGLANG_REQUIREMENT = "sglang==0.5.23"
INSTALL_HINT = (f"install SGLang where the engines run: pip install {SGLANG_REQUIREMENT} "
                "(or use the docker/Dockerfile image), or use --rollout-backend hf")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


class SGLangArgumentError(ValueError):
    """A forwarded `--sglang-<field>` that SGLang's ServerArgs does not accept; the message names the flag."""


@dataclass(frozen=True)
class ServerField:
    """One `ServerArgs` field as far as forwarding needs it."""

    name: str
    annotation: Any  # `Annotated[...]` stripped
    cli_flag: str | None  # None: SGLang has no command-line flag for it
    negatable: bool = False  # an `--x / --no-x` boolean
    own_parser: bool = False  # SGLang parses the string itself (type_parser)
    choices: tuple | None = None  # the CLI's allowed values, when SGLang lists them


def flag_of(field: str) -> str:
    return "--sglang-" + field.replace("_", "-")


def _strip_annotated(tp: Any) -> tuple[Any, tuple]:
    if typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        return args[0], tuple(args[1:])
    return tp, ()


def _field_of(name: str, annotation: Any) -> ServerField:
    tp, meta = _strip_annotated(annotation)
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
    """Public fields of a `ServerArgs` class (dataclass or msgspec Struct)."""
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


@functools.lru_cache(maxsize=1)
def server_fields() -> dict[str, ServerField] | None:
    """The installed sglang's ServerArgs fields, or None when sglang cannot be imported here (said once)."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as e:  # noqa: BLE001 (a broken install is as good as none: say why, check nothing)
        logger.warning("--sglang-<field> flags are not checked against SGLang's ServerArgs: sglang does not import "
                       "here (%s: %s); %s", type(e).__name__, e, INSTALL_HINT)
        return None
    return fields_of(ServerArgs)


# ---- typing the values ----------------------------------------------------------------------------------
def as_bool(raw: Any) -> bool:
    """A forwarded flag's value as a bool: True for a bare flag, true/false/1/0/yes/no/on/off as text."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
        return raw.lower() in _TRUE
    raise ValueError(f"expected a boolean (a bare flag, true or false), got {raw!r}")


def _scalar(tp: Any, raw: Any) -> Any:
    if tp is bool:
        return as_bool(raw)
    if raw is True:
        raise ValueError("needs a value")
    if tp is int:
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"expected an integer, got {raw!r}")
        return int(raw)
    if tp is float:
        if isinstance(raw, bool):
            raise ValueError(f"expected a number, got {raw!r}")
        return float(raw)
    if tp is str:
        return raw if isinstance(raw, str) else str(raw)
    raise TypeError(tp)


def convert_value(tp: Any, raw: Any) -> Any:
    """Type `raw` (str, True for a bare flag, list of str, or an already typed YAML value) as annotation `tp`."""
    tp, _ = _strip_annotated(tp)
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return raw
    if origin in (typing.Union, types.UnionType):
        options = [a for a in targs if a is not type(None)]
        none_spelled = raw is None or (isinstance(raw, str) and raw.lower() in _NONE and str not in options)
        if none_spelled and type(None) in targs:
            return None
        errors = []
        for option in options:
            try:
                return convert_value(option, raw)
            except (ValueError, TypeError) as e:
                errors.append(str(e))
        raise ValueError("; ".join(dict.fromkeys(errors)) or f"cannot use {raw!r}")
    if origin is typing.Literal:
        for choice in targs:
            if raw == choice or (isinstance(raw, str) and raw == str(choice)):
                return choice
        raise ValueError(f"{raw!r} is not one of {list(targs)}")
    if origin in (list, set, tuple, frozenset) or tp in (list, set, tuple):
        item = targs[0] if targs else Any
        values = raw if isinstance(raw, (list, tuple, set)) else [raw]
        if item is Any:
            return list(values)
        return [convert_value(item, v) for v in values]
    if origin is dict or tp is dict:
        value = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {raw!r}")
        return value
    if tp in (bool, int, float, str):
        if isinstance(raw, list):
            raise ValueError(f"takes one value, got {len(raw)}: {raw}")
        return _scalar(tp, raw)
    return raw  # a class or callable: SGLang's own parsing decides


def convert_sglang_args(raw_args: dict[str, Any], fields: dict[str, ServerField]) -> dict[str, Any]:
    """Check every forwarded field exists in `fields` and type its value; raises SGLangArgumentError."""
    out = {}
    for name, raw in raw_args.items():
        field = fields.get(name)
        if field is None:
            close = difflib.get_close_matches(name, list(fields), n=3)
            hint = f"; did you mean {', '.join(flag_of(c) for c in close)}?" if close else ""
            raise SGLangArgumentError(f"{flag_of(name)}: the installed SGLang's ServerArgs has no field "
                                      f"{name!r}{hint}")
        if field.cli_flag is None:
            raise SGLangArgumentError(f"{flag_of(name)}: SGLang offers no command-line flag for {name!r}, so "
                                      "it cannot be forwarded; drop it")
        if field.own_parser:
            out[name] = raw
            continue
        try:
            out[name] = value = convert_value(field.annotation, raw)
            for v in value if isinstance(value, list) else [value]:
                if field.choices and v is not None and v not in field.choices:
                    raise ValueError(f"{v!r} is not one of {list(field.choices)}")
        except (ValueError, TypeError) as e:
            raise SGLangArgumentError(f"{flag_of(name)} {raw!r}: not a valid value for ServerArgs.{name} "
                                      f"({_type_name(field.annotation)}): {e}") from e
    return out


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


# ---- back to sglang.launch_server flags -----------------------------------------------------------------
def sglang_cli_args(values: dict[str, Any], fields: dict[str, ServerField] | None = None) -> list[str]:
    """`{"mem_fraction_static": 0.7, "enable_x": True, "cuda_graph_bs": [1, 2]}` ->
    `["--mem-fraction-static", "0.7", "--enable-x", "--cuda-graph-bs", "1", "2"]`. None and False are
    left out (SGLang's default applies), except `--no-<flag>` for negatable booleans."""
    out: list[str] = []
    for name, value in values.items():
        field = (fields or {}).get(name)
        flag = field.cli_flag if field and field.cli_flag else "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            if field is not None and field.negatable:
                out.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple, set)):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out
