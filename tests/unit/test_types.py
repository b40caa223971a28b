from __future__ import annotations

import argparse
import base64
import pickle

import numpy as np
import pytest
import torch

from slime.utils.types import MultimodalTypes, Sample, TrainBatch, decode_int32_meta_array


def _b64(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def test_sample_round_trips_through_dict_and_keeps_unknown_keys():
    s = Sample(group_index=3, index=7, rollout_id=2, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2, 3, 4],
               response="x y", response_length=2, label="4", reward={"score": 1.0, "acc": True},
               loss_mask=[1, 0], rollout_log_probs=[-0.5, 0.0], weight_versions=["3"],
               status=Sample.Status.TRUNCATED, metadata={"rm_type": "math"}, remove_sample=True,
               custom_rm_path="my.rm", train_metadata={"loss_type": "sft_loss"}, session_id="s-1")  # fmt: skip
    s.spec_info.spec_verify_ct = 4
    s.prefix_cache_info.cached_tokens = 9
    d = s.to_dict()
    assert d["status"] == "truncated"
    assert d["spec_info"]["spec_verify_ct"] == 4 and d["prefix_cache_info"] == {"cached_tokens": 9, "total_prompt_tokens": 0}
    back = Sample.from_dict(pickle.loads(pickle.dumps(d)))  # what crossing a process boundary does to it
    assert back == s and isinstance(back.spec_info, Sample.SpecInfo)
    assert s.prompt_length == 2
    extra = Sample.from_dict({**d, "source": "gsm8k"})  # a newer producer's field: kept as an attribute
    assert extra.source == "gsm8k" and extra.to_dict()["source"] == "gsm8k"
    assert Sample.from_dict({}).status is Sample.Status.PENDING


def test_reward_value_takes_args_or_the_key():
    s = Sample(reward={"score": 0.5, "acc": 1})
    assert s.get_reward_value(argparse.Namespace(reward_key="score")) == 0.5
    assert s.get_reward_value("acc") == 1
    # slime's contract: without --reward-key a dict reward comes back whole (slime's OPD post-process reads it)
    assert s.get_reward_value(argparse.Namespace(reward_key=None)) == {"score": 0.5, "acc": 1}
    with pytest.raises(ValueError, match=r"--reward-key pred is not in the reward dict \(keys \['acc', 'score'\]\)"):
        s.get_reward_value("pred")
    assert Sample(reward=2).get_reward_value(None) == 2 and Sample().get_reward_value(None) is None


def test_scalar_reward_is_what_the_trainer_uses():
    s = Sample(reward={"score": 0.5, "acc": 1})
    assert s.scalar_reward("acc") == 1.0 and isinstance(s.scalar_reward("acc"), float)
    with pytest.raises(ValueError, match="reward is a dict with keys \\['acc', 'score'\\]; pass --reward-key"):
        s.scalar_reward(None)
    assert Sample(reward=2).scalar_reward(None) == 2.0 and Sample().scalar_reward(None) == 0.0


def test_append_model_then_tool_tokens_keeps_fields_aligned():
    s = Sample(tokens=[5, 6])  # a 2-token prompt
    s.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.1, -0.2], text="ab",
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3",
                                        "prompt_tokens": 2, "cached_tokens": 1})  # fmt: skip
    s.append_response_tokens(tokens=torch.tensor([9]), trainable=False, text="<tool>")
    assert s.tokens == [5, 6, 7, 8, 9] and s.response == "ab<tool>" and s.response_length == 3
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs == [-0.1, -0.2, 0.0]
    assert s.effective_response_length == 2 and s.prompt_length == 2
    assert s.status is Sample.Status.COMPLETED and s.weight_versions == ["3"]
    assert s.prefix_cache_info.prefix_cache_hit_rate == 0.5

    with pytest.raises(ValueError, match="trainable response tokens require rollout log probabilities"):
        s.append_response_tokens(tokens=[1])
    with pytest.raises(ValueError, match="non-trainable response tokens should not pass"):
        s.append_response_tokens(tokens=[1], log_probs=[-0.5], trainable=False)
    s.append_response_tokens(tokens=[4, 5], log_probs=[0.0, 0.0], trainable=False)  # zeros: the value they get
    assert s.loss_mask == [1, 1, 0, 0, 0] and s.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="1 log_probs for 2 tokens"):
        s.append_response_tokens(tokens=[1, 2], log_probs=[0.0])
    bare = Sample(tokens=[1, 2, 3], response_length=1)  # a response without log-probs cannot gain model tokens
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        bare.append_response_tokens(tokens=[4], log_probs=[-1.0])


def test_appending_extends_the_sample_lists_in_place():
    """slime's `append_response_tokens` extends `tokens`, `loss_mask` and `rollout_log_probs` in place: a plugin may
    hold one of them and write it back (slime's retool example keeps `loss_mask` from before its turns so)."""
    s = Sample(tokens=[5, 6], loss_mask=[])
    tokens, mask = s.tokens, s.loss_mask
    s.append_response_tokens(tokens=[7], log_probs=[-0.1])
    log_probs = s.rollout_log_probs
    s.append_response_tokens(tokens=[8, 9], trainable=False)
    assert tokens is s.tokens and tokens == [5, 6, 7, 8, 9]
    assert mask is s.loss_mask and mask == [1, 0, 0]
    assert log_probs is s.rollout_log_probs and log_probs == [-0.1, 0.0, 0.0]

    # the retool example's shape: reset the response, keep the (empty) mask, append turns, write the mask back
    retool = Sample(tokens=[1, 2, 3], response_length=0, loss_mask=[])
    kept = retool.loss_mask
    retool.append_response_tokens(tokens=[4, 5], log_probs=[-0.5, -0.6])
    retool.append_response_tokens(tokens=[6], trainable=False)
    retool.loss_mask = kept
    assert retool.loss_mask == [1, 1, 0] and retool.response_length == 3
    # a mask the sample did not have yet is created once and then extended
    fresh = Sample(tokens=[1], response_length=1, rollout_log_probs=[-1.0])
    fresh.append_response_tokens(tokens=[2], trainable=False)
    created = fresh.loss_mask
    fresh.append_response_tokens(tokens=[3], log_probs=[-0.2])
    assert created is fresh.loss_mask and created == [1, 0, 1]


@pytest.mark.parametrize("reason,status", [("length", "truncated"), ("abort", "aborted"), ("stop", "completed"),
                                           ("something_new", "pending")])  # fmt: skip
def test_finish_reason_sets_status_unless_streaming(reason, status):
    s = Sample()
    s.append_response_tokens(tokens=[], meta_info={"finish_reason": {"type": reason}, "weight_version": "1"})
    assert s.status.value == status and s.weight_versions == ["1"]
    chunk = Sample()
    chunk.append_response_tokens(tokens=[], meta_info={"finish_reason": {"type": reason}}, update_terminal_info=False)
    assert chunk.status is Sample.Status.PENDING


def test_speculative_counters_only_with_the_flag():
    meta = {"finish_reason": {"type": "stop"}, "spec_accept_token_num": 3, "spec_draft_token_num": 4,
            "spec_verify_ct": 2, "completion_tokens": 6}  # fmt: skip
    off, on = Sample(), Sample()
    off.append_response_tokens(argparse.Namespace(sglang_speculative_algorithm=None), tokens=[], meta_info=meta)
    on.append_response_tokens(argparse.Namespace(sglang_speculative_algorithm="EAGLE"), tokens=[], meta_info=meta)
    assert off.spec_info.spec_draft_token_num == 0
    assert on.spec_info.spec_accept_rate == 0.75 and on.spec_info.spec_accept_length == 3.0


def test_top_p_spans_merge_and_pad_for_tool_tokens():
    s = Sample(tokens=[0, 1], response_length=1, loss_mask=[1], rollout_log_probs=[-0.3],
               rollout_top_p_token_ids=[4], rollout_top_p_token_offsets=[0, 1])  # fmt: skip
    s.append_response_tokens(tokens=[10, 20], log_probs=[-0.1, -0.2],
                             meta_info={"top_p_token_ids": _b64([10, 11, 20]), "top_p_token_offsets": _b64([0, 2, 3])})
    assert s.rollout_top_p_token_ids.tolist() == [4, 10, 11, 20]
    assert s.rollout_top_p_token_offsets.tolist() == [0, 1, 3, 4]
    s.append_response_tokens(tokens=[30, 31], trainable=False)  # tool tokens: empty spans
    assert s.rollout_top_p_token_offsets.tolist() == [0, 1, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="one entry more than the 1 generated tokens"):
        s.append_response_tokens(tokens=[40], log_probs=[0.0],
                                 meta_info={"top_p_token_ids": _b64([1]), "top_p_token_offsets": _b64([0, 1, 1])})


def test_routed_experts_decode_and_continue():
    args = argparse.Namespace(num_layers=2, moe_router_topk=1)
    s = Sample(tokens=[1, 2, 3])  # 3 tokens: routing of the 2 that had a successor
    s.append_response_tokens(args, tokens=[], meta_info={"routed_experts": _b64([0, 1, 2, 3])})
    assert s.rollout_routed_experts.tolist() == [[[0], [1]], [[2], [3]]]
    s.append_response_tokens(args, tokens=[4], log_probs=[-0.5],
                             meta_info={"routed_experts": _b64([7, 8, 9, 9]), "routed_experts_start_len": 1})
    assert s.rollout_routed_experts.tolist() == [[[0], [1]], [[7], [8]], [[9], [9]]]  # row 0 kept, then the new rows
    with pytest.raises(ValueError, match=r"element count 2 does not match the sample: expected 6"):
        s.append_response_tokens(args, tokens=[], meta_info={"routed_experts": _b64([0, 1])})
    with pytest.raises(ValueError, match="pass args"):
        Sample(tokens=[1, 2]).append_response_tokens(tokens=[], meta_info={"routed_experts": _b64([0, 1])})


def test_int32_meta_arrays_decode_every_wire_form():
    want = [3, -1, 7]
    for value in (_b64(want), np.asarray(want, dtype="<i4").tobytes(), torch.tensor(want), np.array(want), want):
        assert decode_int32_meta_array({"b": value}, ("a", "b")).tolist() == want
    assert decode_int32_meta_array({}, "a") is None and decode_int32_meta_array({"a": None}, "a") is None


def test_multimodal_types():
    assert MultimodalTypes.get("image").placeholder == "<image>"
    assert [m.name for m in MultimodalTypes.all()] == ["image", "video", "audio"] and MultimodalTypes.get("x") is None


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
