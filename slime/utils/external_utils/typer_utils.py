"""`dataclass_cli`, slime's: a command-line interface (typer) built from the fields of a dataclass.

`fn(config: SomeDataclass)` becomes a typer command with one option per field (`--field-name`), each also read
from the environment variable `SLIME_SCRIPT_<FIELD_NAME>` (the prefix is an argument). The command prints the
dataclass it built, then calls `fn` with it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Annotated

import typer


def dataclass_cli(fn, env_var_prefix: str = "SLIME_SCRIPT_"):
    params = list(inspect.signature(fn).parameters.values())
    config_cls = params[0].annotation if params else None
    if isinstance(config_cls, str):  # postponed annotations: resolve in the function's module
        config_cls = typing.get_type_hints(fn).get(params[0].name)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"dataclass_cli: the first parameter of {fn.__qualname__} must be annotated with a dataclass")
    hints = typing.get_type_hints(config_cls)
    options = []
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        option = typer.Option(envvar=f"{env_var_prefix}{f.name.upper()}")
        options.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                         annotation=Annotated[hints[f.name], option]))

    def command(**kwargs):
        config = config_cls(**kwargs)
        print(f"Execute command with args: {config}")
        return fn(config)

    command.__signature__ = inspect.Signature(options)
    command.__doc__, command.__name__, command.__qualname__ = fn.__doc__, fn.__name__, fn.__qualname__
    return command
