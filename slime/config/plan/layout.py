"""Where the training ranks and rollout engines of a run would sit, computed without Ray.

Mirrors `slime.ray.placement_group.create_placement_groups` and `RolloutManager._start_engines`
(slime/ray/rollout.py): one bundle per device, bundles sorted by (node ip, GPU id); the actor takes sorted
bundles `[0, A)`, the rollout `[A, A+R)` (`--colocate`: `[0, R)` of max(A, R) bundles); engine i takes the rollout's
bundles `[i·E, (i+1)·E)` for E = `--rollout-num-gpus-per-engine`; an engine wider than a node has one actor
per node. The device counts reuse `num_training_devices` / `num_bundles` and `engine_node_count`; the bundle
index arithmetic is re-derived here because the real function needs a live placement group.

Assumption: every node has `--num-gpus-per-node` GPUs and PACK fills them in order, so sorted bundle k is
GPU k mod n of node k div n. CPU bundles are taken to sit on one node (the local Ray cluster of a CPU run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slime.utils.placement import engine_node_count, num_bundles, num_training_devices


@dataclass(frozen=True)
class Engine:
    rank: int
    bundles: list[int]  # sorted bundle indices, one per GPU
    nnodes: int  # actors (one per node) of this engine

    def node_actor_bundles(self) -> list[int]:
        """The bundle each of this engine's actors is scheduled on (its node's first GPU)."""
        per_node = len(self.bundles) // self.nnodes
        return [self.bundles[r * per_node] for r in range(self.nnodes)]


@dataclass(frozen=True)
class Layout:
    device: str  # "GPU" or "CPU"
    node_size: int
    total_bundles: int
    actor: list[int]
    critic: bool  # PPO: a critic group on the actor's bundles
    rollout: list[int]
    engines: list[Engine]
    colocated: bool
    external_engines: list[str] = field(default_factory=list)

    def where(self, bundle: int) -> tuple[int, int]:
        """(node, device index on that node) of a sorted bundle."""
        return divmod(bundle, self.node_size)


def compute_layout(args) -> Layout:
    num_actor = num_training_devices(args)
    total = num_bundles(args)
    rollout = list(range(min(total, args.rollout_num_gpus or 0))) if args.colocate else list(range(num_actor, total))
    external = list(args.rollout_external_engine_addrs or [])
    engines: list[Engine] = []
    per_engine = args.rollout_num_gpus_per_engine
    if not external and not args.debug_train_only:
        nnodes = engine_node_count(args)
        for i in range((args.rollout_num_gpus or 0) // per_engine):
            engines.append(Engine(rank=i, bundles=rollout[i * per_engine:(i + 1) * per_engine], nnodes=nnodes))
    return Layout(
        device="GPU" if args.use_cuda else "CPU",
        node_size=args.num_gpus_per_node if args.use_cuda else max(1, total),
        total_bundles=total,
        actor=list(range(num_actor)),
        critic=bool(args.use_critic) and num_actor > 0,
        rollout=rollout,
        engines=engines,
        colocated=bool(args.colocate),
        external_engines=external,
    )


def describe_bundles(layout: Layout, bundles: list[int]) -> str:
    """"node 0: GPU 0-7, node 1: GPU 0-3", with runs of identical nodes folded: "nodes 0-7: GPU 0-7 each"."""
    if not bundles:
        return "-"
    unit = "GPU" if layout.device == "GPU" else "CPU slot"
    per_node: dict[int, list[int]] = {}
    for b in bundles:
        node, idx = layout.where(b)
        per_node.setdefault(node, []).append(idx)
    items = [(node, _ranges(ids)) for node, ids in sorted(per_node.items())]
    parts = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1][1] == items[i][1] and items[j + 1][0] == items[j][0] + 1:
            j += 1
        if j > i:
            parts.append(f"nodes {items[i][0]}-{items[j][0]}: {unit} {items[i][1]} each")
        else:
            parts.append(f"node {items[i][0]}: {unit} {items[i][1]}")
        i = j + 1
    return ", ".join(parts)


def bundle_ranges(bundles: list[int]) -> str:
    return _ranges(bundles) if bundles else "-"


def _ranges(ids: list[int]) -> str:
    ids = sorted(ids)
    out, start, prev = [], ids[0], ids[0]
    for x in ids[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def engine_node_problems(layout: Layout) -> list[str]:
    """Engines whose GPUs do not sit where SGLang needs them: an engine within one node must not straddle
    two; an engine spanning nodes must start on a node boundary and take whole nodes."""
    problems = []
    for e in layout.engines:
        nodes = sorted({layout.where(b)[0] for b in e.bundles})
        if e.nnodes == 1 and len(nodes) > 1:
            where = describe_bundles(layout, e.bundles)
            problems.append(f"engine {e.rank} straddles nodes {nodes[0]}-{nodes[-1]} ({where})")
        elif e.nnodes > 1 and (len(nodes) != e.nnodes or layout.where(e.bundles[0])[1] != 0):
            problems.append(f"engine {e.rank} spans {e.nnodes} nodes but starts at "
                            f"{describe_bundles(layout, e.bundles[:1])}, not at a node's first GPU")
    return problems
