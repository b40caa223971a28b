"""Metrics sinks: TensorBoard (`--use-tensorboard`), wandb (`--use-wandb`, offline works) and a console line.

All metrics reach the driver, which is the only writer; the step is the rollout id. A step may be logged in
parts (the loops log a rollout's generation and training metrics before its checkpoint is written, the step time
and evaluation after; evaluation before training is a part of step 0 of its own): every part is written and
flushed at once. A console line shows the parts of the step logged since its last line: a few training keys, then
`eval <dataset>=<score> ...` (each eval dataset's mean reward, `eval/<dataset>`); a part with none of those prints
no line.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

SECRET_ARGS = ("engine_api_key",)  # never sent to a tracking service

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
# eval/<dataset> is the dataset's score; eval/<dataset>-truncated_ratio and -pass@k sit beside it
_EVAL_SCORE = re.compile(r"eval/(?P<name>[^/]+)")
_EVAL_DETAIL = re.compile(r".*-(truncated_ratio|pass@\d+)")


def console_line(scalars: dict[str, float]) -> str:
    """The console's summary of `scalars`: the training keys shown, then every eval dataset's score ('' when
    there is neither)."""
    shown = [f"{k.split('/', 1)[1]}={scalars[k]:.4g}" for k in _CONSOLE_KEYS if k in scalars]
    scores = []
    for key in sorted(scalars):
        score = _EVAL_SCORE.fullmatch(key)
        if score and not _EVAL_DETAIL.fullmatch(score["name"]):
            scores.append(f"{score['name']}={scalars[key]:.4g}")
    if scores:
        shown.append("eval " + " ".join(scores))
    return " ".join(shown)


class Tracker:
    def __init__(self, args):
        self._tb = None
        self._wandb = None
        self._step: int | None = None
        self._unshown: dict[str, float] = {}  # the parts of the current step logged since its last console line
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
                config={k: v for k, v in vars(args).items()
                        if isinstance(v, (int, float, str, bool, type(None))) and k not in SECRET_ARGS},
            )

    def log(self, metrics: dict[str, Any], step: int, console: bool = True) -> None:
        """Write `metrics` at `step` to every sink now. `console=False`: an early part of the step (no console
        line yet; the step's next line includes it)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**scalars, "rollout_id": step}, step=step)
        if step != self._step:
            self._step, self._unshown = step, {}
        self._unshown.update(scalars)
        if console:
            line = console_line(self._unshown)
            self._unshown = {}
            if line:
                logger.info("rollout %d: %s", step, line)

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
