"""Closed-form checks of the algorithm's math (slime/algorithm/returns.py, objectives.py, log_probs.py), through
slime's import path `slime.utils.ppo_utils` that plugins use."""

import math

import pytest
import torch

from slime.algorithm import log_probs, objectives, returns
from slime.utils import ppo_utils as pu

# what plugins written for slime import from slime.utils.ppo_utils here
SLIME_NAMES = {
    "KL_LOSS_TYPES", "aggregate_loss", "calculate_log_probs_and_entropy", "chunked_discounted_returns", "chunked_gae",
    "compute_approx_kl", "compute_cispo_loss", "compute_policy_loss", "compute_value_loss",
    "get_advantages_and_returns_batch", "get_grpo_returns", "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns", "group_normalize_rewards", "icepop_weights", "kl_penalized_token_rewards",
    "masked_moments", "masked_whiten", "opsm_mask", "per_sample_masked_mean", "sequence_ppo_kl",
    "sum_of_sample_mean", "tis_weights", "vanilla_gae", "whiten_with_moments",
}


def test_the_facade_re_exports_each_name_from_its_home():
    assert set(pu.__all__) == SLIME_NAMES
    for name in SLIME_NAMES:
        homes = [m for m in (returns, objectives, log_probs) if getattr(m, name, None) is getattr(pu, name)]
        assert len(homes) == 1, name


# ---- KL ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", lambda d: d),
        ("k2", lambda d: d * d / 2),
        ("k3", lambda d: math.exp(-d) - 1 + d),
        ("low_var_kl", lambda d: math.exp(-d) - 1 + d),
    ],
)
def test_kl_estimators_closed_form(kind, expected):
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1])
    ref = torch.tensor([-1.0, -1.5, -0.7, -0.6])
    got = pu.compute_approx_kl(logp, ref, kind)
    want = torch.tensor([expected(float(a - b)) for a, b in zip(logp, ref)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_kl_is_zero_for_identical_policies_and_low_var_kl_is_clamped():
    x = torch.tensor([-0.3, -2.0])
    for kind in pu.KL_LOSS_TYPES:
        assert torch.all(pu.compute_approx_kl(x, x, kind) == 0)
    # Δ = -20: e^20 - 1 - 20 is huge for k3, clamped to 10 for low_var_kl.
    logp, ref = torch.tensor([-25.0]), torch.tensor([-5.0])
    assert pu.compute_approx_kl(logp, ref, "k3").item() > 1e8
    assert pu.compute_approx_kl(logp, ref, "low_var_kl").item() == 10.0


def test_kl_unknown_type_names_flag():
    with pytest.raises(ValueError, match="--kl-loss-type"):
        pu.compute_approx_kl(torch.zeros(1), torch.zeros(1), "k4")


# ---- group normalisation -------------------------------------------------------------------------------------
def test_group_normalize_by_group_index_not_position():
    rewards = [1.0, 10.0, 0.0, 20.0, 2.0]
    groups = [0, 1, 0, 1, 7]  # interleaved groups and a singleton
    out = pu.group_normalize_rewards(rewards, groups, std_normalize=False)
    assert out == pytest.approx([0.5, -5.0, -0.5, 5.0, 0.0])


def test_group_normalize_std_unbiased():
    rewards = [1.0, 0.0, 0.0, 0.0, 3.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1]
    out = pu.group_normalize_rewards(rewards, groups, std_normalize=True)
    mean, std = 0.25, math.sqrt(((0.75**2) + 3 * (0.25**2)) / 3)  # unbiased (n - 1)
    assert out[:4] == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards[:4]])
    assert out[4:] == pytest.approx([0.0, 0.0])  # zero std: 0 / (0 + eps)
    # singleton group with std_normalize: only centred (std undefined)
    assert pu.group_normalize_rewards([5.0], [3], True) == [0.0]


def test_group_normalize_length_mismatch():
    with pytest.raises(ValueError, match="2 rewards but 1 group"):
        pu.group_normalize_rewards([1.0, 2.0], [0], True)


# ---- advantages and returns ------------------------------------------------------------------------------------
def test_grpo_returns_broadcast_the_reward_in_the_kl_shape():
    adv = pu.get_grpo_returns(torch.tensor([0.5, -1.0, 2.0]), [torch.zeros(3), torch.ones(1), torch.zeros(0)])
    assert [a.tolist() for a in adv] == [[0.5, 0.5, 0.5], [-1.0], []]
    assert all(a.dtype == torch.float32 for a in adv)


def test_reinforce_plus_plus_puts_the_reward_on_the_last_loss_masked_in_token():
    # sample 0: the last token is a tool token (mask 0): the reward sits on token 2, the KL of masked tokens is 0
    kl = [torch.tensor([0.2, 0.4, -0.1, 0.3]), torch.tensor([0.2]), torch.tensor([0.5, 0.5])]
    masks = [torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([1.0]), torch.zeros(2)]
    got = pu.get_reinforce_plus_plus_returns([1.0, 0.0, 3.0], kl, masks, [4, 1, 2], [9, 3, 5], kl_coef=0.5,
                                            gamma=0.5)
    # token rewards [-0.1, 0, 1.05, 0] -> G3 = 0, G2 = 1.05, G1 = 0.525, G0 = -0.1 + 0.2625
    torch.testing.assert_close(got[0], torch.tensor([0.1625, 0.525, 1.05, 0.0]))
    torch.testing.assert_close(got[1], torch.tensor([-0.1]))
    # a sample dropped from the loss (all-zero mask) gets no reward: nothing to credit
    assert got[2].tolist() == [0.0, 0.0]
    assert pu.get_reinforce_plus_plus_returns([], [], [], [], [], 0.1, 1.0) == []


def test_reinforce_plus_plus_baseline_advantages():
    got = pu.get_reinforce_plus_plus_baseline_advantages([0.5, -0.5], [torch.tensor([0.2, 0.4]), torch.zeros(1)],
                                                         [torch.ones(2), torch.ones(1)], kl_coef=0.5)
    assert [[round(x, 6) for x in a.tolist()] for a in got] == [[0.4, 0.3], [-0.5]]


def test_kl_penalized_token_rewards_do_not_touch_the_kl():
    kl = torch.tensor([0.2, 0.4, -0.1])
    got = pu.kl_penalized_token_rewards([1.0, 2.0], [kl, torch.zeros(0)], kl_coef=0.5)
    torch.testing.assert_close(got[0], torch.tensor([-0.1, -0.2, 1.05]))
    assert got[1].tolist() == []
    assert kl.tolist() == pytest.approx([0.2, 0.4, -0.1])  # the logged KL is not modified in place


def _serial_returns(rewards, gamma):
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def test_discounted_returns_closed_form_and_chunk_boundaries():
    # G2 = 1; G1 = -0.2 + 0.5·1 = 0.3; G0 = 0.1 + 0.5·0.3 = 0.25
    got = pu.chunked_discounted_returns(torch.tensor([[0.1, -0.2, 1.0]]), discount=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.25, 0.3, 1.0]]))
    # chunks of 2 over 7 steps: the hand-over between chunks and the padded last chunk
    rewards = [0.3, -1.0, 2.0, 0.5, 0.0, 1.5, -0.25]
    got = pu.chunked_discounted_returns(torch.tensor([rewards], dtype=torch.float64), 0.9, chunk_size=2)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got[0], torch.tensor(_serial_returns(rewards, 0.9), dtype=torch.float64))
    # discount 0: each return is its own reward
    torch.testing.assert_close(pu.chunked_discounted_returns(torch.tensor([rewards]), 0.0, chunk_size=3),
                               torch.tensor([rewards]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        pu.chunked_discounted_returns(torch.zeros(3), 1.0)


@pytest.mark.parametrize("gae", [pu.vanilla_gae, pu.chunked_gae])
def test_gae_closed_form(gae):
    r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.2, 0.4]])
    adv, ret = gae(r, v, gamma=0.9, lambd=0.8)
    # δ2 = 1 − 0.4 = 0.6;  δ1 = 0.9·0.4 − 0.2 = 0.16;  δ0 = 0.9·0.2 − 0.5 = −0.32
    # A2 = 0.6;  A1 = 0.16 + 0.72·0.6 = 0.592;  A0 = −0.32 + 0.72·0.592 = 0.10624
    torch.testing.assert_close(adv, torch.tensor([[0.10624, 0.592, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.60624, 0.792, 1.0]]))
    # γ = λ = 1: A_t = (sum of rewards from t) − V_t, returns = the undiscounted reward-to-go
    adv1, ret1 = gae(r, v, 1.0, 1.0)
    torch.testing.assert_close(adv1, torch.tensor([[0.5, 0.8, 0.6]]))
    torch.testing.assert_close(ret1, torch.ones(1, 3))
    with pytest.raises(ValueError, match="gae"):
        gae(r, v[:, :2], 1.0, 1.0)


def test_gae_batch_of_unequal_lengths_equals_each_sample_alone():
    rewards = [torch.tensor([0.0, 0.0, 1.0]), torch.tensor([2.0])]
    values = [torch.tensor([0.5, 0.2, 0.4]), torch.tensor([0.5])]
    adv, ret = pu.get_advantages_and_returns_batch([7, 4], [3, 1], values, rewards, 0.9, 0.8)
    torch.testing.assert_close(adv[0], torch.tensor([0.10624, 0.592, 0.6]))
    torch.testing.assert_close(adv[1], torch.tensor([1.5]))  # δ = 2 − 0.5, nothing after it
    torch.testing.assert_close(ret[1], torch.tensor([2.0]))
    serial, _ = pu.get_advantages_and_returns_batch([7, 4], [3, 1], values, rewards, 0.9, 0.8, chunked=False)
    torch.testing.assert_close(serial[0], adv[0])
    assert pu.get_advantages_and_returns_batch([], [], [], [], 1.0, 1.0) == ([], [])
    with pytest.raises(ValueError, match="sample 1 has values of shape"):
        pu.get_advantages_and_returns_batch([7, 4], [3, 1], [values[0], torch.zeros(2)], rewards, 1.0, 1.0)


def test_masked_whiten():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    out = pu.masked_whiten(values, mask)
    std = math.sqrt(2 / 3)  # population std of 1, 2, 3
    torch.testing.assert_close(out[:3], torch.tensor([-1 / std, 0.0, 1 / std]), rtol=1e-5, atol=1e-5)
    assert out[3].item() == 100.0


def test_masked_whiten_across_shards_equals_whole_batch():
    """--normalize-advantages over data-parallel ranks: moments are additive, so all-reducing (summing)
    each rank's moments and whitening each shard with the sum equals whitening the whole batch."""
    values = torch.tensor([1.0, 2.0, 3.0, 100.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    whole = pu.masked_whiten(values, mask)
    shards = [(values[:2], mask[:2]), (values[2:], mask[2:])]
    total = sum(pu.masked_moments(v, m) for v, m in shards)
    torch.testing.assert_close(total, torch.tensor([11.0, 39.0, 4.0], dtype=torch.float64))
    got = torch.cat([pu.whiten_with_moments(v, m, total) for v, m in shards])
    torch.testing.assert_close(got, whole)
    mean, std = 11 / 4, math.sqrt(39 / 4 - (11 / 4) ** 2)
    torch.testing.assert_close(whole[[0, 4]], torch.tensor([(1 - mean) / std, (5 - mean) / std]))


# ---- policy loss ---------------------------------------------------------------------------------------------
def _ppo_closed_form(r, a, lo, hi):
    return max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)


def test_policy_loss_closed_form():
    ratios = [0.5, 0.9, 1.0, 1.1, 1.5, 0.5, 1.5]
    advs = [1.0, 1.0, 2.0, -1.0, 1.0, -1.0, -1.0]
    ppo_kl = -torch.log(torch.tensor(ratios))  # slime's argument: logp_old − logp
    pg, clipfrac = pu.compute_policy_loss(ppo_kl, torch.tensor(advs), eps_clip=0.2, eps_clip_high=0.3)
    want = [_ppo_closed_form(r, a, 0.2, 0.3) for r, a in zip(ratios, advs)]
    torch.testing.assert_close(pg, torch.tensor(want), rtol=1e-6, atol=1e-6)
    # clipped (the clipped term wins) exactly where r leaves the trust region in the direction of A
    assert clipfrac.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_policy_loss_at_ratio_one_has_advantage_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([2.0, -3.0])
    pg, _ = pu.compute_policy_loss(logp.detach() - logp, adv, 0.2, 0.2)
    pg.sum().backward()
    torch.testing.assert_close(pg.detach(), -adv)
    torch.testing.assert_close(logp.grad, -adv)  # d(-r A)/dlogp = -A at r = 1


def test_dual_clip():
    # A < 0 and a huge ratio: the ordinary loss -r·A = 10 is capped at -c·A = 3.
    ppo_kl = -torch.log(torch.tensor([10.0, 10.0, 2.0]))
    adv = torch.tensor([-1.0, 1.0, -1.0])
    pg, _ = pu.compute_policy_loss(ppo_kl, adv, 0.2, 0.2, eps_clip_c=3.0)
    torch.testing.assert_close(pg, torch.tensor([3.0, -1.2, 2.0]))
    with pytest.raises(ValueError, match="--eps-clip-c"):
        pu.compute_policy_loss(ppo_kl, adv, 0.2, 0.2, eps_clip_c=0.5)


def test_gspo_sequence_ratio():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 9.0], [0.2, -0.2, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ppo_kl = pu.sequence_ppo_kl(logp, old, mask)
    torch.testing.assert_close(ppo_kl.detach(), torch.tensor([[-0.2] * 3, [0.0] * 3]))
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    pg, clipfrac = pu.compute_policy_loss(ppo_kl, adv, 0.1, 0.1)
    # row 0: r = e^0.2 ≈ 1.221 > 1.1 with A > 0 -> clipped loss -1.1, constant in logp
    torch.testing.assert_close(pg[0].detach(), torch.full((3,), -1.1))
    assert clipfrac[0].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(pg[1].detach(), torch.ones(3))
    (pg * mask).sum().backward()
    # row 1 (unclipped): d/dlogp_t of Σ_t' (r·1) with r = exp(mean) is r / n_tokens per masked token
    torch.testing.assert_close(logp.grad[1], torch.full((3,), 3 * 1.0 / 3))
    assert torch.all(logp.grad[0] == 0)


def test_tis_and_icepop_weights():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    rollout = torch.log(torch.tensor([0.1, 0.5, 1.0]))  # ratios 5, 1, 0.5
    w, m = pu.tis_weights(old, rollout, tis_clip=2.0, tis_clip_low=0.6)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, 0.6]))
    torch.testing.assert_close(m["tis"], torch.tensor([5.0, 1.0, 0.5]))  # slime logs the raw ratio
    assert m["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0]
    torch.testing.assert_close(m["tis_abs"], torch.tensor([4.0, 0.0, 0.5]))
    w, m = pu.icepop_weights(old, rollout, tis_clip=2.0, tis_clip_low=0.6)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.0]))  # outside the band: dropped, not clamped
    assert m["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0]


# ---- fused log-probs and entropy -----------------------------------------------------------------------------
def _logits():
    return torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 0.5, 2.0], [-1.0, 3.0, 2.0, 0.0]])


@pytest.mark.parametrize("chunk_size", [-1, 2])
def test_log_probs_and_entropy_match_log_softmax_with_their_gradient(chunk_size):
    tokens = torch.tensor([3, 0, 1])
    logits = _logits().requires_grad_()
    lp, ent = pu.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True, chunk_size=chunk_size)
    ref_logits = _logits().requires_grad_()
    log_p = torch.log_softmax(ref_logits, -1)
    want_lp = log_p.gather(-1, tokens.unsqueeze(-1))
    want_ent = -(log_p.exp() * log_p).sum(-1)
    assert lp.shape == (3, 1) and ent.shape == (3,)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
    w_lp, w_ent = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 0.3, -0.7])
    (lp.squeeze(-1) * w_lp + ent * w_ent).sum().backward()
    (want_lp.squeeze(-1) * w_lp + want_ent * w_ent).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_log_probs_keep_mask_restricts_the_distribution_but_not_the_entropy():
    tokens = torch.tensor([3, 0, 1])
    keep = torch.tensor([[False, True, True, False], [False, True, False, True], [True, True, False, False]])
    lp, ent = pu.calculate_log_probs_and_entropy(_logits(), tokens, None, with_entropy=True, log_prob_keep_mask=keep)
    kept = keep.clone()
    kept[torch.arange(3), tokens] = True  # the sampled token always stays in
    want = torch.log_softmax(_logits().masked_fill(~kept, float("-inf")), -1).gather(-1, tokens.unsqueeze(-1))
    torch.testing.assert_close(lp, want)
    full = torch.log_softmax(_logits(), -1)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    # row 0 keeps ids 1, 2 and the target 3: log(e^4 / (e^2 + e^3 + e^4))
    assert lp[0].item() == pytest.approx(4 - math.log(math.exp(2) + math.exp(3) + math.exp(4)), abs=1e-6)


def test_log_probs_without_entropy_and_empty_input():
    lp, ent = pu.calculate_log_probs_and_entropy(_logits(), torch.tensor([0, 1, 2]), None)
    assert ent is None and lp.shape == (3, 1)
    lp, ent = pu.calculate_log_probs_and_entropy(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), None,
                                                 with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)


# ---- aggregation -------------------------------------------------------------------------------------------
def test_aggregation_sample_mean_and_token_mean():
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(pu.per_sample_masked_mean(values, mask), torch.tensor([2.0, 4.0, 0.0]))
    # slime's sum_of_sample_mean: the micro-batch's sum of sample means (2 + 4 + 0), or of masked tokens
    assert pu.sum_of_sample_mean(values, mask, per_token=False).item() == pytest.approx(6.0)
    assert pu.sum_of_sample_mean(values, mask, per_token=True).item() == pytest.approx(8.0)
    # default: Σ sample means / number of samples in the global batch (here 4: one lives on another rank)
    assert pu.aggregate_loss(values, mask, per_token=False, global_denominator=4).item() == pytest.approx(6.0 / 4)
    # per token: Σ masked tokens / global masked-token count
    assert pu.aggregate_loss(values, mask, per_token=True, global_denominator=5).item() == pytest.approx(8.0 / 5)


def test_aggregation_shares_sum_to_global_mean():
    torch.manual_seed(0)
    values = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    whole = pu.aggregate_loss(values, mask, False, 6)
    parts = sum(pu.aggregate_loss(values[i : i + 2], mask[i : i + 2], False, 6) for i in (0, 2, 4))
    torch.testing.assert_close(whole, parts)
    n_tok = float(mask.sum())
    whole_t = pu.aggregate_loss(values, mask, True, n_tok)
    torch.testing.assert_close(whole_t, (values * mask).sum() / n_tok)
    parts_t = sum(pu.aggregate_loss(values[i : i + 3], mask[i : i + 3], True, n_tok) for i in (0, 3))
    torch.testing.assert_close(whole_t, parts_t)


def test_aggregation_unequal_lengths_per_sample_vs_per_token():
    """Sample A has 3 tokens of loss 1, 2, 3; sample B one token of loss 10.
    Per sample: mean(mean(1, 2, 3), 10) = (2 + 10) / 2 = 6. Per token: (1 + 2 + 3 + 10) / 4 = 4."""
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert pu.aggregate_loss(values, mask, per_token=False, global_denominator=2).item() == pytest.approx(6.0)
    assert pu.aggregate_loss(values, mask, per_token=True, global_denominator=4).item() == pytest.approx(4.0)


# ---- CISPO, unbiased KL, value loss -------------------------------------------------------------------------
def test_cispo_closed_form_and_gradient():
    old = torch.log(torch.tensor([0.25, 0.5, 0.5]))
    logp = torch.log(torch.tensor([0.5, 0.5, 0.1])).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 1.0])
    pg, clipfrac = pu.compute_cispo_loss(old - logp, logp, adv, eps_clip=0.2, eps_clip_high=0.28)
    # ratios 2, 1, 0.2 -> weights clip(·, 0.8, 1.28) = 1.28, 1, 0.8; loss = −w·A·logp
    w = torch.tensor([1.28, 1.0, 0.8])
    torch.testing.assert_close(pg.detach(), -w * adv * logp.detach())
    assert clipfrac.tolist() == [1.0, 0.0, 1.0]
    pg.sum().backward()
    torch.testing.assert_close(logp.grad, -w * adv)  # the weight is a constant: every token keeps a gradient


def test_unbiased_kl_weights_by_the_ratio_with_its_gradient():
    logp = torch.log(torch.tensor([0.6, 0.2])).requires_grad_(True)
    ref = torch.log(torch.tensor([0.6, 0.4]))
    old = torch.log(torch.tensor([0.3, 0.4]))
    ratio = torch.exp(logp - old)  # [2, 0.5]
    out = pu.compute_approx_kl(logp, ref, "k1", importance_ratio=ratio)
    torch.testing.assert_close(out.detach(), torch.tensor([0.0, 0.5 * math.log(0.5)]))
    out.sum().backward()
    # d/dlogp [r·(logp − ref)] = r·(logp − ref) + r (slime does not detach the ratio)
    torch.testing.assert_close(logp.grad, torch.tensor([2.0, 0.5 * math.log(0.5) + 0.5]))
    # low_var_kl is clamped after the ratio: 10 stays the bound
    big = pu.compute_approx_kl(torch.tensor([-25.0]), torch.tensor([-5.0]), "low_var_kl", torch.tensor([3.0]))
    assert big.item() == 10.0


# ---- off-policy sequence masking (--use-opsm) --------------------------------------------------------------
def test_opsm_masks_negative_advantage_sequences_whose_kl_exceeds_delta():
    # logp_old − logp per row (binary-exact): row 0 [0.25, 0] -> seq KL 0.125; row 1 same KL, A > 0;
    # row 2 KL 1.0, A = 0; row 3 [0.25, 5.0] with the second token unmasked -> KL 0.25 (not 2.625);
    # row 4 KL 0.125 with per-token advantages of both signs.
    cur = torch.tensor([[-1.0, -0.5], [-1.0, -0.5], [-1.0, -1.0], [-1.0, -6.0], [-1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-0.75, -0.5], [-0.75, -0.5], [0.0, 0.0], [-0.75, -1.0], [-0.75, -0.5]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [-1.0, -1.0], [-1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    # KL exactly at delta is kept (strictly above masks)
    at = pu.opsm_mask(cur, old, adv, mask, delta=0.125)
    assert at.tolist() == [[1, 1], [1, 1], [1, 1], [0, 0], [1, 1]]
    below = pu.opsm_mask(cur, old, adv, mask, delta=0.124)
    assert below.tolist() == [[0, 0], [1, 1], [1, 1], [0, 0], [0, 1]]
    # the padded token does not enter the sequence KL: 0.25 <= 0.3 keeps row 3 (2.625 would mask it)
    assert pu.opsm_mask(cur, old, adv, mask, delta=0.3).tolist() == [[1.0] * 2] * 5
    assert not at.requires_grad


def test_opsm_keeps_everything_on_policy_and_a_negative_kl():
    cur = torch.tensor([[-1.0, -0.5], [-0.5, -0.5]])
    adv = -torch.ones(2, 2)
    mask = torch.ones(2, 2)
    assert pu.opsm_mask(cur, cur.clone(), adv, mask, delta=1e-4).tolist() == [[1, 1], [1, 1]]
    # the current policy more likely than the old one (KL < 0): never masked, whatever the sign of A
    assert pu.opsm_mask(cur, cur - 0.5, adv, mask, delta=0.0).tolist() == [[1, 1], [1, 1]]


def test_value_loss_clipped_and_unclipped():
    values, old, ret = torch.tensor([1.0, 0.0, 0.6]), torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 0.0])
    loss, clipfrac = pu.compute_value_loss(values, old, ret, value_clip=0.2)
    # V_clip = [0.7, 0.3, 0.6]; (V−R)² = [1, 0, 0.36]; (V_clip−R)² = [1.69, 0.09, 0.36]; max, as slime
    torch.testing.assert_close(loss, torch.tensor([1.69, 0.09, 0.36]))
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]  # |V − V_old| > 0.2
    loss_nc, clip_nc = pu.compute_value_loss(values, old, ret, value_clip=None)
    torch.testing.assert_close(loss_nc, torch.tensor([1.0, 0.0, 0.36]))
    assert clip_nc.sum() == 0


# ---- flag couplings of the algorithm group (slime/config/arg_groups/algorithm.py) -----------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gamma", "1.5"], "--gamma 1.5"),
        (["--advantage-estimator", "ppo", "--value-clip", "0"], "--value-clip 0.0"),
        (["--critic-lr", "1e-5"], "--critic-lr configures the PPO critic"),
        (["--advantage-estimator", "ppo", "--critic-load", "nowhere"], "--critic-load nowhere"),
        (["--advantage-estimator", "reinforce_plus_plus"], "add --normalize-advantages"),
        (["--kl-coef", "0.1", "--use-kl-loss", "--kl-loss-coef", "0.1"], "keep only one"),
        (["--use-tis", "--use-rollout-logprobs"], "drop one of them"),
        (["--num-critic-only-steps", "2"], "use --advantage-estimator ppo"),
    ],
)
def test_algorithm_flag_couplings_name_flag_and_fix(tmp_path, monkeypatch, extra, message):
    from slime.config.arguments import SlimeArgumentError, parse_args

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    monkeypatch.chdir(tmp_path)
    argv = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--hf-checkpoint", "model",
            "--prompt-data", "train.jsonl", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--train-backend", "fsdp"]
    args = parse_args(argv + ["--advantage-estimator", "ppo", "--critic-load", "model", "--critic-lr", "1e-5"])
    assert args.use_critic and args.critic_lr == 1e-5
    with pytest.raises(SlimeArgumentError, match=message):
        parse_args(argv + extra)
