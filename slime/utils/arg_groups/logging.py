"""Logging: TensorBoard and wandb, and extra rollout statistics.

`args.tensorboard_dir` is always resolved (even with TensorBoard off) so every process agrees on it:
`--tensorboard-dir`, else `$TENSORBOARD_DIR`, else
`outputs/tensorboard/<--tb-project-name or slime>/<--tb-experiment-name or the parse time>`.
"""

from __future__ import annotations

import argparse
import os
import time


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging", "TensorBoard, wandb and extra statistics.")
    g.add_argument("--use-tensorboard", action="store_true", help="Write metrics to TensorBoard.")
    g.add_argument(
        "--tensorboard-dir",
        type=str,
        default=None,
        help="TensorBoard folder (default: $TENSORBOARD_DIR, else "
        "outputs/tensorboard/<tb-project-name or slime>/<tb-experiment-name or a timestamp>).",
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
    g.add_argument("--wandb-key", type=str, default=None, help="API key (else the environment's login).")
    g.add_argument("--wandb-host", type=str, default=None)
    g.add_argument("--wandb-team", type=str, default=None)
    g.add_argument("--log-passrate", action="store_true", help="Log pass@k of each rollout's groups.")
    g.add_argument("--log-multi-turn", action="store_true", help="Log turn counts of multi-turn rollouts.")


def validate_logging(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is None:
        args.tensorboard_dir = os.environ.get("TENSORBOARD_DIR") or os.path.join(
            "outputs",
            "tensorboard",
            args.tb_project_name or "slime",
            args.tb_experiment_name or time.strftime("%Y%m%d-%H%M%S"),
        )
    env_mode = os.environ.get("WANDB_MODE")
    if args.wandb_mode is None:
        args.wandb_mode = env_mode if env_mode in ("online", "offline", "disabled") else "online"
