"""The actor's `--loss-type` assembly and the critic loss (slime.algorithm.loss.py), with
hand-computed values; plus the plugin signatures of `--custom-loss-function-path` and
`--custom-advantage-function-path`."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from slime.algorithm.loss import LossInputs, compute_actor_loss, critic_loss
from slime.algorithm.estimators import AdvantageInputs, compute_advantages_and_returns
from slime.utils import ppo_utils as pu
from tests.args import make_args


def _args(**kw):
    """GRPO's validated args (eps clip 0.2 both sides, no KL, no entropy, no TIS) with `kw` set before validation."""
    return make_args(**kw)


def _inputs(per_token=False, denominator=2.0, **kw):
    """Two samples: A with 2 tokens, B with 1 token (mask [[1, 1], [1, 0]]), on-policy (r = 1)."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 1.0]])).requires_grad_(True)
    base = dict(
        log_probs=logp, old_log_probs=logp.detach().clone(), advantages=torch.tensor([[1.0, 1.0], [-2.0, 0.0]]),
        mask=mask, entropy=torch.tensor([[0.6, 0.2], [1.0, 5.0]]),
        aggregate=functools.partial(pu.aggregate_loss, mask=mask, per_token=per_token, global_denominator=denominator),
    )
    base.update(kw)
    return LossInputs(**base)


def _f(metrics):
    return {k: round(float(v), 6) for k, v in metrics.items()}


def test_policy_loss_on_policy_per_sample_and_per_token():
    # r = 1: pg per token = −A = [[-1, -1], [2, ·]]; per sample: mean(-1, 2) = 0.5; per token: (−1−1+2)/3 = 0
    loss, m = compute_actor_loss(_args(), _inputs())
    assert _f(m)["train/pg_loss"] == 0.5 and _f(m)["train/loss"] == 0.5
    assert m["train/ppo_kl"] == 0 and m["train/pg_clipfrac"] == 0
    assert _f(m)["train/entropy_loss"] == pytest.approx(((0.6 + 0.2) / 2 + 1.0) / 2)
    assert "train/kl_loss" not in m and "train/tis" not in m
    loss_t, m_t = compute_actor_loss(_args(), _inputs(per_token=True, denominator=3.0))
    assert _f(m_t)["train/pg_loss"] == 0.0


def test_entropy_bonus_and_kl_loss_terms():
    ref = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]]))  # Δ = [ln 2, 0], [0, ·]
    args = _args(entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    loss, m = compute_actor_loss(args, _inputs(ref_log_probs=ref))
    kl = (math.log(2) / 2 + 0.0) / 2  # per-sample means (ln2/2, 0), mean over 2 samples
    ent = ((0.6 + 0.2) / 2 + 1.0) / 2
    assert m["train/kl_loss"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 - 0.1 * ent + 0.5 * kl)
    # a reference without --use-kl-loss (e.g. --kl-coef reward shaping): KL reported, not in the loss
    loss2, m2 = compute_actor_loss(_args(), _inputs(ref_log_probs=ref))
    assert m2["train/kl_loss"].item() == pytest.approx(kl) and loss2.item() == pytest.approx(0.5)


def test_tis_weights_the_pg_loss():
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]]))  # old/rollout = [[2, 1], [1, ·]]
    loss, m = compute_actor_loss(_args(use_tis=True, tis_clip=1.5), _inputs(rollout_log_probs=rollout))
    # weights [[1.5 (clipped from 2), 1], [1, 1]]: pg = [[-1.5, -1], [2, ·]] -> (−1.25 + 2) / 2
    assert m["train/pg_loss"].item() == pytest.approx(0.375)
    assert m["train/tis"].item() == pytest.approx(((1.5 + 1) / 2 + 1) / 2)
    assert m["train/tis_clipfrac"].item() == pytest.approx((0.5 + 0) / 2)
    with pytest.raises(ValueError, match="--use-tis"):
        compute_actor_loss(_args(use_tis=True), _inputs())


def test_cispo_and_gspo_dispatch():
    _, m = compute_actor_loss(_args(advantage_estimator="cispo"), _inputs())
    # −1·A·logp per token: [[ln2, 2 ln2], [2·(−ln2)·(−1)... ]] -> A: −(ln 0.5 + ln 0.25)/2 = 1.5 ln2; B: 2·ln 0.5
    assert m["train/pg_loss"].item() == pytest.approx((1.5 * math.log(2) - 2 * math.log(2)) / 2)
    _, m = compute_actor_loss(_args(advantage_estimator="gspo"), _inputs())
    assert m["train/pg_loss"].item() == pytest.approx(0.5)


def test_sft_loss_is_masked_nll():
    loss, m = compute_actor_loss(_args(loss_type="sft_loss"), _inputs())
    want = ((math.log(2) + math.log(4)) / 2 + math.log(2)) / 2
    assert loss.item() == pytest.approx(want) and m["train/sft_loss"].item() == pytest.approx(want)


CUSTOM_LOSS = '''
def my_loss(args, inputs):
    """--custom-loss-function-path contract: (args, LossInputs) -> (scalar loss share, {name: scalar share})."""
    loss = inputs.aggregate(-inputs.advantages * inputs.log_probs)
    return loss, {"train/my_term": inputs.aggregate(inputs.advantages)}
'''

CUSTOM_ADV = '''
import torch

def my_advantages(args, inputs):
    """--custom-advantage-function-path contract: (args, AdvantageInputs) -> (advantages, returns)."""
    adv = [torch.full((n,), r * 10.0) for r, n in zip(inputs.raw_rewards, inputs.response_lengths)]
    return adv, None
'''


def test_custom_loss_function_contract(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(CUSTOM_LOSS)
    loss, m = compute_actor_loss(_args(loss_type="custom_loss", custom_loss_function_path=f"{path}:my_loss"),
                                 _inputs())
    # −A·logp: A rows: (ln2 + 2 ln2)/2 = 1.5 ln2; B: −2·ln2 ... sample means averaged
    assert loss.item() == pytest.approx((1.5 * math.log(2) - 2 * math.log(2)) / 2)
    assert m["train/my_term"].item() == pytest.approx((1.0 - 2.0) / 2) and "train/loss" in m
    loss.backward()  # the custom loss carries the policy gradient


def test_custom_advantage_function_contract(tmp_path):
    path = tmp_path / "my_adv.py"
    path.write_text(CUSTOM_ADV)
    args = _args(custom_advantage_function_path=f"{path}:my_advantages")
    inputs = AdvantageInputs(rewards=[0.0, 0.0], raw_rewards=[1.0, 0.5], response_lengths=[2, 1],
                                loss_masks=[torch.ones(2), torch.ones(1)], group_indices=[0, 0])
    adv, ret = compute_advantages_and_returns(args, inputs)
    assert [a.tolist() for a in adv] == [[10.0, 10.0], [5.0]] and ret is None


def test_unknown_loss_type_names_flag():
    with pytest.raises(ValueError, match="--loss-type"):
        compute_actor_loss(_args(loss_type="nope"), _inputs())


def test_critic_loss_aggregates_value_loss():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    agg = functools.partial(pu.aggregate_loss, mask=mask, per_token=False, global_denominator=2)
    values = torch.tensor([[1.0, 0.0], [0.6, 9.0]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.5], [0.5, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    loss, m = critic_loss(_args(value_clip=0.2), values, old, ret, agg)
    # per token ½·max(...) = [[0.845, 0.045], [0.18, ·]] -> ((0.845 + 0.045)/2 + 0.18)/2
    assert loss.item() == pytest.approx(((0.845 + 0.045) / 2 + 0.18) / 2)
    assert m["train/value_loss"].item() == pytest.approx(loss.item())
    assert m["train/value_clipfrac"].item() == pytest.approx((1.0 + 0.0) / 2)
    loss.backward()
    assert values.grad[1, 1] == 0  # padded token: no gradient


def test_critic_values_are_read_where_the_token_is_predicted():
    from slime.backends.fsdp_utils.data import extract_response_values
    from slime.backends.training.batching import make_micro_batch

    # row 0: 5 tokens, response of 2 (positions 3, 4) -> V read at positions 2, 3; row 1: 3 tokens, response
    # of 1 (position 2) -> V at position 1; padded slots are 0
    mb = make_micro_batch([[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1])
    position_values = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [10.0, 11.0, 12.0, 13.0, 14.0]])
    got = extract_response_values(position_values, mb)
    torch.testing.assert_close(got, torch.tensor([[2.0, 3.0], [11.0, 0.0]]))
