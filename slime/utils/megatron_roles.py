"""Per-role Megatron overrides (`--megatron-config-path`): slime's YAML of actor / critic settings.

    megatron:
      - name: default
        role: critic
        overrides: {lr: 1e-5, tensor_model_parallel_size: 2}

`parse_megatron_role_args(args, path, role)` returns a copy of `args` with that role's overrides applied (a role
without an entry inherits `args` unchanged); slime.utils.arguments exposes it at slime's path. `role_args(args,
role)` is what a training group of that role is built from (the actor's group, with its reference model, and the
PPO critic's): `args` itself without `--megatron-config-path`. The overrides are applied to the validated args, as
slime applies them (derived values are not derived again); validation checks each role's copy before Ray starts
(slime/config/arg_groups/megatron.py, `check_megatron_roles`). The critic's copy
also drops what only the actor does (a KL shaping coefficient, distillation, a custom advantage function) and
never ties its embeddings (its output layer is a value head). Values YAML reads as strings (`1e-5`) take the
type of the argument they replace. GPU counts follow the command line: `num_nodes` / `num_gpus_per_node`
entries are ignored, as in slime.

A malformed file raises `MegatronRoleConfigError`, both a `SlimeArgumentError` (the message names the file and
the fix) and an `AssertionError` (what slime raises, so code catching that keeps working).
"""

from __future__ import annotations

import argparse
import copy
import logging
from typing import Any

from slime.utils.errors import SlimeArgumentError
from slime.utils.misc import read_yaml

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic")
IGNORED_KEYS = ("num_nodes", "num_gpus_per_node")
_EXAMPLE = "megatron: [{name: default, role: critic, overrides: {lr: 1e-5}}]"


class MegatronRoleConfigError(SlimeArgumentError, AssertionError):
    """A --megatron-config-path file that does not have slime's layout."""


def megatron_role_overrides(path: str, role: str) -> dict[str, Any]:
    """The `overrides` (or `args`) mapping of `role`'s entry in the YAML at `path`; {} when it has none."""
    if role not in ROLES:
        raise MegatronRoleConfigError(f"role {role!r}: a Megatron config role is one of {list(ROLES)}")
    config = read_yaml(path, "--megatron-config-path", MegatronRoleConfigError) or {}
    entries = config.get("megatron") if isinstance(config, dict) else None
    if not isinstance(entries, list):
        raise MegatronRoleConfigError(f"--megatron-config-path {path}: the file must have a top-level 'megatron' "
                                      f"list of role entries, e.g. {_EXAMPLE}")
    mine = [e for e in entries if isinstance(e, dict) and e.get("role") == role]
    if len(mine) > 1:
        raise MegatronRoleConfigError(f"--megatron-config-path {path}: {len(mine)} entries have role {role}; keep "
                                      "at most one per role")
    if not mine:
        return {}
    overrides = mine[0].get("overrides") or mine[0].get("args") or {}
    if not isinstance(overrides, dict):
        raise MegatronRoleConfigError(f"--megatron-config-path {path}: the {role} entry's overrides must be a "
                                      f"mapping of argument names to values, got {type(overrides).__name__}")
    return overrides


def _typed_like(original: Any, value: Any) -> Any:
    """YAML reads `1e-5` as a string: give it the type of the number it replaces (else keep it as given)."""
    if isinstance(value, str) and isinstance(original, (int, float)) and not isinstance(original, bool):
        try:
            return type(original)(value)
        except ValueError:
            return value
    return value


def apply_megatron_role_overrides(base_args: argparse.Namespace, overrides: dict[str, Any],
                                  role: str) -> argparse.Namespace:  # fmt: skip
    """A deep copy of `base_args` with `overrides` set (see the module docstring)."""
    role_args = copy.deepcopy(base_args)
    for key, value in overrides.items():
        if key in IGNORED_KEYS:
            logger.info("%s config key %r ignored: GPU counts follow the command line.", role, key)
            continue
        if hasattr(role_args, key):
            value = _typed_like(getattr(role_args, key), value)
        else:
            logger.warning("%s config key %r is not an argument of slime; set anyway.", role, key)
        setattr(role_args, key, value)
    if role == "critic":
        role_args.kl_coef = 0
        role_args.use_opd = False
        role_args.custom_advantage_function_path = None
        role_args.untie_embeddings_and_output_weights = True
        if "disable_param_buffers_cpu_backup" not in overrides:
            role_args.disable_param_buffers_cpu_backup = False
    return role_args


def parse_megatron_role_args(base_args: argparse.Namespace, megatron_config_path: str,
                             role: str) -> argparse.Namespace:  # fmt: skip
    """`base_args` with `role`'s overrides from the YAML at `megatron_config_path` (slime's contract)."""
    overrides = megatron_role_overrides(megatron_config_path, role)
    logger.info("--megatron-config-path %s: %s overrides %s", megatron_config_path, role, sorted(overrides))
    return apply_megatron_role_overrides(base_args, overrides, role)


def role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """The args the training group of `role` is built from: with `--megatron-config-path`, a copy with the role's
    overrides (`parse_megatron_role_args`); without it, `args`."""
    if args.megatron_config_path is None:
        return args
    return parse_megatron_role_args(args, args.megatron_config_path, role)
