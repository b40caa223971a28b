"""Logging: TensorBoard and wandb, and extra rollout statistics.

TensorBoard is on by default (`--no-use-tensorboard` turns it off), so `tensorboard --logdir outputs/` shows a
run started with no logging flags. `args.tensorboard_dir` is always resolved so every process agrees on it:
`--tensorboard-dir`, else `$TENSORBOARD_DIR`, else `outputs/tensorboard/<run_name(args)>`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

from slime.config.arg_groups._common import fail


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging", "TensorBoard, wandb and extra statistics.")
    g.add_argument(
        "--use-tensorboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Write metrics to TensorBoard (on by default: `tensorboard --logdir outputs/`).",
    )
    g.add_argument(
        "--tensorboard-dir",
        type=str,
        default=None,
        help="TensorBoard folder (default: $TENSORBOARD_DIR, else "
        "outputs/tensorboard/<tb-project-name or slime>/<tb-experiment-name or the start time>).",
    )
    g.add_argument("--tb-project-name", type=str, default=None, help="TensorBoard project (a folder level).")
    g.add_argument("--tb-experiment-name", type=str, default=None, help="TensorBoard run (a folder level).")
    g.add_argument("--use-wandb", action="store_true", help="Log metrics to Weights & Biases.")
    g.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        default=None,
        help="wandb mode (default: $WANDB_MODE, else online); offline works without network.",
    )
    g.add_argument("--wandb-dir", type=str, default=None, help="wandb files folder (default ./wandb).")
    g.add_argument("--wandb-project", type=str, default=None)
    g.add_argument("--wandb-group", type=str, default=None)
    g.add_argument("--wandb-key", type=str, default=None, help="API key to log in with (online mode; else the "
                   "environment's login).")
    g.add_argument("--wandb-host", type=str, default=None, help="wandb server URL to log in to (online mode).")
    g.add_argument("--wandb-team", type=str, default=None, help="wandb entity (team or user) the run belongs to.")
    g.add_argument("--log-passrate", action="store_true", help="Log pass@k of each rollout's groups.")
    g.add_argument("--log-multi-turn", action="store_true", help="Log turn counts of multi-turn rollouts.")


def run_name(args: argparse.Namespace) -> str:
    """`<--tb-project-name or slime>/<--tb-experiment-name or the parse time>`: the run's folder under
    outputs/tensorboard/ and (when --save is not given) outputs/checkpoints/. Fixed at the first call."""
    if args.run_name is None:
        args.run_name = os.path.join(args.tb_project_name or "slime",
                                     args.tb_experiment_name or time.strftime("%Y%m%d-%H%M%S"))
    return args.run_name


def validate_logging(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is None:
        args.tensorboard_dir = os.environ.get("TENSORBOARD_DIR") or os.path.join("outputs", "tensorboard",
                                                                                 run_name(args))
    if args.use_wandb and importlib.util.find_spec("wandb") is None:
        fail('--use-wandb: the wandb package is not installed; pip install -e ".[wandb]" (or drop --use-wandb).')
    env_mode = os.environ.get("WANDB_MODE")
    if args.wandb_mode is None:
        args.wandb_mode = env_mode if env_mode in ("online", "offline", "disabled") else "online"
