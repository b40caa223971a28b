"""`--offload-train`'s round trip of a Megatron chunk without the distributed optimizer, on a real GPU (run on the
H200; skipped without CUDA).

Without `--use-distributed-optimizer` megatron-core keeps no parameter buffer, so the offloader moves the bf16
parameters one by one (slime/backends/training/offload.py, `loose_parameters`). It used to replace each one's `.data`
with a pinned host tensor and back: autograd then drops the parameter's gradient accumulator, on which megatron-core
DDP had hooked the add into `main_grad`, so no gradient reached the optimizer again and the colocated Megatron
student stopped learning (on-policy distillation's KL stayed flat). Checked here with the real `Offloader`: the
parameters leave the GPU, and after the round trip one optimizer step fills every `main_grad` and equals, bit for
bit, the step of a twin chunk that never moved (its optimizer's onload deferred, as the trainer's). One rank (nccl), in a child process (megatron-core's groups are
per process).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]


def _round_trip(out) -> None:
    import torch.distributed as dist

    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.backends.training.offload import Offloader, TrainState, loose_parameters
    from slime.utils.net import free_port
    from tests.args import make_args
    from tests.conftest import model_args

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--lr", "1e-2", "--weight-decay",
                     "0", "--seed", "0", "--no-use-distributed-optimizer")
    assert args.bf16 and not args.use_distributed_optimizer
    initialize_parallel(args)
    chunks = {name: build_model(args) for name in ("moved", "twin")}
    with torch.no_grad():
        for a, b in zip(*(list(c.parameters()) for c in (chunks["moved"][0], chunks["twin"][0]))):
            b.copy_(a)
    optimizers = {name: build_optimizer(args, model, total_steps=1)[0] for name, model in chunks.items()}

    def train_state(name: str) -> TrainState:  # as MegatronTrainRayActor.train_state
        opt = optimizers[name]
        inner = getattr(opt, "chained_optimizers", None) or [opt]
        return TrainState(ddp_chunks=list(chunks[name]), optimizers=[o.optimizer for o in inner])

    state = train_state("moved")
    loose = {name: loose_parameters(TrainState(ddp_chunks=list(model))) for name, model in chunks.items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in loose["moved"])
    mover = Offloader(device)
    before = torch.cuda.memory_allocated(device)
    mover.offload(state, weights=False)  # the handoff's two moves around a push
    mover.offload(state)
    freed = before - torch.cuda.memory_allocated(device)
    parked = all(p.is_cuda and p.untyped_storage().nbytes() == 0 for p in loose["moved"])
    mover.onload(state, defer_optimizer=True)  # as the Megatron trainer: the optimizer's copies in flight
    same_weights = all(torch.equal(a, b) for a, b in zip(loose["moved"], loose["twin"]))

    result = {"params": len(loose["moved"]), "weight_bytes": weight_bytes, "freed": freed, "parked": parked,
              "same_weights_after_onload": same_weights}
    for name, model in chunks.items():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizers[name].zero_grad()
        g = torch.Generator(device=device).manual_seed(1)
        loss = sum((p.float() * torch.randn(p.shape, device=device, generator=g)).sum() for p in loose[name])
        loss.backward()
        if name == "moved":
            mover.optimizer_ready()
        result[f"{name}_with_main_grad"] = sum(bool(p.main_grad.abs().sum() > 0) for p in loose[name])
        result[f"{name}_grad_norm"] = float(optimizers[name].step()[1])
    result["same_weights_after_step"] = all(torch.equal(a, b) for a, b in zip(loose["moved"], loose["twin"]))
    out.put(result)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_megatron_chunk_trains_after_the_offload_round_trip():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_round_trip, args=(out,), daemon=True)
    proc.start()
    try:
        result = out.get(timeout=240)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    print("\n[megatron offload round trip]", result)
    n = result["params"]
    assert n > 0 and result["parked"] and result["freed"] >= 0.99 * result["weight_bytes"], result
    assert result["same_weights_after_onload"], result
    assert result["twin_with_main_grad"] == n and result["twin_grad_norm"] > 0, result
    # before the fix: moved_with_main_grad 0, moved_grad_norm 0.0, the weights unchanged by the step
    assert result["moved_with_main_grad"] == n, result
    assert result["moved_grad_norm"] == pytest.approx(result["twin_grad_norm"], rel=1e-6), result
    assert result["same_weights_after_step"], result
    assert proc.exitcode == 0
