"""slime's argument entry points at slime's path (`slime.utils.arguments`), onto slime/config.

Plugins and scripts written for slime call these; each is a thin adapter onto the one implementation in
`slime.config.arguments` (parser, validation) or `slime.utils.megatron_roles` (per-role overrides):

- `parse_args(add_custom_arguments=None)`: parse and validate sys.argv; `add_custom_arguments(parser)` adds a
  plugin's own flags first (it may return the parser or None);
- `slime_validate_args(args)`: validate slime's own flags of a namespace in place (what slime's function of that
  name checks: batch sizes, colocation, debug paths, weight-sync couplings, ...; not the Megatron flags, plugin
  paths or files). A partial namespace is completed with the parser's defaults first;
- `parse_megatron_role_args(base_args, megatron_config_path, role)`: a copy of the args with a role's overrides
  from a `--megatron-config-path` YAML;
- `reset_arg(parser, name, **kwargs)`: change a flag's default (or add the flag) inside `add_custom_arguments`.

This module is an entry point that lives on the floor's path only because slime put it there: it belongs to the
configuration layer (docs/architecture.md, "slime's import paths").
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.arguments import (
    CustomArguments,
    build_parser,
    complete_namespace,
    reset_arg,
    validate_slime_flags,
)
from slime.config.arguments import parse_args as _parse_args
from slime.utils.megatron_roles import apply_megatron_role_overrides, parse_megatron_role_args

__all__ = ["parse_args", "parse_megatron_role_args", "reset_arg", "slime_validate_args"]

_apply_megatron_role_overrides = apply_megatron_role_overrides  # slime's private name


def parse_args(add_custom_arguments: CustomArguments | None = None) -> argparse.Namespace:
    """Parse and validate the process's command line (slime's signature)."""
    return _parse_args(None, add_custom_arguments)


def slime_validate_args(args: Any) -> Any:
    """Validate slime's own flags of `args` in place (see the module docstring); raises SlimeArgumentError."""
    return validate_slime_flags(complete_namespace(args, build_parser()))
