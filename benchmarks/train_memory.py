"""`--dry-run`'s training-memory estimate against the peak a real run measures (GPU).

    python benchmarks/train_memory.py [--shape qwen3-0.6b] [--num-rollout 2] [--response-len 256]

Makes a random-init model of the shape (benchmarks/weight_sync.py's helper) and toy prompts, prints the
dry-run plan of a colocated fsdp + hf-engine GRPO run, runs it for `--num-rollout` rollouts, and prints the
estimate next to `perf/actor_peak_gpu_gb` (torch's peak allocation on training rank 0 per rollout).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from slime.utils.tracking import read_scalars  # noqa: E402
from tools.make_toy_data import write_toy_data  # noqa: E402
from weight_sync import make_model_dir  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--num-rollout", type=int, default=2)
    p.add_argument("--response-len", type=int, default=256)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/train_memory.py needs CUDA")
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    with tempfile.TemporaryDirectory() as root:
        model_dir, model = make_model_dir(args.shape, root)
        del model
        torch.cuda.empty_cache()
        data = write_toy_data(os.path.join(root, "toy.jsonl"), num_samples=200, seed=0)
        tb = os.path.join(root, "tb")
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--hf-checkpoint", model_dir, "--prompt-data", data,
               "--input-key", "prompt", "--label-key", "label", "--rm-type", "toy", "--train-backend", "fsdp",
               "--rollout-backend", "hf", "--colocate", "--actor-num-gpus-per-node", "1",
               "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
               "--micro-batch-size", "8", "--rollout-max-response-len", str(args.response_len),
               "--num-rollout", str(args.num_rollout), "--use-tensorboard", "--tensorboard-dir", tb]
        plan = subprocess.run([*cmd, "--dry-run", "--dry-run-gpu-gb", f"{gpu_gb:.0f}"], capture_output=True,
                              text=True, cwd=root)
        print(plan.stdout or plan.stderr)
        estimate = re.search(r"total: ([\d.]+) GB", plan.stdout)
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        if run.returncode != 0:
            sys.exit(f"train.py failed:\n{run.stderr[-4000:]}")
        peaks = read_scalars(tb, "perf/actor_peak_gpu_gb")
    print("| shape | dry-run estimate (GB) | measured peak per rollout (GB, torch allocated, rank 0) |")
    print("| --- | ---: | --- |")
    print(f"| {args.shape} | {estimate.group(1) if estimate else '?'} | "
          f"{', '.join(f'{peaks[k]:.1f}' for k in sorted(peaks))} |")


if __name__ == "__main__":
    main()
