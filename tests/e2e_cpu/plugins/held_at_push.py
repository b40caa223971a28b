"""A generate plugin that keeps some responses generating until a weight push aborts them (fully async e2e).

The first attempt of each sample of every HELD_EVERY-th prompt group asks the engine for one token at a time
(`ignore_eos`) with a short pause between requests, until a request comes back aborted. Before every push the
fully async worker aborts the engines' requests and re-sends the abort every 0.5 s while groups are in flight,
so a held group launched before a push is still generating at that push, however slow or fast the machine is:
the tests about what happens to responses at a push no longer depend on generation outlasting a training step.
A held sample that reaches HELD_MAX_TOKENS before any push finishes there (truncated).

A held sample continued after the abort (--partial-rollout) generates at most CONTINUED_TOKENS more tokens, so its
group finishes right after the push, before the next one: what a push did to it is collected and trained within
a rollout or two, not regenerated as stale. A sample restarted from the prompt, and every other group, generate as
the default `generate` does.
"""

from __future__ import annotations

import asyncio

from slime.rollout.sglang_rollout import generate as default_generate
from slime.utils.types import Sample

HELD_EVERY = 8
HELD_MAX_TOKENS = 400  # at ~30 tokens/s on an idle 2-core machine: held ~14 s, several training steps of the e2e tests
STEP_PAUSE_S = 0.02  # a fixed share of each token's time that a loaded machine does not slow
CONTINUED_TOKENS = 8
_held: set[int] = set()  # samples whose first attempt was held (the rollout manager's process)


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    if sample.group_index % HELD_EVERY:
        return await default_generate(args, sample, sampling_params)
    if sample.index in _held:
        if sample.response_length:  # continued after the push that aborted it
            limit = min(int(sampling_params["max_new_tokens"]), sample.response_length + CONTINUED_TOKENS)
            return await default_generate(args, sample, dict(sampling_params, max_new_tokens=limit))
        return await default_generate(args, sample, sampling_params)
    _held.add(sample.index)
    while True:
        params = dict(sampling_params, max_new_tokens=sample.response_length + 1, ignore_eos=True)
        sample = await default_generate(args, sample, params)
        if sample.status == Sample.Status.ABORTED or sample.response_length >= HELD_MAX_TOKENS:
            return sample
        await asyncio.sleep(STEP_PAUSE_S)
