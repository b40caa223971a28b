"""Reward: built-in reward types, remote or custom reward functions, and which key of a dict reward counts."""

from __future__ import annotations

import argparse
import logging

from slime.config.arg_groups._common import fail
from slime.rollout.rm_hub import RM_TYPES
from slime.rollout.rm_hub.ifbench import ifbench_missing_reason

logger = logging.getLogger(__name__)

FUNCTION_FLAGS = ("custom_rm_path", "custom_reward_post_process_path")


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reward", "Reward functions.")
    g.add_argument(
        "--rm-type",
        type=str,
        default=None,
        help="Built-in reward (slime.rollout.rm_hub), e.g. deepscaler, math, dapo, f1, gpqa, ifbench, remote_rm, "
        "random; a boxed_ prefix grades the last \\boxed{} answer. Samples may override it with metadata['rm_type'].",
    )
    g.add_argument("--reward-key", type=str, default=None, help="Key of a dict reward that is the scalar reward.")
    g.add_argument("--eval-reward-key", type=str, default=None, help="--reward-key for eval (default: the same).")
    g.add_argument(
        "--group-rm", action="store_true", help="Call the reward function once per group: (args, samples) -> list."
    )
    g.add_argument("--rm-url", type=str, default=None, help="Reward service URL for --rm-type remote_rm.")
    g.add_argument(
        "--custom-rm-path",
        type=str,
        default=None,
        help="async fn(args, sample) -> float | dict replacing --rm-type.",
    )
    g.add_argument(
        "--custom-reward-post-process-path",
        type=str,
        default=None,
        help="fn replacing the default group reward normalisation.",
    )


def validate_reward(args: argparse.Namespace) -> None:
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    if args.rm_type is not None and args.rm_type.removeprefix("boxed_") == "remote_rm" and not args.rm_url:
        fail("--rm-type remote_rm needs --rm-url http://host:port of the reward service.")
    if args.rm_type is None or args.custom_rm_path is not None:
        return
    base = args.rm_type.removeprefix("boxed_")
    if base not in RM_TYPES:
        fail(
            f"--rm-type {args.rm_type}: unknown reward type; known types: {sorted(RM_TYPES)} (each may take a "
            "boxed_ prefix), or give --custom-rm-path pkg.module.fn."
        )
    if base == "ifbench" and ifbench_missing_reason() is not None:
        fail(f"--rm-type {args.rm_type}: {ifbench_missing_reason()}.")
