"""A generate plugin that opens a window for killing the engine in the middle of one rollout (fault tolerance).

In rollout $SLIME_KILL_ROLLOUT the first prompt group generates at once; when its first sample is back, the
plugin creates the file $SLIME_KILL_MARKER and every other sample of the rollout waits (up to 5 minutes) for
`$SLIME_KILL_MARKER.done`, which the test creates once it has SIGKILLed the engine server. So the kill lands
while the rollout runs: the first group's other requests may be in flight, and the rest are sent after it.
Every other rollout generates as the default `generate` does.
"""

from __future__ import annotations

import asyncio
import os
import time

from slime.rollout.sample_hooks import current_rollout_id
from slime.rollout.sglang_rollout import generate as default_generate

_state: dict = {"first_group": None}


async def wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def generate(args, sample, sampling_params):
    marker = os.environ["SLIME_KILL_MARKER"]
    if current_rollout_id() != int(os.environ["SLIME_KILL_ROLLOUT"]):
        return await default_generate(args, sample, sampling_params)
    if _state["first_group"] is None:
        _state["first_group"] = sample.group_index
    if sample.group_index != _state["first_group"]:
        await wait_for(marker + ".done")
        return await default_generate(args, sample, sampling_params)
    sample = await default_generate(args, sample, sampling_params)
    open(marker, "a").close()
    return sample
