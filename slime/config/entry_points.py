"""slime's argument entry points with slime's signatures, re-exported at slime's path `slime.utils.arguments` for
plugins and scripts written for slime; each is a thin adapter onto the parser and validation of
slime/config/arguments.py:

- `parse_args(add_custom_arguments=None)`: parse and validate sys.argv; `add_custom_arguments(parser)` adds a
  plugin's own flags first (it may return the parser or None);
- `slime_validate_args(args)`: validate slime's own flags of a namespace in place (what slime's function of that
  name checks: batch sizes, colocation, debug paths, weight-sync couplings, ...; not the Megatron flags, plugin
  paths or files). A partial namespace is completed with the parser's defaults first.

(`reset_arg` and the per-role Megatron overrides, slime's other names there, are re-exported as they are.)
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.arguments import CustomArguments, build_parser, complete_namespace, validate_slime_flags
from slime.config.arguments import parse_args as _parse_args


def parse_args(add_custom_arguments: CustomArguments | None = None) -> argparse.Namespace:
    """Parse and validate the process's command line (slime's signature)."""
    return _parse_args(None, add_custom_arguments)


def slime_validate_args(args: Any) -> Any:
    """Validate slime's own flags of `args` in place (see the module docstring); raises SlimeArgumentError."""
    return validate_slime_flags(complete_namespace(args, build_parser()))
