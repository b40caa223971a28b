"""On-policy distillation with a teacher server (`--use-opd --opd-type sglang`), slime's two plugin functions:

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://TEACHER_HOST:PORT/generate

`reward_func` posts each sample's tokens (prompt + the student's response) to the teacher's SGLang `/generate`
with `max_new_tokens` 0 and `return_logprob` from position 0 at `--rollout-temperature` (the student's sampling
temperature, so both distributions are compared at the same temperature): the teacher scores the sequence
without generating, and its answer becomes the sample's reward. `post_process_rewards` takes from each answer the
log-probs of the response tokens (`meta_info.input_token_logprobs`, whose first entry has no prediction) into
`Sample.teacher_log_probs` and returns rewards 0: the learning signal is the reverse KL the trainer adds to the
advantages (slime/algorithm/opd.py). Any SGLang-API server serves as the teacher, e.g. a second `hf` engine on
CPU (`python -m slime.backends.hf_engine --model-path TEACHER --port N`); it needs the student's tokenizer.

Checked here where slime indexes blindly: the answer holds one log-prob per input token and names the tokens it
was sent. A sample marked FAILED (its generation or its reward failed) keeps reward 0 and gets teacher log-probs
0.0: its loss mask is all 0, so they are never trained on.
"""

from __future__ import annotations

from typing import Any

from slime.utils.http_utils import post
from slime.utils.types import Sample

__all__ = ["post_process_rewards", "reward_func"]


def teacher_payload(args: Any, sample: Sample) -> dict[str, Any]:
    """The teacher's `/generate` request for one sample: score `sample.tokens`, generate nothing."""
    if sample.multimodal_inputs and any(v is not None for v in sample.multimodal_inputs.values()):
        raise ValueError(f"sample {sample.index}: on-policy distillation here is text only (the sample has media)")
    return {
        "input_ids": list(sample.tokens),
        "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0,
                            "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


async def reward_func(args: Any, sample: Sample, **kwargs) -> dict[str, Any]:
    """The teacher server's answer for `sample` (slime's OPD reward: a dict, read by `post_process_rewards`)."""
    if not args.rm_url:
        raise ValueError("slime.rollout.on_policy_distillation.reward_func posts to the teacher server: set --rm-url "
                         "http://HOST:PORT/generate")
    return await post(args.rm_url, teacher_payload(args, sample))


def response_teacher_log_probs(answer: Any, sample: Sample, where: str) -> list[float]:
    """The teacher's log-probs of `sample`'s response tokens, from its `/generate` answer."""
    try:
        entries = answer["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        shown = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise ValueError(f"sample {sample.index}: the teacher at {where} answered without meta_info."
                         f"input_token_logprobs ({shown}); it must be an SGLang /generate endpoint and the request "
                         "must come from slime.rollout.on_policy_distillation.reward_func") from None
    if len(entries) != len(sample.tokens):
        raise ValueError(f"sample {sample.index}: the teacher at {where} returned {len(entries)} input log-probs for "
                         f"{len(sample.tokens)} tokens (logprob_start_len 0 gives one per token)")
    sent = [int(e[1]) for e in entries if len(e) > 1 and e[1] is not None]
    if sent and sent != list(sample.tokens)[: len(sent)]:
        raise ValueError(f"sample {sample.index}: the teacher at {where} scored other tokens than the sample's; it "
                         "must take input_ids as sent (the student's tokenizer)")
    response = entries[1:][len(entries) - 1 - sample.response_length:]  # the first entry has no prediction
    return [float(e[0]) for e in response]


def post_process_rewards(args: Any, samples: list[Sample], **kwargs) -> tuple[list[float], list[float]]:
    """slime's OPD post-process: each sample's `teacher_log_probs` from its teacher answer; (raw, training) rewards
    both 0.0 (pure distillation: the signal is the KL term; add a task reward here to combine them)."""
    for sample in samples:
        if sample.status == Sample.Status.FAILED:
            sample.teacher_log_probs = [0.0] * sample.response_length
            continue
        sample.teacher_log_probs = response_teacher_log_probs(sample.reward, sample, args.rm_url)
    rewards = [0.0] * len(samples)
    return rewards, list(rewards)
