"""A frozen vision tower (`--freeze-params-name-list visual.`) goes to the engine in the run's first push only
(slime/weight_sync/frozen.py): the second push announces no tower tensor and fewer bytes, yet afterwards the
engine's tower equals the trainer's (per-tensor checksums), every other tensor too, and the engine's log-probs of
rows with images equal the trainer's. One and two gloo ranks, a real hf engine (tests/e2e_cpu/fsdp_vision_frozen_worker.py).
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "fsdp_vision_frozen_worker.py")
TOL = 1e-5


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def run(request, tmp_path_factory):
    """One rank, and two (FSDP shards: every rank gathers each pushed tensor, so all leave out the same ones)."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_vision_frozen")
    vlm = make_tiny_model(str(root / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    return run_ranks(WORKER, request.param, str(root / "w"), ["--model", vlm], timeout_s=300)


@pytest.mark.timeout(400)
def test_the_frozen_tower_goes_in_the_first_push_only(run):
    first, second = run["pushes"]
    tower = {n for n in first["names"] if "visual." in n}
    assert tower and not any("visual." in n for n in run["trainable"])
    # pushed as the checkpoint spells them (what SGLang loads), not as transformers names them in memory
    assert all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "visual.", "lm_head."))
               for n in first["names"]), sorted(first["names"])[:5]
    assert not any("visual." in n for n in second["names"])
    assert set(second["names"]) == set(first["names"]) - tower  # the rest still goes, every push
    assert second["bytes"] < first["bytes"]


@pytest.mark.timeout(400)
def test_the_engine_holds_the_trainers_weights_after_the_pushes(run):
    engine, trainer = run["engine_checksums"], run["trainer_checksums"]
    shared = set(engine) & set(trainer)
    tower = {n for n in shared if "visual." in n}
    assert tower and len(shared) >= len(engine) - 1  # names match (the engine may hold a derived extra)
    assert {n: engine[n] for n in shared} == {n: trainer[n] for n in shared}
    # the tower did not train: what the engine kept from the first push is still the trainer's
    assert {n: trainer[n] for n in tower} == {n: run["tower_at_start"][n] for n in tower}
    pairs = [(a, b) for ra, rb in zip(run["engine_lp"], run["trainer_lp"]) for a, b in zip(ra, rb)]
    assert pairs and max(abs(a - b) for a, b in pairs) < TOL
