"""Metrics sinks: TensorBoard (`--use-tensorboard`), wandb (`--use-wandb`, offline works) and a console line.

All metrics reach the driver, which is the only writer; the step is the rollout id. A step may be logged in
parts (the loops log a rollout's generation and training metrics before its checkpoint is written, the step time
and evaluation after): every part is written and flushed at once, and the console line shows the step's parts so
far.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("slime")

_CONSOLE_KEYS = (
    "rollout/raw_reward",
    "rollout/response_len/mean",
    "train/loss",
    "train/ppo_kl",
    "train/kl_loss",
    "train/grad_norm",
    "perf/step_time",
)


class Tracker:
    def __init__(self, args):
        self._tb = None
        self._wandb = None
        self._step: int | None = None
        self._step_scalars: dict[str, float] = {}  # the parts of the current step logged so far
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(args.tensorboard_dir, exist_ok=True)
            self._tb = SummaryWriter(log_dir=args.tensorboard_dir)
            logger.info("TensorBoard logs: %s (view with `tensorboard --logdir %s`)", args.tensorboard_dir,
                        os.path.dirname(args.tensorboard_dir.rstrip("/")) or ".")
        if args.use_wandb:
            import wandb

            if args.wandb_mode == "online" and (args.wandb_key or args.wandb_host):
                wandb.login(key=args.wandb_key, host=args.wandb_host)
            self._wandb = wandb.init(
                entity=args.wandb_team,
                project=args.wandb_project or "slime",
                group=args.wandb_group,
                dir=args.wandb_dir,
                mode=args.wandb_mode,
                config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
            )

    def log(self, metrics: dict[str, Any], step: int, console: bool = True) -> None:
        """Write `metrics` at `step` to every sink now. `console=False`: an early part of the step (no console
        line yet; the next part's line includes it)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**scalars, "rollout_id": step}, step=step)
        if step != self._step:
            self._step, self._step_scalars = step, {}
        self._step_scalars.update(scalars)
        if console:
            seen = self._step_scalars
            shown = " ".join(f"{k.split('/', 1)[1]}={seen[k]:.4g}" for k in _CONSOLE_KEYS if k in seen)
            logger.info("rollout %d: %s", step, shown)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_scalars(logdir: str, tag: str) -> dict[int, float]:
    """{step: value} of one scalar from every TensorBoard event file under `logdir` (for tests, benchmarks
    and plots)."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for path in glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values
