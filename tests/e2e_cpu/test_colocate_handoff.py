"""train.py --colocate on CPU: the memory handoff runs in slime's order around every step (slime/ray/handoff.py).

On CPU nothing moves by default (there is no device memory to free), but every call is made: the engines release
all their memory after generating and take weights, then KV cache back around each push (SGLang's calls, which the
`hf` engine serves); the trainer offloads all but its weights before the push, its weights after it, and onloads
before training. The order is read from
the driver's log, and the engines' log-probs must still equal the trainer's after every push. Every step logs the
figures of the trainer's three moves (`perf/actor_<move>_moved_gb`; 0 GB on CPU, where nothing moves).

The `freed` case runs the engines as on CUDA (`SLIME_ENGINE_RELEASE_MEMORY_ON_CPU=1`): every release frees their
weights and every resume gives them back uninitialised, so the run only trains if each push is complete (the
engine refuses to generate until it is).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

from slime.utils.tracking import read_scalars
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd
from tests.e2e_cpu.together import result_of, run_together

PUSH = ["trainers offload optimizer state, gradients", "engines resume weights", "trainers offload",
        "engines resume kv_cache, cuda_graph"]
START = ["engines release weights, kv_cache, cuda_graph", *PUSH]
STEP = ["engines release weights, kv_cache, cuda_graph", "trainers onload", *PUSH]


N_ROLLOUT = {"resident": 3, "freed": 3, "broadcast": 2}


def _colocated_run(root, tiny_model_dir, toy_data_path, key):
    """One colocated train.py run: `resident` / `freed` one training rank and one engine sharing its bundle (the
    engine's memory kept or freed on release), `broadcast` two engines for one rank (freed). Returns the driver's
    output, the TensorBoard folder and the engines' log folder."""
    n = N_ROLLOUT[key]
    tmp_path = root / key
    tmp_path.mkdir()
    tb = tmp_path / "tb"
    engines = ["--rollout-num-gpus", "2"] if key == "broadcast" else []
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--actor-num-gpus-per-node", "1", "--colocate", *engines,
                     "--global-batch-size", "16", "--num-rollout", str(n), "--rm-type", "toy",
                     "--use-tensorboard", "--tensorboard-dir", str(tb))
    logs = tmp_path / "engine_logs"
    env = dict(_env(), SLIME_ENGINE_LOG_DIR=str(logs),
               SLIME_ENGINE_RELEASE_MEMORY_ON_CPU="0" if key == "resident" else "1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out, tb, logs


@pytest.fixture(scope="module")
def colocated_runs(tiny_model_dir, toy_data_path, tmp_path_factory) -> dict:
    """The module's three runs, two at a time (tests/e2e_cpu/together.py); each test checks its own run."""
    root = tmp_path_factory.mktemp("colocate")
    return run_together(lambda key: _colocated_run(root, tiny_model_dir, toy_data_path, key), N_ROLLOUT)


@pytest.mark.timeout(1500)  # the module fixture's runs count against the first test
@pytest.mark.parametrize("engine_memory", ["resident", "freed"])
def test_colocated_run_hands_memory_over_in_slimes_order(colocated_runs, engine_memory):
    n = N_ROLLOUT[engine_memory]
    out, tb, logs = result_of(colocated_runs, engine_memory)
    calls = re.findall(r"memory handoff: (.+)", out)
    assert calls == START + STEP * n, calls
    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == list(range(n)) and max(diffs.values()) < 1e-3, diffs  # every push reached the engine
    handoff = read_scalars(str(tb), "perf/handoff_time")
    assert sorted(handoff) == list(range(n)) and all(v >= 0 for v in handoff.values())
    for move in ("onload", "offload_state", "offload"):  # onload, all but the weights before the push, the rest
        moved = read_scalars(str(tb), f"perf/actor_{move}_moved_gb")
        assert moved == {k: 0.0 for k in range(n)}, (move, moved)
    engine_log = "".join(open(f, errors="replace").read() for f in glob.glob(os.path.join(logs, "hf-engine-*.log")))
    freed = [float(gb) for gb in re.findall(r"memory: released .*\(weights \w+: ([\d.]+) GB freed\)", engine_log)]
    assert len(freed) == 1 + n, engine_log[-4000:]  # start-up and every step
    assert all(gb > 0 for gb in freed) if engine_memory == "freed" else all(gb == 0 for gb in freed), freed


@pytest.mark.timeout(1500)  # the module fixture's runs count against the first test
def test_colocated_engines_past_the_actors_devices_get_the_weights_by_broadcast(colocated_runs):
    """--colocate --rollout-num-gpus 2 with one training rank (slime's sizing: two bundles, the engines on both):
    engine 0 shares the rank's bundle and takes handles, engine 1 has its own and takes a gloo broadcast. Its
    engines free their weights on release, as on CUDA, so each must get every push to serve the next rollout."""
    n = N_ROLLOUT["broadcast"]
    out, tb, logs = result_of(colocated_runs, "broadcast")
    assert "the engines sit on the actor's 1 GPUs and 1 more of their own" in out
    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == list(range(n)) and max(diffs.values()) < 1e-3, diffs  # every push reached both engines
    engine_logs = sorted(glob.glob(os.path.join(logs, "hf-engine-*.log")))
    assert len(engine_logs) == 2, engine_logs
    for path in engine_logs:  # each engine freed its weights at start-up and every step, and served requests
        text = open(path, errors="replace").read()
        assert len(re.findall(r"memory: released .*\(weights \w+: ([\d.]+) GB freed\)", text)) == 1 + n, text[-3000:]
