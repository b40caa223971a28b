"""The estimator registry (slime/algorithm/estimators.py): each record's advantages and returns, in closed
form, and what adding an estimator takes (one record: the parser, the reward normalisation, the loss and the
critic decision all follow it)."""

import math

import pytest
import torch

from slime.algorithm.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    Estimator,
    compute_advantages_and_returns,
    compute_advantages_and_returns_in_place,
)
from slime.algorithm.loss import LossInputs, compute_actor_loss
from slime.algorithm.rewards import train_rewards
from slime.config.arguments import SlimeArgumentError
from slime.utils import ppo_utils as pu
from slime.utils.types import Sample
from tests.args import make_args


def _args(**kw):
    """The parser's args (GRPO, no KL, gamma = lambda = 1) with `kw`; not validated (nothing here needs it)."""
    return make_args(validate=False, **kw)


def _inputs(rewards, lengths, kl=None, values=None, masks=None):
    masks = masks or [[1.0] * n for n in lengths]
    return AdvantageInputs(
        rewards=rewards, response_lengths=lengths, loss_masks=[torch.tensor(m) for m in masks],
        kl=None if kl is None else [torch.tensor(k) for k in kl],
        values=None if values is None else [torch.tensor(v) for v in values],
    )


def _lists(tensors):
    return [[round(x, 6) for x in t.tolist()] for t in tensors]


@pytest.mark.parametrize("est", ["grpo", "gspo", "cispo"])
def test_scalar_reward_estimators_broadcast_and_ignore_kl(est):
    adv, ret = compute_advantages_and_returns(
        _args(advantage_estimator=est, kl_coef=0.5), _inputs([1.5, -0.5], [2, 1], kl=[[0.2, 0.4], [1.0]]))
    assert _lists(adv) == [[1.5, 1.5], [-0.5]] and ret is None


def test_unknown_estimator_names_flag():
    with pytest.raises(ValueError, match="--advantage-estimator 'nope'"):
        compute_advantages_and_returns(_args(advantage_estimator="nope"), _inputs([1.0], [2]))


def test_ppo_estimator_uses_values_and_kl_shaped_rewards():
    args = _args(advantage_estimator="ppo", kl_coef=0.5, gamma=0.9, lambd=0.8)
    # slime's token rewards: −kl_coef·KL on every response token (the loss mask does not enter), the reward on
    # the last: [-0.1, -0.2, 1.05]; values [0.5, 0.2, 0.4]
    # δ2 = 1.05 − 0.4 = 0.65; δ1 = −0.2 + 0.36 − 0.2 = −0.04; δ0 = −0.1 + 0.18 − 0.5 = −0.42
    # A2 = 0.65; A1 = −0.04 + 0.72·0.65 = 0.428; A0 = −0.42 + 0.72·0.428 = −0.11184
    adv, ret = compute_advantages_and_returns(
        args, _inputs([1.0], [3], kl=[[0.2, 0.4, -0.1]], values=[[0.5, 0.2, 0.4]], masks=[[1.0, 0.0, 1.0]]))
    torch.testing.assert_close(adv[0], torch.tensor([-0.11184, 0.428, 0.65]))
    torch.testing.assert_close(ret[0], torch.tensor([0.38816, 0.628, 1.05]))
    # --kl-coef 0: the KL given is not used (slime's zeros)
    adv0, _ = compute_advantages_and_returns(
        _args(advantage_estimator="ppo", gamma=1.0, lambd=1.0),
        _inputs([1.0], [2], kl=[[5.0, 5.0]], values=[[0.0, 0.0]]))
    torch.testing.assert_close(adv0[0], torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="no critic values"):
        compute_advantages_and_returns(args, _inputs([1.0], [3]))


def test_reinforce_plus_plus():
    args = _args(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=1.0)
    adv, ret = compute_advantages_and_returns(
        args, _inputs([1.0, 0.0], [3, 1], kl=[[0.2, 0.4, -0.1], [0.2]], masks=[[1.0, 0.0, 1.0], [1.0]]))
    # token rewards [-0.1, 0, 1.05] -> returns [0.95, 1.05, 1.05]; [-0.1] -> [-0.1]; advantages = returns
    assert _lists(adv) == [[0.95, 1.05, 1.05], [-0.1]]
    assert _lists(ret) == _lists(adv)
    # the reward sits on the last loss-masked-in token, here token 1 (token 2 is a tool token):
    # token rewards [-0.1, 1 - 0.2, 0] -> G = [0.7, 0.8, 0]
    adv_m, _ = compute_advantages_and_returns(
        args, _inputs([1.0], [3], kl=[[0.2, 0.4, -0.1]], masks=[[1.0, 1.0, 0.0]]))
    assert _lists(adv_m) == [[0.7, 0.8, 0.0]]
    # γ = 0.5: G = [-0.1 + 0.5·0.525, 0.5·1.05, 1.05]
    adv_g, _ = compute_advantages_and_returns(
        _args(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.5),
        _inputs([1.0], [3], kl=[[0.2, 0.4, -0.1]], masks=[[1.0, 0.0, 1.0]]))
    assert _lists(adv_g) == [[0.1625, 0.525, 1.05]]
    # no KL term: the reward alone, on every token (γ = 1)
    adv0, _ = compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus"), _inputs([2.0], [2]))
    assert _lists(adv0) == [[2.0, 2.0]]


def test_reinforce_plus_plus_baseline():
    # rewards arrive group-mean-centred; per token: reward − kl_coef·KL, as slime (a loss-masked token's value
    # enters neither the loss nor the whitening)
    args = _args(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5)
    adv, _ = compute_advantages_and_returns(
        args, _inputs([0.5, -0.5], [3, 1], kl=[[0.2, 0.4, -0.1], [0.2]], masks=[[1.0, 0.0, 1.0], [1.0]]))
    assert _lists(adv) == [[0.4, 0.3, 0.55], [-0.6]]


# ---- slime's dict-shaped entry point ---------------------------------------------------------------------------
def test_rollout_data_entry_point_fills_kl_advantages_and_returns_in_place():
    """slime's compute_advantages_and_returns(args, rollout_data): the KL of the old policy to the reference
    (--kl-loss-type) lands in rollout_data["kl"] untouched by the PPO reward shaping, then advantages/returns."""
    args = _args(advantage_estimator="ppo", kl_coef=0.5, gamma=1.0, lambd=1.0)
    log_probs, ref = [torch.tensor([0.5, 0.7, 0.9])], [torch.tensor([0.4, 0.5, 0.6])]
    data = {"log_probs": log_probs, "ref_log_probs": ref, "rewards": [1.0], "values": [torch.zeros(3)],
            "response_lengths": [3], "total_lengths": [5], "loss_masks": [torch.ones(3)]}
    compute_advantages_and_returns_in_place(args, data)
    torch.testing.assert_close(data["kl"][0], torch.tensor([0.1, 0.2, 0.3]))
    # token rewards −0.5·KL + reward on the last: [−0.05, −0.1, 0.85]; γ = λ = 1, V = 0: reward-to-go
    torch.testing.assert_close(data["advantages"][0], torch.tensor([0.7, 0.75, 0.85]))
    torch.testing.assert_close(data["returns"][0], data["advantages"][0])
    # grpo with --normalize-advantages: whitened over the rows given; returns = advantages as in slime
    args = _args(advantage_estimator="grpo", normalize_advantages=True)
    data = {"rewards": [1.0, -1.0], "response_lengths": [1, 1], "loss_masks": [torch.ones(1), torch.ones(1)]}
    compute_advantages_and_returns_in_place(args, data)
    assert _lists(data["advantages"]) == [[1.0], [-1.0]] and data["returns"] is data["advantages"]
    with pytest.raises(ValueError, match="no 'ref_log_probs'"):
        compute_advantages_and_returns_in_place(_args(kl_coef=0.1), {**data, "log_probs": log_probs * 2})


# ---- adding an estimator: one record -------------------------------------------------------------------------
def sign_advantages(args, inputs):
    """A toy estimator: the sign of each (normalised) reward on every token, returns for the critic."""
    adv = [torch.full((n,), float((r > 0) - (r < 0))) for r, n in zip(inputs.rewards, inputs.response_lengths)]
    return adv, adv


def reinforce_loss(log_probs, old_log_probs, advantages, mask, args):
    """A toy policy loss: plain REINFORCE, −A·logp (no clipping, so clipfrac 0)."""
    return -advantages * log_probs, torch.zeros_like(log_probs), old_log_probs - log_probs


def test_a_new_estimator_is_one_record(monkeypatch):
    """Registering one record is all it takes: the parser accepts the name, validation asks for the whitening the
    record wants and decides on the critic from it, the reward normalisation, the advantages and the policy loss
    follow it."""
    toy = Estimator("toy_sign", sign_advantages, reinforce_loss, group_normalized=True, divide_by_std=False,
                    needs_critic=True, whitens=True)
    monkeypatch.setitem(ESTIMATORS, "toy_sign", toy)

    with pytest.raises(SlimeArgumentError, match="--advantage-estimator toy_sign whitens its advantages"):
        make_args("--advantage-estimator", "toy_sign")
    args = make_args("--advantage-estimator", "toy_sign", "--normalize-advantages")
    assert args.use_critic is True  # the critic decision reads the record

    # group-mean centred (group_normalized), not divided by the std (divide_by_std=False)
    samples = [Sample(group_index=g) for g in (0, 0, 1, 1)]
    assert train_rewards(args, samples, [1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1]) == [0.5, -0.5, 0.0, 0.0]

    inputs = AdvantageInputs(rewards=[0.5, -0.5, 0.0], response_lengths=[2, 1, 1],
                             loss_masks=[torch.ones(2), torch.ones(1), torch.ones(1)])
    adv, ret = compute_advantages_and_returns(args, inputs)
    assert [a.tolist() for a in adv] == [[1.0, 1.0], [-1.0], [0.0]] and ret is adv

    # the loss: −A·logp summed per row's token mean over 2 rows: (−1·log .5 + 1·log .25) / 2
    log_probs = torch.log(torch.tensor([[0.5, 0.5], [0.25, 1.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss_inputs = LossInputs(log_probs=log_probs, old_log_probs=log_probs, advantages=torch.tensor([[1.0, 1.0],
                             [-1.0, 0.0]]), mask=mask, entropy=torch.zeros(2, 2),
                             aggregate=lambda v: (pu.per_sample_masked_mean(v, mask)).sum() / 2)
    _, metrics = compute_actor_loss(args, loss_inputs)
    expected = (-math.log(0.5) + math.log(0.25)) / 2
    assert metrics["train/pg_loss"].item() == pytest.approx(expected)
