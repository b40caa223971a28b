"""The colocated memory handoff on one GPU: the same job with and without it, memory per phase (GPU).

    python benchmarks/colocate_memory.py [--shape qwen3-4b] [--rollouts sglang,hf] [--backend megatron|fsdp]
        [--prompts 32] [--prompt-len 64] [--response-len 1024] [--steps 10] [--sglang-mem-fraction 0.6]
        [--modes handoff,resident] [--engine-weights-cpu-backup] [--growth-tolerance-gb 1.0] [--keep-logs DIR]
        [--train-args "--max-tokens-per-gpu 8704 ..."]

    # the trainer's memory over 10 push / offload cycles in a few minutes (the memory per cycle does not depend on
    # the number of samples): 4 prompts x 8 samples x 128 tokens
    python benchmarks/colocate_memory.py --rollouts sglang --modes handoff --prompts 4 --response-len 128

Each mode is one `train.py --colocate` run of benchmarks/grpo_step.py's job (a random-init model of the shape, its
prompts of exactly `--prompt-len` tokens, 8 samples each, fixed-length responses, its reward), per rollout
backend: `handoff` with the defaults (`--colocate` turns on `--offload-rollout` and `--offload-train`,
docs/colocate.md), `resident` with `--no-offload-rollout --no-offload-train`. Sized so that the trainer's state and
the engine do not fit together but each fits alone (e.g. the 4B shape: ~60 GB of Megatron bf16 + fp32 Adam state,
and SGLang's static pool at `--sglang-mem-fraction 0.6` of the GPU; the `hf` engine's KV slots grow with the
batch: 256 rows x 1088 tokens of the 4B shape are ~40 GB), the resident run is expected to fail (its error line
is shown).

While a run goes, this script polls every 0.25 s the device's used memory (all processes:
`torch.cuda.mem_get_info`) and nvidia-smi's per-process memory, split into trainer and engine processes. Before
the runs it prints what a bare CUDA process holds (nvidia-smi's GB for a process that set up CUDA and ran one
cuBLAS matmul): the floor under which no released engine or offloaded trainer can go. The
driver's `memory handoff: ...` log lines (logged as each phase begins) cut the run into phases; per phase the
table shows what it left (the first sample taken after it ended: exact for the side that ran the phase, while the
next phase may have begun on the other side), the trainer's peak and the device's peak during it. A trainer offload
hands its reserve back only at its very end (one `empty_cache`), so the trainer's peak in an offload phase is what
it held before (its training state and the allocator's cache left by training). Per step: the step seconds, the
handoff seconds and their ratio to the step, the engines' release / resume seconds and the trainer's offload /
onload seconds as the driver timed them (Ray and HTTP included), the actor's allocated GB after offload (`perf/*` of
its TensorBoard, torch's own count). For the `hf` engine also each release / resume as the engine itself timed it
(its log's `memory: released ...` / `memory: resumed ...` lines): the seconds inside the server and the GB of
weights freed or allocated.

The trainer's memory table is the actor's rank 0 after each of its moves, measured inside the actor
(`perf/actor_<move>_*`, docs/colocate.md): torch's allocated and reserved GB, the process's GB as nvidia-smi
reports it and the device's used GB (all processes), per step. The trainer must stay flat: for each move, its
memory at the last step (nvidia-smi's figure, or torch's reserve where nvidia-smi does not list the process) may
exceed that at the second step (rollout 1, the first whose onload brings back the optimizer state that rollout 0's
first optimizer step created) by at most `--growth-tolerance-gb`; else the script prints FAIL and exits with 1.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH_DIR)

from grpo_step import MemoryPeak  # noqa: E402 (benchmarks/ on the path first)

MODES = {"handoff": [], "resident": ["--no-offload-rollout", "--no-offload-train"]}
PHASE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*memory handoff: (.+)$")
PERF = ("step_time", "handoff_time", "engine_release_time", "engine_resume_time", "train_offload_time",
        "train_onload_time", "actor_offload_allocated_gb", "rollout_time", "train_time", "update_weights_time",
        "actor_peak_gpu_gb")
# the trainer's moves (slime/ray/handoff.py) and the figures measured after each (offload.py's memory_gb)
MOVES = {"onload": "onload", "offload_state": "offload all but weights", "offload": "offload"}
FIGURES = {"allocated_gb": "alloc", "reserved_gb": "reserved", "process_gb": "process", "device_gb": "device"}
MEMORY = tuple(f"actor_{move}_{figure}" for move in MOVES for figure in FIGURES)
# the hf engine's own log line per release / resume (slime/backends/hf_engine/server.py)
ENGINE_MEMORY_LINE = re.compile(r"memory: (released|resumed) \[(.*?)\] in ([\d.]+) s \(weights (\w+): ([\d.]+) GB")


class DeviceUsage(MemoryPeak):
    """Every `interval` seconds, in a thread: the device's used bytes (all processes, `torch.cuda.mem_get_info`)
    and each process's share as nvidia-smi reports it, split into the engine's processes (an SGLang or `hf`
    server, or its engine actor, among its ancestors), the trainer's (a training Ray actor) and the rest (this
    script, Ray itself; also every process when nvidia-smi lists none, e.g. in a PID namespace)."""

    def __init__(self, interval: float = 0.25):
        super().__init__(interval)
        self.samples: list[tuple[float, float, dict[str, float]]] = []  # (wall clock, device GB, {side: GB})
        self._sides: dict[int, str] = {}

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            when = time.time()  # before both readings: a sample stamped after a phase ended was read after it
            used = self._used()
            self.peak = max(self.peak, used)
            self.samples.append((when, used / 1e9, self._per_side()))

    def _per_side(self) -> dict[str, float]:
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                  "nounits"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        sides: dict[str, float] = {}
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().isdigit():
                side = self._side(int(pid))
                sides[side] = sides.get(side, 0.0) + int(mib) * 2**20 / 1e9
        return sides

    def _side(self, pid: int) -> str:
        if pid not in self._sides:
            side, p = "other", pid
            while p > 1:
                cmd = _cmdline(p)
                if "sglang" in cmd or "hf_engine" in cmd or cmd.startswith(("ray::HFEngine", "ray::SGLangEngine")):
                    side = "engine"
                    break
                if cmd.startswith("ray::") and "RayActor" in cmd:  # MegatronTrainRayActor, FSDPCriticRayActor
                    side = "trainer"
                    break
                p = _parent(p)
            self._sides[pid] = side
        return self._sides[pid]

    def window(self, start: float, end: float) -> tuple[tuple[float, dict[str, float]], float, float, float]:
        return phase_window(self.samples, start, end)


def phase_window(samples: list[tuple[float, float, dict[str, float]]], start: float, end: float
                 ) -> tuple[tuple[float, dict[str, float]], float, float, float]:
    """What a phase over [start, end) left: the first of `samples` (wall clock, device GB, {side: GB}) taken after
    `end` ((device GB, {side: GB}); the last one when the run ended first), then the device's, the trainer's and the
    engine's peak GB in the phase (a phase shorter than the polling interval: those of the sample after it)."""
    if not samples:
        return (float("nan"), {}), float("nan"), float("nan"), float("nan")
    after = next((sample for sample in samples if sample[0] >= end), samples[-1])
    inside = [sample for sample in samples if start <= sample[0] < end] or [after]
    return (after[1:], max(used for _, used, _ in inside),
            *(max(sides.get(side, 0.0) for _, _, sides in inside) for side in ("trainer", "engine")))


# a process that only sets up CUDA and cuBLAS, then waits for its stdin to close
BARE_PROCESS = ("import sys, torch; a = torch.ones(256, 256, device='cuda'); (a @ a).sum().item(); "
                "print('ready', flush=True); sys.stdin.read()")


def bare_process_gb(timeout: float = 120.0) -> float:
    """nvidia-smi's GB for a Python process that set up CUDA and ran one cuBLAS matmul: the CUDA context and the
    libraries' handles, which a process keeps until it exits, so no release or offload gives them back. nan when
    nvidia-smi does not list the process (e.g. in a PID namespace)."""
    proc = subprocess.Popen([sys.executable, "-c", BARE_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            return float("nan")
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                  "nounits"], capture_output=True, text=True, timeout=10).stdout
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip() == str(proc.pid) and mib.strip().isdigit():
                    return int(mib) * 2**20 / 1e9
            time.sleep(0.5)
        return float("nan")
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 1


def engine_memory_calls(paths: list[str]) -> list[dict]:
    """Every release / resume the hf engine logs `paths` hold, in order: what, the tags, the server's seconds, the
    weights' mode and GB freed or allocated. SGLang logs no such line: []."""
    calls = []
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = ENGINE_MEMORY_LINE.search(line)
                if m:
                    tags = [t.strip(" '\"") for t in m.group(2).split(",") if t.strip()]
                    calls.append({"call": m.group(1), "tags": tags, "seconds": float(m.group(3)),
                                  "weights": m.group(4), "gb": float(m.group(5))})
    return calls


def engine_memory_table(calls: list[dict]) -> list[str]:
    """The hf engine's own seconds per kind of call (release of everything, resume of the weights, of the rest)."""
    if not calls:
        return []
    lines = ["", f"hf engine's own timing (weights: {calls[0]['weights']}), per call:", "",
             "| call | tags | count | mean s | max s | GB of weights |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    kinds: dict[tuple[str, str], list[dict]] = {}
    for c in calls:
        kinds.setdefault((c["call"], ", ".join(c["tags"])), []).append(c)
    for (call, tags), group in kinds.items():
        seconds = [c["seconds"] for c in group]
        lines.append(f"| {call} | {tags} | {len(group)} | {sum(seconds) / len(seconds):.3f} | {max(seconds):.3f} | "
                     f"{max(c['gb'] for c in group):.2f} |")
    return lines


def run_mode(args, rollout: str, mode: str, model_dir: str, data: str, workdir: str,
             extra_flags: tuple[str, ...] = ()) -> dict:
    """One train.py run of the job (`extra_flags` appended to its command, e.g. LoRA's: tests/gpu/
    test_lora_colocate_gpu.py); its exit status, phases with their memory, `perf/*` figures and engine calls."""
    from grpo_step import slime_command

    from slime.utils.tracking import read_scalars

    name = f"{rollout}_{mode}"
    tb = os.path.join(workdir, f"{name}_tb")
    log_path = os.path.join(workdir, f"{name}.log")
    extra = [*MODES[mode], *(["--sglang-enable-weights-cpu-backup"] if args.engine_weights_cpu_backup else []),
             *shlex.split(args.train_args), *extra_flags]
    cmd = [*slime_command(args, model_dir, data, tb, args.backend, rollout), *extra]
    engine_logs = os.path.join(workdir, f"{name}_engine_logs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               SLIME_ENGINE_LOG_DIR=engine_logs)
    print(f"[{name}] train.py --colocate --rollout-backend {rollout} {' '.join(extra)} (log: {log_path})",
          flush=True)
    with DeviceUsage() as usage, open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir).returncode
        ended = time.time()
    if args.keep_logs:
        shutil.copy(log_path, os.path.join(args.keep_logs, f"colocate_{name}.log"))
    with open(log_path, errors="replace") as f:
        text = f.read()
    began = []
    for line in text.splitlines():
        m = PHASE_LINE.match(line)
        if m:
            began.append((m.group(2), datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()))
    timeline = [(phase, *usage.window(t, began[i + 1][1] if i + 1 < len(began) else ended))
                for i, (phase, t) in enumerate(began)]
    errors = [line for line in text.splitlines() if "OutOfMemory" in line or "out of memory" in line.lower()]
    perf = {key: read_scalars(tb, f"perf/{key}") if os.path.isdir(tb) else {} for key in (*PERF, *MEMORY)}
    peak = max((used for _, used, _ in usage.samples), default=0.0)
    engine = engine_memory_calls(sorted(glob.glob(os.path.join(engine_logs, "*.log"))))
    return {"rc": rc, "timeline": timeline, "perf": perf, "peak_gb": peak, "engine": engine,
            "error": errors[-1] if errors else (text.strip().splitlines() or [""])[-1] if rc else ""}


# what runs after each logged phase, until the next one
AFTER = {"trainers onload": " (then train, save)", "engines resume kv_cache, cuda_graph": " (then generate)",
         "engines resume weights": " (then push)"}


def report(name: str, r: dict) -> str:
    lines = [f"## {name}: exit {r['rc']}, device peak {r['peak_gb']:.1f} GB"
             + (f"; {r['error'][:300]}" if r["rc"] else "")]
    steps = sorted(r["perf"]["step_time"])
    if steps:
        lines += ["| step | step s | handoff s | handoff / step | engine release s | engine resume s | offload s | "
                  "onload s | actor GB after offload | rollout s | train s | push s | trainer allocator peak GiB |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in steps:
            p = {key: r["perf"][key].get(k, float("nan")) for key in PERF}
            lines.append(f"| {k} | {p['step_time']:.2f} | {p['handoff_time']:.2f} | "
                         f"{p['handoff_time'] / p['step_time']:.1%} | {p['engine_release_time']:.2f} | "
                         f"{p['engine_resume_time']:.2f} | {p['train_offload_time']:.2f} | "
                         f"{p['train_onload_time']:.2f} | {p['actor_offload_allocated_gb']:.2f} | "
                         f"{p['rollout_time']:.2f} | {p['train_time']:.2f} | {p['update_weights_time']:.2f} | "
                         f"{p['actor_peak_gpu_gb']:.1f} |")
    if any(r["perf"][key] for key in MEMORY):
        lines += ["", trainer_memory_table(r["perf"])]
    if r["timeline"]:
        lines += ["", "| phase | device GB after | trainer GB after | engine GB after | trainer peak GB in phase | "
                  "engine peak GB in phase | device peak GB in phase |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for phase, (used, sides), peak, trainer_peak, engine_peak in r["timeline"]:
            lines.append(f"| {phase}{AFTER.get(phase, '')} | {used:.1f} | {sides.get('trainer', 0.0):.1f} | "
                         f"{sides.get('engine', 0.0):.1f} | {trainer_peak:.1f} | {engine_peak:.1f} | {peak:.1f} |")
    lines += engine_memory_table(r.get("engine", []))
    return "\n".join(lines)


def trainer_memory_table(perf: dict[str, dict[int, float]]) -> str:
    """The actor's rank 0 after each move, per step: one column per move, `alloc / reserved / process / device` GB
    (`-` where a figure was not logged)."""
    steps = sorted(set().union(*(perf.get(key, {}) for key in MEMORY)))
    head = " / ".join(FIGURES.values())
    lines = ["| step | " + " | ".join(f"after {what}: {head} GB" for what in MOVES.values()) + " |",
             "| ---: |" + " ---: |" * len(MOVES)]
    for k in steps:
        cells = [" / ".join(_gb(perf.get(f"actor_{move}_{figure}", {}).get(k)) for figure in FIGURES)
                 for move in MOVES]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def memory_growth(perf: dict[str, dict[int, float]], tolerance_gb: float) -> list[tuple[bool, str]]:
    """(passed, line) per move: the trainer's memory after the move (nvidia-smi's figure of the process, else torch's
    reserve) at the last step against the second step (rollout 1); with the device's used GB (all processes, the
    engine's too) on the same line, for information. Fails when it grew by more than `tolerance_gb`, or when fewer
    than 3 steps logged it (there is nothing to compare)."""
    out = []
    for move, what in MOVES.items():
        figure = "process_gb" if perf.get(f"actor_{move}_process_gb") else "reserved_gb"
        values = perf.get(f"actor_{move}_{figure}", {})
        steps = sorted(values)
        if len(steps) < 3:
            out.append((False, f"FAIL: trainer memory after {what}: {len(steps)} step(s) logged "
                               f"perf/actor_{move}_{figure}; at least 3 are needed to compare step 2 with the last"))
            continue
        first, last = steps[1], steps[-1]
        growth = values[last] - values[first]
        device = perf.get(f"actor_{move}_device_gb", {})
        extra = (f"; device (all processes) {device[first]:.2f} -> {device[last]:.2f} GB"
                 if first in device and last in device else "")
        ok = growth <= tolerance_gb
        out.append((ok, f"{'PASS' if ok else 'FAIL'}: trainer memory after {what} ({figure}) {values[first]:.2f} GB "
                        f"at rollout {first} -> {values[last]:.2f} GB at rollout {last}: {growth:+.2f} GB "
                        f"(tolerance {tolerance_gb} GB){extra}"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--rollouts", default="sglang", help="comma list of rollout backends: sglang, hf")
    p.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    # 4 x 1088 tokens per micro-batch: at 16 the 4B shape's training alone (state, activations, fp32 logits) asked
    # for more than the H200's 141 GB (measured)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.6)
    p.add_argument("--sglang-attention-backend", default="triton")
    p.add_argument("--modes", default="handoff,resident")
    p.add_argument("--engine-weights-cpu-backup", action="store_true",
                   help="pass --sglang-enable-weights-cpu-backup: released engine weights are copied to host memory "
                        "and back instead of freed (and pushed again)")
    p.add_argument("--keep-logs", default="", help="a folder to copy each run's train.py log into")
    p.add_argument("--train-args", default="",
                   help="more train.py flags, one shell-quoted string appended to each run's command (e.g. "
                        "\"--max-tokens-per-gpu 8704\"); later flags win")
    p.add_argument("--growth-tolerance-gb", type=float, default=1.0,
                   help="how much the trainer's memory after a move may grow from the second step to the last")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/colocate_memory.py needs CUDA")
    modes, rollouts = args.modes.split(","), args.rollouts.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if unknown := [r for r in rollouts if r not in ("sglang", "hf")]:
        sys.exit(f"--rollouts: unknown {unknown}; choose from sglang, hf")
    from grpo_step import job_inputs

    failed = False
    print(f"bare CUDA process: {bare_process_gb():.2f} GB (nvidia-smi: a process that set up CUDA and ran one "
          "cuBLAS matmul; no release or offload gives this back)", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        model_dir, data = job_inputs(args, workdir)
        for rollout in rollouts:
            for mode in modes:
                r = run_mode(args, rollout, mode, model_dir, data, workdir)
                print(f"{args.shape}, {args.backend} + {rollout} colocated on {torch.cuda.get_device_name()}, "
                      f"{args.prompts} prompts x 8 samples x {args.response_len} tokens", flush=True)
                print(report(f"{rollout}, {mode}", r), flush=True)
                if mode == "handoff":  # the resident run moves nothing
                    for ok, line in memory_growth(r["perf"], args.growth_tolerance_gb):
                        print(line, flush=True)
                        failed |= not ok
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
