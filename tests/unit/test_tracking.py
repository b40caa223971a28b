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
