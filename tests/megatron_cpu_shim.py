"""Test-only: lets megatron-core run on CPU over gloo (never imported by `slime/`).

megatron-core assumes CUDA in a handful of places. `install()` redirects them for the current process:

- the model-parallel RNG tracker keeps CPU generator states instead of CUDA ones;
- `torch.cuda.current_device()` answers "cpu", so buffers it sizes land on the CPU;
- `device="cuda"` literals in tensor factories become "cpu", and `Tensor.cuda()` is the identity;
- `Tensor.type()` reports CUDA type names, which the optimizers check for;
- CUDA synchronisation / cache calls are no-ops, and CUDA streams and events are inert stand-ins (the
  MoE all-to-all dispatcher creates a side stream for its device-to-host copies).
- megatron-core's `torch.compile`d fusions (bias-dropout-add, bias-SwiGLU) run eagerly: on CPU every rank
  process would otherwise trace them and build C++ kernels for them (~7 s a process). Same math, unfused.

Call it before building any megatron-core object, in every rank process. It also replaces slime's "needs
CUDA" guard of the Megatron backend, since the shim is the accelerator here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_INSTALLED = False


class _InertEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


class _InertStream:
    """Work on CPU is synchronous: there is nothing to order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _InertEvent()


_DEFAULT_STREAM = _InertStream()
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "zeros_like", "empty_like")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    assert not torch.cuda.is_available(), "the CPU shim is for machines without CUDA"

    for name in _FACTORIES:
        setattr(torch, name, _redirect_device(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.Stream = _InertStream
    torch.cuda.Event = _InertEvent
    torch.cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    original_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        out = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = cuda_type_name

    import torch._dynamo as dynamo

    dynamo.config.disable = True  # before megatron's @jit_fuser decorators are applied

    from megatron.core.tensor_parallel import random as mg_random

    class _CpuRngTracker(mg_random.CudaRNGStatesTracker):
        """Same bookkeeping as megatron's tracker, with the CPU generator."""

        def add(self, name, seed):
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mg_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mg_random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mg_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mg_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mg_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

    # The all-to-all dispatcher hands its split sizes to all_to_all_single as host (numpy) values, which it
    # only makes from CUDA tensors.
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    import slime.backends.megatron_utils.args as mg_args

    mg_args.check_megatron_runtime = lambda args, cuda_available=None: mg_args.require_model_args(args)


if __name__ == "__main__":
    # python tests/megatron_cpu_shim.py SCRIPT [ARGS...]: run a script (e.g. a tools/ converter) on CPU.
    import os
    import runpy
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
