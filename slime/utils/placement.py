"""Device counts of a run, from its args alone: what the placement groups reserve, what the `--dry-run` planner
plans and how many nodes one SGLang engine spans (no Ray here: the parser and the planner import it)."""

from __future__ import annotations

import math


def num_actor_devices(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def num_rollout_devices(args) -> int:
    if args.colocate or args.debug_train_only:
        return 0
    return args.rollout_num_gpus or 0


def engine_nnodes(args) -> int:
    """Nodes one engine spans: an engine wider than a node takes whole nodes."""
    per_engine = args.rollout_num_gpus_per_engine
    per_node = args.num_gpus_per_node
    return max(1, math.ceil(per_engine / per_node)) if per_engine > per_node else 1
