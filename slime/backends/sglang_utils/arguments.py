"""`--sglang-<flag>` forwarding, checked against the installed SGLang's own command line.

A forwarded `--sglang-<flag>` is resolved through what the installed sglang accepts (server_fields.py: the
fields of `ServerArgs` and every option string `ServerArgs.add_cli_args` registers, aliases and deprecated
flags included) and stored under the field it sets (`--sglang-expert-parallel-size 8` -> `ep_size: 8`), so an
option added to SGLang works here without a code change. A flag SGLang renamed (`RENAMED_FLAGS`) that the
installed release knows only by its other name is forwarded under that name, with an info line. A value
arrives from the command line as a string (a bare flag is True, several values a list) or from
`--custom-config-path` YAML already typed; it is typed by the field's annotation (bool, int, float, str,
Literal choices, Optional/Union, lists, JSON dicts) and `sglang_cli_args` turns the typed values back into
`sglang.launch_server` flags.

Simplifications:
- fields whose CLI value SGLang parses with a parser of its own (JSON lists, "16k"-style integers; the
  `type_parser` of their `Arg`) are checked for existence only and handed over as given;
- annotations we cannot type (callables, SGLang classes) keep the value as given;
- without sglang importable in this process nothing is checked: values stay as given and flags are
  rendered as `--<field-with-dashes>` (the SGLang backend refuses to launch without sglang anyway).
"""

from __future__ import annotations

import difflib
import json
import logging
import types
import typing
from typing import Any

from slime.backends.sglang_utils.server_fields import (
    INSTALL_HINT,
    ServerField,
    fields_of,
    flag_of,
    renamed,
    server_fields,
    sglang_version,
    strip_annotated,
)

# INSTALL_HINT, fields_of, flag_of, server_fields and sglang_version are server_fields.py's, named here too
# because the engines and the parser import this module for everything about forwarded flags.
__all__ = [
    "INSTALL_HINT", "SGLangArgumentError", "ServerField", "as_bool", "check_sglang_args", "convert_sglang_args",
    "convert_value", "fields_of", "flag_of", "resolve_flag", "server_fields", "sglang_cli_args", "sglang_version",
]

logger = logging.getLogger(__name__)

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


class SGLangArgumentError(ValueError):
    """A forwarded `--sglang-<flag>` that the installed SGLang does not accept; the message names the flag."""


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
    tp, _ = strip_annotated(tp)
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


# ---- resolving and checking forwarded flags -------------------------------------------------------------
def resolve_flag(name: str, fields: dict[str, ServerField]) -> ServerField:
    """The field `--sglang-<name>` sets; raises SGLangArgumentError for a flag the installed SGLang lacks."""
    field = fields.get(name)
    if field is None and (rename := renamed(name, fields)) is not None:
        known, both = rename
        field = fields[known]
        logger.info("%s: forwarded as --%s, the name SGLang %s knows it by (SGLang renamed it; %s accepts both)",
                    flag_of(name), known.replace("_", "-"), sglang_version(), both)
    if field is None:
        close = difflib.get_close_matches(name, list(fields), n=3)
        hint = f"; did you mean {', '.join(flag_of(c) for c in close)}?" if close else ""
        raise SGLangArgumentError(f"{flag_of(name)}: the installed SGLang ({sglang_version()}) has no flag "
                                  f"--{name.replace('_', '-')}{hint}")
    if field.cli_flag is None:
        raise SGLangArgumentError(f"{flag_of(name)}: SGLang offers no command-line flag for {name!r}, so "
                                  "it cannot be forwarded; drop it")
    return field


def _typed(name: str, field: ServerField, raw: Any) -> Any:
    if field.own_parser:
        return raw
    try:
        value = convert_value(field.annotation, raw)
        for v in value if isinstance(value, list) else [value]:
            if field.choices and v is not None and v not in field.choices:
                raise ValueError(f"{v!r} is not one of {list(field.choices)}")
    except (ValueError, TypeError) as e:
        raise SGLangArgumentError(f"{flag_of(name)} {raw!r}: not a valid value for ServerArgs.{field.name} "
                                  f"({_type_name(field.annotation)}): {e}") from e
    return value


def check_sglang_args(raw_args: dict[str, Any], fields: dict[str, ServerField]
                      ) -> tuple[dict[str, Any], list[SGLangArgumentError]]:
    """Resolve and type every forwarded flag: ({field: typed value}, the problems). A flag with a problem
    keeps its name and raw value in the result."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    problems: list[SGLangArgumentError] = []
    for name, raw in raw_args.items():
        try:
            field = resolve_flag(name, fields)
            value = _typed(name, field, raw)
            if field.name in out and out[field.name] != value:
                raise SGLangArgumentError(f"{flag_of(name)} {raw!r}: sets ServerArgs.{field.name}, which "
                                          f"{flag_of(given_as[field.name])} already sets to {out[field.name]!r}; "
                                          "keep one of the two")
        except SGLangArgumentError as e:
            problems.append(e)
            out[name] = raw
            continue
        out[field.name], given_as[field.name] = value, name
    return out, problems


def convert_sglang_args(raw_args: dict[str, Any], fields: dict[str, ServerField]) -> dict[str, Any]:
    """{field: typed value} for the forwarded flags; raises SGLangArgumentError (the first problem)."""
    out, problems = check_sglang_args(raw_args, fields)
    if problems:
        raise problems[0]
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
