"""How SGLang engines lie over nodes: a pure helper the engine actor, the rollout manager and the `--dry-run`
planner share (kept apart from sglang_engine.py so that the planner does not import the engine actor)."""

from __future__ import annotations

import math


def engine_nnodes(args) -> int:
    """Nodes one engine spans: an engine wider than a node takes whole nodes."""
    per_engine = args.rollout_num_gpus_per_engine
    per_node = args.num_gpus_per_node
    return max(1, math.ceil(per_engine / per_node)) if per_engine > per_node else 1
