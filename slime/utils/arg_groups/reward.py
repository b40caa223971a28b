"""Reward: built-in reward types, remote or custom reward functions, and which key of a dict reward counts."""

from __future__ import annotations

import argparse
import logging

from slime.utils.arg_groups._common import fail

logger = logging.getLogger(__name__)

FUNCTION_FLAGS = ("custom_rm_path", "custom_reward_post_process_path")


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reward", "Reward functions.")
    g.add_argument(
        "--rm-type",
        type=str,
        default=None,
        help="Built-in reward (slime.rollout.rm_hub), e.g. deepscaler, math, dapo, f1, gpqa, remote_rm, random; "
        "a boxed_ prefix grades the last \\boxed{} answer. Samples may override it with metadata['rm_type'].",
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


def known_rm_types() -> set[str] | None:
    """Names registered in slime.rollout.rm_hub, or None when that registry cannot be imported."""
    try:
        from slime.rollout.rm_hub import RM_TYPES
    except Exception as e:  # noqa: BLE001 - the hub is optional here; failing to import it skips the check
        logger.warning(
            "--rm-type not checked: cannot import slime.rollout.rm_hub.RM_TYPES (%s: %s)", type(e).__name__, e
        )
        return None
    return set(RM_TYPES)


def validate_reward(args: argparse.Namespace) -> None:
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    if args.rm_type is not None and args.rm_type.removeprefix("boxed_") == "remote_rm" and not args.rm_url:
        fail("--rm-type remote_rm needs --rm-url http://host:port of the reward service.")
    if args.rm_type is None or args.custom_rm_path is not None:
        return
    known = known_rm_types()
    if known is None:
        return
    base = args.rm_type.removeprefix("boxed_")
    if base not in known:
        fail(
            f"--rm-type {args.rm_type}: unknown reward type; known types: {sorted(known)} (each may take a "
            "boxed_ prefix), or give --custom-rm-path pkg.module.fn."
        )
