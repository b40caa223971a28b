"""Ray placement groups for training ranks and rollout engines.

One bundle per device: `{GPU: 1, CPU: 1}` with CUDA, `{CPU: 1}` without (then `--actor-num-gpus-per-node` and
`--rollout-num-gpus` count CPU ranks and CPU engines). Disaggregated: actor bundles `[0, A)`, rollout bundles
`[A, A+R)`; `--colocate`: max(A, R) bundles, the actor on `[0, A)` and the engines on `[0, R)` (so
with R < A some training GPUs hold no engine, with R > A the engines past the actor's GPUs have GPUs of their
own). Bundles are ordered by (node ip, GPU id) so that ranks land on GPUs in a predictable order.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.utils.placement import num_bundles, num_training_devices

logger = logging.getLogger(__name__)


class PlacementSlice(NamedTuple):
    """Bundles of one placement group reserved for one role, in rank order (unpacks as `(pg, bundle_indices)`)."""

    pg: PlacementGroup
    bundle_indices: list[int]

    def strategy(self, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_indices[i],
            placement_group_capture_child_tasks=True,
        )


@ray.remote(num_cpus=0)
class _BundleProbe:
    def where(self) -> tuple[str, int]:
        gpu_ids = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else 0


def create_placement_groups(args, timeout_s: float = 120.0) -> dict[str, PlacementSlice]:
    num_actor = num_training_devices(args)
    total = num_bundles(args)
    bundle = {"GPU": 1, "CPU": 1} if args.use_cuda else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(total)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        kind = "GPU" if args.use_cuda else "CPU"
        raise RuntimeError(
            f"could not reserve {total} x {bundle} within {timeout_s:.0f}s: the run asks for {num_actor} training "
            f"{kind}s (--actor-num-nodes x --actor-num-gpus-per-node) + {total - num_actor} rollout {kind}s "
            f"(--rollout-num-gpus), the Ray cluster has {ray.cluster_resources()}"
        )
    order = _sorted_bundles(pg, total, args.use_cuda)
    rollout = order[:total] if args.colocate else order[num_actor:]
    logger.info("placement group: %d bundles; actor %s, rollout %s", total, order[:num_actor], rollout)
    return {"actor": PlacementSlice(pg, order[:num_actor]), "rollout": PlacementSlice(pg, rollout)}


def _sorted_bundles(pg: PlacementGroup, total: int, use_cuda: bool) -> list[int]:
    if not use_cuda:
        return list(range(total))
    probes = [
        _BundleProbe.options(
            num_gpus=0.01,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(total)
    ]
    where = ray.get([p.where.remote() for p in probes])
    for p in probes:
        ray.kill(p)
    return sorted(range(total), key=lambda i: where[i])
