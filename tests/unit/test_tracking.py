"""slime/utils/tracking.py: a step logged in parts reaches TensorBoard part by part, one console line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from slime.utils.tracking import Tracker, read_scalars


def test_a_step_logged_in_parts_is_written_at_once_and_shown_together(tmp_path, caplog):
    args = SimpleNamespace(use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), use_wandb=False)
    tracker = Tracker(args)
    with caplog.at_level(logging.INFO, logger="slime"):
        tracker.log({"train/loss": 0.5, "rollout/raw_reward": 0.25}, step=3, console=False)
        # written and flushed before the rest of the step: a driver killed now keeps it
        assert read_scalars(str(tmp_path / "tb"), "train/loss") == {3: 0.5}
        assert not [r for r in caplog.records if r.getMessage().startswith("rollout 3")]
        tracker.log({"perf/step_time": 2.0}, step=3)
        tracker.log({"train/loss": 0.4}, step=4)
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout ")]
    assert lines == ["rollout 3: raw_reward=0.25 loss=0.5 step_time=2", "rollout 4: loss=0.4"]
    assert read_scalars(str(tmp_path / "tb"), "perf/step_time") == {3: 2.0}


def test_eval_scores_reach_the_console_and_no_line_is_empty(tmp_path, caplog):
    """Eval before training is a step part of its own: its line names each eval dataset's score (never an empty
    `rollout 0:`); a step's line shows the parts logged since its last line, so the scores are not repeated."""
    tracker = Tracker(SimpleNamespace(use_tensorboard=False, use_wandb=False))
    before = {"eval/gsm8k": 0.3125, "eval/gsm8k-truncated_ratio": 0.5, "eval/aime-2024": 0.1,
              "eval/aime-2024-truncated_ratio": 0.0, "eval/aime-2024-pass@1": 0.1, "perf/eval_time": 3.0}
    with caplog.at_level(logging.INFO, logger="slime"):
        tracker.log(before, step=0)
        tracker.log({"train/loss": 0.5, "rollout/raw_reward": 0.25}, step=0, console=False)
        tracker.log({"perf/step_time": 2.0}, step=0)
        tracker.log({"perf/step_time": 1.0, "eval/gsm8k": 0.5, "perf/eval_time": 2.0}, step=1)
        tracker.log({"perf/eval_time": 2.0}, step=2)  # nothing the console shows: no line
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout ")]
    assert lines == ["rollout 0: eval aime-2024=0.1 gsm8k=0.3125",
                     "rollout 0: raw_reward=0.25 loss=0.5 step_time=2",
                     "rollout 1: step_time=1 eval gsm8k=0.5"]
