"""Device counts of a run, from its args alone: what the placement groups reserve, what the `--dry-run` planner
plans and how many nodes one SGLang engine spans (no Ray here: the parser and the planner import it)."""

from __future__ import annotations

import math

from slime.utils.backend_specs import engine_spec


def num_actor_devices(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def num_training_devices(args) -> int:
    """Devices of the training ranks: none with `--debug-rollout-only`."""
    return 0 if args.debug_rollout_only else num_actor_devices(args)


def num_rollout_devices(args) -> int:
    if args.colocate or args.debug_train_only:
        return 0
    return args.rollout_num_gpus or 0


def num_bundles(args) -> int:
    """Devices the run's placement group reserves: the actor's and the rollout's; with `--colocate` the engines
    share the actor's devices, so the larger of the two counts (slime's sizing: engines on the first
    `--rollout-num-gpus` of them, a subset or a superset of the actor's)."""
    num_actor = num_training_devices(args)
    if args.colocate:
        return max(num_actor, args.rollout_num_gpus or 0)
    return num_actor + num_rollout_devices(args)


def num_colocated_engines(args) -> int:
    """Under `--colocate`, the engines whose devices all hold a training rank (engine i takes devices
    [i·E, (i+1)·E)); the engines past them sit on devices of their own (a `--rollout-num-gpus` above the actor's).
    0 without `--colocate`."""
    if not args.colocate:
        return 0
    per_engine = args.rollout_num_gpus_per_engine
    engines = (args.rollout_num_gpus or 0) // per_engine
    return min(engines, num_actor_devices(args) // per_engine)


def engine_node_count(args) -> int:
    """Nodes (one engine process each) one engine of this run spans: `engine_nnodes` for an engine that spans
    nodes (SGLang), else 1."""
    return engine_nnodes(args) if engine_spec(args).spans_nodes else 1


def engine_nnodes(args) -> int:
    """Nodes one SGLang engine spans: an engine wider than a node takes whole nodes."""
    per_engine = args.rollout_num_gpus_per_engine
    per_node = args.num_gpus_per_node
    return max(1, math.ceil(per_engine / per_node)) if per_engine > per_node else 1
