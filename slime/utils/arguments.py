"""slime's `slime.utils.arguments`: its argument entry points, re-exported from the configuration layer
(slime/config/entry_points.py: `parse_args`, `slime_validate_args`; slime/config/arguments.py: `reset_arg`, to
change a flag's default or add a flag inside `add_custom_arguments`) and the per-role Megatron overrides of a
`--megatron-config-path` YAML (slime/utils/megatron_roles.py: `parse_megatron_role_args`, and slime's private
`_apply_megatron_role_overrides`).

A facade for plugins and scripts only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
"""

from __future__ import annotations

from slime.config.arguments import reset_arg
from slime.config.entry_points import parse_args, slime_validate_args
from slime.utils.megatron_roles import apply_megatron_role_overrides as _apply_megatron_role_overrides  # noqa: F401
from slime.utils.megatron_roles import parse_megatron_role_args

__all__ = ["parse_args", "parse_megatron_role_args", "reset_arg", "slime_validate_args"]
