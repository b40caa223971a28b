from __future__ import annotations

import pytest

from slime.utils.types import Sample, TrainBatch


def test_sample_round_trips_through_dict():
    s = Sample(group_index=3, index=7, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2, 3, 4],
               response="x y", response_length=2, label="4", reward={"score": 1.0, "acc": True},
               loss_mask=[1, 0], rollout_log_probs=[-0.5, 0.0], weight_versions=["3"],
               status=Sample.Status.TRUNCATED, metadata={"rm_type": "math"})
    d = s.to_dict()
    assert d["status"] == "truncated"
    assert Sample.from_dict(d) == s
    assert s.prompt_length == 2
    with pytest.raises(ValueError, match="unknown fields"):
        Sample.from_dict({**d, "bogus": 1})


def test_reward_key_picks_from_dict_rewards():
    s = Sample(reward={"score": 0.5, "acc": 1})
    assert s.get_reward_value("score") == 0.5
    with pytest.raises(ValueError, match="--reward-key"):
        s.get_reward_value(None)
    assert Sample(reward=2).get_reward_value(None) == 2.0


def _batch(n=3):
    return TrainBatch(tokens=[[1, 2, 3]] * n, response_lengths=[2] * n, loss_masks=[[1, 1]] * n,
                      rewards=[float(i) for i in range(n)], raw_rewards=[0.0] * n, truncated=[False] * n,
                      group_indices=list(range(n)), rollout_log_probs=[[-1.0, -2.0]] * n)


def test_train_batch_checks_lengths_and_selects_rows():
    b = _batch()
    assert len(b) == 3
    sub = b.select([2, 0])
    assert sub.rewards == [2.0, 0.0] and sub.group_indices == [2, 0] and len(sub.rollout_log_probs) == 2
    with pytest.raises(ValueError, match="rewards has 2 entries"):
        TrainBatch(tokens=[[1]] * 3, response_lengths=[1] * 3, loss_masks=[[1]] * 3, rewards=[0.0] * 2,
                   raw_rewards=[0.0] * 3, truncated=[False] * 3, group_indices=[0] * 3)
    with pytest.raises(ValueError, match="loss_mask has 1 entries, response_length=2"):
        TrainBatch(tokens=[[1, 2, 3]], response_lengths=[2], loss_masks=[[1]], rewards=[0.0],
                   raw_rewards=[0.0], truncated=[False], group_indices=[0])
