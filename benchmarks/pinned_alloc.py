"""Pinned host memory: how fast each way of making it is and how much host memory it takes (GPU).

    python benchmarks/pinned_alloc.py [--gb 8] [--tensor-mb 100] [--threads 8] [--methods torch,register,...]

The trainer's offload (`--offload-train`, slime/backends/training/offload.py) copies the optimizer state and the
weights into pinned host buffers made on the first offload and kept. A 4B model's first offloads took 52 s in
acceptance row 1 (2026-12-06) against 1.4 s for the later ones: making the buffers, not copying into them. This
allocates `--gb` of host memory as tensors of `--tensor-mb` each (sizes like a model's optimizer shards: not
powers of two), one way per method, each in a fresh process (its own CUDA context, nothing cached):

- `torch`: `torch.empty(..., pin_memory=True)`, torch's caching host allocator (`cudaHostAlloc`);
- `torch-register`: the same with `PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
  pinned_num_register_threads:T` (torch pages the memory in from T threads, then `cudaHostRegister`);
- `register`: a plain host tensor of the exact size, its pages written by `--threads` threads, then
  `cudaHostRegister` (slime/utils/pinned.py, what the offload uses);
- `register-untouched`: the same without the threads (the driver pages the memory in).

Printed per method: seconds to make them all, GB/s, the process's resident host memory after (pinned pages are
resident: torch's allocator rounds each block up to a power of two), and host-to-device GB/s of a copy from one of
them (a pinned source copies at PCIe speed; pageable memory is slower). benchmarks/README.md has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from slime.utils.pinned import pinned_empty  # noqa: E402

METHODS = ("torch", "torch-register", "register", "register-untouched")


def resident_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def make(method: str, nbytes: int, threads: int) -> torch.Tensor:
    if method in ("torch", "torch-register"):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return pinned_empty((nbytes,), torch.uint8, threads=threads if method == "register" else 0)


def measure(method: str, gb: float, tensor_mb: float, threads: int) -> dict:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    nbytes = int(tensor_mb * 2**20)
    count = max(1, int(gb * 1e9 // nbytes))
    before = resident_gb()
    start = time.perf_counter()
    kept = [make(method, nbytes, threads) for _ in range(count)]
    seconds = time.perf_counter() - start
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(kept[0], non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device.copy_(kept[0], non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * nbytes / (time.perf_counter() - start) / 1e9
    return {"method": method, "tensors": count, "gb": count * nbytes / 1e9, "seconds": seconds,
            "resident_gb": resident_gb() - before, "h2d_gb_s": h2d, "pinned": all(t.is_pinned() for t in kept)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=8.0)
    p.add_argument("--tensor-mb", type=float, default=100.0)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child process: measure this method
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.gb, args.tensor_mb, args.threads)))
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        sys.exit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    print(f"{args.gb:g} GB as tensors of {args.tensor_mb:g} MiB, {args.threads} threads; "
          f"{torch.cuda.get_device_name()}")
    print("| method | tensors | GB | seconds | GB/s | resident host GB | pinned | H2D GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for method in methods:
        env = dict(os.environ)
        if method == "torch-register":
            env["PYTORCH_CUDA_ALLOC_CONF"] = (f"pinned_use_cuda_host_register:True,"
                                              f"pinned_num_register_threads:{args.threads}")
        out = subprocess.run([sys.executable, __file__, "--one", method, "--gb", str(args.gb),
                              "--tensor-mb", str(args.tensor_mb), "--threads", str(args.threads)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"| {method} | failed: {out.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {method} | {r['tensors']} | {r['gb']:.2f} | {r['seconds']:.2f} | {r['gb'] / r['seconds']:.2f} | "
              f"{r['resident_gb']:.2f} | {r['pinned']} | {r['h2d_gb_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
