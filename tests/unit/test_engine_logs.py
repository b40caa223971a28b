"""slime/utils/engine_logs.py: the one telling line of an engine's log, on log texts shaped like the ones our hf
engine and SGLang 0.5.16 write (their logger formats, tracebacks and shutdown messages)."""

from __future__ import annotations

import signal

import pytest

from slime.utils.engine_logs import MAX_LINE, advice, exit_description, failure_kind, telling_line

TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 20.19 GiB is free. Process 81234 has 60.02 GiB memory in use. Including non-PyTorch "
    "memory, this process has 59.53 GiB memory in use. Of the allocated memory 54.13 GiB is allocated by PyTorch, "
    "and 4.67 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

# Our hf engine: a decode step ran out of memory growing its KV slots; the scheduler logs and keeps serving.
HF_STEP_OOM = f"""\
$ /usr/bin/python -m slime.backends.hf_engine --model-path /data/qwen3-4b --host 10.0.0.5 --port 31412 --device cuda
2026-12-01 10:12:03,441 INFO slime.hf_engine: loaded /data/qwen3-4b (cuda, bfloat16) in 12.3 s; serving on http://10.0.0.5:31412 (pid 4242, process group 4242)
2026-12-01 10:14:55,102 ERROR slime.backends.hf_engine.scheduler: engine step failed:
Traceback (most recent call last):
  File "/work/slime/backends/hf_engine/scheduler.py", line 548, in _loop
    self.step()
  File "/work/slime/backends/hf_engine/scheduler.py", line 575, in step
    self._decode()
  File "/work/slime/backends/hf_engine/slots.py", line 131, in ensure
    nk = k.new_zeros(new_rows, k.shape[1], new_columns, k.shape[3])
         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
{TORCH_OOM}
2026-12-01 10:14:55,390 WARNING slime.backends.hf_engine.scheduler: 256 request(s) failed
"""

# SGLang 0.5.16: the scheduler process dies on a CUDA error, logs it, SIGQUITs its parent, which kills the tree.
SGLANG_CUDA_ERROR = """\
[2026-12-01 10:20:11 TP0] Decode batch, #running-req: 256, #token: 201344, token usage: 0.71, cuda graph: True, gen throughput (token/s): 9521.33, #queue-req: 0,
[2026-12-01 10:20:12 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/managers/scheduler.py", line 4638, in run_scheduler_process
    scheduler.run_event_loop()
  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/model_executor/cuda_graph_runner.py", line 712, in replay
    self.graphs[self.bs].replay()
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

[2026-12-01 10:20:12] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
[2026-12-01 10:20:12] kill_process_tree called: parent_pid=5120, include_parent=True, pid=5120
"""

# SGLang's scheduler on a bare assert (resuming a memory tag it already holds).
SGLANG_ASSERT = """\
[2026-12-01 11:02:40 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/managers/scheduler.py", line 4638, in run_scheduler_process
    scheduler.run_event_loop()
  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/managers/scheduler_update_weights_mixin.py", line 171, in resume_memory_occupation
    assert self._is_released(tag)
AssertionError

[2026-12-01 11:02:40] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
"""

# SGLang at start-up: the weights leave no room for the KV cache.
SGLANG_POOL = """\
[2026-12-01 09:00:01 TP0] Load weight end. type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem=10.21 GB, mem usage=7.55 GB.
[2026-12-01 09:00:02 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/model_executor/pool_configurator.py", line 64, in __post_init__
    raise RuntimeError(msg)
RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.05

[2026-12-01 09:00:02] Received sigquit from a child process. It usually means the child failed.
"""

# A model folder without weights: the hf engine's main raises at start-up (chained tracebacks).
HF_STARTUP = """\
$ /usr/bin/python -m slime.backends.hf_engine --model-path /tmp/empty --host 127.0.0.1 --port 30555
Traceback (most recent call last):
  File "/usr/lib/python3.11/json/decoder.py", line 355, in raw_decode
    raise JSONDecodeError("Expecting value", s, err.value) from None
json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/slime/backends/hf_engine/server.py", line 630, in main
    model, tokenizer = load_model(args.model_path, args.dtype, args.device)
OSError: It looks like the config file at '/tmp/empty/config.json' is not a valid JSON file.
"""

NCCL = """\
2026-12-01 12:00:00,000 INFO slime.hf_engine: joined weight update group 'slime_weight_update' as rank 1 of 2
Traceback (most recent call last):
  File "/work/slime/weight_sync/group.py", line 88, in broadcast_tensors
    dist.broadcast(t, src=0, group=group)
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5
"""

SEGFAULT = """\
2026-12-01 12:00:00,000 INFO slime.hf_engine: loaded /data/m (cuda, bfloat16) in 3.0 s; serving on http://h:1 (pid 1, process group 1)
Fatal Python error: Segmentation fault

Thread 0x00007f3a2affd640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/work/slime/backends/hf_engine/scheduler.py", line 540 in _loop
"""

HOST_OOM = """\
2026-12-01 12:00:00,000 ERROR slime.backends.hf_engine.scheduler: engine step failed:
Traceback (most recent call last):
  File "/work/slime/backends/hf_engine/scheduler.py", line 548, in _loop
    self.step()
RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 9663676416 bytes. Error code 12 (Cannot allocate memory)
"""

BIND = """\
2026-12-01 12:00:00,000 INFO slime.hf_engine: loaded /m (cpu, float32) in 1.0 s; serving on http://127.0.0.1:31000 (pid 9, process group 9)
ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 31000): address already in use
"""

CLEAN = """\
$ /usr/bin/python -m slime.backends.hf_engine --model-path /m --port 31000
2026-12-01 12:00:00,000 INFO slime.hf_engine: loaded /m (cpu, float32) in 1.0 s; serving on http://127.0.0.1:31000 (pid 9, process group 9)
2026-12-01 12:00:05,000 INFO slime.hf_engine: weight version 3 loaded (311 tensors)
"""


def test_a_cuda_oom_in_an_hf_decode_step_is_the_line():
    line = telling_line(HF_STEP_OOM)
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a "
                           "total capacity of 139.81 GiB of which 20.19 GiB is free. Process 81234 has 60.02 GiB")
    assert len(line) <= MAX_LINE and "\n" not in line and line.endswith("…")
    assert failure_kind(line, None) == "gpu_oom"


def test_sglang_scheduler_cuda_error_beats_its_hints_and_the_sigquit_line():
    line = telling_line(SGLANG_CUDA_ERROR)
    assert line == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert failure_kind(line, -signal.SIGKILL) == "device"


def test_a_bare_assertion_names_the_frame_it_was_raised_in():
    line = telling_line(SGLANG_ASSERT)
    assert line == ("AssertionError (raised in resume_memory_occupation, /usr/local/lib/python3.12/dist-packages/"
                    "sglang/srt/managers/scheduler_update_weights_mixin.py:171)")
    assert failure_kind(line, -signal.SIGKILL) == "error"


def test_sglang_pool_too_small_is_not_an_out_of_memory():
    line = telling_line(SGLANG_POOL)
    assert line == ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
                    "mem_fraction_static=0.05")
    kind = failure_kind(line, 1)
    assert kind == "pool"
    assert "raise --sglang-mem-fraction-static" in advice(kind, backend="sglang", colocate=False,
                                                          offload_rollout=False, offload_train=False)


def test_the_last_traceback_of_a_chain_wins():
    assert telling_line(HF_STARTUP) == ("OSError: It looks like the config file at '/tmp/empty/config.json' is not a "
                                        "valid JSON file.")


def test_nccl_segfault_host_memory_and_bind_errors():
    assert telling_line(NCCL).startswith("torch.distributed.DistBackendError: NCCL error in: ")
    assert failure_kind(telling_line(NCCL), 1) == "device"
    assert telling_line(SEGFAULT) == "Fatal Python error: Segmentation fault"
    assert failure_kind(telling_line(SEGFAULT), -signal.SIGSEGV) == "crash"
    host = telling_line(HOST_OOM)
    assert "DefaultCPUAllocator: can't allocate memory" in host and failure_kind(host, None) == "host_oom"
    assert telling_line(BIND).endswith("address already in use")


def test_a_clean_log_has_no_telling_line_and_sigkill_is_said_so():
    assert telling_line(CLEAN) is None
    assert telling_line("") is None
    assert failure_kind(None, -signal.SIGKILL) == "killed"
    assert "OOM killer" in advice("killed", backend="hf", colocate=False, offload_rollout=True, offload_train=True)
    assert telling_line(CLEAN + "Killed\n") == "Killed"


def test_exit_descriptions():
    assert exit_description(None) == "is running"
    assert exit_description(0) == "exited with code 0"
    assert exit_description(1) == "exited with code 1"
    assert exit_description(-9) == "was killed by SIGKILL"
    assert exit_description(-11) == "was killed by SIGSEGV"
    assert exit_description(-200) == "was killed by signal 200"


@pytest.mark.parametrize("backend,colocate,offload,expect,absent", [
    ("hf", True, False, ["drop --no-offload-rollout / --no-offload-train", "--sglang-server-concurrency",
                         "KV slots"], ["--sglang-mem-fraction-static"]),
    ("sglang", True, True, ["lower --sglang-mem-fraction-static", "--rollout-batch-size"], ["handoff"]),
    ("sglang", False, False, ["lower --sglang-mem-fraction-static"], ["handoff"]),
])  # fmt: skip
def test_out_of_memory_advice_follows_the_run(backend, colocate, offload, expect, absent):
    text = advice("gpu_oom", backend=backend, colocate=colocate, offload_rollout=offload, offload_train=offload)
    assert all(e in text for e in expect), text
    assert not any(a in text for a in absent), text
