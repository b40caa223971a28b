"""What the fsdp backend's actor and critic ranks share: the process group and 1-D data-parallel mesh, FSDP2
sharding, AdamW with its learning-rate schedule, and one optimizer step over a step's micro-batches."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from slime.backends.training.actor import TrainRayActor

def lr_at(args: Any, step: int, total_steps: int = 1) -> float:
    """Learning rate of optimizer step `step` (0-based: the steps taken before it), by Megatron-LM's
    OptimizerParamScheduler rule, slime's schedule: a linear warm-up from --lr-warmup-init over --lr-warmup-iters
    steps (or --lr-warmup-fraction of the decay steps), then --lr-decay-style down to --min-lr over the decay steps
    (--lr-decay-iters, else the run's `total_steps`), --min-lr after them. As in Megatron-LM the first warm-up step
    runs at --lr-warmup-init."""
    lr, min_lr = args.lr, args.min_lr
    decay = args.lr_decay_iters or max(total_steps, 1)
    warmup = args.lr_warmup_iters if args.lr_warmup_fraction is None else args.lr_warmup_fraction * decay
    decay = max(decay, math.floor(warmup) + 1)  # the decay horizon ends after the warm-up (Megatron-LM's kwargs)
    if warmup > 0 and step <= warmup:
        return args.lr_warmup_init + (lr - args.lr_warmup_init) * step / warmup
    style = args.lr_decay_style
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - ratio)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))
    raise NotImplementedError(
        f"--lr-decay-style {style}: the fsdp backend implements constant, linear and cosine; choose one of them"
    )


def setup_rank(actor: TrainRayActor, args: Any) -> None:
    """Process group, threads, seed, device and the 1-D data-parallel mesh of one rank (actor or critic)."""
    torch.set_num_threads(int(os.environ.get("SLIME_TRAIN_NUM_THREADS", "1")))
    if not dist.is_initialized():
        actor.init_process_group(args.distributed_backend, args.distributed_timeout_minutes)
    actor.rank, actor.world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    lr_at(args, 0)  # fail now, not after the first rollout, on an unsupported --lr-decay-style
    cuda = torch.cuda.is_available()
    actor.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    actor.mesh = init_device_mesh(actor.device.type, (actor.world_size,))


def shard_model(model: torch.nn.Module, layers_of: torch.nn.Module, mesh, device, path: str) -> torch.nn.Module:
    """FSDP2 on every decoder layer of `layers_of` (its `_no_split_modules`) and on the root `model`;
    bf16 compute with fp32 reduction on CUDA, fp32 on CPU. Dropout stays off (eval mode) in every
    forward: old-policy and training log-probs must agree."""
    model.eval()
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    layer_classes = set(getattr(layers_of, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{path}: cannot find the decoder layers to shard ({type(layers_of).__name__} lists none "
                         "in _no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # moves the shards to the mesh's device
    return model


def make_optimizer(model: torch.nn.Module, args: Any, lr: float) -> torch.optim.Optimizer:
    """torch's AdamW over the trained parameters, with the kernel --adam-kernel resolved to (fused on CUDA by
    default: torch's fused kernel takes FSDP2's DTensor parameters)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                             weight_decay=args.weight_decay, fused=True if args.adam_kernel == "fused" else None)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float | None) -> float:
    """Clip the global gradient norm (0/None: no clipping), step; returns the norm before clipping."""
    max_norm = clip_grad if clip_grad and clip_grad > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    return float(grad_norm)


def sum_over_ranks(local: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metric shares of global means: the sum over ranks is the global value."""
    names = sorted(local)
    if not names:
        return {}
    summed = torch.stack([local[k].detach().float().reshape(()) for k in names])
    dist.all_reduce(summed)
    return dict(zip(names, summed.tolist()))


def gather_rows(per_row: dict[int, torch.Tensor], num_rows: int, world_size: int) -> list[list[float]]:
    """Every rank's {row: tensor} -> the full per-row list, on every rank."""
    shards: list = [None] * world_size
    dist.all_gather_object(shards, {r: t.tolist() for r, t in per_row.items()})
    out: list[list[float] | None] = [None] * num_rows
    for shard in shards:
        for r, v in shard.items():
            out[r] = v
    return out


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, clip_grad: float,
                   micro_batches: list[list[int]],
                   micro_loss: Callable[[list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
                   ) -> tuple[dict[str, float], float]:
    """Forward and backward every micro-batch (`micro_loss(rows)` -> its share of the step's loss and metric
    shares), clip, step. Returns the metrics summed over ranks and the gradient norm before clipping."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    local: dict[str, torch.Tensor] = {}
    for rows in micro_batches:
        loss, shares = micro_loss(rows)
        # FSDP averages gradients over ranks; each rank's loss is its share of a global sum, so undo that.
        (loss * dist.get_world_size()).backward()
        for k, v in shares.items():
            local[k] = local[k] + v.detach() if k in local else v.detach()
    return sum_over_ranks(local), clip_and_step(model, optimizer, clip_grad)

