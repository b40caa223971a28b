"""Reward hub (`slime.rollout.rm_hub`): the built-in reward types and the dispatch that grades a sample.

Which function grades a sample, first match wins:
1. `sample.custom_rm_path` (set per eval dataset),
2. `--custom-rm-path` (`async (args, sample) -> float | dict`; `batched_async_rm` calls it as
   `(args, samples) -> list`, which is what `--group-rm` does),
3. `sample.metadata["rm_type"]`, then `--rm-type`.

Built-in types (`RM_TYPES`), graded as slime grades them:

| type | reward |
| --- | --- |
| math | 1 / 0: `grade_answer_verl` on the last `\\boxed{}` of the response |
| deepscaler | 1 / 0: `get_deepscaler_rule_based_reward` (the text after `</think>` / `###Response`) |
| dapo | `{"score": ±1.0, "acc", "pred"}`: `math_dapo_utils.compute_score` |
| f1 | SQuAD token F1: `f1_score(response, label)[0]` |
| gpqa | 1.0 / 0.0: `compute_gpqa_reward` (metadata `choices`, `correct_letter`, `valid_letters`) |
| ifbench | 1.0 / 0.0: `compute_ifbench_reward` (IFBench's strict instruction checks) |
| random | 0 or 1 at random |
| remote_rm | the JSON answer of `POST --rm-url {"prompt", "response", "label"}` |
| toy | 1.0 / 0.0: the CPU toy task of `tools/make_toy_data.py` (not in slime) |

A `boxed_` prefix (`boxed_f1`) grades only the last `\\boxed{}` content of the response ("" when there is
none). Where slime differs, on purpose: `boxed_math` grades the response itself (slime hands the unboxed
answer to a grader that looks for a box, so it always scores 0); a list label (several acceptable answers)
is graded against each for math, deepscaler and f1, the best grade counting (slime would grade the list's
text); an unknown or missing type names the choices.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward
from slime.rollout.rm_hub.ifbench import compute_ifbench_reward, ifbench_missing_reason
from slime.rollout.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from slime.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from slime.rollout.rm_hub.math_utils import grade_answer_verl
from slime.rollout.rm_hub.toy import toy_reward
from slime.utils.http_utils import post
from slime.utils.hooks import hooks_of, sample_hook
from slime.utils.types import Sample

__all__ = [
    "RM_TYPES",
    "async_rm",
    "batched_async_rm",
    "compute_gpqa_reward",
    "compute_ifbench_reward",
    "compute_score_dapo",
    "extract_boxed_answer",
    "f1_score",
    "get_deepscaler_rule_based_reward",
    "grade_answer_verl",
    "remote_rm",
    "validate_rm_type",
]


def _best_over_labels(grade):
    """`grade(response, label)` for one label; for a list of labels, the best grade over them."""

    def graded(response: str, label, metadata: dict):
        if isinstance(label, (list, tuple)):
            return max((grade(response, one) for one in label), default=0)
        return grade(response, label)

    return graded


# rm_type -> fn(response, label, metadata) for the types that only read the sample
_GRADERS = {
    "math": _best_over_labels(lambda response, label: 1 if grade_answer_verl(response, label) else 0),
    "deepscaler": _best_over_labels(get_deepscaler_rule_based_reward),
    "dapo": lambda response, label, metadata: compute_score_dapo(response, label),
    "f1": _best_over_labels(lambda response, label: f1_score(response, str(label))[0]),
    "gpqa": lambda response, label, metadata: compute_gpqa_reward(response, label, metadata=metadata),
    "ifbench": lambda response, label, metadata: compute_ifbench_reward(response, label, metadata=metadata),
    "random": lambda response, label, metadata: random.randint(0, 1),
    "toy": lambda response, label, metadata: toy_reward(response, label),
}
RM_TYPES = frozenset({*_GRADERS, "remote_rm"})
BOXED_PREFIX = "boxed_"
REMOTE_RM_ATTEMPTS = 10  # slime's: a failed --rm-url request (transport error, 5xx) is tried this often in all


def validate_rm_type(rm_type: str | None, flag: str = "--rm-type") -> None:
    """Raise a ValueError naming the flag and the fix when `rm_type` cannot grade here (unknown, or `ifbench`
    without the IFBench package)."""
    if rm_type is None:
        return
    base = rm_type.strip().removeprefix(BOXED_PREFIX)
    if base not in RM_TYPES:
        raise ValueError(
            f"{flag} {rm_type!r} is not a known reward type; choose one of {sorted(RM_TYPES)} "
            f"(optionally with the '{BOXED_PREFIX}' prefix), or pass --custom-rm-path"
        )
    if base == "ifbench" and ifbench_missing_reason() is not None:
        raise ValueError(f"{flag} {rm_type!r}: {ifbench_missing_reason()}")


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def remote_rm(args, sample: Sample, max_retries: int = REMOTE_RM_ATTEMPTS) -> Any:
    """POST `{"prompt", "response", "label"}` to `--rm-url` and return the decoded answer; transport errors and
    5xx answers are retried with exponential backoff, `max_retries` attempts in all."""
    if not args.rm_url:
        raise ValueError("--rm-type remote_rm needs --rm-url (the reward server's POST endpoint)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(args.rm_url, payload, retries=max(0, max_retries - 1), backoff=1.0)


def _rm_type_of(args, sample: Sample) -> str:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    if not rm_type:
        raise NotImplementedError(
            f"sample {sample.index}: no reward type: set --rm-type (one of {sorted(RM_TYPES)}), "
            "--custom-rm-path, or metadata['rm_type'] in the data"
        )
    return rm_type


async def _builtin_reward(args, sample: Sample, rm_type: str) -> Any:
    response = sample.response
    base = rm_type.removeprefix(BOXED_PREFIX)
    if base != rm_type and base != "math":
        response = extract_boxed_answer(response) or ""
    if base == "remote_rm":
        return await remote_rm(args, sample)
    grade = _GRADERS.get(base)
    if grade is None:
        raise NotImplementedError(
            f"sample {sample.index}: reward type {rm_type!r} is not implemented; choose one of {sorted(RM_TYPES)} "
            f"(optionally with the '{BOXED_PREFIX}' prefix), or pass --custom-rm-path"
        )
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return grade(response, sample.label, metadata)


async def async_rm(args, sample: Sample, **kwargs) -> Any:
    """The reward of one sample (see the module docstring for which function grades it)."""
    if sample.custom_rm_path:
        fn = sample_hook(sample.custom_rm_path, "--custom-rm-path", "sample.custom_rm_path")
        return await _maybe_await(fn(args, sample, **kwargs))
    custom = hooks_of(args).custom_rm
    if custom is not None:
        return await _maybe_await(custom(args, sample, **kwargs))
    return await _builtin_reward(args, sample, _rm_type_of(args, sample))


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[Any]:
    """Rewards of several samples (a group with `--group-rm`). A `--custom-rm-path` function gets the whole list
    at once and must return one reward per sample; otherwise each sample is graded by `async_rm` concurrently."""
    path = args.custom_rm_path
    custom = hooks_of(args).custom_rm
    if custom is not None:
        rewards = await _maybe_await(custom(args, samples, **kwargs))
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(
                f"--custom-rm-path={path} called with {len(samples)} samples (batched_async_rm, as --group-rm does) "
                f"returned {got}; it must return one reward per sample"
            )
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
