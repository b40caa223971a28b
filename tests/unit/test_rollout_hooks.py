"""slime's rollout-side hooks, called where slime calls them, with slime's arguments.

The plugins below are loaded by dotted path (`tests.unit.test_rollout_hooks.<fn>`, this very module), so what
they record on `args` or on the samples is what the code under test handed them. Generation is a scripted
custom generate function: no engine, no router (the HTTP side is tests/unit/test_sglang_rollout.py's).
"""

from __future__ import annotations

import asyncio
import re

import pytest

from slime.ray.rollout import RolloutManager
from slime.rollout.base_types import RolloutFnEvalOutput
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import (
    DynamicFilterOutput,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from slime.rollout.sample_hooks import set_current_rollout_id
from slime.rollout.sglang_rollout import GenerateState, build_sampling_params, generate_and_rm, generate_rollout
from slime.rollout.train_data import rollout_count, samples_to_train_batch, save_debug_samples
from slime.utils.errors import SlimeArgumentError
from slime.utils.http_utils import run_sync
from slime.utils.types import Sample
from tests.args import make_args

HERE = __name__


# --- plugins ---------------------------------------------------------------------------------------------


async def scripted_generate(args, sample, sampling_params):
    """Two response tokens after a two-token prompt; the response text is the group index."""
    sample.tokens = [1, 2, 3, 4]
    sample.response = f"g{sample.group_index}"
    sample.response_length = 2
    sample.loss_mask = [1, 1]
    sample.rollout_log_probs = [-0.1, -0.2]
    sample.status = Sample.Status.COMPLETED
    return sample


async def split_generate(args, sample, sampling_params):
    """One prompt's rollout split into two trained segments (slime's compaction / sub-agent pattern)."""
    await scripted_generate(args, sample, sampling_params)
    second = Sample(group_index=sample.group_index, index=sample.index, tokens=[1, 2, 5],
                    response="tail", response_length=1, loss_mask=[1], rollout_log_probs=[-0.3],
                    status=Sample.Status.COMPLETED)
    return [sample, second]


async def returns_a_dict(args, sample, sampling_params):
    return {"response": "x"}


async def split_disagreeing(args, sample, sampling_params):
    first, second = await split_generate(args, sample, sampling_params)
    first.rollout_id, second.rollout_id = 1, 2
    return [first, second]


async def odd_groups_tie(args, sample):
    """--custom-rm-path: odd groups score 1.0 on every sample (zero std), even groups 0.0 / 1.0."""
    return 1.0 if sample.group_index % 2 else float(sample.index % 2)


async def reward_from_hook(args, sample):
    return float(sample.metadata["hooked"])


def mark_hooked(args, sample, *, rollout_id=None):
    sample.metadata["hooked"] = 1.0
    sample.metadata["hook_rollout_id"] = rollout_id


async def replace_response(args, sample, evaluation=False):
    sample.response = f"{sample.response}|eval={evaluation}"
    return sample


def remove_second(args, groups):
    """--rollout-sample-filter-path: leave the second sample of every kept group out of the loss."""
    args.filtered_groups = [g[0].group_index for g in groups]
    for group in groups:
        group[1].remove_sample = True


def count_all(args, all_groups, data_source):
    args.all_groups_seen = [g[0].group_index for g in all_groups]
    args.all_groups_source = data_source


async def wait_for_abort(args, sample, sampling_params):
    """Group 0 finishes at once; group 1 runs until the rollout's abort flag (GenerateState.aborted) is set."""
    if sample.group_index == 0:
        return await scripted_generate(args, sample, sampling_params)
    for _ in range(500):
        if GenerateState(args).aborted:
            sample.metadata["saw_abort"] = True
            break
        await asyncio.sleep(0.01)
    sample.status = Sample.Status.ABORTED
    return sample


def log_and_skip(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    args.logged = (rollout_id, len(samples), rollout_extra_metrics, rollout_time > 0)
    return True


def log_and_keep(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    args.logged = (rollout_id, len(samples), rollout_extra_metrics, rollout_time > 0)
    return False


def eval_log_and_skip(rollout_id, args, data, extra_metrics):
    args.eval_logged = (rollout_id, sorted(data), extra_metrics)
    return True


def one_eval_set(args, rollout_id, data_source, evaluation=False):
    sample = Sample(index=0, group_index=0, reward=0.5, status=Sample.Status.COMPLETED)
    return RolloutFnEvalOutput(data={"toy": {"rewards": [0.5], "truncated": [False], "samples": [sample]}},
                               metrics={"eval/custom": 1.0})


def half_rewards(args, samples):
    """--custom-convert-samples-to-train-data-path returning slime's train-data dict."""
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [0.5] * len(samples),
        "raw_reward": [s.reward for s in samples],
        "truncated": [0] * len(samples),
        "sample_indices": [s.index for s in samples],
        "loss_masks": [[1] * s.response_length for s in samples],
    }


def convert_without_rewards(args, samples):
    return {"tokens": [s.tokens for s in samples]}


def log_with_three_args(rollout_id, args, samples):
    return True


def hook_without_sample(args):
    return None


# --- helpers ---------------------------------------------------------------------------------------------


def _args(**kw):
    """No prompt file (empty prompts, as with --disable-rollout-global-dataset): scripted generation."""
    base = dict(disable_rollout_global_dataset=True, custom_generate_function_path=f"{HERE}.scripted_generate",
                rollout_max_response_len=4, custom_rm_path=f"{HERE}.odd_groups_tie")
    return make_args(**{**base, **kw})


def _sample(group, index, reward, **kw):
    return Sample(group_index=group, index=index, tokens=[1, 2, 3, 4], response_length=2, reward=reward,
                  status=Sample.Status.COMPLETED, loss_mask=[1, 1], rollout_log_probs=[-0.1, -0.2], **kw)


# --- dynamic filters -------------------------------------------------------------------------------------


def test_nonzero_std_filter_and_its_fallback():
    args = make_args()
    tie = [_sample(0, 0, 1.0), _sample(0, 1, 1.0)]
    mixed = [_sample(1, 2, 0.0), _sample(1, 3, 1.0)]
    assert call_dynamic_filter(check_reward_nonzero_std, args, mixed).keep is True
    strict = call_dynamic_filter(check_reward_nonzero_std, args, tie)
    assert (strict.keep, strict.reason, strict.keep_when_insufficient) == (False, "zero_std_1.0", False)
    fallback = call_dynamic_filter(check_reward_nonzero_std_with_fallback, args, tie)
    assert (fallback.keep, fallback.keep_when_insufficient) == (False, True)
    # dropped unless the groups that could still fill the batch (this one included) would fall short of it
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=3, target_data_size=2) is True
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=2, target_data_size=2) is False
    assert should_drop_dynamic_filter_output(strict, remaining_batch_size=1, target_data_size=2) is True


def test_filter_answers_are_normalised_and_bad_ones_named():
    assert call_dynamic_filter(None, None, []) == DynamicFilterOutput(keep=True)
    assert call_dynamic_filter(lambda a, g: 0, None, []).keep is False
    assert call_dynamic_filter(lambda a, g: DynamicFilterOutput(keep=1, reason="r"), None, []).keep is True
    with pytest.raises(TypeError, match="returned NoneType; return a bool or DynamicFilterOutput"):
        call_dynamic_filter(lambda a, g: None, None, [])


def test_rollout_drops_tied_groups_and_runs_the_end_of_rollout_hooks():
    args = _args(dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters."
                 "check_reward_nonzero_std", rollout_sample_filter_path=f"{HERE}.remove_second",
                 rollout_all_samples_process_path=f"{HERE}.count_all")
    data_source = RolloutDataSourceWithBuffer(args)
    output = generate_rollout(args, 0, data_source)
    assert [g[0].group_index for g in output.samples] == [0, 2]  # group 1 tied and was replaced by group 2
    assert output.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
    assert args.filtered_groups == [0, 2]
    assert args.all_groups_seen == [0, 1, 2] and args.all_groups_source is data_source  # the dropped one too
    batch = samples_to_train_batch(args, [s for g in output.samples for s in g])
    assert batch.loss_masks == [[1, 1], [0, 0], [1, 1], [0, 0]]  # remove_sample: out of the loss
    assert batch.raw_rewards == [0.0, 1.0, 0.0, 1.0]


def test_fallback_filter_keeps_a_tied_group_rather_than_sampling_again():
    args = _args(dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters."
                 "check_reward_nonzero_std_with_fallback")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [g[0].group_index for g in output.samples] == [0, 1]
    assert not any(k.startswith("rollout/dynamic_filter/") for k in output.metrics)


# --- per-sample hooks and generate functions ---------------------------------------------------------------


def test_sample_hooks_run_before_the_reward_in_order():
    args = _args(rollout_sample_hook_path=[f"{HERE}.mark_hooked", f"{HERE}.replace_response"],
                 custom_rm_path=f"{HERE}.reward_from_hook")
    set_current_rollout_id(4)
    try:
        sample = run_sync(generate_and_rm(args, Sample(group_index=3, index=6), {}, evaluation=True))
    finally:
        set_current_rollout_id(None)
    assert sample.reward == 1.0  # the reward saw what the hook wrote
    assert sample.metadata["hook_rollout_id"] == 4
    assert sample.response == "g3|eval=True"


def test_per_sample_generate_function_wins_and_split_samples_share_a_rollout_id():
    args = _args()
    sample = Sample(group_index=1, index=5, generate_function_path=f"{HERE}.split_generate")
    out = run_sync(generate_and_rm(args, sample, {}))
    assert isinstance(out, list) and [s.response for s in out] == ["g1", "tail"]
    assert [s.rollout_id for s in out] == [5, 5]  # the input's index: one rollout
    assert [s.reward for s in out] == [1.0, 1.0]
    assert rollout_count(out + [_sample(2, 6, 0.0)]) == 2


@pytest.mark.parametrize(("fn", "error"), [
    ("returns_a_dict", "returned dict for sample 5; return the Sample or a non-empty list"),
    ("split_disagreeing", r"with different rollout_id values \[1, 2\]; samples split from one rollout share"),
])
def test_a_generate_function_returning_the_wrong_shape_fails_its_sample(fn, error):
    out = run_sync(generate_and_rm(_args(custom_generate_function_path=f"{HERE}.{fn}"), Sample(index=5), {}))
    assert out.status == Sample.Status.FAILED
    assert f"{fn}" in out.metadata["error"]
    assert re.search(error, out.metadata["error"]), out.metadata["error"]


def test_a_rollout_of_split_samples_counts_rollouts_against_the_batch():
    args = _args(custom_generate_function_path=f"{HERE}.split_generate", rollout_batch_size=1,
                 global_batch_size=2)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    assert [len(g) for g in groups] == [4]  # 2 samples x 2 segments, side by side
    assert rollout_count(groups[0]) == 2


@pytest.fixture
def fresh_state():
    GenerateState.clear_instances()
    yield
    GenerateState.clear_instances()


def test_generate_state_is_one_per_process_and_sees_the_rollouts_abort(fresh_state, tokenizer_dir):
    args = _args(hf_checkpoint=tokenizer_dir, custom_generate_function_path=f"{HERE}.wait_for_abort",
                 rollout_batch_size=1, global_batch_size=2, over_sampling_batch_size=2, partial_rollout=True)
    state = GenerateState(args)
    assert GenerateState(_args()) is state  # built once, from the first args
    assert state.sampling_params == build_sampling_params(args)
    assert state.tokenizer("one two", add_special_tokens=False)["input_ids"]
    assert state.processor is None  # a text-only model
    assert state.aborted is False  # outside a rollout nothing is aborted
    with state.dp_rank_context() as rank:
        assert rank == 0 and state.dp_counts == [1]
    assert state.dp_counts == [0]

    data_source = RolloutDataSourceWithBuffer(args)
    groups = generate_rollout(args, 2, data_source).samples
    assert [g[0].group_index for g in groups] == [0]
    [leftover] = data_source.buffer  # group 1 stopped when the rollout aborted it, and went back to the buffer
    assert all(s.metadata["saw_abort"] and s.metadata["start_rollout_id"] == 2 for s in leftover)
    assert state.aborted is False  # the flag belongs to that rollout call


# --- RolloutManager: conversion and logging hooks -----------------------------------------------------------


@pytest.fixture
def dumped(tmp_path):
    """Rollout 0 of 2 groups x 2 samples as a debug dump; args that train on it (no engines)."""
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    save_debug_samples(template, 0, [_sample(0, 0, 0.0), _sample(0, 1, 1.0), _sample(1, 2, 1.0), _sample(1, 3, 1.0)])
    return template


def test_rollout_log_function_gets_slime_arguments_and_can_skip_the_default_metrics(dumped):
    args = make_args(load_debug_rollout_data=dumped, custom_rollout_log_function_path=f"{HERE}.log_and_skip")
    batch, metrics = RolloutManager(args, None).generate(0)
    assert args.logged == (0, 4, None, True)  # a dump has no rollout-function metrics
    assert metrics == {} and len(batch) == 4

    args = make_args(load_debug_rollout_data=dumped, custom_rollout_log_function_path=f"{HERE}.log_and_keep")
    _, metrics = RolloutManager(args, None).generate(0)
    assert args.logged[:2] == (0, 4) and metrics["rollout/raw_reward"] == pytest.approx(0.75)


def test_eval_log_function_can_skip_the_default_eval_metrics(dumped):
    args = make_args(load_debug_rollout_data=dumped, eval_function_path=f"{HERE}.one_eval_set",
                     custom_eval_rollout_log_function_path=f"{HERE}.eval_log_and_skip")
    assert RolloutManager(args, None).eval(3) == {}
    assert args.eval_logged == (3, ["toy"], {"eval/custom": 1.0})


def test_custom_conversion_replaces_the_train_data(dumped):
    args = make_args(load_debug_rollout_data=dumped,
                     custom_convert_samples_to_train_data_path=f"{HERE}.half_rewards")
    batch, _ = RolloutManager(args, None).generate(0)
    assert batch.rewards == [0.5] * 4 and batch.raw_rewards == [0.0, 1.0, 1.0, 1.0]
    assert batch.group_indices == [0, 0, 1, 1] and batch.truncated == [False] * 4
    assert batch.rollout_log_probs is None

    bad = make_args(load_debug_rollout_data=dumped,
                    custom_convert_samples_to_train_data_path=f"{HERE}.convert_without_rewards")
    with pytest.raises(KeyError, match=r"custom-convert-samples-to-train-data-path=.*convert_without_rewards "
                                       r"returned a dict without \['response_lengths', 'rewards'"):
        RolloutManager(bad, None).generate(0)


def test_manager_counts_rollouts_not_samples(tmp_path):
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    split = [_sample(0, 0, 0.0, rollout_id=0), _sample(0, 0, 0.0, rollout_id=0)]
    save_debug_samples(template, 0, split + [_sample(0, 1, 1.0), _sample(1, 2, 1.0), _sample(1, 3, 1.0)])
    batch, _ = RolloutManager(make_args(load_debug_rollout_data=template), None).generate(0)
    assert len(batch) == 5  # 4 rollouts, one of them in two samples

    save_debug_samples(template, 1, split + [_sample(0, 1, 1.0)])
    with pytest.raises(RuntimeError, match=r"returned 2 rollouts in 3 samples, expected .* = 4"):
        RolloutManager(make_args(load_debug_rollout_data=template), None).generate(1)


# --- contracts checked when the command line is parsed -------------------------------------------------------


@pytest.mark.parametrize(("flag", "path", "expected"), [
    ("custom_rollout_log_function_path", "log_with_three_args",
     r"fn\(rollout_id, args, samples, rollout_extra_metrics, rollout_time\)"),
    ("rollout_sample_hook_path", "hook_without_sample", r"fn\(args, sample, \*, rollout_id=None"),
])
def test_a_hook_with_the_wrong_signature_fails_at_parse_time(flag, path, expected):
    value = [f"{HERE}.{path}"] if flag == "rollout_sample_hook_path" else f"{HERE}.{path}"
    with pytest.raises(SlimeArgumentError, match=rf"--{flag.replace('_', '-')}=.*{path}.*cannot be called as "
                                                 rf".*{expected}"):
        make_args(**{flag: value})
