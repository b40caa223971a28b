"""`--adam-kernel` in the fsdp trainer: torch's AdamW over FSDP2's DTensor parameters, fused or torch's default
(slime/backends/fsdp_utils/parallel.py `make_optimizer`; slime/backends/training/optimizer_state.py
`set_adam_kernel`). The real sharding and DCP checkpoint of the trainer, one rank in a child process (gloo here; nccl
and CUDA parameters in tests/gpu/test_adam_kernel_gpu.py). Two twin models take the same three steps, one per
kernel: their weights agree to rounding. Then a fresh fused model and optimizer resume from the unfused run's
checkpoint (slime/backends/fsdp_utils/checkpoint.py `load_optimizer`): the fused kernel stays (torch's
`load_state_dict` would take the saving run's), each step counter sits where the fused kernel keeps it, and the next
step agrees with the unfused run's."""

from __future__ import annotations

import pytest

from slime.utils.errors import SlimeArgumentError
from tests.args import make_args
from tests.conftest import model_args
from tests.e2e_cpu.test_megatron_adam_kernel import check_adam_kernels
from tests.forkserver import spawned_result


def fsdp_adam_kernels(out, model_dir: str, root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils import checkpoint
    from slime.backends.fsdp_utils.parallel import make_optimizer, shard_model
    from slime.utils.net import free_port

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    kernels = ("fused", "unfused")
    args = {k: make_args("--train-backend", "fsdp", "--hf-checkpoint", model_dir, "--adam-kernel", k)
            for k in kernels}

    def build(k: str):
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model = shard_model(model, model, mesh, device, model_dir)
        return model, make_optimizer(model, args[k], 1e-2)

    models, optimizers = {}, {}
    for k in kernels:
        models[k], optimizers[k] = build(k)

    def weights(k: str) -> list:
        return [p.full_tensor().detach().float().clone() for p in models[k].parameters()]

    def flags(k: str) -> list:
        return sorted({str(g["fused"]) for g in optimizers[k].param_groups})

    def steps(k: str) -> list:
        return sorted({f"{s['step'].device.type}:{float(s['step']):g}" for s in optimizers[k].state.values()})

    def step(k: str, seed: int) -> None:
        optimizers[k].zero_grad()
        g = torch.Generator().manual_seed(seed)
        loss = sum((p.float() * torch.randn(p.shape, generator=g).to(device)).sum()
                   for p in (q.full_tensor() for q in models[k].parameters()))
        loss.backward()
        optimizers[k].step()

    initial = weights("fused")
    result = {"built": {k: flags(k) for k in kernels}}
    for seed in range(3):
        for k in kernels:
            step(k, seed)
    result["steps"] = {k: steps(k) for k in kernels}
    result["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(weights("fused"), weights("unfused")))
    result["moved"] = min(float((a - b).abs().max()) for a, b in zip(weights("fused"), initial))
    checkpoint.save_checkpoint(models["unfused"], optimizers["unfused"], root, 0, None, {},
                               write_folder=lambda *a: None)
    # A fused run resumes from it (as FSDPTrainRayActor.init: a fresh model and optimizer, then the load).
    models["resumed"], optimizers["resumed"] = build("fused")
    with torch.no_grad():
        for a, b in zip(models["resumed"].parameters(), models["unfused"].parameters()):
            a.copy_(b)
    assert checkpoint.load_optimizer(models["resumed"], optimizers["resumed"], checkpoint.iteration_dir(root, 0))
    result["loaded"] = {"flags": flags("resumed"), "steps": steps("resumed")}
    for k in ("resumed", "unfused"):
        step(k, 3)
    result["resumed"] = {"flags": flags("resumed"), "steps": steps("resumed")}
    result["resumed_diff"] = max(float((a - b).abs().max()) for a, b in zip(weights("resumed"), weights("unfused")))
    out.put(result)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp_fused_and_unfused_adam_train_alike_and_a_checkpoint_keeps_the_kernel(tiny_model_dir, tmp_path):
    # fp32 parameters and moments: the kernels agree to float rounding
    check_adam_kernels(spawned_result(fsdp_adam_kernels, tiny_model_dir, str(tmp_path)), "cpu", tolerance=1e-5)


def test_auto_is_fused_on_cuda_for_a_torch_adam():
    megatron_flags = (*model_args("tiny-qwen3"), "--train-backend", "megatron")
    assert make_args(*megatron_flags, use_cuda=True).adam_kernel == "fused"
    assert make_args(*megatron_flags, use_cuda=False).adam_kernel == "unfused"
    assert make_args(*megatron_flags, "--optimizer", "sgd", use_cuda=True).adam_kernel == "unfused"
    assert make_args(*megatron_flags, "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                     use_cuda=True).adam_kernel == "unfused"
    assert make_args(*megatron_flags, "--adam-kernel", "unfused", use_cuda=True).adam_kernel == "unfused"
    assert make_args("--train-backend", "fsdp", use_cuda=True).adam_kernel == "fused"  # always AdamW
    assert make_args("--train-backend", "fsdp", use_cuda=False).adam_kernel == "unfused"
    assert make_args("--train-backend", "fsdp", "--adam-kernel", "fused").adam_kernel == "fused"


def test_fused_is_refused_where_no_torch_adam_steps():
    with pytest.raises(SlimeArgumentError, match="--adam-kernel fused .*--optimizer sgd"):
        make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--optimizer", "sgd",
                  "--adam-kernel", "fused")
    with pytest.raises(SlimeArgumentError, match="--adam-kernel fused with --optimizer-cpu-offload"):
        make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--optimizer-cpu-offload",
                  "--use-precision-aware-optimizer", "--bf16",
                  "--adam-kernel", "fused")
