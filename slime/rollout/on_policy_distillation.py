"""On-policy distillation with a teacher server (`--use-opd --opd-type sglang`), slime's two plugin functions:

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://TEACHER_HOST:PORT/generate

`reward_func` posts each sample's tokens (prompt + the student's response) to the teacher's SGLang `/generate`
with `max_new_tokens` 0 and `return_logprob` from position 0 (temperature 0, slime's request; SGLang's prompt
log-probs ignore the temperature, so they are the teacher's own distribution): the teacher scores the sequence
without generating, and its answer becomes the sample's reward. `post_process_rewards` takes from each answer the
log-probs of the response tokens (`meta_info.input_token_logprobs`, whose first entry has no prediction) into
`Sample.teacher_log_probs` and returns rewards 0: the learning signal is the reverse KL the trainer adds to the
advantages (slime/algorithm/opd.py). Any SGLang-API server serves as the teacher, e.g. a second `hf` engine on
CPU (`python -m slime.backends.hf_engine --model-path TEACHER --port N`); it needs the student's tokenizer.

A sample with images (`Sample.multimodal_inputs`, read by the data source with `--multimodal-keys`) is scored with
them: its images go as PNG data URLs in `image_data`, and its ids with each image's run of image tokens cut to one
image token, which the server expands back to the trained ids (SGLang 0.5.16 keeps such ids as sent and expands
image k's token to its count; ids holding the expanded runs it would expand a second time: docs/vlm.md). Where the
policy sampled image tokens itself the ids go expanded, which only the `hf` engine tells apart.

Checked here where slime indexes blindly: the answer holds one log-prob per input token and names the tokens it
was sent, as SGLang names them: SGLang reports an input id of its `vocab_size - 1` or more as 0 (with the sent
token's log-prob), and a random-init student's samples do hold its last id (`scored_tokens_problem`). A sample
marked FAILED (its generation or its reward failed) keeps reward 0 and gets teacher log-probs 0.0: its loss mask
is all 0, so they are never trained on.
"""

from __future__ import annotations

from typing import Any

from slime.rollout.generation import sample_images, short_image_ids
from slime.utils.http_utils import post
from slime.utils.processing_utils import encode_image_for_rollout_engine
from slime.utils.types import Sample

__all__ = ["post_process_rewards", "reward_func"]


def teacher_payload(args: Any, sample: Sample) -> dict[str, Any]:
    """The teacher's `/generate` request for one sample: score `sample.tokens`, generate nothing (slime's); the
    sample's images, if any, go along as `image_data`, and its ids with each image's run of image tokens cut to one
    where they allow it (`short_image_ids`: what SGLang expands back to the sample's ids; the hf engine takes both)."""
    images = sample_images(sample)
    short = short_image_ids(args, sample) if images else None
    payload = {
        "input_ids": list(sample.tokens if short is None else short),
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if images:
        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in images]
    return payload


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
    problem = scored_tokens_problem([e[1] if len(e) > 1 else None for e in entries], list(sample.tokens))
    if problem:
        raise ValueError(f"sample {sample.index}: the teacher at {where} scored other tokens than the sample's: "
                         f"{problem}")
    response = entries[1:][len(entries) - 1 - sample.response_length:]  # the first entry has no prediction
    return [float(e[0]) for e in response]


def scored_tokens_problem(reported: list[int | None], sent: list[int]) -> str | None:
    """None when `reported` (the ids of the teacher's `input_token_logprobs`) are what SGLang reports for the
    `sent` input_ids, else what differs first and why.

    SGLang 0.5.16 reports the id of every input token `t` as `t if t < vocab_size - 1 else 0` (its config's
    `vocab_size`, unknown here); the log-prob at such a position is still the sent token's. A teacher that can
    score the sample holds every sent id in its vocabulary, so `vocab_size - 1 >= max(sent)`: the only id it may
    report as 0 is the sample's largest, and then wherever it occurs. An entry without an id is not compared.
    """
    top = max(sent, default=0)
    top_kept = next((k for k, (r, s) in enumerate(zip(reported, sent)) if s == top and r == s), None)
    for i, (r, s) in enumerate(zip(reported, sent)):
        if r is None or r == s or (r == 0 and s == top and top_kept is None):
            continue
        where = f"position {i}: the sample has id {s}, the teacher reported id {r}"
        shift = next((d for d in (1, -1) if _shifted_by(reported, sent, d)), None)
        if shift is not None:
            return (f"{where}: its ids are the sample's shifted by {shift:+d} position; the answer must hold one "
                    "entry per input token from position 0 (logprob_start_len 0)")
        if r == 0 and s == top:
            return f"{where}, yet id {s} as itself at position {top_kept}: it was given other input_ids"
        if r == 0:
            return (f"{where}; SGLang reports 0 only in place of its vocab_size - 1, which is at least the sample's "
                    f"largest id {top} for a teacher that can score it: the teacher was given other input_ids or "
                    "has a smaller vocabulary than the student")
        return (f"{where}; the teacher must score the input_ids as sent (not re-tokenized text) with the "
                "student's vocabulary")
    return None


def _shifted_by(reported: list[int | None], sent: list[int], d: int) -> bool:
    """Whether every reported id is the sent id `d` positions on (or SGLang's clipped 0)."""
    pairs = [(r, sent[k + d]) for k, r in enumerate(reported) if r is not None and 0 <= k + d < len(sent)]
    return any(r != 0 for r, _ in pairs) and all(r == s or r == 0 for r, s in pairs)


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
