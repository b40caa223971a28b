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

from slime.rollout.rm_hub.dapo import dapo_reward
from slime.rollout.rm_hub.f1 import f1_reward
from slime.rollout.rm_hub.gpqa import gpqa_reward
from slime.rollout.rm_hub.math_utils import deepscaler_reward, last_boxed_answer, math_reward
from slime.rollout.rm_hub.toy import toy_reward
from slime.utils.http_utils import post
from slime.utils.misc import load_function
from slime.utils.types import Sample

# rm_type -> fn(response, label, metadata) for the graders that only read the sample
_GRADERS = {
    "math": lambda response, label, metadata: math_reward(response, label),
    "deepscaler": lambda response, label, metadata: deepscaler_reward(response, label),
    "dapo": lambda response, label, metadata: dapo_reward(response, label),
    "f1": lambda response, label, metadata: f1_reward(response, label),
    "gpqa": gpqa_reward,
    "toy": lambda response, label, metadata: toy_reward(response, label),
    "random": lambda response, label, metadata: float(random.randint(0, 1)),
}
RM_TYPES = frozenset({*_GRADERS, "remote_rm"})
BOXED_PREFIX = "boxed_"
REMOTE_RM_RETRIES = 5  # retries of a failed --rm-url request (transport errors and 5xx)


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


def _rm_type_of(args, sample: Sample) -> str:
    rm_type = (sample.metadata or {}).get("rm_type") or args.rm_type
    if not rm_type:
        raise ValueError(
            f"sample {sample.index}: no reward function: set --rm-type (one of {sorted(RM_TYPES)}), "
            "--custom-rm-path, or metadata['rm_type'] in the data"
        )
    return str(rm_type).strip()


async def _remote_rm(args, sample: Sample) -> Any:
    url = args.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url (the reward server's POST endpoint)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(url, payload, retries=REMOTE_RM_RETRIES, backoff=1.0)


async def _builtin_reward(args, sample: Sample, rm_type: str) -> Any:
    response = sample.response
    if rm_type.startswith(BOXED_PREFIX):
        rm_type = rm_type[len(BOXED_PREFIX) :]
        boxed = last_boxed_answer(response)
        if boxed is None:
            return 0.0
        # `math` grades the boxed answer by itself, so it keeps the full response
        if rm_type != "math":
            response = boxed
    if rm_type == "remote_rm":
        return await _remote_rm(args, sample)
    validate_rm_type(rm_type)
    return _GRADERS[rm_type](response, sample.label, sample.metadata)


async def async_rm(args, sample: Sample, **kwargs) -> float | dict:
    """The reward of one sample (see the module docstring for which function is used)."""
    path = (sample.metadata or {}).get("custom_rm_path")
    if path:
        return await _maybe_await(load_function(path, "metadata['custom_rm_path']")(args, sample, **kwargs))
    path = args.custom_rm_path
    if path:
        return await _maybe_await(load_function(path, "--custom-rm-path")(args, sample, **kwargs))
    return await _builtin_reward(args, sample, _rm_type_of(args, sample))


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[float | dict]:
    """Rewards of several samples. With --group-rm and --custom-rm-path the plugin gets the whole list at
    once and must return one reward per sample; otherwise each sample is graded by `async_rm` concurrently."""
    path = args.custom_rm_path
    if args.group_rm and path:
        rewards = await _maybe_await(load_function(path, "--custom-rm-path")(args, samples, **kwargs))
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(f"--custom-rm-path={path} with --group-rm returned {got} for {len(samples)} samples")
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
