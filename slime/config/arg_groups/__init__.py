"""slime's own command-line flags, one module per area.

Each module exposes `add_<area>_arguments(parser)` and `validate_<area>(args)`; modules whose flags name
plugin functions list them in `FUNCTION_FLAGS` so the assembler can check they load. `ADD_ORDER` is the
order groups appear in --help; `VALIDATE_ORDER` the order validators run (later ones read fields earlier
ones resolved: backends and rank counts before batch sizes, batch sizes before over-sampling).
"""

from __future__ import annotations

from slime.config.arg_groups import (
    algorithm,
    cluster,
    data,
    debug,
    eval,
    fault_tolerance,
    logging,
    lora,
    not_built,
    reward,
    rollout,
    sglang,
    train,
    weight_update,
)
from slime.config.arg_groups._common import SlimeArgumentError

ADD_ORDER = [
    cluster.add_cluster_arguments,
    train.add_train_arguments,
    rollout.add_rollout_arguments,
    sglang.add_sglang_arguments,
    data.add_data_arguments,
    eval.add_eval_arguments,
    algorithm.add_algorithm_arguments,
    reward.add_reward_arguments,
    logging.add_logging_arguments,
    debug.add_debug_arguments,
    fault_tolerance.add_fault_tolerance_arguments,
    weight_update.add_weight_update_arguments,
    lora.add_lora_arguments,
    not_built.add_not_built_arguments,
]

VALIDATE_ORDER = [
    debug.validate_debug,
    not_built.validate_not_built,
    train.validate_train,
    cluster.validate_cluster,
    weight_update.validate_weight_update,
    sglang.validate_sglang,
    data.validate_data,
    rollout.validate_rollout,
    lora.validate_lora,
    eval.validate_eval,
    algorithm.validate_algorithm,
    reward.validate_reward,
    logging.validate_logging,
    fault_tolerance.validate_fault_tolerance,
]

FUNCTION_FLAGS = (
    rollout.FUNCTION_FLAGS
    + data.FUNCTION_FLAGS
    + eval.FUNCTION_FLAGS
    + algorithm.FUNCTION_FLAGS
    + reward.FUNCTION_FLAGS
    + train.FUNCTION_FLAGS
)


def add_all_arguments(parser) -> None:
    for add in ADD_ORDER:
        add(parser)


def validate_all(args) -> None:
    for validate in VALIDATE_ORDER:
        validate(args)


__all__ = ["ADD_ORDER", "FUNCTION_FLAGS", "VALIDATE_ORDER", "SlimeArgumentError", "add_all_arguments", "validate_all"]
