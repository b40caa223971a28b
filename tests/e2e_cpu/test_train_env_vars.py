"""--train-env-vars reaches every training rank's environment (real Ray, the fsdp backend's rank actors)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from slime.ray.actor_group import RayTrainGroup
from slime.ray.placement_group import PlacementSlice
from tests.args import make_args


def _environment(rank_actor, names):
    return ray.get(rank_actor.__ray_call__.remote(lambda self: {n: os.environ.get(n) for n in names}))


@pytest.mark.timeout(120)
def test_every_rank_gets_the_train_env_vars():
    args = make_args("--actor-num-gpus-per-node", "2", "--train-env-vars",
                     '{"SLIME_TEST_ENV_A": "x y", "SLIME_TEST_ENV_B": 3}')  # fmt: skip
    assert "SLIME_TEST_ENV_A" not in os.environ
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = None
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    try:
        ray.get(pg.ready())
        group = RayTrainGroup(args, PlacementSlice(pg, [0, 1]), role="actor")
        names = ["SLIME_TEST_ENV_A", "SLIME_TEST_ENV_B"]
        assert [_environment(a, names) for a in group.actors] == [{"SLIME_TEST_ENV_A": "x y",
                                                                   "SLIME_TEST_ENV_B": "3"}] * 2
        group.shutdown()  # its ranks hold the bundles' CPUs
        group = RayTrainGroup(make_args("--actor-num-gpus-per-node", "1"), PlacementSlice(pg, [0]), role="actor")
        assert _environment(group.actors[0], names) == {"SLIME_TEST_ENV_A": None, "SLIME_TEST_ENV_B": None}
    finally:
        if group is not None:
            group.shutdown()
        remove_placement_group(pg)
        ray.shutdown()
