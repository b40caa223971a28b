"""`FSDPTrainRayActor`: one training rank of the `fsdp` backend (a transformers causal LM under FSDP2).

Per rank: the policy model (and, with a KL term, a frozen reference model) loaded with
`AutoModelForCausalLM.from_pretrained`, each decoder layer and the root wrapped with
`torch.distributed.fsdp.fully_shard` on a 1-D mesh over all ranks (pure data parallel, parameters,
gradients and optimizer state sharded), and AdamW. fp32 on CPU (gloo); on CUDA, bf16 compute with fp32
master weights and fp32 gradient reduction (FSDP2 MixedPrecisionPolicy).

One `train` call = one rollout: the batch's rows are cut into `num_steps = len(batch) // gbs` optimizer
steps; each rank trains on a contiguous share of every step's rows, in micro-batches. Old-policy (and
reference) log-probs are computed first, with the same micro-batches, so the first step's ppo_kl is 0.

Advantages are computed per rank for the rows it trains on (slime/utils/ppo_utils.py); with
`--normalize-advantages` their moments are all-reduced, so whitening is over the whole rollout batch. For
`--advantage-estimator ppo` the values come from the critic group (critic.py) and the actor keeps the
returns for the critic to fetch (`get_returns`).

Micro-batches are `--micro-batch-size` rows or, with `--use-dynamic-batch-size`, token-budgeted
(slime/backends/training/batching.py `plan_micro_batches`, equal in count on every rank since FSDP forwards are
collective). Simplifications (see docs/fsdp_backend.md, docs/algorithms.md): padded micro-batches, no
packing; dropout is kept off (eval mode) in every forward, so recomputed and
training log-probs agree; no offloading between rollout and training (`--offload-train` is not acted on);
no gradient checkpointing.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from slime.algorithm.loss import compute_actor_loss
from slime.backends.fsdp_utils import checkpoint, weight_sync
from slime.backends.fsdp_utils.data import (
    forward_response_log_probs,
    make_micro_batch,
    rows_per_step,
    unpad_per_token,
)
from slime.backends.training import policy_batch
from slime.backends.training.actor import TrainRayActor
from slime.backends.training.batching import plan_micro_batches
from slime.utils import ppo_utils
from slime.utils.progress import progress
from slime.utils.types import TrainBatch

logger = logging.getLogger(__name__)

DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE = 512 * 2**20


def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        raise ImportError(
            f"--train-backend fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
            f"this torch is {torch.__version__}: upgrade torch"
        ) from e
    return fully_shard, MixedPrecisionPolicy


def lr_at(args: Any, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based): Megatron-style warm-up then decay."""
    lr, min_lr = args.lr, args.min_lr
    warmup = args.lr_warmup_iters
    if step < warmup:
        init = args.lr_warmup_init
        return init + (lr - init) * (step + 1) / warmup
    style = args.lr_decay_style
    decay_iters = args.lr_decay_iters
    if style == "constant" or not decay_iters:
        return lr
    ratio = min(1.0, max(0.0, (step - warmup) / max(1, decay_iters - warmup)))
    if style == "linear":
        return lr - (lr - min_lr) * ratio
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))
    raise NotImplementedError(
        f"--lr-decay-style {style}: the fsdp backend implements constant, linear and cosine; choose one of them"
    )


def setup_rank(actor: TrainRayActor, args: Any) -> None:
    """Process group, threads, seed, device and the 1-D data-parallel mesh of one rank (actor or critic)."""
    torch.set_num_threads(int(os.environ.get("SLIME_TRAIN_NUM_THREADS", "1")))
    if not dist.is_initialized():
        backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        actor.init_process_group(backend, args.distributed_timeout_minutes)
    actor.rank, actor.world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    lr_at(args, 0)  # fail now, not after the first rollout, on an unsupported --lr-decay-style

    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    actor.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    actor.mesh = init_device_mesh(actor.device.type, (actor.world_size,))


def shard_model(model: torch.nn.Module, layers_of: torch.nn.Module, mesh, device, path: str) -> torch.nn.Module:
    """FSDP2 on every decoder layer of `layers_of` (its `_no_split_modules`) and on the root `model`;
    bf16 compute with fp32 reduction on CUDA, fp32 on CPU. Dropout stays off (eval mode) in every
    forward: old-policy and training log-probs must agree."""
    fully_shard, MixedPrecisionPolicy = _fully_shard()
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
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                             weight_decay=args.weight_decay)


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


class FSDPTrainRayActor(TrainRayActor):
    # ---- setup ------------------------------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool) -> int:
        if role != "actor":
            raise ValueError(f"FSDPTrainRayActor: role {role!r}; the critic is FSDPCriticRayActor (critic.py)")
        self.args = args
        setup_rank(self, args)
        if args.advantage_estimator not in ppo_utils.ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage-estimator {args.advantage_estimator!r}: choose one of "
                             f"{', '.join(ppo_utils.ADVANTAGE_ESTIMATORS)}")
        self._returns: list[list[float]] | None = None

        ckpt = checkpoint.find_checkpoint(args.load)
        self.model = self._build_model(ckpt.path if ckpt else args.hf_checkpoint, trainable=True)
        self.ref_model = None
        if with_ref:
            ref_load = args.ref_load
            if ref_load and not checkpoint.is_hf_folder(ref_load):
                logger.warning("--ref-load %s is not an HF folder (no config.json); the fsdp backend takes the "
                               "reference model from --hf-checkpoint %s", ref_load, args.hf_checkpoint)
            self.ref_model = self._build_model(
                ref_load if checkpoint.is_hf_folder(ref_load) else args.hf_checkpoint, trainable=False
            )
        self.optimizer = make_optimizer(self.model, args, args.lr)
        self.global_step = 0
        if ckpt is None:
            return args.start_rollout_id or 0
        if not args.no_load_optim:
            checkpoint.load_optimizer(self.model, self.optimizer, ckpt.path)
        self.global_step = int(ckpt.trainer_state.get("global_step", 0))
        logger.info("rank %d: resumed from %s (rollout %d)", self.rank, ckpt.path, ckpt.iteration)
        return ckpt.iteration + 1

    def _build_model(self, path: str, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if not checkpoint.is_hf_folder(path):
            raise FileNotFoundError(f"--hf-checkpoint {path}: not an HF model folder (no config.json there)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.requires_grad_(trainable)
        return shard_model(model, model, self.mesh, self.device, path)

    # ---- log-probs --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _log_probs_of_rows(self, model, batch: TrainBatch, micro_batches: list[list[int]]) -> dict[int, torch.Tensor]:
        out = {}
        for rows in micro_batches:
            mb = make_micro_batch([batch.tokens[r] for r in rows], [batch.response_lengths[r] for r in rows],
                                  device=self.device)
            lp, _ = forward_response_log_probs(model, mb, self.args.rollout_temperature)
            for i, r in enumerate(rows):
                out[r] = lp[i, : batch.response_lengths[r]]
        return out

    @torch.no_grad()
    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """All ranks run it on the same rows (FSDP forwards are collective); each returns all rows."""
        result: list[list[float]] = []
        for rows in plan_micro_batches(self.args, tokens, range(len(tokens)), self.device, log_probs=True):
            mb = make_micro_batch([tokens[r] for r in rows], [response_lengths[r] for r in rows], device=self.device)
            lp, _ = forward_response_log_probs(self.model, mb, self.args.rollout_temperature)
            result.extend(unpad_per_token(lp, mb.response_lengths))
        return result

    # ---- training ---------------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None = None) -> dict[str, float]:
        """One rollout's policy update. `values` (ppo): the critic's per-token values of every row; the
        returns computed from them are then available from `get_returns`. With `--num-critic-only-steps N`
        the first N rollouts compute advantages and returns but do not update the policy."""
        args = self.args
        steps = rows_per_step(len(batch), args.global_batch_size, self.world_size, self.rank)
        plan = [plan_micro_batches(args, batch.tokens, rows, self.device) for rows in steps]
        all_micro_batches = [mb for step in plan for mb in step]
        local_rows = [r for rows in steps for r in rows]

        rollout_lp = policy_batch.rollout_log_probs(args, batch, local_rows, self.device)
        extra: dict[str, float] = {}
        # One optimizer step per rollout and no reference model: the policy that generated the log-probs of
        # the loss is still the trained one, so the training forward's own log-probs (detached) are the old
        # ones; skip the separate forward (old_lp = None: filled in per micro-batch).
        reuse_forward = len(plan) == 1 and self.ref_model is None
        if args.use_rollout_logprobs:
            old_lp = rollout_lp
        elif reuse_forward:
            old_lp = None
        else:
            old_lp = self._log_probs_of_rows(self.model, batch, all_micro_batches)
            if rollout_lp is not None:
                extra["train/train_rollout_logprob_abs_diff"] = policy_batch.logprob_abs_diff(
                    old_lp, rollout_lp, batch, self.device)
        policy_batch.require_ref(args, self.ref_model is not None)
        ref_lp = (self._log_probs_of_rows(self.ref_model, batch, all_micro_batches)
                  if self.ref_model is not None else None)

        advantages, returns = policy_batch.advantages_and_returns(args, batch, local_rows, old_lp, ref_lp, values,
                                                                  self.device)
        # Only a critic (ppo, given values) needs the returns of every row.
        self._returns = self._gather_rows(returns, len(batch)) if returns is not None and values is not None else None
        if rollout_id < (args.num_critic_only_steps or 0):
            extra["train/critic_only_step"] = 1.0
            return extra

        totals: dict[str, float] = defaultdict(float)
        seen_lp: dict[int, torch.Tensor] = {}  # the training forward's log-probs, when they are the old ones
        with progress(sum(map(len, plan)), f"train {rollout_id}", "micro-batch", enabled=self.rank == 0) as bar:
            for s, micro_batches in enumerate(plan):
                global_rows = range(s * args.global_batch_size, (s + 1) * args.global_batch_size)
                step_metrics = self._train_step(batch, micro_batches, global_rows, advantages,
                                                seen_lp if old_lp is None else old_lp, ref_lp, rollout_lp, bar,
                                                fill_old=old_lp is None)
                for k, v in step_metrics.items():
                    totals[k] += v
        if old_lp is None and rollout_lp is not None:
            extra["train/train_rollout_logprob_abs_diff"] = policy_batch.logprob_abs_diff(
                seen_lp, rollout_lp, batch, self.device)
        metrics = {k: v / len(plan) for k, v in totals.items()}
        metrics.update(extra)
        return metrics

    def get_returns(self) -> list[list[float]] | None:
        """The returns (ppo: advantages + values) of every row of the last `train` call, for the critic."""
        return self._returns

    def _gather_rows(self, per_row: dict[int, torch.Tensor], num_rows: int) -> list[list[float]]:
        """Every rank's {row: tensor} -> the full per-row list, on every rank."""
        shards: list = [None] * self.world_size
        dist.all_gather_object(shards, {r: t.tolist() for r, t in per_row.items()})
        out: list[list[float] | None] = [None] * num_rows
        for shard in shards:
            for r, v in shard.items():
                out[r] = v
        return out

    def _train_step(
        self, batch, micro_batches, global_rows, advantages, old_lp, ref_lp, rollout_lp, bar, fill_old=False
    ) -> dict[str, float]:
        args = self.args
        denominator = policy_batch.loss_denominator(args, batch, global_rows)
        lr = lr_at(args, self.global_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        local: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        self.optimizer.zero_grad(set_to_none=True)
        for rows in micro_batches:
            loss, shares = self._micro_batch_loss(batch, rows, advantages, old_lp, ref_lp, rollout_lp, denominator,
                                                  fill_old)
            # FSDP averages gradients over ranks; each rank's loss is its share of a global sum, so undo that.
            (loss * self.world_size).backward()
            for k, v in shares.items():
                local[k] += v
            bar.update(1)

        grad_norm = clip_and_step(self.model, self.optimizer, args.clip_grad)
        self.global_step += 1
        metrics = sum_over_ranks(local)
        metrics["train/grad_norm"] = grad_norm
        metrics["train/lr"] = lr
        return metrics

    def _micro_batch_loss(
        self, batch, rows, advantages, old_lp, ref_lp, rollout_lp, denominator: float, fill_old: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward one micro-batch: its share of the global-batch loss, and its (detached) metric shares.
        `fill_old`: record this forward's detached log-probs into `old_lp` first (they are the old ones)."""
        mb = make_micro_batch([batch.tokens[r] for r in rows], [batch.response_lengths[r] for r in rows],
                              device=self.device)
        log_probs, entropy = forward_response_log_probs(self.model, mb, self.args.rollout_temperature,
                                                        with_entropy=True)
        if fill_old:
            for i, r in enumerate(rows):
                old_lp[r] = log_probs[i, : batch.response_lengths[r]].detach()
        inputs = policy_batch.loss_inputs(self.args, batch, rows, mb, log_probs, entropy, advantages, old_lp,
                                          ref_lp, rollout_lp, denominator)
        return compute_actor_loss(self.args, inputs)

    # ---- weights and checkpoints ------------------------------------------------------------------------
    def update_weights(self, engines: list[Any], weight_version: int) -> None:
        buffer_size = self.args.update_weight_buffer_size or DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
        weight_sync.update_weights(self.model, engines, weight_version, buffer_size, self.engine_push)

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save() called without --save; pass --save DIR to write checkpoints")
        optimizer = None if self.args.no_save_optim else self.optimizer
        checkpoint.save_checkpoint(self.model, optimizer, self.args.save, rollout_id, self.args.hf_checkpoint,
                                   {"global_step": self.global_step})
