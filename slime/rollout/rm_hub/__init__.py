"""Reward hub: built-in reward types and the dispatch that picks a reward function for a sample.

Precedence, first match wins:
1. `sample.metadata["custom_rm_path"]` (per-sample plugin),
2. `--custom-rm-path` (`async (args, sample) -> float | dict`; with `--group-rm`, `(args, samples) -> list`),
3. `sample.metadata["rm_type"]`, then `--rm-type`. The per-sample type wins over the flag so one eval set
   (or one row) can be graded differently from the training data.

Built-in types (`RM_TYPES`): math, deepscaler, dapo, f1, gpqa, random, remote_rm, toy. A `boxed_` prefix
(e.g. `boxed_f1`) grades only the last `\\boxed{}` of the response (0 when there is none).
"""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

from slime.utils.types import Sample

RM_TYPES = frozenset({"math", "deepscaler", "dapo", "f1", "gpqa", "random", "remote_rm", "toy"})
BOXED_PREFIX = "boxed_"


def validate_rm_type(rm_type: str | None, flag: str = "--rm-type") -> None:
    """Raise a ValueError naming the flag and the valid choices when `rm_type` is unknown."""
    if rm_type is None:
        return
    base = rm_type.removeprefix(BOXED_PREFIX)
    if base not in RM_TYPES:
        raise ValueError(
            f"{flag} {rm_type!r} is not a known reward type; choose one of {sorted(RM_TYPES)} "
            f"(optionally with the '{BOXED_PREFIX}' prefix), or pass --custom-rm-path"
        )


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _load(path: str, flag: str):
    from slime.utils.misc import load_function

    return load_function(path, flag)


def _rm_type_of(args, sample: Sample) -> str:
    rm_type = (sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None)
    if not rm_type:
        raise ValueError(
            f"sample {sample.index}: no reward function: set --rm-type (one of {sorted(RM_TYPES)}), "
            "--custom-rm-path, or metadata['rm_type'] in the data"
        )
    return str(rm_type).strip()


async def _remote_rm(args, sample: Sample) -> Any:
    from slime.utils.http_utils import post

    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url (the reward server's POST endpoint)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(url, payload, retries=getattr(args, "rm_retries", 5), backoff=1.0)


async def _builtin_reward(args, sample: Sample, rm_type: str) -> Any:
    response = sample.response
    if rm_type.startswith(BOXED_PREFIX):
        from slime.rollout.rm_hub.math_utils import last_boxed_answer

        rm_type = rm_type[len(BOXED_PREFIX) :]
        boxed = last_boxed_answer(response)
        if boxed is None:
            return 0.0
        # `math` grades the boxed answer by itself, so it keeps the full response
        if rm_type != "math":
            response = boxed
    if rm_type == "math":
        from slime.rollout.rm_hub.math_utils import math_reward

        return math_reward(response, sample.label)
    if rm_type == "deepscaler":
        from slime.rollout.rm_hub.math_utils import deepscaler_reward

        return deepscaler_reward(response, sample.label)
    if rm_type == "dapo":
        from slime.rollout.rm_hub.dapo import dapo_reward

        return dapo_reward(response, sample.label)
    if rm_type == "f1":
        from slime.rollout.rm_hub.f1 import f1_reward

        return f1_reward(response, sample.label)
    if rm_type == "gpqa":
        from slime.rollout.rm_hub.gpqa import gpqa_reward

        return gpqa_reward(response, sample.label, sample.metadata)
    if rm_type == "random":
        return float(random.randint(0, 1))
    if rm_type == "remote_rm":
        return await _remote_rm(args, sample)
    if rm_type == "toy":
        from slime.rollout.rm_hub.toy import toy_reward

        return toy_reward(response, sample.label)
    validate_rm_type(rm_type)
    raise AssertionError("unreachable")


async def async_rm(args, sample: Sample, **kwargs) -> float | dict:
    """The reward of one sample (see the module docstring for which function is used)."""
    path = (sample.metadata or {}).get("custom_rm_path")
    if path:
        return await _maybe_await(_load(path, "metadata['custom_rm_path']")(args, sample, **kwargs))
    path = getattr(args, "custom_rm_path", None)
    if path:
        return await _maybe_await(_load(path, "--custom-rm-path")(args, sample, **kwargs))
    return await _builtin_reward(args, sample, _rm_type_of(args, sample))


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[float | dict]:
    """Rewards of several samples. With --group-rm and --custom-rm-path the plugin gets the whole list at
    once and must return one reward per sample; otherwise each sample is graded by `async_rm` concurrently."""
    path = getattr(args, "custom_rm_path", None)
    if getattr(args, "group_rm", False) and path:
        rewards = await _maybe_await(_load(path, "--custom-rm-path")(args, samples, **kwargs))
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(f"--custom-rm-path={path} with --group-rm returned {got} for {len(samples)} samples")
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
