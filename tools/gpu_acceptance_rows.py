"""The rows of the GPU acceptance (docs/gpu_acceptance.md), and how to read each row's figures from its output.

One `Row` per check: its command (a pytest selection of tests/gpu/ run with `-s`, or a benchmark), timeout,
estimated seconds, the part it runs in (each part fits one device call of 10 minutes by the estimates, PART_LIMIT_S),
what it must show, how to read its figures and which conditions on its output make it pass beyond its exit status
(tools/gpu_acceptance.py runs them; its docstring has the status rules). The estimates are guesses from the runs in
docs/ and benchmarks/README.md, cold start included (SGLang ~40 s without CUDA graphs, 1-3 min with them).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

PART_LIMIT_S = 540  # one device call is at most 10 minutes: 9 of rows, and room to stop the last one
# SGLang without CUDA graphs for rows that do not measure speed (its launcher's flag comes before slime's own)
FAST_SGLANG = 'SLIME_SGLANG_LAUNCHER="${SLIME_SGLANG_LAUNCHER:-python3 -m sglang.launch_server} --disable-cuda-graph"'
PYTEST = "python -m pytest -s -rs -p no:cacheprovider"

Figures = dict[str, str]


@dataclass(frozen=True)
class Row:
    """One acceptance check. `figures(output)` reads what the row shows; `check(output)` returns the ways the
    output falls short of `must_show` (empty: it holds), on top of the exit status rules of tools/gpu_acceptance.py."""

    id: int
    name: str
    area: str
    command: str  # bash, from the repository root; $ROW_OUT is the row's own output folder
    timeout_s: int
    estimate_s: int
    part: str
    must_show: str
    kind: str = "pytest"  # "pytest": pytest's outcome rules; "command": its exit status
    gpus: int = 1
    gpu_gb: int = 0  # memory each card needs (GB of 2^30 B, as nvidia-smi's total); 0: any card
    figures: Callable[[str], Figures] = field(default=lambda out: {}, compare=False)
    check: Callable[[str], list[str]] = field(default=lambda out: [], compare=False)


# ---- reading outputs ---------------------------------------------------------------------------------------------


def last(pattern: str, text: str, group: int = 1) -> str | None:
    found = list(re.finditer(pattern, text, re.M))
    return found[-1].group(group).strip() if found else None


def grab(**patterns: str) -> Callable[[str], Figures]:
    """Figures from the last match of each regex (its first group, cut to 160 characters), e.g.
    `grab(loss=r"loss: (.+)")`: the figure "loss"."""

    def read(out: str) -> Figures:
        found = {name.replace("_", " "): last(p, out) for name, p in patterns.items()}
        return {k: v if len(v) <= 160 else v[:157] + "..." for k, v in found.items() if v is not None}

    return read


def merged(*readers: Callable[[str], Figures]) -> Callable[[str], Figures]:
    """The figures of each reader, in order (a row whose command runs a test and then a benchmark)."""
    return lambda out: {k: v for read in readers for k, v in read(out).items()}


def table(text: str, first_cell: str) -> list[list[str]]:
    """Cells of the markdown table rows whose first cell matches `first_cell` (a regex, whole cell)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            cells = [c.strip() for c in line[1:-1].split("|")]
            if re.fullmatch(first_cell, cells[0]):
                rows.append(cells)
    return rows


def number(cell: str) -> float:
    """'1,234.5' / '66.7%' / '2.81x' -> float (nan when not a number)."""
    try:
        return float(cell.replace(",", "").rstrip("%x"))
    except ValueError:
        return float("nan")


def pytest_outcome(out: str) -> tuple[dict[str, int], list[str]]:
    """Counts of pytest's last summary line ({"passed": 2, ...}) and the reasons of `-rs`'s SKIPPED lines."""
    summary = last(r"^=+ (.*\bin [\d.]+s.*?) =+$", out) or ""
    counts: dict[str, int] = {}
    for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", summary):
        key = "error" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    reasons = [m.strip() for m in re.findall(r"^SKIPPED \[\d+\] \S+: (.+)$", out, re.M)]
    return counts, reasons


# ---- colocate_memory.py's report -----------------------------------------------------------------------------------


def colocate_runs(out: str) -> dict[str, dict]:
    """benchmarks/colocate_memory.py's report per run ("sglang, handoff"): train.py's exit, the step table's rows
    (step, step s, handoff s, handoff %, ..., actor GB after offload, rollout s, train s, push s, trainer allocator
    peak GiB; the last four since 2026-12-06), the phase table's rows (phase, device,
    trainer, engine GB after it, ...) and the trainer-memory verdicts it prints after a handoff run
    ({move: (passed, "+0.12 GB")})."""
    runs: dict[str, dict] = {}
    bare = last(r"^bare CUDA process: ([\d.]+|nan) GB", out)
    for m in re.finditer(r"^## (\w+, \w+): exit (-?\d+), device peak ([\d.]+) GB(.*)$", out, re.M):
        body = out[m.end():].split("\n## ", 1)[0]
        steps = [[number(c) for c in cells] for cells in table(body, r"\d+") if len(cells) >= 7]
        phases = [(cells[0], *[number(c) for c in cells[1:]]) for cells in table(body, r"(engines|trainers) .*")]
        verdicts = {v.group(2): (v.group(1) == "PASS", v.group(3)) for v in re.finditer(
            r"^(PASS|FAIL): trainer memory after (.+?) \(.*?: ([+-][\d.]+ GB)", body, re.M)}
        runs[m.group(1)] = {"rc": int(m.group(2)), "peak": float(m.group(3)), "error": m.group(4).lstrip("; "),
                            "steps": steps, "phases": phases, "verdicts": verdicts,
                            "floor": float(bare) if bare and bare != "nan" else 0.0}
    return runs


def freed(phases: list[tuple], side: int, held_in: str, left_in: str, floor: float = 0.0) -> float:
    """Share of one side's GB (`side`: 4 trainer, 5 engine: its peak-in-phase column) freed while the other side
    works: its peak in the phases starting with `held_in` against its peak in those starting with `left_in`, both
    above `floor` (what a bare CUDA process holds: its context and libraries' handles, which no release gives
    back; a side whose peak is small, as the `hf` engine's in a short job, would otherwise be judged on them).
    Peaks, not the samples after a phase: a release or an offload that takes less than the polling interval
    (the `hf` engine releases in ~0.1 s) is over before the sample after the phase before it is read, which then
    shows the side already emptied and the other one already filling."""
    held = [p[side] for p in phases if p[0].startswith(held_in)]
    left = [p[side] for p in phases if p[0].startswith(left_in)]
    if not held or not left or max(held) <= floor:
        return float("nan")
    return 1.0 - max(max(left) - floor, 0.0) / (max(held) - floor)


# the phases (the driver's `memory handoff: ...` lines) in which the engines generate and the trainers train
GENERATING, TRAINING = "engines resume kv_cache", "trainers onload"
# (side, its peak-in-phase column, the phases it works in, those in which the other side works)
SIDES = (("engine", 5, GENERATING, TRAINING), ("trainer", 4, TRAINING, GENERATING))


def handoff_figures(run_name: str) -> Callable[[str], Figures]:
    def read(out: str) -> Figures:
        run = colocate_runs(out).get(run_name)
        if run is None:
            return {}
        steps = run["steps"]
        later = steps[1:] or steps  # the first step pays the pinned allocations and warm-up
        figures = {"exit": str(run["rc"]), "steps": str(len(steps)), "peak GB": f"{run['peak']:.1f}"}
        if later:
            figures.update({"step s": f"{statistics.median(s[1] for s in later):.2f}",
                            "handoff s": f"{statistics.median(s[2] for s in later):.2f}",
                            "handoff/step": f"{statistics.median(s[3] for s in later):.1f}%"})
            if all(len(s) >= 13 for s in later):  # colocate_memory.py's phase columns (since 2026-12-06)
                figures.update({name: f"{statistics.median(s[col] for s in later):.2f}"
                                for col, name in ((9, "rollout s"), (10, "train s"), (11, "push s"))})
                figures["trainer allocator peak GiB"] = f"{max(s[12] for s in later):.1f}"
        for side, col, held, left in SIDES:
            figures[f"{side} freed"] = f"{freed(run['phases'], col, held, left):.0%}"
            if run["floor"]:
                figures[f"{side} freed above floor"] = f"{freed(run['phases'], col, held, left, run['floor']):.0%}"
        if run["floor"]:
            figures["bare CUDA process GB"] = f"{run['floor']:.2f}"
        if run["rc"]:
            figures["error"] = run["error"][:120]
        return figures

    return read


def handoff_check(run_name: str, min_steps: int, max_step_s: float | None = None) -> Callable[[str], list[str]]:
    """colocate_memory.py's handoff run: exit 0, >= `min_steps` steps, the handoff <= 10% of the step (median of
    the steps after the first), >= 90% of each side's GB above a bare CUDA process's freed while the other side
    works; with `max_step_s`, that median step no slower (the row's speed ceiling)."""

    def check(out: str) -> list[str]:
        run = colocate_runs(out).get(run_name)
        if run is None:
            return [f"no '## {run_name}' report in the output"]
        problems = []
        if run["rc"] != 0:
            problems.append(f"train.py exited {run['rc']}: {run['error'][:200]}")
        if len(run["steps"]) < min_steps:
            problems.append(f"{len(run['steps'])} step(s) logged, fewer than {min_steps}")
        later = run["steps"][1:]
        if later and statistics.median(s[3] for s in later) > 10.0:
            problems.append(f"the handoff took {statistics.median(s[3] for s in later):.1f}% of the step (> 10%)")
        if later and max_step_s is not None and statistics.median(s[1] for s in later) > max_step_s:
            problems.append(f"the step took {statistics.median(s[1] for s in later):.2f} s (> {max_step_s} s: a "
                            "speed regression)")
        for side, col, held, left in SIDES:
            share = freed(run["phases"], col, held, left, run["floor"])
            if not share >= 0.9:
                above = f" above the {run['floor']:.2f} GB of a bare CUDA process" if run["floor"] else ""
                problems.append(f"the {side} freed {share:.0%} of its GB{above} (< 90%)")
        return problems

    return check


def flat_figures(run_name: str) -> Callable[[str], Figures]:
    """Row 1's figures of colocate_memory.py's run `run_name`, and its trainer-memory verdict per move."""

    def read(out: str) -> Figures:
        figures = handoff_figures(run_name)(out)
        run = colocate_runs(out).get(run_name)
        if run:
            figures.update({f"trainer after {move}": f"{growth} ({'ok' if ok else 'grew'})"
                            for move, (ok, growth) in run["verdicts"].items()})
        return figures

    return read


def flat_check(run_name: str) -> Callable[[str], list[str]]:
    """>= 10 steps, each side freed as in row 1, and colocate_memory.py's own verdict: the trainer's memory after
    each of its moves did not grow from the second step to the last (its `PASS:` / `FAIL:` lines)."""

    def check(out: str) -> list[str]:
        problems = [p for p in handoff_check(run_name, 10)(out) if "% of the step" not in p]
        run = colocate_runs(out).get(run_name)
        if run:
            if not run["verdicts"]:
                problems.append("colocate_memory.py printed no trainer-memory verdict")
            problems += [f"the trainer's memory after {move} grew {growth}" for move, (ok, growth) in
                         run["verdicts"].items() if not ok]
        return problems

    return check


def resident_hf_figures(out: str) -> Figures:
    run = colocate_runs(out).get("hf, resident")
    if run is None:
        return {}
    return {"exit": str(run["rc"]), "steps": str(len(run["steps"])), "peak GB": f"{run['peak']:.1f}",
            **({"error": run["error"][:120]} if run["rc"] else {})}


def resident_hf_check(out: str) -> list[str]:
    """The resident hf job is refused by the memory plan before anything starts, or fails with an out-of-memory
    message, or fits (then it ran every step)."""
    run = colocate_runs(out).get("hf, resident")
    if run is None:
        return ["no '## hf, resident' report in the output"]
    said = run["error"].lower()
    if run["rc"] != 0 and not any(m in said for m in ("out of memory", "outofmemory", "memory plan refuses")):
        return [f"exited {run['rc']} without an out-of-memory message or the plan's refusal: {run['error'][:200]}"]
    if run["rc"] == 0 and len(run["steps"]) < 3:
        return [f"exited 0 with {len(run['steps'])} step(s) logged"]
    return []


# ---- the perf rows' tables ---------------------------------------------------------------------------------------


def prefill_figures(out: str) -> Figures:
    shared = table(out, "shared")
    chunked = {c[1]: c[2] for c in table(out, "megatron chunked")}
    figures = {"shared prefill vs alone": shared[-1][4]} if shared else {}
    figures.update({f"megatron chunked B/logit, entropy {k}": v for k, v in chunked.items()})
    return figures


def grpo_figures(system: str) -> Callable[[str], Figures]:
    def read(out: str) -> Figures:
        mine, trl = table(out, re.escape(system)), table(out, "trl")
        ratio = table(out, rf"TRL / {re.escape(system)} .*")
        figures = {}
        if mine:
            figures.update({f"{system} step s": mine[-1][1], f"{system} train s": mine[-1][4]})
        if trl:
            figures["trl step s"] = trl[-1][1]
        if ratio:
            figures["TRL / slime step"] = ratio[-1][1]
        return figures

    return read


def decode_figures(out: str) -> Figures:
    """ms per decode step per engine, RMSNorm, rotary and projection forms (`op` / `fused` for the hf engine),
    schedule (overlap `off` / `on`) and batch."""
    return {f"{c[0]} (norms {c[1]}, rotary {c[2]}, projections {c[3]}, overlap {c[4]}) batch {c[5]} ms/step": c[9]
            for c in table(out, r"slots(:[\w-]+)?|sglang \w+")}


# Speed ceilings: a row fails when a figure is worse than its last measured value by more than 15% (the same row's
# runs on the H200 spread 1-6%): they catch regressions; the performance issue's goals are further.
def grpo_check(system: str, max_step_s: float | None, min_trl_ratio: float) -> Callable[[str], list[str]]:
    """benchmarks/grpo_step.py: `system`'s step no slower than `max_step_s` (None: no ceiling yet) and TRL's step
    at least `min_trl_ratio` times as long."""

    def check(out: str) -> list[str]:
        figures = grpo_figures(system)(out)
        step, ratio = figures.get(f"{system} step s"), figures.get("TRL / slime step")
        if step is None or ratio is None:
            return [f"no {system} row or TRL ratio in grpo_step.py's table"]
        problems = []
        if max_step_s is not None and number(step) > max_step_s:
            problems.append(f"{system} step {step} s (> {max_step_s} s: a speed regression)")
        if not number(ratio) >= min_trl_ratio:
            problems.append(f"TRL / {system} step {ratio} (< {min_trl_ratio}x)")
        return problems

    return check


def decode_check(max_ms: dict[int, float]) -> Callable[[str], list[str]]:
    """benchmarks/decode_speed.py: the `hf` engine's ms per decode step (slots, fused RMSNorm and rotary, joined
    projections, overlap schedule: what it serves with on CUDA) at each batch in `max_ms` no slower than its
    ceiling."""

    def check(out: str) -> list[str]:
        ms = {int(c[5]): number(c[9]) for c in table(out, "slots") if c[1:5] == ["fused", "fused", "fused", "on"]}
        problems = []
        for batch, ceiling in max_ms.items():
            if batch not in ms:
                problems.append(f"no slots row at batch {batch} in decode_speed.py's table")
            elif not ms[batch] <= ceiling:
                problems.append(f"hf engine decode {ms[batch]:.2f} ms/step at batch {batch} (> {ceiling} ms: a speed "
                                "regression)")
        return problems

    return check


def decode_attention_check(out: str) -> list[str]:
    """benchmarks/decode_speed.py --kv-cache slots:sdpa,slots:triton-kv,slots:triton: at each batch (fused norms,
    rotary and projections, overlap on) the slot cache with the Triton decode attention, its KV written apart
    (--disable-fused-kv-write), no slower than with SDPA, and with the KV writes fused into the kernel (its default)
    no slower than apart: the conditions of both being the default."""
    ms = {(c[0], int(c[5])): number(c[9]) for c in table(out, r"slots:(sdpa|triton|triton-kv)")
          if c[1:5] == ["fused", "fused", "fused", "on"]}
    batches = sorted({b for _, b in ms})
    if not batches:
        return ["no slots rows in decode_speed.py's table"]
    problems = []
    for b in batches:
        sdpa, apart, fused = (ms.get((f"slots:{name}", b)) for name in ("sdpa", "triton-kv", "triton"))
        for name, value in (("sdpa", sdpa), ("triton-kv", apart), ("triton", fused)):
            if value is None:
                problems.append(f"batch {b}: no slots:{name} row")
        if sdpa is not None and apart is not None and not apart <= sdpa:
            problems.append(f"batch {b}: the Triton decode attention {apart:.2f} ms/step, slower than SDPA's "
                            f"{sdpa:.2f}")
        if apart is not None and fused is not None and not fused <= apart:
            problems.append(f"batch {b}: the KV writes fused into the Triton decode attention {fused:.2f} ms/step, "
                            f"slower than apart {apart:.2f}")
    return problems


def kernel_step_check(min_speedup: float, fast: str = "thd:triton+torchrope", slow: str = "thd:torch+torchrope",
                      what: str = "the Triton kernels", against: str = "the torch form") -> Callable[[str], list[str]]:
    """benchmarks/megatron_train.py --layouts `slow`,`fast`: the train step of layout `fast` at least `min_speedup`
    times as fast as `slow`'s (train s, the table's sixth column); by default the Triton log-prob kernels against
    the torch form."""

    def check(out: str) -> list[str]:
        step = {c[0]: number(c[5]) for c in table(out, "|".join(re.escape(x) for x in (fast, slow)))}
        if set(step) != {fast, slow}:
            return [f"megatron_train.py printed no train step for {sorted({fast, slow} - set(step))}"]
        if not step[slow] >= min_speedup * step[fast]:
            return [f"train step {step[fast]:.2f} s with {what} against {step[slow]:.2f} s with {against}: less than "
                    f"{min_speedup}x (a speed regression)"]
        return []

    return check


# ---- the rows --------------------------------------------------------------------------------------------------

# The 4B job's trainer with Adam on the GPU (fp32 gradient buffers, fp32 master weights and moments: 67.4 GB) and its
# activations does not fit an 80 GB H100: row 1 ran out of memory there on 2026-12-06 (in its first optimizer step)
FOUR_B_GB = 100

ROWS: tuple[Row, ...] = (
    Row(1, "4B handoff, SGLang", "handoff",
        "python benchmarks/colocate_memory.py --rollouts sglang --modes handoff --steps 3 --keep-logs \"$ROW_OUT\"",
        timeout_s=600, estimate_s=450, part="4",
        must_show="the 4B job (32 × 8 × 1024 tokens, micro-batch 4, Megatron + SGLang) runs 3 steps with the "
        "handoff; handoff ≤ 10% of the step; ≥ 90% of each side's GB (above what a bare CUDA process holds) freed "
        "while the other works; the trainer's memory flat (the benchmark's verdict, else it exits 1); per-phase "
        "memory; step ≤ 38 s (33.3 s measured on 2026-12-06, +15%)",
        kind="command", figures=handoff_figures("sglang, handoff"), check=handoff_check("sglang, handoff", 3, 38.0),
        gpu_gb=FOUR_B_GB),
    Row(2, "4B resident refused by --dry-run", "handoff",
        f"{PYTEST} tests/gpu/test_colocate_plan_gpu.py", timeout_s=300, estimate_s=30, part="1",
        must_show="the same job without the handoff is refused by the plan on the GPU node (exit ≠ 0, the fix "
        "named) before anything starts",
        figures=grab(plan=r"\[plan, resident 4B \+ sglang[^\]]*\] (.+)$")),
    Row(3, "fsdp handoff + fault tolerance, SGLang", "handoff",
        f"{FAST_SGLANG} {PYTEST} tests/gpu/test_sglang_train.py -k \"colocated and fsdp or killed\"",
        timeout_s=600, estimate_s=440, part="1",
        must_show="the fsdp trainer with the handoff against real SGLang (versions 1-5, |Δ log-prob| < 0.05, "
        "`perf/engine_release_time` and `perf/actor_offload_moved_gb` every rollout); a SIGKILLed server restarted "
        "mid-rollout with the handoff on, every group trained once",
        figures=grab(fsdp_logprob_diff=r"\[sglang fsdp\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     handoff_s=r"\[sglang fsdp\] handoff s (.+)$",
                     restarts=r"\[sglang fault tolerance[^\]]*\].*?restarts (\[[^\]]*\])")),
    Row(4, "engine contract vs real SGLang", "engine contract",
        f"{PYTEST} tests/gpu/test_contract_sglang_gpu.py", timeout_s=600, estimate_s=120, part="2",
        must_show="tests/contract passes against a real SGLang server (`--enable-memory-saver`, gloo, same host, "
        "tol 0.05), `test_update_weights_from_distributed` included (the group's key prefix)",
        figures=grab(sglang_up_s=r"\[sglang\] up in ([\d.]+) s", suite=r"\[contract vs sglang\] (.+?); not passed",
                     not_passed=r"\[contract vs sglang\].*; not passed: (.+)$")),
    Row(5, "weights-only onload, Megatron colocate + resume", "handoff",
        f"{PYTEST} tests/gpu/test_offload_gpu.py tests/gpu/test_offload_ipc_gpu.py tests/gpu/test_hf_engine_release.py "
        "tests/gpu/test_megatron_offload_trains_gpu.py tests/gpu/test_adam_kernel_gpu.py tests/gpu/test_megatron_gpu.py::"
        "test_train_py_megatron_colocate_then_resume", timeout_s=600, estimate_s=300,
        part="2",
        must_show="the mover's two moves and the weights-only onload (fault tolerance's mid-rollout push) on CUDA; an "
        "offload frees a push bucket an engine held past the sender; the `hf` engine's release frees its weights' "
        "bytes and a complete push restores the same decode; a Megatron chunk without the distributed optimizer "
        "trains after the offload's round trip as one that never moved; torch's fused and unfused Adam train alike and a "
        "checkpoint of one resumes under the other, in megatron-core's distributed optimizer and in the fsdp trainer; Megatron + `hf` colocated, only the weights on the GPU "
        "during a push, SIGTERM after a checkpoint, `--load` resumes at the next rollout",
        figures=grab(offload=r"^\[offload\] (.+)$", logprob_diff=r"engine/trainer \|Δ log-prob\| per rollout: (.+?);",
                     resumed=r"run 2 resumed from checkpoint (.+)$")),
    Row(6, "OPD with a real SGLang teacher", "SFT / OPD",
        f"{PYTEST} tests/gpu/test_sft_opd_gpu.py -k \"opd_sglang_teacher or opd_megatron_type\"", timeout_s=600,
        estimate_s=460, part="3",
        must_show="OPD `--opd-type sglang` against a real SGLang teacher on both trainers and `--opd-type megatron` "
        "(student-teacher KL falls, every step has a gradient; the teacher log-probs are the teacher's)",
        figures=grab(teacher_up=r"\[teacher\] SGLang up in (.+)$",
                     teacher_logprobs=r"teacher log-probs vs a transformers fp32 forward of the teacher: (.+)$")),
    Row(7, "--check-weight-update-equal vs SGLang", "weight sync",
        f"{PYTEST} tests/gpu/test_sglang_weight_check_gpu.py -k 'not moe and not triton'", timeout_s=600,
        estimate_s=330, part="7",
        must_show="SGLang's `/weights_checker` finds every tensor equal to its snapshot after the first push, from "
        "Megatron and from FSDP; then the usual versions and |Δ log-prob| < 0.05",
        figures=grab(megatron_logprob_diff=r"\[weights checker, megatron\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     fsdp_logprob_diff=r"\[weights checker, fsdp\].*?\|Δ log-prob\| (\[[^\]]*\])")),
    Row(8, "--optimizer-cpu-offload (Megatron) + SGLang", "weight sync",
        f"{PYTEST} tests/gpu/test_megatron_optimizer_offload_gpu.py", timeout_s=600, estimate_s=430, part="8",
        must_show="Megatron's host optimizer (`HybridDeviceOptimizer`) with and without `--offload-train`: pushes "
        "reach SGLang (|Δ log-prob| < 0.05) and the policy moves (`train/kl_loss` > 0)",
        figures=grab(handoff_kl=r"\[optimizer cpu offload, handoff\] kl_loss[^\[]*(\[[^\]]*\])",
                     resident_kl=r"\[optimizer cpu offload, resident\] kl_loss[^\[]*(\[[^\]]*\])")),
    Row(9, "trainer memory flat over 10 steps (4B, short)", "handoff",
        "python benchmarks/colocate_memory.py --rollouts sglang --modes handoff --steps 10 --prompts 4 "
        "--response-len 128 --keep-logs \"$ROW_OUT\"", timeout_s=600, estimate_s=415, part="5",
        must_show="10 push / offload cycles of the 4B job, short (4 × 8 × 128 tokens): the trainer's memory after "
        "each of its moves does not grow from the second step to the last (the benchmark's PASS lines, ≤ 1 GB); "
        "≥ 90% freed each side",
        kind="command", figures=flat_figures("sglang, handoff"), check=flat_check("sglang, handoff"),
        gpu_gb=FOUR_B_GB),
    Row(10, "4B handoff, hf engine", "handoff",
        "python benchmarks/colocate_memory.py --rollouts hf --modes handoff --steps 3 --keep-logs \"$ROW_OUT\"",
        timeout_s=600, estimate_s=400, part="6",
        must_show="row 1 with the built-in `hf` engine; step ≤ 60 s (50.3-53.3 s measured, +15%)", kind="command",
        figures=handoff_figures("hf, handoff"), check=handoff_check("hf, handoff", 3, 60.0), gpu_gb=FOUR_B_GB),
    Row(11, "4B resident, hf engine", "handoff",
        "python benchmarks/colocate_memory.py --rollouts hf --modes resident --steps 3 --keep-logs \"$ROW_OUT\"",
        timeout_s=600, estimate_s=45, part="6",
        must_show="without the handoff the `hf` job is refused by the memory plan before Ray starts (the `hf` "
        "engine's KV slots counted), or fails with a clear out-of-memory message naming the engine, or fits and "
        "runs its 3 steps",
        kind="command", figures=resident_hf_figures, check=resident_hf_check),
    Row(12, "train_async.py + SGLang on its own GPU", "async", f"{PYTEST} tests/gpu/test_sglang_two_gpus.py -k async",
        timeout_s=600, estimate_s=200, part="x2", gpus=2,
        must_show="one-step-off generation overlapping training; weights by NCCL broadcast into SGLang (rollout 0's "
        "|Δ log-prob| < 0.05); versions 1, 1, 2, 3, 4; the policy moves",
        figures=grab(versions=r"\[train_async \+ sglang[^\]]*\] versions per rollout (\[.*?\]\]);",
                     logprob_diff=r"\[train_async \+ sglang[^\]]*\].*\|Δ log-prob\| (\[[^\]]*\])")),
    Row(13, "delta weight sync (Megatron) + SGLang", "weight sync",
        f"{PYTEST} tests/gpu/test_sglang_two_gpus.py -k delta", timeout_s=600, estimate_s=200, part="x2", gpus=2,
        must_show="`--update-weight-mode delta` over disk into SGLang (`update_weights_from_disk` of the local "
        "checkpoint): a full push, then deltas on it; versions 1-5, |Δ log-prob| < 0.05 every rollout",
        figures=grab(logprob_diff=r"\[delta sync[^\]]*\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     MB_written=r"\[delta sync[^\]]*\] pushes .*; MB written (.+)$")),
    Row(14, "shared prefill, chunked log-prob memory", "performance",
        "python benchmarks/group_prefill.py --shape qwen3-0.6b && python benchmarks/log_prob_memory.py",
        timeout_s=400, estimate_s=110, part="perf",
        must_show="the shared prefill of a GRPO group on the GPU; Megatron's chunked log-probs' bytes per logit on "
        "CUDA", kind="command", figures=prefill_figures),
    Row(15, "GRPO step vs TRL (Megatron + SGLang)", "performance",
        "python benchmarks/grpo_step.py --steps 4 --systems slime-sglang,trl --max-tokens-per-gpu 20480",
        timeout_s=600, estimate_s=250,
        part="perf", must_show="slime's default step (the Triton log-prob and rotary kernels on CUDA, the handoff's "
        "idle wait asking SGLang's scheduler, the optimizer's onload copies beside the first step) with "
        "micro-batches of 20480 tokens (slime's --max-tokens-per-gpu; TRL keeps 16 samples, its peak memory already "
        "84 GB of 80): step ≤ 3.7 s and TRL's ≥ 2.8x as long (3.19 s, 3.22x TRL's 10.25 s on an H100 on 2026-12-06, "
        "+15%, with bf16 gradient buffers: fp32, --bf16's default since, not yet timed; 3.73 s before the rotary "
        "kernel and the deferred onload; without the flag, micro-batches of 16 samples as TRL's, 5.24 s, train "
        "2.76 s; TRL's step varies by machine: 14.0 s on 2026-12-05)",
        kind="command", figures=grpo_figures("slime-sglang"), check=grpo_check("slime-sglang", 3.7, 2.8)),
    Row(16, "GRPO step vs TRL (Megatron + hf)", "performance",
        "python benchmarks/grpo_step.py --steps 4 --systems slime-megatron,trl", timeout_s=600, estimate_s=220,
        part="perf2", must_show="the Megatron trainer's step with the packed rotary fix and the chunked log-probs: "
        "faster than TRL's (not measured since the fix: 17.19 s vs TRL 14.34 s before it, the trainer alone then "
        "10.47 → 2.86 s; the ceiling comes from its first run)",
        kind="command", figures=grpo_figures("slime-megatron"), check=grpo_check("slime-megatron", None, 1.0)),
    Row(17, "decode speed, hf engine vs SGLang", "performance",
        f"{PYTEST} tests/gpu/test_hf_engine_slots.py; tests=$?; python benchmarks/decode_speed.py --kv-cache slots "
        "--norms fused --rotary fused --projections op,fused --sglang triton && exit $tests", timeout_s=600, estimate_s=320,
        part="perf2", must_show="the `hf` engine's decode against the bandwidth bound and SGLang's, its RMSNorms fused "
        "(one F.rms_norm kernel each) and its rotary embedding fused (one Triton kernel per tensor), its q/k/v and "
        "gate/up projections as transformers runs them (`op`) and joined (`fused`: one product per group), with the "
        "plain and the overlap schedule (`off` / `on`, the default on CUDA), the decode attention the slot cache's "
        "default (the Triton kernel on CUDA, the step's KV stored by it): fused with overlap ≤ 3.9 / 7.3 ms per step "
        "at batch 64 / 256 (3.38 / 6.30 ms in row 29 on an H100 on 2026-12-06, +15%; SGLang triton 2.59 / 5.61 in "
        "the same run; with SDPA's attention, the default before, fused 4.02 / 7.75 and op 4.10 / 7.86 ms); first, "
        "the slot cache with CUDA graphs and the overlap schedule gives the "
        "dynamic cache's tokens and the plain schedule's, so do the fused rotary and the joined projections (also "
        "after a weight update and a release/resume), and so do image rows of the tiny Qwen2.5-VL and Qwen3-VL in "
        "decode graphs (tests/gpu/test_hf_engine_slots.py; its failure fails the row after the benchmark)",
        kind="command", figures=decode_figures, check=decode_check({64: 3.9, 256: 7.3})),
    Row(18, "SFT on both trainers", "SFT / OPD", f"{PYTEST} tests/gpu/test_sft_opd_gpu.py -k sft_loss_halves",
        timeout_s=400, estimate_s=115, part="2", must_show="SFT on the Megatron and the fsdp trainer (the loss halves)",
        figures=grab(sft_fsdp_loss=r"\[sft fsdp\] loss: (.+)$")),
    Row(19, "trainer memory flat over 10 steps (4B, short), hf engine", "handoff",
        "python benchmarks/colocate_memory.py --rollouts hf --modes handoff --steps 10 --prompts 4 "
        "--response-len 128 --keep-logs \"$ROW_OUT\"", timeout_s=600, estimate_s=420, part="9",
        must_show="row 9 with the built-in `hf` engine: the trainer's memory after each of its moves does not grow "
        "from the second step to the last (≤ 1 GB); ≥ 90% freed each side",
        kind="command", figures=flat_figures("hf, handoff"), check=flat_check("hf, handoff"),
        gpu_gb=FOUR_B_GB),
    Row(20, "--engine-api-key vs SGLang", "auth", f"{PYTEST} tests/gpu/test_sglang_auth_gpu.py", timeout_s=600,
        estimate_s=200, part="7",
        must_show="SGLang started with `--api-key` answers 401 on every endpoint slime calls without the key (none, a "
        "wrong one, no `Bearer`) and a refused call changes nothing; `train.py --engine-api-key auto` (fsdp, colocated "
        "with the handoff) trains with every server started with the key: versions 1-3, |Δ log-prob| < 0.05",
        figures=grab(endpoints=r"\[sglang auth, endpoints\] (.+)$",
                     logprob_diff=r"\[sglang auth, train.py\].*?\|Δ log-prob\| (\[[^\]]*\])")),
    Row(21, "LoRA contract vs real SGLang", "LoRA", f"{PYTEST} tests/gpu/test_lora_sglang_gpu.py", timeout_s=600,
        estimate_s=100, part="9",
        must_show="tests/contract/test_lora_api.py passes against SGLang started with `--enable-lora` (as "
        "`--lora-rank` starts it): a PEFT folder and a tensor push load, a request naming the adapter moves the "
        "log-probs and a zero adapter does not, unload restores the base, unknown / duplicate names are refused",
        figures=grab(suite=r"\[lora contract vs sglang\] (.+?); not passed",
                     not_passed=r"\[lora contract vs sglang\].*; not passed: (.+)$")),
    Row(22, "LoRA colocated, Megatron + SGLang (4B)", "LoRA",
        f"{FAST_SGLANG} {PYTEST} tests/gpu/test_lora_colocate_gpu.py -k adapter", timeout_s=600, estimate_s=335,
        part="lora",
        must_show="the short 4B job (4 × 8 × 128 tokens) with LoRA r = 16 on all linear layers and a KL term (its "
        "reference: the base, adapters off), Megatron + SGLang "
        "colocated with the handoff (SGLang started with `--enable-lora --enable-weights-cpu-backup`), 3 rollouts: "
        "|Δ log-prob| < 0.05 after every adapter push, the KL to the base > 0, the adapter push < 2% of the full "
        "weights' bytes; step seconds, memory per phase, the adapter's push seconds (row 24: the full weights')",
        figures=grab(logprob_diff=r"\[lora colocate\] step s .*?\|Δ log-prob\| (\[[^\]]*\])",
                     step_s=r"\[lora colocate\] step s (\[[^\]]*\])",
                     push_s=r"\[lora colocate\] push s adapter (\[[^\]]*\])",
                     push_bytes=r"\[lora colocate\] .*push bytes (.+)$")),
    Row(23, "images through real SGLang (Megatron)", "VLM", f"{PYTEST} tests/gpu/test_vlm_sglang_gpu.py -k 'not fsdp'",
        timeout_s=600, estimate_s=330, part="vlm",
        must_show="tests/contract/test_image_api.py passes against SGLang serving the tiny Qwen2.5-VL (text with "
        "one placeholder per image + PNG data URLs: its prompt tokens are the trained ids, log-probs within 0.05 of "
        "a transformers fp32 forward, a continued sample sent as ids with one image token per image expanded back to its "
        "own ids, a push to the vision tower reaching an image seen before it); train.py on the "
        "colour task, Megatron + SGLang colocated, 3 rollouts with images: versions 1-3, |Δ log-prob| < 0.05; "
        "the step times (on an H100 on 2026-12-05: the train.py job passed, and the contract after a fix of the tiny "
        "tokenizer's decoding, 5 of 5, alone)",
        figures=grab(contract=r"^\[image contract vs sglang\] (.+?); not passed",
                     vision_push=r"^\[image contract vs sglang\] vision push: (.+)$",  # not the test's source line
                     logprob_diff=r"\[vlm megatron \+ sglang\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     step_s=r"\[vlm megatron \+ sglang\].*; step s (\[[^\]]*\])")),
    Row(24, "full-weight push of row 22's job", "LoRA",
        f"{FAST_SGLANG} {PYTEST} tests/gpu/test_lora_colocate_gpu.py -k full_weight", timeout_s=600, estimate_s=275,
        part="lora2",
        must_show="row 22's job without LoRA (the same KL term, so with a reference model of its own), one rollout, "
        "colocated with the handoff: it trains, |Δ log-prob| < 0.05 (the gap row 22 has without its adapters), "
        "and its step, push seconds and bytes are the full-weight side of row 22's adapter push",
        figures=grab(full_push=r"\[full push\] (.+)$")),
    Row(25, "images through real SGLang at Qwen2.5-VL-3B's shape (Megatron)", "VLM",
        f"{PYTEST} tests/gpu/test_vlm_3b_sglang_gpu.py", timeout_s=600, estimate_s=420, part="vlm2",
        must_show="row 23's train.py job with a random-init model of Qwen2.5-VL-3B-Instruct's published shape (3.75B "
        "parameters in bf16, written on the GPU; the tiny VLM's tokenizer and processor), Megatron + SGLang "
        "colocated with the handoff (Adam on the CPU on a card under 100 GB), 3 rollouts of 4 prompts × 4 samples "
        "with images: versions 1-3, |Δ log-prob| below twice transformers' own bf16-vs-fp32 gap on rollout 0 (0.05 "
        "at least); the step times (passed on an H100 on 2026-12-06: gaps 6.4e-2 / 4.3e-2 / 4.6e-2 under a bound "
        "of 8.1e-2, steps 36.5 / 11.0 / 8.2 s)",
        figures=grab(model_written=r"\[vlm 3b\] model written in (.+)$",
                     bf16_floor=r"\[vlm 3b\] rollout 0 vs HF fp32: (.+)$",
                     logprob_diff=r"\[vlm 3b megatron \+ sglang\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     step_s=r"\[vlm 3b megatron \+ sglang\].*; step s (\[[^\]]*\])",
                     train_py_s=r"\[vlm 3b\] train.py took ([\d.]+) s")),
    Row(26, "fsdp pushes the checkpoint's names: a VLM and a MoE vs SGLang", "weight sync",
        f"{PYTEST} tests/gpu/test_vlm_sglang_gpu.py tests/gpu/test_sglang_weight_check_gpu.py -k 'fsdp_vlm or moe'",
        timeout_s=600, estimate_s=330, part="fsdp-names",
        must_show="the fsdp trainer, colocated with SGLang and `--check-weight-update-equal`: SGLang's "
        "`/weights_checker` finds every tensor restored by the first push for the tiny Qwen2.5-VL (images, "
        "`model.layers.*` / `visual.*` pushed) and the small Qwen3-MoE (experts held fused, pushed per expert; "
        "head_dim 64: SGLang asserts at start-up for the tiny one's 32; every layer MoE: SGLang reads no "
        "mlp_only_layers, and a dense layer 0 left its experts NaN); then versions 1-3 and |Δ log-prob| < 0.05 "
        "(both halves passed on an H100 on 2026-12-06)",
        figures=grab(vlm_logprob_diff=r"\[vlm fsdp \+ sglang\].*?\|Δ log-prob\| (\[[^\]]*\])",
                     moe_logprob_diff=r"\[weights checker, fsdp, qwen3_moe\].*?\|Δ log-prob\| (\[[^\]]*\])")),
    Row(27, "fused log-prob kernel (--log-probs-kernel triton)", "performance",
        f"{PYTEST} tests/gpu/test_log_probs_triton_gpu.py && python benchmarks/megatron_train.py --shape qwen3-0.6b "
        "--seq-len 320 --samples 256 --max-tokens-per-gpu 20480 --layouts thd:torch+torchrope,thd:triton+torchrope --steps 2",
        timeout_s=600, estimate_s=120, part="perf3",
        must_show="the Triton kernels give the torch form's log-probs and entropy at the trainer's shape (15,360 "
        "response rows of a 20,480-token micro-batch, bf16, 151,936 words), each form's gradient within half a bf16 "
        "unit of fp64's plus 2^-14 of the size of its terms, with both forms' forward + "
        "backward milliseconds; then the Megatron train step of GRPO's batch (256 × 320 tokens) with each form, the "
        "Triton one ≥ 1.3x as fast (on an H100 on 2026-12-06: kernels 170.1 / 11.6 ms, steps 1.59 / 1.09 s)",
        kind="command", figures=grab(kernel=r"\[log-probs kernel\] (.+)$", torch_step=r"^\| thd:torch\+torchrope \| (.+)$",
                                     triton_step=r"^\| thd:triton\+torchrope \| (.+)$"), check=kernel_step_check(1.3)),
    Row(28, "the Triton log-prob kernel in whole jobs", "performance",
        f"{PYTEST} tests/gpu/test_sglang_weight_check_gpu.py -k triton && python benchmarks/grpo_step.py --steps 4 "
        "--systems slime-sglang,trl --max-tokens-per-gpu 20480 --log-probs-kernel triton", timeout_s=600,
        estimate_s=420, part="perf4",
        must_show="row 7's job (train.py, SGLang colocated, `--check-weight-update-equal`) on both trainers with "
        "`--log-probs-kernel triton`: every SGLang tensor restored by the first push, versions 1-3, |Δ log-prob| < "
        "0.05 (read beside row 7's torch-form figures); then GRPO's step against TRL's with the kernel: step ≤ 3.9 s "
        "and TRL's ≥ 2.5x as long (on an H100 on 2026-12-06: the jobs passed, |Δ log-prob| 1.5e-3 / 1.1e-3 / 9.9e-4 "
        "Megatron, 1.4e-3 / 1.3e-3 / 9.7e-4 fsdp; step 4.46 s, 2.21x TRL's 9.87 s with the old idle wait, then "
        "3.38 s, 2.90x with the new one; the kernel became the default on CUDA after it)",
        kind="command", check=grpo_check("slime-sglang", 3.9, 2.5), figures=merged(
            grab(megatron_logprob_diff=r"\[weights checker, megatron, triton\].*?\|Δ log-prob\| (\[[^\]]*\])",
                 fsdp_logprob_diff=r"\[weights checker, fsdp, triton\].*?\|Δ log-prob\| (\[[^\]]*\])"),
            grpo_figures("slime-sglang"))),
    Row(29, "Triton decode attention in the hf engine (--decode-attention triton)", "performance",
        f"{PYTEST} tests/gpu/test_hf_engine_slots.py -k \"triton_decode_attention or fused_kv_write\"; tests=$?; python "
        "benchmarks/decode_speed.py --kv-cache slots:sdpa,slots:triton-kv,slots:triton --norms fused --rotary fused "
        "--projections fused --overlap on --sglang triton && exit $tests", timeout_s=600, estimate_s=260,
        part="perf5",
        must_show="the slot cache's decode attention as one Triton kernel per layer that reads only each row's live "
        "columns (decode_attention.py; SDPA reads the whole column bucket under a mask: 24 us per layer and step at "
        "batch 64 on an H100, the step's largest kernel): transformers' tokens under CUDA graphs (fp32, also after a "
        "weight update; with the step's KV written apart, --disable-fused-kv-write, and with it stored by the kernel, "
        "the default, instead of two indexed writes a layer), then ms per decode step at batch 64 / 256 with SDPA, "
        "with the kernel and the KV written apart, and with the default, beside SGLang triton's: the kernel no slower "
        "than SDPA and the fused write no slower than apart at each batch, the conditions of their being the "
        "default (on an H100 on 2026-12-06: SDPA 4.05 / 7.80, the kernel 3.62 / 6.48, with the fused write 3.38 / "
        "6.30 ms; SGLang triton 2.59 / 5.61)",
        kind="command", figures=decode_figures, check=decode_attention_check),

    Row(30, "Triton rotary embedding in the Megatron trainer (--rope-kernel triton)", "performance",
        f"{PYTEST} tests/gpu/test_fused_rope_gpu.py && python benchmarks/megatron_train.py --shape qwen3-0.6b "
        "--seq-len 320 --samples 256 --max-tokens-per-gpu 20480 --layouts thd:triton+torchrope,thd:triton+rope --steps 2",
        timeout_s=600, estimate_s=120, part="perf5",
        must_show="the packed rotary embedding as one Triton kernel forward and one backward (fused_rope.py) gives "
        "megatron-core's rotation and gradient on the GPU (fp32 to 1e-5, bf16 within two units in the last place), "
        "then the Megatron train step of GRPO's batch (256 × 320 tokens, the Triton log-prob kernels on both sides) "
        "with it no slower than without, the condition of its being the default (--rope-kernel auto, what rope "
        "fusion means without TransformerEngine; on an H100 on 2026-12-06: 0.98 s against 1.15 s)",
        kind="command", figures=grab(rope_step=r"^\| thd:triton\+rope \| (.+)$",
                                     torch_rope_step=r"^\| thd:triton\+torchrope \| (.+)$"),
        check=kernel_step_check(1.0, "thd:triton+rope", "thd:triton+torchrope", "the Triton rotary embedding",
                                "megatron-core's")),
)
PARTS = tuple(sorted({r.part for r in ROWS}))  # "1".."9", then perf, perf2, x2


