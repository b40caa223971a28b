"""What an engine's log says about why it failed, in one line: pure functions on the log text.

`telling_line(text)` picks the most telling line of a server log's tail: a GPU out-of-memory message first, then
host memory, CUDA / NCCL errors and SGLang's own "not enough memory" for its pool, then a fatal signal's trace
(faulthandler's "Fatal Python error: ..."), then the final exception line of the latest Python traceback (with
the frame it was raised in when its message is empty, as SGLang's bare `assert`s are), then the last line that
only says something went wrong (`Killed`, SGLang's "SIGQUIT received", a watchdog timeout, an error-level log
line). Among lines of the same rank the latest wins. `failure_kind(line, returncode)` names the class of failure
and `advice(kind, ...)` what to change for it; `exit_description(returncode)` turns a `Popen.returncode` into
words ("exited with code 1", "was killed by SIGKILL").

Simplified: patterns, not a parser of every library's format; a message that spans lines contributes its first
line only (cut to `MAX_LINE` characters).
"""

from __future__ import annotations

import re
import signal

from slime.utils.backend_specs import ENGINE_SPECS

MAX_LINE = 400

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation|"
                      r"CUBLAS_STATUS_ALLOC_FAILED|out of memory", re.IGNORECASE)
_HOST_OOM = re.compile(r"\bMemoryError\b|Cannot allocate memory|DefaultCPUAllocator: can't allocate")
_POOL = re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")
_DEVICE = re.compile(r"CUDA error|CUDA driver error|NCCL error|ncclUnhandledCudaError|cuDNN error|CUBLAS_STATUS_|"
                     r"CUDNN_STATUS_|illegal memory access|device-side assert triggered|no CUDA-capable device|"
                     r"no kernel image is available")
_FATAL = re.compile(r"^Fatal Python error: |Segmentation fault|\bAborted\b.*core dumped|terminate called after")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\s*$")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::(.*))?$")  # "pkg.SomeError: message" at the start of a line
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_VAGUE = re.compile(r"^Killed\b|SIGQUIT received|Received sigquit|watchdog timeout|crashed with exit code|"
                    r"hit an exception|\bERROR\b|^ERROR:|\[error\]|\bCRITICAL\b")

# rank of each kind of line: the higher, the more telling
_GPU_OOM_RANK, _MEMORY_RANK, _FATAL_RANK, _EXCEPTION_RANK, _VAGUE_RANK = 5, 4, 3, 2, 1


def _clean(line: str) -> str:
    return _ANSI.sub("", line).rstrip()


def _cut(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…"


def _rank(line: str) -> int:
    if _GPU_OOM.search(line) and not _HOST_OOM.search(line):
        return _GPU_OOM_RANK
    if _HOST_OOM.search(line) or _POOL.search(line) or _DEVICE.search(line):
        return _MEMORY_RANK
    if _FATAL.search(line):
        return _FATAL_RANK
    if _VAGUE.search(line):
        return _VAGUE_RANK
    return 0


def _exception_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(index, text) of the final exception line of each traceback in `lines`, with the innermost frame
    appended when the exception carries no message (`AssertionError`)."""
    found = []
    i = 0
    while i < len(lines):
        if not _TRACEBACK.search(lines[i]):
            i += 1
            continue
        frame = None
        j = i + 1
        while j < len(lines) and (not lines[j] or lines[j][0].isspace()):
            m = _FRAME.match(lines[j])
            if m:
                frame = m
            j += 1
        if j < len(lines):
            m = _EXCEPTION.match(lines[j])
            if m:
                text = lines[j]
                if not (m.group(2) or "").strip() and frame is not None:
                    text = f"{m.group(1)} (raised in {frame.group(3)}, {frame.group(1)}:{frame.group(2)})"
                found.append((j, text))
        i = j
    return found


def telling_line(text: str) -> str | None:
    """The most telling line of a server log (see the module docstring), or None when nothing in it looks like
    a failure. Lines our launcher wrote (`$ command`) are skipped."""
    lines = [_clean(line) for line in text.splitlines()]
    best: tuple[int, int, str] | None = None  # (rank, index, text)

    def offer(rank: int, index: int, line: str) -> None:
        nonlocal best
        if rank and (best is None or (rank, index) >= best[:2]):
            best = (rank, index, line)

    exception_at = dict(_exception_lines(lines))
    for index, line in enumerate(lines):
        if not line.strip() or line.startswith("$ "):
            continue
        rank = _rank(line)
        if index in exception_at:
            offer(max(rank, _EXCEPTION_RANK), index, exception_at[index])
        elif rank and not line[0].isspace():  # indented: a traceback's frames and code, not a message
            offer(rank, index, line.strip())
    return _cut(best[2]) if best else None


def exit_description(returncode: int | None) -> str:
    """A `Popen.returncode` in words: None -> "is running", n >= 0 -> "exited with code n", -n -> the signal."""
    if returncode is None:
        return "is running"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def failure_kind(line: str | None, returncode: int | None) -> str:
    """One of gpu_oom, host_oom, pool, device, crash, killed, error, unknown."""
    if line:
        if _GPU_OOM.search(line) and not _HOST_OOM.search(line):
            return "gpu_oom"
        if _POOL.search(line):
            return "pool"
        if _HOST_OOM.search(line):
            return "host_oom"
        if _DEVICE.search(line):
            return "device"
        if _FATAL.search(line):
            return "crash"
        return "error"  # SGLang SIGKILLs its own process tree after logging why
    if returncode == -signal.SIGKILL:
        return "killed"
    if returncode is not None and returncode < 0:
        return "crash"
    return "unknown"


def advice(kind: str, *, backend: str, colocate: bool, offload_rollout: bool, offload_train: bool) -> str:
    """What to change for a failure of `kind`, for an engine of `backend` ("sglang" / "hf") in a run with these
    placement flags; "" for a plain error, whose own line says what went wrong."""
    if kind == "gpu_oom":
        steps = []
        if colocate and not (offload_rollout and offload_train):
            steps.append("keep the colocated memory handoff on (drop --no-offload-rollout / --no-offload-train)")
        kv_cache = ENGINE_SPECS[backend].kv_cache
        if kv_cache == "static_pool":
            steps.append("lower --sglang-mem-fraction-static")
        steps.append("lower --sglang-server-concurrency or --rollout-batch-size"
                     + (" (the hf engine's KV slots grow with its running batch)" if kv_cache == "slots" else ""))
        return "the engine ran out of GPU memory: " + ", or ".join(steps) + "; `--dry-run` estimates the peak"
    if kind == "pool":
        return ("SGLang's static pool leaves no room for a KV cache: raise --sglang-mem-fraction-static, or give each "
                "engine more GPUs (--rollout-num-gpus-per-engine)")
    if kind == "host_oom":
        return "host memory ran out: fewer engines or training ranks per node, or less offloaded to host memory"
    if kind == "device":
        return ("a CUDA / NCCL error: check the GPU with nvidia-smi; rerun with CUDA_LAUNCH_BLOCKING=1 "
                "(NCCL_DEBUG=INFO for NCCL) to find the failing call")
    if kind == "killed":
        return ("SIGKILL with no error in the log: the kernel's OOM killer (host memory; see `dmesg`) or another "
                "process ended it")
    if kind == "crash":
        return "the process crashed; the stack (faulthandler) is in the log"
    return ""  # the telling line itself is the cause
