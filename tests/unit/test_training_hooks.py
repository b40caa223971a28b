"""The training side of slime's plugin API and Megatron options, in pieces (pure CPU): the rollout_data view of
--rollout-data-postprocess-path, --keep-old-actor's weight queue, the Megatron hook / provider / --spec
contracts, and the mapping of --optimizer-cpu-offload, --no-check-for-nan-in-loss-and-grad,
--lr-warmup-fraction, --no-position-embedding and --deterministic-mode onto megatron-core. The hooks running
inside real trainers: tests/e2e_cpu/test_training_hooks.py."""

from __future__ import annotations

import argparse
import importlib.util
import textwrap

import pytest
import torch

from slime.backends.megatron_utils import args as margs
from slime.backends.megatron_utils import plugins
from slime.backends.fsdp_utils.data import extract_response_log_probs
from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, policy_loss_function
from slime.backends.training.batching import MicroBatch, make_micro_batch, rollout_mask_sums
from slime.backends.training.old_actor import OldActor
from slime.backends.training.record import (
    RolloutRecord,
    advantages_and_returns,
    loss_denominator,
    rollout_log_probs,
    token_mean,
)
from slime.backends.training.rollout_data import apply_rollout_data, rollout_data_of
from slime.config.arguments import SlimeArgumentError
from slime.algorithm.slime_formats import loss_hooks_set
from slime.utils.misc import check_hook_signature
from slime.utils.types import TrainBatch
from tests.args import make_args
from tests.conftest import model_args

HAS_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
OFFLOAD = ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--bf16")


def megatron_args(*argv: str, **fields) -> argparse.Namespace:
    return make_args("--train-backend", "megatron", *model_args("tiny-qwen3"), *argv, **fields)


def megatron_error(*argv: str) -> str:
    with pytest.raises(SlimeArgumentError) as info:
        megatron_args(*argv)
    return str(info.value)


# ---- --rollout-data-postprocess-path: slime's rollout_data of one rank ------------------------------------------
def record_of_two_rows() -> RolloutRecord:
    batch = TrainBatch(tokens=[[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], response_lengths=[2, 1, 3],
                       loss_masks=[[1, 1], [1], [1, 0, 1]], rewards=[0.5, -0.5, 1.0], raw_rewards=[1.0, 0.0, 1.0],
                       truncated=[False, True, False], group_indices=[0, 0, 1])
    record = RolloutRecord(batch, [[[2, 0]]], rollout_id=7)  # this rank trains rows 2 and 0
    record.loss_masks = {r: torch.tensor(batch.loss_masks[r], dtype=torch.float32) for r in (0, 2)}
    record.advantages = {0: torch.tensor([0.5, 0.5]), 2: torch.tensor([1.0, 1.0, 1.0])}
    record.old_log_probs = {0: torch.tensor([-1.0, -2.0]), 2: torch.tensor([-0.5, -0.25, -0.125])}
    return record


def test_rollout_data_has_slimes_keys_for_this_ranks_rows():
    data = rollout_data_of(record_of_two_rows())
    assert data["partition"] == [2, 0]
    assert [t.tolist() for t in data["tokens"]] == [[8, 9, 10, 11, 12], [1, 2, 3, 4]]
    assert data["response_lengths"] == [3, 2] and data["total_lengths"] == [5, 4]
    assert data["rewards"] == [1.0, 0.5] and data["truncated"] == [0, 0]
    assert data["raw_reward"] == [1.0, 0.0, 1.0]  # the whole batch's, as slime ships it
    assert data["loss_masks"][0].dtype == torch.int and data["loss_masks"][0].tolist() == [1, 0, 1]
    assert data["log_probs"][1].tolist() == [-1.0, -2.0] and data["advantages"][0].tolist() == [1.0, 1.0, 1.0]
    assert "ref_log_probs" not in data and "returns" not in data and "rollout_log_probs" not in data


def test_rollout_entropy_reaches_rollout_data_under_slimes_keys_and_its_token_mean():
    record = record_of_two_rows()
    assert "entropy" not in rollout_data_of(record)  # off: no entropy key, as slime without --use-rollout-entropy
    record.entropies = {"entropy": {0: torch.tensor([0.5, 1.0]), 2: torch.tensor([0.25, 0.0, 2.0])},
                        "ref_entropy": {0: torch.tensor([1.0, 1.0])}}  # not known for row 2: absent
    data = rollout_data_of(record)
    assert [t.tolist() for t in data["entropy"]] == [[0.25, 0.0, 2.0], [0.5, 1.0]]  # in partition order
    assert "ref_entropy" not in data
    data["entropy"][0][0] = 9.0  # a copy: the hook reads it, the record keeps its own
    assert record.entropies["entropy"][2][0].item() == 0.25
    # the logged mean is over every response token, not loss-masked (row 2's middle token counts)
    import socket

    import torch.distributed as dist

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert token_mean(record.entropies["entropy"], "cpu") == pytest.approx(3.75 / 5)
    finally:
        dist.destroy_process_group()


def test_the_hooks_edits_reach_the_record_in_place_or_assigned():
    record = record_of_two_rows()
    data = rollout_data_of(record)
    given = set(data)
    data["loss_masks"][1].zero_()  # row 0, in place
    data["advantages"] = [a * 2 for a in data["advantages"]]  # a new list
    data["extra_key"] = [1, 2]  # keys the hook adds are for itself
    assert record.loss_masks[0].tolist() == [1.0, 1.0]  # untouched until applied
    apply_rollout_data(record, data, given, "my.hook")
    assert record.loss_masks[0].tolist() == [0.0, 0.0] and record.loss_masks[2].tolist() == [1.0, 0.0, 1.0]
    assert record.advantages[2].tolist() == [2.0, 2.0, 2.0] and record.loss_masks[0].dtype == torch.float32


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["loss_masks"].pop(), "rollout_data['loss_masks'] has 1 entries after the hook"),
    (lambda d: d.__setitem__("advantages", [torch.ones(2), torch.ones(2)]),
     "rollout_data['advantages'][0] (row 2) has 2 values after the hook; it needs one per response token (3)"),
    (lambda d: d.pop("log_probs"), "the hook removed rollout_data['log_probs']"),
])  # fmt: skip
def test_bad_edits_name_the_hook_key_and_row(edit, message):
    record = record_of_two_rows()
    data = rollout_data_of(record)
    given = set(data)
    edit(data)
    with pytest.raises(ValueError, match="--rollout-data-postprocess-path my.hook") as info:
        apply_rollout_data(record, data, given, "my.hook")
    assert message in str(info.value)


def test_postprocess_hook_signature_is_checked_at_parse_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "post.py").write_text("def good(args, rollout_id, rollout_data):\n    pass\n"
                                      "def bad(args, rollout_data):\n    pass\n")
    assert make_args("--rollout-data-postprocess-path", "post.py:good").rollout_data_postprocess_path == "post.py:good"
    with pytest.raises(SlimeArgumentError, match=r"cannot be called as fn\(args, rollout_id, rollout_data\)"):
        make_args("--rollout-data-postprocess-path", "post.py:bad")


# ---- slime's loss and advantage hooks fed by a trainer's RolloutRecord ---------------------------------------------
HERE = __name__
SEEN: list = []


def slime_style_loss(args, batch, logits, sum_of_sample_mean):
    """A --custom-loss-function-path written for slime: log-probs from the logits with slime's helper, then
    slime's policy loss."""
    _, current = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                           total_lengths=batch["total_lengths"],
                                           response_lengths=batch["response_lengths"], with_entropy=True)
    SEEN.append((current, batch))
    return policy_loss_function(args, batch, logits, sum_of_sample_mean)


def seeing_advantages(args, rollout_data):
    """A --custom-advantage-function-path: keeps what it was given; advantages = the old log-probs."""
    SEEN.append({k: list(v) if isinstance(v, list) else v for k, v in rollout_data.items()})
    rollout_data["advantages"] = [lp.clone() for lp in rollout_data["log_probs"]]
    rollout_data["returns"] = rollout_data["advantages"]


def sum_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """A --custom-pg-loss-reducer-function-path: the flat pg loss's plain sum."""
    return lambda flat: flat.sum()


def split_rollout_record(args) -> tuple[RolloutRecord, MicroBatch, torch.Tensor]:
    """Rows 0 and 1 split from rollout 4, row 2 rollout 9: one optimizer step of 2 rollouts on this rank, its
    forward's logits (vocabulary 16) and the old policy a little off the current one."""
    batch = TrainBatch(tokens=[[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], response_lengths=[2, 1, 3],
                       loss_masks=[[1, 1], [1], [1, 0, 1]], rewards=[0.5, 0.5, -1.0], raw_rewards=[1.0, 1.0, 0.0],
                       truncated=[False, True, False], group_indices=[0, 0, 1],
                       rollout_log_probs=[[-2.5, -2.0], [-3.0], [-2.2, -2.9, -2.4]], rollout_ids=[4, 4, 9])
    record = RolloutRecord(batch, [[[0, 1, 2]]], rollout_id=3, loss_hooks=loss_hooks_set(args))
    record.loss_masks = {r: torch.tensor(m, dtype=torch.float32) for r, m in enumerate(batch.loss_masks)}
    record.rollout_log_probs = rollout_log_probs(args, batch, [0, 1, 2], "cpu")
    record.denominators = [loss_denominator(args, batch, [0, 1, 2])]
    record.mask_sums = rollout_mask_sums(batch.loss_masks, batch.rollout_of_rows())
    mb = make_micro_batch(batch.tokens, batch.response_lengths)
    logits = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    lp, _ = extract_response_log_probs(logits.detach(), mb, args.rollout_temperature)
    record.old_log_probs = {r: lp[r, :n] + 0.05 * (r + 1) for r, n in enumerate(batch.response_lengths)}
    record.advantages = {0: torch.tensor([1.0, 1.0]), 1: torch.tensor([1.0]), 2: torch.tensor([-1.0, -1.0, -1.0])}
    return record, mb, logits


def test_the_record_gives_slimes_loss_hooks_what_they_read():
    args = make_args(rollout_temperature=0.7, loss_type="custom_loss", custom_loss_function_path=f"{HERE}.slime_style_loss")
    record, mb, logits = split_rollout_record(args)
    lp, ent = extract_response_log_probs(logits, mb, args.rollout_temperature, with_entropy=True)
    inputs = record.loss_inputs([0, 1, 2], mb, lp, ent, record.denominators[0], mb.slime_logits(logits))
    hook_inputs = inputs.hook_inputs
    assert hook_inputs.response_lengths == [2, 1, 3] and hook_inputs.total_lengths == [4, 3, 5]
    assert inputs.global_denominator == 2  # the step's rollouts, not its 3 rows
    assert inputs.sample_denominators.tolist() == [3.0, 3.0, 2.0]  # each row's rollout's masked tokens
    assert [t.tolist() for t in hook_inputs.tokens] == record.batch.tokens and hook_inputs.logits.shape == (1, 12, 16)


@pytest.mark.parametrize("hook, built", [
    ({}, False),
    ({"use_tis": True, "custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function"}, True),
    ({"custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function"}, False),  # never called
    ({"custom_pg_loss_reducer_function_path": f"{HERE}.sum_reducer"}, True),
    ({"loss_type": "custom_loss", "custom_loss_function_path": f"{HERE}.slime_style_loss"}, True),
])
def test_what_only_slimes_loss_hooks_read_is_built_only_when_one_is_set(hook, built):
    args = make_args(rollout_temperature=0.7, **hook)
    record, mb, logits = split_rollout_record(args)
    lp, ent = extract_response_log_probs(logits, mb, args.rollout_temperature, with_entropy=True)
    assert loss_hooks_set(args) == built
    inputs = record.loss_inputs([0, 1, 2], mb, lp, ent, record.denominators[0])
    assert (inputs.hook_inputs is not None) == built
    assert inputs.global_denominator == 2 and inputs.sample_denominators.tolist() == [3.0, 3.0, 2.0]


@pytest.mark.parametrize("tis", [{}, {"use_tis": True,
                                      "custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function",
                                      "tis_clip": 1.2, "tis_clip_low": 0.9}])
def test_a_slime_custom_loss_trains_like_the_built_in_policy_loss(tis):
    """The same micro-batch through --loss-type policy_loss and through a slime-written custom loss that rebuilds
    the log-probs from the logits (slime.backends.megatron_utils.loss): the same loss, metrics and gradient."""
    results = {}
    for loss_type in ("policy_loss", "custom_loss"):
        custom = {"custom_loss_function_path": f"{HERE}.slime_style_loss"} if loss_type == "custom_loss" else {}
        args = make_args(rollout_temperature=0.7, loss_type=loss_type, **custom, **tis)
        record, mb, logits = split_rollout_record(args)
        lp, ent = extract_response_log_probs(logits, mb, args.rollout_temperature, with_entropy=True)
        loss, metrics = record.micro_batch_loss(args, [0, 1, 2], mb, lp, ent, record.denominators[0],
                                                mb.slime_logits(logits) if loss_type == "custom_loss" else None)
        loss.backward()
        results[loss_type] = (loss.item(), metrics, logits.grad)
    (policy, policy_metrics, policy_grad), (custom, custom_metrics, custom_grad) = results.values()
    assert custom == pytest.approx(policy) and policy != 0
    for name in ("train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy_loss"):
        assert custom_metrics[name].item() == pytest.approx(policy_metrics[name].item(), abs=1e-6)
    if tis:
        assert policy_metrics["train/tis_clipfrac"].item() > 0  # icepop rejected some tokens
    torch.testing.assert_close(custom_grad, policy_grad)
    current, batch = SEEN[-1]
    for got, want in zip(current["log_probs"], batch["cur_log_probs"]):
        torch.testing.assert_close(got, want)


def test_a_custom_advantage_function_gets_slimes_rollout_data_and_the_hooks_share_it():
    args = make_args(custom_advantage_function_path=f"{HERE}.seeing_advantages")
    record, _, _ = split_rollout_record(args)
    record.steps = [[[2, 0]]]  # this rank trains rows 2 and 0
    record.advantages = None
    advantages_and_returns(args, record, None, "cpu")
    seen = SEEN[-1]
    assert seen["partition"] == [2, 0] and seen["total_lengths"] == [5, 4] and seen["response_lengths"] == [3, 2]
    assert seen["raw_reward"] == [1.0, 1.0, 0.0]  # the whole batch's, as slime ships it
    for key, per_row in (("log_probs", record.old_log_probs), ("rollout_log_probs", record.rollout_log_probs)):
        assert [x.tolist() for x in seen[key]] == [per_row[2].tolist(), per_row[0].tolist()]
    assert [k.tolist() for k in seen["kl"]] == [[0.0] * 3, [0.0] * 2]  # no --kl-coef: zeros, as slime
    torch.testing.assert_close(record.advantages[2], record.old_log_probs[2])  # its advantages are trained on
    # --rollout-data-postprocess-path reads the same dict, with the advantages and returns filled in
    assert set(rollout_data_of(record)) == set(seen) - {"kl"} | {"advantages", "returns"}


def test_slimes_megatron_loss_module_is_ours_behind_slimes_names():
    from slime.algorithm import tis
    from slime.algorithm.estimators import compute_advantages_and_returns_in_place
    from slime.backends.megatron_utils import loss as mloss

    data = {"rewards": [1.0, -1.0], "response_lengths": [2, 1], "loss_masks": [torch.ones(2), torch.ones(1)]}
    ours = {k: list(v) for k, v in data.items()}
    mloss.compute_advantages_and_returns(make_args(normalize_advantages=True), data)  # no megatron groups here
    compute_advantages_and_returns_in_place(make_args(normalize_advantages=True), ours)
    assert [a.tolist() for a in data["advantages"]] == [a.tolist() for a in ours["advantages"]]
    assert [k.tolist() for k in data["kl"]] == [[0.0, 0.0], [0.0]]
    assert (mloss.icepop_function, mloss.vanilla_tis_function) == (tis.icepop_function, tis.vanilla_tis_function)
    args = make_args()
    common = dict(args=args, unconcat_tokens=[torch.tensor([1, 2, 3])], total_lengths=[3], response_lengths=[2])
    _, values = mloss.get_values(torch.tensor([[[0.5], [1.5], [2.5]]]), **common)
    assert values["values"][0].tolist() == [0.5, 1.5]  # read where each response token is predicted
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3, 4\); slime's layout is \[1, T, V\]"):
        mloss.get_log_probs_and_entropy(torch.zeros(2, 3, 4), **common)
    with pytest.raises(ValueError, match="the samples hold 3 tokens .* but the logits cover 2 positions"):
        mloss.get_log_probs_and_entropy(torch.zeros(1, 2, 4), **common)
    with pytest.raises(ValueError, match="top-p replay"):
        mloss.get_log_probs_and_entropy(torch.zeros(1, 3, 4), top_p_token_ids=[[1]], **common)


# ---- --keep-old-actor -------------------------------------------------------------------------------------------
def weights_of(module: torch.nn.Module):
    return lambda: dict(module.state_dict())


def set_weight(module: torch.nn.Linear, value: float) -> None:
    with torch.no_grad():
        module.weight.fill_(value)
        module.bias.fill_(value)


def old_weight(old: OldActor, module: torch.nn.Linear) -> float:
    with old.loaded():
        return float(module.weight[0, 0])


def test_old_actor_queue_with_interval_one_lags_one_push():
    """Weights W0 at start; pushes of W0 (start), W1, W2: the old actor is W0, W0, W1 (slime's queue)."""
    model = torch.nn.Linear(2, 2)
    set_weight(model, 0.0)
    old = OldActor(weights_of(model), update_weights_interval=1)
    seen = []
    for version in range(3):
        set_weight(model, float(version))
        old.pushed()
        seen.append(old_weight(old, model))
    assert seen == [0.0, 0.0, 1.0]


def test_old_actor_with_a_longer_interval_is_the_last_push():
    model = torch.nn.Linear(2, 2)
    set_weight(model, 0.0)
    old = OldActor(weights_of(model), update_weights_interval=2)
    assert old_weight(old, model) == 0.0
    set_weight(model, 5.0)
    assert old_weight(old, model) == 0.0  # not pushed yet
    old.pushed()
    assert old_weight(old, model) == 5.0


def test_old_actor_swap_restores_the_model_bit_for_bit_and_calls_after_load():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    old = OldActor(weights_of(model), 1, after_load=lambda: loads.append(float(model.weight.sum())))
    loads: list[float] = []
    with torch.no_grad():
        model.weight.mul_(1.0 + 1e-7).add_(0.3)  # "trained"
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 4)
    with old.loaded():
        inside = model(x)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert not torch.equal(inside, model(x)) and len(loads) == 2  # swapped in, then back


def test_keep_old_actor_refuses_rollout_logprobs_and_overlapped_param_gather():
    with pytest.raises(SlimeArgumentError, match="--keep-old-actor recomputes.*drop one"):
        make_args("--keep-old-actor", "--use-rollout-logprobs")
    assert "--keep-old-actor with --overlap-param-gather" in megatron_error(
        "--keep-old-actor", "--overlap-param-gather", "--use-distributed-optimizer")
    assert make_args("--keep-old-actor").keep_old_actor


# ---- the Megatron hooks, the model provider, --spec --------------------------------------------------------------
@pytest.mark.parametrize("flag, good, bad", [
    ("--custom-megatron-init-path", "def f(args): pass", "def f(): pass"),
    ("--custom-megatron-before-log-prob-hook-path", "def f(args, model, store_prefix): pass",
     "def f(args, model): pass"),
    ("--custom-megatron-before-train-step-hook-path",
     "def f(args, rollout_id, step_id, model, optimizer, opt_param_scheduler): pass", "def f(args, step_id): pass"),
    ("--custom-model-provider-path", "def f(pre_process=True, post_process=True, vp_stage=None): pass",
     "def f(config): pass"),
])  # fmt: skip
def test_megatron_hook_contracts_are_slimes(flag, good, bad):
    namespace: dict = {}
    exec(good, namespace)
    check_hook_signature(namespace["f"], "p.f", flag)
    exec(bad, namespace)
    with pytest.raises(TypeError, match=f"{flag}=p.f: f.* cannot be called as"):
        check_hook_signature(namespace["f"], "p.f", flag)


def test_megatron_hooks_load_from_their_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def init(args): pass\ndef step(a, r, s, m, o, p): pass\n")
    args = make_args("--custom-megatron-init-path", "mine.py:init",
                     "--custom-megatron-before-train-step-hook-path", "mine.py:step")
    hooks = plugins.MegatronHooks.from_args(args)
    assert hooks.init.__name__ == "init" and hooks.before_train_step.__name__ == "step"
    assert hooks.before_log_prob is None


def test_model_provider_gets_vp_stage_and_config_only_when_it_names_them():
    calls = []

    def two(pre_process, post_process):
        calls.append((pre_process, post_process))

    def four(pre_process, post_process, vp_stage=None, config=None):
        calls.append((pre_process, post_process, vp_stage, config))

    plugins.call_model_provider(two, True, False, 1, "cfg")
    plugins.call_model_provider(four, False, True, 1, "cfg")
    assert calls == [(True, False), (False, True, 1, "cfg")]
    assert plugins.is_model_provider(four) and not plugins.is_model_provider(lambda args, config, vp: None)


def test_plugins_get_args_is_the_runs_args():
    plugins.set_args(None)
    with pytest.raises(RuntimeError, match="no megatron training rank has started"):
        plugins.get_args()
    args = make_args()
    plugins.set_args(args)
    try:
        assert plugins.get_args() is args
    finally:
        plugins.set_args(None)


def test_spec_in_slimes_two_token_form_is_loaded_at_validation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_specs.py").write_text(textwrap.dedent("""
        def get_spec(args, config, vp_stage):
            return ("spec", args.num_layers, config, vp_stage)
    """))
    args = megatron_args("--spec", "my_specs", "get_spec")
    assert args.spec == ["my_specs", "get_spec"] and plugins.spec_path(args) == "my_specs:get_spec"
    spec = plugins.load_spec(args)
    assert plugins.custom_layer_spec(spec, args, "cfg", None) == ("spec", args.num_layers, "cfg", None)
    assert plugins.custom_layer_spec("a spec object", args, "cfg", None) == "a spec object"
    assert "my_specs' has no attribute 'nope'" in megatron_error("--spec", "my_specs", "nope")
    assert "expected MODULE FUNCTION" in megatron_error("--spec", "a", "b", "c")


def test_slimes_own_model_specs_are_built_in_or_refused_with_the_reason():
    glm = megatron_args("--spec", "slime_plugins.models.glm4", "get_glm_spec")
    assert plugins.load_spec(glm) is None  # the built-in spec (sandwich norms from the GLM-4 flags)
    msg = megatron_error("--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec")
    assert "Qwen3.5 (gated DeltaNet linear attention)" in msg and "not built here" in msg
    assert "GLM-5" in megatron_error("--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec")
    # a dry run (a login node may lack megatron-core) checks the form and slime's plugins, without importing
    assert megatron_args("--spec", "not_importable_here", "fn", "--dry-run").spec == ["not_importable_here", "fn"]
    assert "Qwen3-Next" in megatron_error("--spec", "slime_plugins.models.qwen3_next", "f", "--dry-run")


# ---- Megatron options -> megatron-core ---------------------------------------------------------------------------
def test_optimizer_cpu_offload_maps_onto_optimizer_config():
    args = megatron_args(*OFFLOAD, "--overlap-cpu-optimizer-d2h-h2d")
    kw = margs.optimizer_config_kwargs(args)
    assert kw["optimizer_cpu_offload"] and kw["overlap_cpu_optimizer_d2h_h2d"] and kw["use_precision_aware_optimizer"]
    assert kw["optimizer_offload_fraction"] == 1.0  # Megatron-LM's default (megatron-core's field defaults to 0)
    assert kw["pin_cpu_grads"] and kw["pin_cpu_params"] and not kw["use_torch_optimizer_for_cpu_offload"]
    # megatron-core needs the distributed optimizer there; slime always uses it
    assert args.use_distributed_optimizer and margs.ddp_config_kwargs(args)["use_distributed_optimizer"]
    half = margs.optimizer_config_kwargs(megatron_args(*OFFLOAD, "--optimizer-offload-fraction", "0.5",
                                                       "--no-pin-cpu-grads"))
    assert half["optimizer_offload_fraction"] == 0.5 and not half["pin_cpu_grads"]
    assert not margs.optimizer_config_kwargs(megatron_args())["optimizer_cpu_offload"]


def test_optimizer_cpu_offload_rules_are_megatron_lms():
    assert "needs --use-precision-aware-optimizer" in megatron_error("--optimizer-cpu-offload", "--bf16")
    assert "needs --bf16" in megatron_error("--optimizer-cpu-offload", "--use-precision-aware-optimizer")
    assert "add --optimizer-cpu-offload or drop it" in megatron_error("--overlap-cpu-optimizer-d2h-h2d")
    assert "must lie in [0, 1]" in megatron_error(*OFFLOAD, "--optimizer-offload-fraction", "1.5")


@pytest.mark.skipif(HAS_TE, reason="TransformerEngine is installed")
def test_precision_aware_optimizer_alone_needs_transformer_engine():
    msg = megatron_error("--use-precision-aware-optimizer", "--bf16")
    assert "runs TransformerEngine's FusedAdam" in msg and "add --optimizer-cpu-offload" in msg


@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core not installed")
def test_optimizer_config_with_cpu_offload_builds():
    """megatron-core's OptimizerConfig itself, with or without TransformerEngine (its hybrid CPU optimizer is
    torch's Adam)."""
    config = margs.build_optimizer_config(megatron_args(*OFFLOAD, "--overlap-cpu-optimizer-d2h-h2d"))
    assert config.optimizer_cpu_offload and config.overlap_cpu_optimizer_d2h_h2d and config.bf16
    assert config.optimizer_offload_fraction == 1.0 and config.use_distributed_optimizer
    assert config.use_precision_aware_optimizer and config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    if not HAS_TE:
        assert not config.store_param_remainders  # TE FusedAdam's; the hybrid optimizer keeps fp32 copies


def test_nan_check_is_on_by_default_and_reaches_ddp():
    assert margs.ddp_config_kwargs(megatron_args())["check_for_nan_in_grad"] is True
    args = megatron_args("--no-check-for-nan-in-loss-and-grad")
    assert args.check_for_nan_in_loss_and_grad is False
    assert margs.ddp_config_kwargs(args)["check_for_nan_in_grad"] is False


def test_lr_warmup_fraction_is_a_share_of_the_decay_steps():
    kw = margs.lr_scheduler_kwargs(megatron_args("--lr-warmup-fraction", "0.1"), total_steps=50)
    assert kw["lr_warmup_steps"] == pytest.approx(5.0) and kw["lr_decay_steps"] == 50
    kw = margs.lr_scheduler_kwargs(megatron_args("--lr-warmup-fraction", "0.25", "--lr-decay-iters", "40"), 50)
    assert kw["lr_warmup_steps"] == pytest.approx(10.0) and kw["lr_decay_steps"] == 40
    assert margs.lr_scheduler_kwargs(megatron_args("--lr-warmup-iters", "3"), 50)["lr_warmup_steps"] == 3
    assert "give one warm-up length" in megatron_error("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2")
    assert "must lie in [0, 1)" in megatron_error("--lr-warmup-fraction", "1.0")


def test_no_position_embedding_is_megatron_lms_rule():
    args = megatron_args("--no-position-embedding")  # the tiny model is RoPE: no learned position table
    assert not args.add_position_embedding and margs.gpt_model_kwargs(args)["position_embedding_type"] == "rope"
    with pytest.raises(SlimeArgumentError) as info:
        megatron_args("--no-position-embedding", position_embedding_type="learned_absolute",
                      use_rotary_position_embeddings=False)
    msg = str(info.value)
    assert "--no-position-embedding with --position-embedding-type learned_absolute" in msg


def test_deterministic_mode_reaches_the_transformer_config_and_torch():
    assert margs.transformer_config_kwargs(megatron_args("--deterministic-mode"))["deterministic_mode"] is True
    assert margs.transformer_config_kwargs(megatron_args())["deterministic_mode"] is False
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    env: dict[str, str] = {}
    try:
        margs.enable_deterministic_mode(env)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
        kept = {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        margs.enable_deterministic_mode(kept)
        assert kept == {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        with pytest.raises(SlimeArgumentError, match="NCCL_ALGO=NVLS does not reduce in a fixed order"):
            margs.enable_deterministic_mode({"NCCL_ALGO": "NVLS"})
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def test_disabled_advantages_are_never_computed_and_a_custom_loss_sees_none():
    args = make_args("--disable-compute-advantages-and-returns", "--loss-type", "custom_loss",
                     custom_loss_function_path=f"{HERE}.slime_style_loss",
                     custom_advantage_function_path=f"{HERE}.seeing_advantages")
    record, mb, logits = split_rollout_record(args)
    record.advantages = None
    calls = len(SEEN)
    advantages_and_returns(args, record, None, "cpu")
    assert record.advantages is None and record.returns is None and len(SEEN) == calls  # the hook never ran
    lp, ent = extract_response_log_probs(logits, mb, args.rollout_temperature, with_entropy=True)
    inputs = record.loss_inputs([0, 1, 2], mb, lp, ent, record.denominators[0], mb.slime_logits(logits))
    assert inputs.advantages is None
