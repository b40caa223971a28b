"""`--dry-run`: validate the command line, print the plan of the run, start nothing (docs/dry_run.md).

    from slime.config.plan import print_plan
    print_plan(args, "train.py")          # args from parse_args; raises SlimeArgumentError if the plan refuses

Modules: `model_size` (parameter counts from config.json), `layout` (placement without Ray), `memory`
(per-device estimates), `report` (batch math, warnings, the text).
"""

from __future__ import annotations

import sys

from slime.config.arg_groups._common import SlimeArgumentError
from slime.config.plan.report import Plan, build_plan, memory_refusals


def format_plan(args, entry: str = "train.py") -> str:
    return build_plan(args, entry).render()


def print_plan(args, entry: str = "train.py", file=None) -> None:
    """Print the plan; then, if it refuses the run (a colocated GPU the estimate overfills), raise
    SlimeArgumentError with the refusals (train.py exits 1 with them), unless --skip-memory-check."""
    plan = build_plan(args, entry)
    (file or sys.stdout).write(plan.render())
    if plan.refusals:
        raise SlimeArgumentError(refusal_message(plan.refusals))


def check_memory_fits(args, gpu_bytes: float) -> None:
    """train.py's check before Ray starts: raise SlimeArgumentError when the plan's memory estimate for GPUs of
    `gpu_bytes` refuses the run (unless --skip-memory-check)."""
    refusals = memory_refusals(args, gpu_bytes)
    if refusals:
        raise SlimeArgumentError(refusal_message(refusals))


def refusal_message(refusals: list[str]) -> str:
    return ("the memory plan refuses this run: " + "; and ".join(refusals) + ". `--dry-run` shows the whole "
            "estimate; --skip-memory-check starts the run anyway (the estimate is rough: docs/dry_run.md)")


__all__ = ["Plan", "build_plan", "check_memory_fits", "format_plan", "print_plan"]
