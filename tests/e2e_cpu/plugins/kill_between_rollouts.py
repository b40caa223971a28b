"""A generate plugin that holds one rollout's requests until the test has killed an engine (fault tolerance).

In rollout $SLIME_KILL_ROLLOUT the first generate call creates the file $SLIME_KILL_MARKER, and every generate
call of that rollout waits (up to 5 minutes) for `$SLIME_KILL_MARKER.done`, which the test creates once it has
SIGKILLed an engine server. Generate is called only once the rollout manager's `generate` runs, after the weight
push that precedes the rollout has ended, and no request of the rollout is sent before `.done`: so the kill
always lands between that push and the rollout's first request, whatever the machine's load. Every other rollout
generates as the default `generate` does.
"""

from __future__ import annotations

import os

from slime.rollout.sample_hooks import current_rollout_id
from slime.rollout.sglang_rollout import generate as default_generate
from tests.e2e_cpu.plugins.engine_kill import wait_for


async def generate(args, sample, sampling_params):
    if current_rollout_id() == int(os.environ["SLIME_KILL_ROLLOUT"]):
        marker = os.environ["SLIME_KILL_MARKER"]
        open(marker, "a").close()  # the first call creates it; the others find it there
        await wait_for(marker + ".done")
    return await default_generate(args, sample, sampling_params)
