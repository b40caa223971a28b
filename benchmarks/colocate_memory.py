"""The colocated memory handoff on one GPU: the same job with and without it, memory per phase (GPU).

    python benchmarks/colocate_memory.py [--shape qwen3-4b] [--rollout sglang|hf] [--backend megatron|fsdp]
        [--prompts 16] [--prompt-len 64] [--response-len 256] [--steps 3] [--sglang-mem-fraction 0.6]
        [--modes handoff,resident]

Each mode is one `train.py --colocate` run of benchmarks/grpo_step.py's job (a random-init model of the shape, its
prompts of exactly `--prompt-len` tokens, 8 samples each, fixed-length responses, its reward): `handoff` with the
defaults (`--colocate` turns on `--offload-rollout` and `--offload-train`, docs/colocate.md), `resident` with
`--no-offload-rollout --no-offload-train`. Sized so that the trainer's state and the engine's pool do not fit
together but each fits alone (e.g. the 4B shape: ~64 GB of Megatron bf16 + fp32 Adam state, and SGLang's static
pool at `--sglang-mem-fraction 0.6` of the GPU), the resident run is expected to fail (its error line is shown).

While a run goes, the device's used memory (all processes: `torch.cuda.mem_get_info`) is polled every 0.1 s; the
driver's `memory handoff: ...` log lines (logged as each phase begins) give the timeline: the device's GB when
each phase began, i.e. what the previous phase left. Per mode the table shows, for each step, the step seconds,
the handoff seconds and their ratio to the step, the trainer's offload / onload seconds and the actor's allocated
GB after offload (`perf/*` of its TensorBoard).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH_DIR)

MODES = {"handoff": [], "resident": ["--no-offload-rollout", "--no-offload-train"]}
PHASE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*memory handoff: (.+)$")
PERF = ("step_time", "handoff_time", "train_offload_time", "train_onload_time", "actor_offload_allocated_gb")


class DeviceUsage:
    """(wall clock, used bytes of the whole device) every `interval` seconds, in a thread."""

    def __init__(self, interval: float = 0.1):
        import torch

        self._torch, self.interval, self.samples = torch, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            free, total = self._torch.cuda.mem_get_info()
            self.samples.append((time.time(), total - free))

    def at(self, t: float) -> float:
        """GB used at the first sample at or after `t` (the last one if none)."""
        for when, used in self.samples:
            if when >= t:
                return used / 1e9
        return self.samples[-1][1] / 1e9 if self.samples else float("nan")

    def __enter__(self) -> DeviceUsage:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_mode(args, mode: str, model_dir: str, data: str, workdir: str) -> dict:
    from grpo_step import slime_command

    from slime.utils.tracking import read_scalars

    tb = os.path.join(workdir, f"{mode}_tb")
    log_path = os.path.join(workdir, f"{mode}.log")
    cmd = [*slime_command(args, model_dir, data, tb, args.backend, args.rollout), *MODES[mode]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               SLIME_ENGINE_LOG_DIR=os.path.join(workdir, f"{mode}_engine_logs"))
    print(f"[{mode}] train.py --colocate {' '.join(MODES[mode])} (log: {log_path})", flush=True)
    with DeviceUsage() as usage, open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir).returncode
    with open(log_path, errors="replace") as f:
        text = f.read()
    timeline = []
    for line in text.splitlines():
        m = PHASE_LINE.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            timeline.append((m.group(2), usage.at(when)))
    errors = [line for line in text.splitlines() if "OutOfMemory" in line or "out of memory" in line.lower()]
    perf = {name: read_scalars(tb, f"perf/{name}") if os.path.isdir(tb) else {} for name in PERF}
    peak = max((used for _, used in usage.samples), default=0) / 1e9
    return {"rc": rc, "timeline": timeline, "perf": perf, "peak_gb": peak,
            "error": errors[-1] if errors else (text.strip().splitlines() or [""])[-1] if rc else ""}


def report(mode: str, r: dict) -> str:
    lines = [f"## {mode}: exit {r['rc']}, device peak {r['peak_gb']:.1f} GB" + (f"; {r['error'][:300]}" if r["rc"]
                                                                              else "")]
    steps = sorted(r["perf"]["step_time"])
    if steps:
        lines += ["| step | step s | handoff s | handoff / step | offload s | onload s | actor GB after offload |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in steps:
            p = {name: r["perf"][name].get(k, float("nan")) for name in PERF}
            lines.append(f"| {k} | {p['step_time']:.2f} | {p['handoff_time']:.2f} | "
                         f"{p['handoff_time'] / p['step_time']:.1%} | {p['train_offload_time']:.2f} | "
                         f"{p['train_onload_time']:.2f} | {p['actor_offload_allocated_gb']:.2f} |")
    if r["timeline"]:
        lines += ["", "| phase (as it began) | device GB |", "| --- | ---: |"]
        lines += [f"| {phase} | {gb:.1f} |" for phase, gb in r["timeline"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--rollout", default="sglang", choices=["sglang", "hf"])
    p.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.6)
    p.add_argument("--sglang-attention-backend", default="triton")
    p.add_argument("--modes", default="handoff,resident")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/colocate_memory.py needs CUDA")
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    from grpo_step import job_inputs

    with tempfile.TemporaryDirectory() as workdir:
        model_dir, data = job_inputs(args, workdir)
        results = {mode: run_mode(args, mode, model_dir, data, workdir) for mode in modes}
    print(f"{args.shape}, {args.backend} + {args.rollout} colocated on {torch.cuda.get_device_name()}, "
          f"{args.prompts} prompts x 8 samples x {args.response_len} tokens")
    for mode, r in results.items():
        print(report(mode, r))


if __name__ == "__main__":
    main()
