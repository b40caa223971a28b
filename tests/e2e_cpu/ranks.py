"""Start N rank processes of a worker script over a real gloo process group and read rank 0's result.

A failed rank (the others would wait on a collective) or a hang past the timeout kills them all; the
test fails with the tail of every rank's log."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from slime.utils.net import free_port
from tests.conftest import REPO_ROOT


def worker_parser() -> argparse.ArgumentParser:
    """The flags `run_ranks` passes to every worker (plus --model, the HF folder all workers train)."""
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    return p


def write_result(cli: argparse.Namespace, result: dict) -> None:
    """Rank 0 writes the worker's `result` where `run_ranks` reads it; other ranks write nothing."""
    if cli.rank == 0:
        with open(os.path.join(cli.out, "result.json"), "w") as f:
            json.dump(result, f)


def run_ranks(worker: str, world_size: int, out_dir: str, extra: list[str], timeout_s: float = 240) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    procs = []
    gpus = torch.cuda.device_count()
    try:
        for rank in range(world_size):
            if gpus >= world_size:  # one GPU per rank, as Ray gives each training actor
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            cmd = [sys.executable, worker, "--world-size", str(world_size), "--rank", str(rank), "--port", str(port),
                   "--out", out_dir, *extra]
            with open(os.path.join(out_dir, f"rank{rank}.log"), "w") as log:  # the child keeps its own handle
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.log")) as f:
                tails.append(f"--- rank {rank} (rc {procs[rank].returncode}) ---\n" + f.read()[-4000:])
        pytest.fail(f"{os.path.basename(worker)} failed:\n" + "\n".join(tails))
    with open(os.path.join(out_dir, "result.json")) as f:
        return json.load(f)
