"""The actor's `--loss-type` assembly and the critic loss (slime.algorithm.loss.py), with
hand-computed values; plus slime's plugin contracts of the loss-side hooks, each with a plugin file that proves
it is called with slime's arguments and its output used: `--custom-loss-function-path`,
`--custom-advantage-function-path`, `--custom-tis-function-path`, `--custom-pg-loss-reducer-function-path`."""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from slime.algorithm.loss import LossInputs, compute_actor_loss, critic_loss
from slime.algorithm.slime_formats import LossHookInputs, rollout_data
from slime.algorithm.estimators import AdvantageInputs, compute_advantages_and_returns
from slime.utils import ppo_utils as pu
from slime.config.arguments import SlimeArgumentError
from tests.args import make_args


def _args(**kw):
    """GRPO's validated args (eps clip 0.2 both sides, no KL, no entropy, no TIS) with `kw` set before validation."""
    return make_args(**kw)


def _inputs(per_token=False, denominator=2.0, logits=None, **kw):
    """Two samples: A with 2 tokens, B with 1 token (mask [[1, 1], [1, 0]]), on-policy (r = 1); both are the
    only samples of the global batch (denominator 2)."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 1.0]])).requires_grad_(True)
    base = dict(
        log_probs=logp, old_log_probs=logp.detach().clone(), advantages=torch.tensor([[1.0, 1.0], [-2.0, 0.0]]),
        mask=mask, entropy=torch.tensor([[0.6, 0.2], [1.0, 5.0]]),
        aggregate=functools.partial(pu.aggregate_loss, mask=mask, per_token=per_token, global_denominator=denominator),
        hook_inputs=LossHookInputs(response_lengths=[2, 1], total_lengths=[5, 3], logits=logits),
        global_denominator=denominator,
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
    # slime's metrics: the raw ratio, its clipped fraction, |ratio − 1|, and ois = exp(−ppo_kl) (1 on-policy)
    assert m["train/tis"].item() == pytest.approx(((2 + 1) / 2 + 1) / 2)
    assert m["train/tis_clipfrac"].item() == pytest.approx((0.5 + 0) / 2)
    assert m["train/tis_abs"].item() == pytest.approx((0.5 + 0) / 2)
    assert m["train/ois"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="--use-tis"):
        compute_actor_loss(_args(use_tis=True), _inputs())


def test_opsm_masks_the_off_policy_negative_sample():
    # B (A = −2) has old − current = 0.25 on its one token > delta 1e-4: its pg loss and gradient are dropped;
    # A (A = +1) is on-policy and positive: kept. pg = [[-1, -1], [0, ·]] -> per sample (−1 + 0) / 2.
    shift = torch.tensor([[0.0, 0.0], [0.25, 0.0]])
    inputs = _inputs()
    inputs.old_log_probs = inputs.old_log_probs + shift
    loss, m = compute_actor_loss(_args(use_opsm=True), inputs)
    assert m["train/pg_loss"].item() == pytest.approx(-0.5)
    assert m["train/opsm_clipfrac"].item() == pytest.approx(0.5)  # one of the two sequences
    loss.backward()
    assert inputs.log_probs.grad[1].tolist() == [0.0, 0.0] and (inputs.log_probs.grad[0] != 0).all()
    # off: B's ratio e^−0.25 < 0.8 is clipped: pg_B = 2·0.8, (−1 + 1.6) / 2; no OPSM metric
    off = _inputs()
    off.old_log_probs = off.old_log_probs + shift
    _, m_off = compute_actor_loss(_args(), off)
    assert m_off["train/pg_loss"].item() == pytest.approx(0.3) and "train/opsm_clipfrac" not in m_off
    # per token: one dropped token of three; a delta above B's KL keeps it (same loss as off)
    on_t = _inputs(per_token=True, denominator=3.0)
    on_t.old_log_probs = on_t.old_log_probs + shift
    _, m_t = compute_actor_loss(_args(use_opsm=True), on_t)
    assert m_t["train/opsm_clipfrac"].item() == pytest.approx(1 / 3)
    high = _inputs()
    high.old_log_probs = high.old_log_probs + shift
    _, m_high = compute_actor_loss(_args(use_opsm=True, opsm_delta=0.25), high)
    assert m_high["train/pg_loss"].item() == pytest.approx(0.3) and m_high["train/opsm_clipfrac"].item() == 0


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
import torch

CALLS = []

def my_loss(args, batch, logits, sum_of_sample_mean):
    # slime's contract: per-sample lists in batch, a flat reducer -> (micro-batch sum, {name: micro-batch sum})
    CALLS.append({k: (v if not isinstance(v, list) else [x.tolist() if hasattr(x, "tolist") else x for x in v])
                  for k, v in batch.items() if k != "entropy"})
    adv, logp = batch["advantages"], batch["cur_log_probs"]
    flat_adv, flat_logp = torch.cat(adv), torch.cat(logp)
    loss = sum_of_sample_mean(-flat_adv * flat_logp)
    return loss, {"my_term": sum_of_sample_mean(flat_adv), "logits_seen": torch.tensor(float(logits is not None))}
'''

CUSTOM_ADV = '''
import torch

def my_advantages(args, rollout_data):
    # slime's contract: fill rollout_data["advantages"] / ["returns"] in place, return nothing
    rollout_data["advantages"] = [torch.full((n,), r * 10.0)
                                  for r, n in zip(rollout_data["raw_reward"], rollout_data["response_lengths"])]
    rollout_data["returns"] = [a + k for a, k in zip(rollout_data["advantages"], rollout_data["kl"])]
    rollout_data["seen"] = sorted(rollout_data)
'''


def _plugin(tmp_path, name, text):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def test_custom_loss_function_contract(tmp_path):
    path = _plugin(tmp_path, "my_loss", CUSTOM_LOSS)
    logits = torch.zeros(2, 2, 3)
    loss, m = compute_actor_loss(_args(loss_type="custom_loss", custom_loss_function_path=f"{path}:my_loss"),
                                 _inputs(logits=logits))
    # −A·logp: A: (ln2 + 2 ln2)/2 = 1.5 ln2; B: −2·ln2; the micro-batch sum divided by the 2 samples
    assert loss.item() == pytest.approx((1.5 * math.log(2) - 2 * math.log(2)) / 2)
    assert m["train/my_term"].item() == pytest.approx((1.0 - 2.0) / 2) and "train/loss" in m
    assert m["train/logits_seen"].item() == pytest.approx(0.5)  # the backend's logits reach the hook
    loss.backward()  # the custom loss carries the policy gradient
    module = sys.modules["_slime_plugin_my_loss"]
    batch = module.CALLS[-1]
    assert batch["advantages"] == [[1.0, 1.0], [-2.0]] and batch["loss_masks"] == [[1.0, 1.0], [1.0]]
    assert batch["response_lengths"] == [2, 1] and batch["total_lengths"] == [5, 3]
    assert batch["ref_log_probs"] is None and batch["rollout_log_probs"] is None


def test_custom_loss_per_token_divides_by_the_global_token_count(tmp_path):
    path = _plugin(tmp_path, "my_loss", CUSTOM_LOSS)
    args = _args(loss_type="custom_loss", custom_loss_function_path=f"{path}:my_loss", calculate_per_token_loss=True)
    loss, _ = compute_actor_loss(args, _inputs(per_token=True, denominator=3.0))
    # Σ −A·logp over the 3 masked tokens: ln2 + 2 ln2 − 2 ln2 = ln2, over 3 tokens
    assert loss.item() == pytest.approx(math.log(2) / 3)


def test_custom_advantage_function_contract(tmp_path):
    path = _plugin(tmp_path, "my_adv", CUSTOM_ADV)
    args = _args(custom_advantage_function_path=f"{path}:my_advantages")
    inputs = AdvantageInputs(rewards=[0.0, 0.0], response_lengths=[2, 1], loss_masks=[torch.ones(2), torch.ones(1)])

    def rollout_data_of(kl):  # the trainer's: the rows' raw rewards too
        return rollout_data(rewards=inputs.rewards, raw_reward=[1.0, 0.5], response_lengths=inputs.response_lengths,
                            loss_masks=inputs.loss_masks, kl=kl, group_indices=[0, 0])

    adv, ret = compute_advantages_and_returns(args, inputs, rollout_data_of)
    assert [a.tolist() for a in adv] == [[10.0, 10.0], [5.0]]
    assert [r.tolist() for r in ret] == [[10.0, 10.0], [5.0]]  # + kl: zeros without --kl-coef (slime's)


@pytest.mark.parametrize("body, message", [
    ("pass", r"set no rollout_data\['advantages'\]"),
    ("rollout_data['advantages'] = [torch.zeros(2)]", "has 1 entries for 2 samples"),
    ("rollout_data['advantages'] = [torch.zeros(2), torch.zeros(3)]", r"\[1\] has shape \(3,\)"),
])
def test_custom_advantage_function_bad_results_name_the_hook(tmp_path, body, message):
    path = _plugin(tmp_path, "bad_adv", f"import torch\n\ndef fn(args, rollout_data):\n    {body}\n")
    args = _args(custom_advantage_function_path=f"{path}:fn")
    inputs = AdvantageInputs(rewards=[0.0, 0.0], response_lengths=[2, 1], loss_masks=[torch.ones(2), torch.ones(1)])
    with pytest.raises(ValueError, match="--custom-advantage-function-path .*" + message):
        compute_advantages_and_returns(args, inputs)


CUSTOM_TIS = '''
import torch

CALLS = []

def half_and_reject(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                    response_lengths, **kwargs):
    # slime's contract: flat pg_loss, per-sample lists -> (flat pg_loss, per-sample masks, flat metrics)
    CALLS.append({"pg_loss": pg_loss.tolist(), "train": [t.tolist() for t in train_log_probs],
                  "rollout": [t.tolist() for t in rollout_log_probs], "masks": [m.tolist() for m in loss_masks],
                  "total_lengths": total_lengths, "response_lengths": response_lengths})
    masks = [m.clone() for m in loss_masks]
    masks[0][1] = 0  # reject sample A's second token
    return pg_loss * 0.5, masks, {"my_weight": torch.full_like(pg_loss, 0.5)}
'''


def test_custom_tis_function_is_called_with_slime_layout_and_used(tmp_path):
    path = _plugin(tmp_path, "my_tis", CUSTOM_TIS)
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]]))
    args = _args(use_tis=True, custom_tis_function_path=f"{path}:half_and_reject")
    loss, m = compute_actor_loss(args, _inputs(rollout_log_probs=rollout))
    call = sys.modules["_slime_plugin_my_tis"].CALLS[-1]
    assert call["pg_loss"] == [-1.0, -1.0, 2.0]  # the rows' response tokens back to back (padding dropped)
    assert call["response_lengths"] == [2, 1] and call["total_lengths"] == [5, 3]
    assert call["masks"] == [[1.0, 1.0], [1.0]] and len(call["train"][0]) == 2 and len(call["rollout"][1]) == 1
    # pg × 0.5 with A's token 1 rejected: A (−0.5 + 0) / 2 tokens (the denominator stays the loss mask's), B 1.0
    assert m["train/pg_loss"].item() == pytest.approx((-0.25 + 1.0) / 2)
    assert m["train/my_weight"].item() == pytest.approx(0.5)  # its metrics are logged as train/<name>
    assert "train/tis" not in m and m["train/ois"].item() == pytest.approx(1.0)


def test_icepop_through_the_tis_flag():
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]]))  # ratios [[2, 1], [1, ·]]
    args = _args(use_tis=True, tis_clip=1.5, custom_tis_function_path="slime.algorithm.tis.icepop_function")
    _, m = compute_actor_loss(args, _inputs(rollout_log_probs=rollout))
    # ratio 2 is outside [0, 1.5]: that token is dropped; pg = [[0, −1], [2, ·]] -> (−0.5 + 2) / 2
    assert m["train/pg_loss"].item() == pytest.approx(0.75)
    assert m["train/tis_clipfrac"].item() == pytest.approx(0.25)
    # vanilla_tis_function equals the built-in truncation
    vanilla = _args(use_tis=True, tis_clip=1.5, custom_tis_function_path="slime.algorithm.tis.vanilla_tis_function")
    _, mv = compute_actor_loss(vanilla, _inputs(rollout_log_probs=rollout))
    _, mb = compute_actor_loss(_args(use_tis=True, tis_clip=1.5), _inputs(rollout_log_probs=rollout))
    assert mv["train/pg_loss"].item() == pytest.approx(mb["train/pg_loss"].item()) == pytest.approx(0.375)


def test_get_mismatch_metrics_runs_the_tis_function_without_use_tis(tmp_path):
    path = _plugin(tmp_path, "my_tis", CUSTOM_TIS)
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]]))
    args = _args(get_mismatch_metrics=True, custom_tis_function_path=f"{path}:half_and_reject")
    _, m = compute_actor_loss(args, _inputs(rollout_log_probs=rollout))
    assert m["train/my_weight"].item() == pytest.approx(0.5)


REDUCER = '''
import torch

CALLS = []

def constant_denominator(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    # Dr.GRPO-style: each sample's masked sum over a constant 4 instead of its token count
    CALLS.append((total_lengths, response_lengths, [m.tolist() for m in loss_masks], calculate_per_token_loss))
    def reduce(x):
        return sum((part * m).sum() / 4.0 for part, m in zip(x.split(response_lengths), loss_masks))
    return reduce
'''


def test_custom_pg_loss_reducer_reduces_only_the_pg_loss(tmp_path):
    path = _plugin(tmp_path, "my_reducer", REDUCER)
    args = _args(custom_pg_loss_reducer_function_path=f"{path}:constant_denominator")
    loss, m = compute_actor_loss(args, _inputs())
    # pg per token [[-1, -1], [2, ·]]: A −2/4, B 2/4 -> sum 0, over the 2 samples of the global batch
    assert m["train/pg_loss"].item() == pytest.approx(0.0)
    assert m["train/entropy_loss"].item() == pytest.approx(((0.6 + 0.2) / 2 + 1.0) / 2)  # default reduction
    call = sys.modules["_slime_plugin_my_reducer"].CALLS[-1]
    assert call == ([5, 3], [2, 1], [[1.0, 1.0], [1.0]], False)
    inputs = _inputs(advantages=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    _, m = compute_actor_loss(args, inputs)
    assert m["train/pg_loss"].item() == pytest.approx((-2 / 4 - 1 / 4) / 2)


def test_rows_split_from_one_rollout_weigh_as_one_token_mean(tmp_path):
    """A and B are the two rows of one rollout (slime's rollout_mask_sums: 3 tokens for both) and the step's only
    rollout: every term is that rollout's token mean, the custom loss's sum_of_sample_mean too."""
    split = dict(aggregate=None, denominator=1.0, sample_denominators=torch.tensor([3.0, 3.0]))
    _, m = compute_actor_loss(_args(), _inputs(**split))
    # pg per token [[-1, -1], [2, ·]] -> (−1 − 1 + 2) / 3; as two rollouts it was the mean of −1 and 2
    assert m["train/pg_loss"].item() == pytest.approx(0.0)
    assert m["train/entropy_loss"].item() == pytest.approx((0.6 + 0.2 + 1.0) / 3)
    path = _plugin(tmp_path, "my_loss", CUSTOM_LOSS)
    args = _args(loss_type="custom_loss", custom_loss_function_path=f"{path}:my_loss")
    loss, m = compute_actor_loss(args, _inputs(**split))
    # Σ −A·logp over the rollout's 3 tokens: 3 ln2 − 2 ln2, over its 3 tokens; Σ A = 1 + 1 − 2
    assert loss.item() == pytest.approx(math.log(2) / 3) and m["train/my_term"].item() == pytest.approx(0.0)
    assert sys.modules["_slime_plugin_my_loss"].CALLS[-1]["rollout_mask_sums"].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="global denominator must be > 0, got 0"):
        compute_actor_loss(_args(), _inputs(aggregate=None, denominator=0.0))


def test_slime_hooks_need_the_rows_lengths(tmp_path):
    path = _plugin(tmp_path, "my_reducer", REDUCER)
    args = _args(custom_pg_loss_reducer_function_path=f"{path}:constant_denominator")
    with pytest.raises(ValueError, match="--custom-pg-loss-reducer-function-path: .*LossInputs.hook_inputs"):
        compute_actor_loss(args, _inputs(hook_inputs=None))


@pytest.mark.parametrize("flag, source, call", [
    ("--custom-loss-function-path", "def fn(args, inputs):\n    pass\n",
     r"fn\(args, batch, logits, sum_of_sample_mean\)"),
    ("--custom-advantage-function-path", "def fn(args):\n    pass\n", r"fn\(args, rollout_data\)"),
    ("--custom-tis-function-path", "def fn(args, pg_loss, train_log_probs):\n    pass\n",
     r"fn\(args, \*, pg_loss, train_log_probs"),
    ("--custom-pg-loss-reducer-function-path", "def fn(total_lengths, response_lengths):\n    pass\n",
     r"fn\(total_lengths, response_lengths, loss_masks, calculate_per_token_loss\)"),
])
def test_a_hook_with_the_wrong_signature_fails_at_parse_time(files, flag, source, call):
    (files / "hook.py").write_text(source)
    extra = ["--loss-type", "custom_loss"] if flag == "--custom-loss-function-path" else []
    extra += ["--use-tis"] if flag == "--custom-tis-function-path" else []
    with pytest.raises(SlimeArgumentError, match=f"{flag}=hook.py:fn: .*cannot be called as {call}"):
        make_args(flag, "hook.py:fn", *extra)


def test_the_slime_tis_functions_pass_the_parse_time_check(files):
    for name in ("vanilla_tis_function", "icepop_function"):
        args = make_args("--use-tis", "--custom-tis-function-path", f"slime.algorithm.tis.{name}")
        assert args.custom_tis_function_path.endswith(name)


def test_unknown_loss_type_names_flag():
    with pytest.raises(ValueError, match="--loss-type"):
        compute_actor_loss(_args(loss_type="nope"), _inputs())


def test_critic_loss_aggregates_value_loss():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    agg = functools.partial(pu.aggregate_loss, mask=mask, per_token=False, global_denominator=2)
    values = torch.tensor([[1.0, 0.0], [0.6, 9.0]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.5], [0.5, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    loss, m = critic_loss(_args(value_clip=0.2), values, old, ret, agg)
    # per token max(...) = [[1.69, 0.09], [0.36, ·]] (slime's, no ½) -> ((1.69 + 0.09)/2 + 0.36)/2
    assert loss.item() == pytest.approx(((1.69 + 0.09) / 2 + 0.36) / 2)
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
