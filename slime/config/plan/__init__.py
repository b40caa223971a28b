"""`--dry-run`: validate the command line, print the plan of the run, start nothing (docs/dry_run.md).

    from slime.config.plan import print_plan
    print_plan(args, "train.py")          # args from parse_args

Modules: `model_size` (parameter counts from config.json), `layout` (placement without Ray), `memory`
(per-device estimates), `report` (batch math, warnings, the text).
"""

from __future__ import annotations

import sys

from slime.config.plan.report import Plan, build_plan


def format_plan(args, entry: str = "train.py") -> str:
    return build_plan(args, entry).render()


def print_plan(args, entry: str = "train.py", file=None) -> None:
    (file or sys.stdout).write(format_plan(args, entry))


__all__ = ["Plan", "build_plan", "format_plan", "print_plan"]
