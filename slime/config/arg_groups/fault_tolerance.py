"""Fault tolerance: engine health checks and how many failing samples a rollout may contain."""

from __future__ import annotations

import argparse

from slime.config.arg_groups._common import fail


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance", "Engine health monitoring and failure budgets.")
    g.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        help="Health-check the engines; a dead engine is deregistered, restarted and re-synced.",
    )
    g.add_argument(
        "--rollout-health-check-interval", type=float, default=30.0, help="Seconds between /health_generate checks."
    )
    g.add_argument(
        "--rollout-health-check-timeout", type=float, default=30.0, help="Seconds an engine has to answer a check."
    )
    g.add_argument(
        "--rollout-health-check-first-wait",
        type=float,
        default=0.0,
        help="Seconds before the first check (give slow-starting engines time).",
    )
    g.add_argument(
        "--max-failed-ratio",
        type=float,
        default=0.05,
        help="Fraction of a rollout's samples whose generate or reward function may raise (marked FAILED and "
        "counted) before the run fails.",
    )


def validate_fault_tolerance(args: argparse.Namespace) -> None:
    for dest in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if getattr(args, dest) <= 0:
            fail(f"--{dest.replace('_', '-')} {getattr(args, dest)}: must be > 0 seconds.")
    if args.rollout_health_check_first_wait < 0:
        fail(f"--rollout-health-check-first-wait {args.rollout_health_check_first_wait}: must be >= 0 seconds.")
    if not 0.0 <= args.max_failed_ratio <= 1.0:
        fail(f"--max-failed-ratio {args.max_failed_ratio}: must be a fraction in [0, 1] (e.g. 0.05).")
