"""A deliberately broken GRPO for the learning check (tests/e2e_cpu/test_learning.py): the advantages with their
sign flipped (`--custom-advantage-function-path tests.e2e_cpu.plugins.broken_advantage.flipped_grpo`, slime's
contract: fill `rollout_data["advantages"]` / `["returns"]` in place). The rewards in `rollout_data` are already
the group-normalised GRPO rewards, so each sample's correct advantage is its reward on every response token."""

from __future__ import annotations

import torch


def flipped_grpo(args, rollout_data):
    advantages = [-float(r) * torch.ones_like(m, dtype=torch.float32)
                  for r, m in zip(rollout_data["rewards"], rollout_data["loss_masks"])]
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = advantages
