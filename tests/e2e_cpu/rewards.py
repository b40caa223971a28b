"""Reward functions for the CPU runs that need the training step to change the weights (`--custom-rm-path
tests.e2e_cpu.rewards.alternating`).

`--rm-type random` is unseeded 0/1 (as slime's): a group of 4 samples gets one reward for all with probability
1/8, so a rollout of 4 such groups has only zero GRPO advantages once in 4096 runs, and its step changes nothing.
"""

from __future__ import annotations

ALTERNATING = "tests.e2e_cpu.rewards.alternating"  # the --custom-rm-path of `alternating`


async def alternating(args, sample) -> float:
    """0/1 by the sample's index: the indices of a group are consecutive, so every group of two or more samples has
    both rewards and non-zero advantages."""
    return float(sample.index % 2)
