"""benchmarks/colocate_memory.py's pure parts on CPU: its per-step table of the trainer's memory after each move, its
check that the trainer stays flat from the second step to the last, and how it cuts its samples into phases."""

from __future__ import annotations

import importlib.util
import os

from tests.conftest import REPO_ROOT


def _benchmark():
    spec = importlib.util.spec_from_file_location("colocate_memory",
                                                  os.path.join(REPO_ROOT, "benchmarks", "colocate_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _perf(bench, after_state: list[float], process: bool = True) -> dict[str, dict[int, float]]:
    perf = {key: {} for key in (*bench.PERF, *bench.MEMORY)}
    for k, gb in enumerate(after_state):
        perf["actor_onload_reserved_gb"][k] = 64.5
        perf["actor_offload_state_reserved_gb"][k] = gb - 1.0
        perf["actor_offload_state_device_gb"][k] = gb + 2.0
        perf["actor_offload_reserved_gb"][k] = 0.1
        if process:
            perf["actor_onload_process_gb"][k] = 65.5
            perf["actor_offload_state_process_gb"][k] = gb
            perf["actor_offload_process_gb"][k] = 1.1
    return perf


def test_the_benchmark_fails_a_trainer_that_grows_from_step_2_to_the_last():
    bench = _benchmark()
    # the step-0 value (before the optimizer state exists) is not the baseline; step 2 (rollout 1) is
    flat = bench.memory_growth(_perf(bench, [31.0, 9.0, 9.2, 9.1, 9.5]), tolerance_gb=1.0)
    assert [ok for ok, _ in flat] == [True, True, True], flat
    assert "9.00 GB at rollout 1 -> 9.50 GB at rollout 4: +0.50 GB" in flat[1][1]
    assert "device (all processes) 11.00 -> 11.50 GB" in flat[1][1]
    growing = bench.memory_growth(_perf(bench, [31.0, 9.0, 49.0, 89.0]), tolerance_gb=1.0)
    assert [ok for ok, _ in growing] == [True, False, True] and growing[1][1].startswith("FAIL"), growing
    # where nvidia-smi does not list the process, torch's reserve is judged
    no_smi = bench.memory_growth(_perf(bench, [31.0, 9.0, 49.0], process=False), tolerance_gb=1.0)
    assert [ok for ok, _ in no_smi] == [True, False, True] and "(reserved_gb) 8.00 GB" in no_smi[1][1], no_smi
    short = bench.memory_growth(_perf(bench, [31.0, 9.0]), tolerance_gb=1.0)
    assert not any(ok for ok, _ in short) and "2 step(s) logged" in short[0][1]
    table = bench.trainer_memory_table(_perf(bench, [31.0, 9.0, 9.0], process=False))
    assert table.splitlines()[2] == "| 0 | - / 64.50 / - / - | - / 30.00 / - / 33.00 | - / 0.10 / - / - |"
    assert len(table.splitlines()) == 2 + 3


def test_a_phase_is_read_after_it_ended():
    """An offload phase hands its reserve back at its very end: the sample inside it shows what the trainer held
    before; what it left is the first sample after it ended."""
    bench = _benchmark()
    samples = [(10.0, 112.0, {"trainer": 111.0, "engine": 1.0}),  # the offload phase, [9.5, 11.0)
               (10.6, 112.0, {"trainer": 111.0, "engine": 1.0}),
               (11.2, 10.0, {"trainer": 9.0, "engine": 1.0}),  # the engine's resume has begun
               (11.8, 18.0, {"trainer": 9.0, "engine": 9.0})]
    assert bench.phase_window(samples, 9.5, 11.0) == ((10.0, {"trainer": 9.0, "engine": 1.0}), 112.0, 111.0, 1.0)
    assert bench.phase_window(samples, 11.0, 20.0) == ((18.0, {"trainer": 9.0, "engine": 9.0}), 18.0, 9.0, 9.0)
    # shorter than the interval: the next sample
    assert bench.phase_window(samples, 11.3, 11.4)[1:] == (18.0, 9.0, 9.0)
    nan = bench.phase_window([], 0.0, 1.0)
    assert nan[0][1] == {} and all(x != x for x in (nan[0][0], *nan[1:]))
