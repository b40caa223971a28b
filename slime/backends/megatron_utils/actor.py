"""`MegatronTrainRayActor`: one training rank of the `megatron` backend (megatron-core GPTModel).

Per rank: megatron-core's parallel groups (TP × PP × CP × EP over the training ranks, the rest data
parallel), this pipeline stage's model chunks under megatron-core DDP, its (distributed) optimizer and
`OptimizerParamScheduler`; with a KL term a frozen reference model of the same layout. Weights come from
`--load` (a torch_dist checkpoint: resume, or a "release" starting point) or else from the HF
`--hf-checkpoint`, converted per model family; the reference model from `--ref-load` (torch_dist or HF)
or `--hf-checkpoint`. MODEL_ARGS are checked against the HF config.json first.

One `train` call = one rollout, as in the fsdp backend: the batch is cut into optimizer steps of
`--global-batch-size` rows, each data-parallel rank takes a contiguous share of a step's rows, in
micro-batches of `--micro-batch-size` rows (or, with `--use-dynamic-batch-size`, of at most
`--max-tokens-per-gpu` tokens), packed into one row each (`--qkv-format thd`, default) or right-padded
(`bshd`), which run through megatron-core's pipeline schedule. Log-probs,
advantages and losses live on the last pipeline stage; metrics travel to rank 0.

Simplifications (docs/megatron_backend.md): the model stays in eval mode (dropout off) so recomputed and
training log-probs agree; no offloading between rollout and training.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from slime.algorithm.loss import compute_actor_loss
from slime.backends.megatron_utils import args as mg_args
from slime.backends.megatron_utils import checkpoint, config_check, weights
from slime.backends.megatron_utils.forward import response_log_probs, run_pipeline
from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel, unwrap
from slime.backends.training import policy_batch
from slime.backends.training.actor import TrainRayActor
from slime.backends.training.batching import (
    make_micro_batch,
    make_packed_micro_batch,
    plan_micro_batches,
    rows_per_step,
)
from slime.utils import ppo_utils
from slime.utils.progress import progress
from slime.utils.types import TrainBatch

logger = logging.getLogger(__name__)

DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE = 512 * 2**20


def _ps():
    from megatron.core import parallel_state

    return parallel_state


class MegatronTrainRayActor(TrainRayActor):
    # ---- setup ------------------------------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool) -> int:
        if role != "actor":
            raise ValueError(f"--train-backend megatron has no {role} role; the PPO critic runs with "
                             "--train-backend fsdp")
        mg_args.check_megatron_runtime(args)
        if args.advantage_estimator not in ppo_utils.ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage-estimator {args.advantage_estimator!r}: choose one of "
                             f"{', '.join(ppo_utils.ADVANTAGE_ESTIMATORS)}")
        self.args = args
        torch.set_num_threads(int(os.environ.get("SLIME_TRAIN_NUM_THREADS", "1")))
        if not dist.is_initialized():
            backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
            self.init_process_group(backend, args.distributed_timeout_minutes)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        initialize_parallel(args)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.hf_config = self._hf_config(args.hf_checkpoint)

        ckpt = checkpoint.find_checkpoint(args.load)
        self.model = build_model(args)
        self._load_weights(self.model, ckpt, args.hf_checkpoint)
        self.ref_model = None
        if with_ref:
            self.ref_model = build_model(args, wrap=False)
            ref_ckpt, ref_hf = self._ref_source(args)
            if ckpt is None and ref_ckpt is None and ref_hf == args.hf_checkpoint:
                # The policy was just loaded from the same HF weights: copy them instead of reading them again.
                for ref, chunk in zip(self.ref_model, self.model):
                    ref.load_state_dict(unwrap(chunk).state_dict())
            else:
                self._load_weights(self.ref_model, ref_ckpt, ref_hf)
        for chunk in self.model:
            chunk.eval()

        self.optimizer, self.scheduler = build_optimizer(args, self.model, self._total_steps(args))
        config = self.model[0].config
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [chunk.no_sync for chunk in self.model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.global_step = 0
        if ckpt is None or ckpt.iteration is None:
            return args.start_rollout_id or 0
        if not args.no_load_optim:
            checkpoint.load_optimizer(ckpt, self.model, self.optimizer)
            if "scheduler" in ckpt.state:
                self.scheduler.load_state_dict(ckpt.state["scheduler"])
        self.global_step = int(ckpt.state.get("global_step", 0))
        logger.info("rank %d: resumed from %s (rollout %d)", self.rank, ckpt.path, ckpt.iteration)
        return ckpt.iteration + 1

    @staticmethod
    def _hf_config(path: str | None) -> dict | None:
        if not config_check.is_hf_folder(path):
            return None
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)

    @staticmethod
    def _ref_source(args):
        """(torch_dist checkpoint, HF folder) of the reference model: --ref-load (either kind), else the
        --hf-checkpoint weights."""
        if not args.ref_load:
            return None, args.hf_checkpoint
        if config_check.is_hf_folder(args.ref_load):
            return None, args.ref_load
        ckpt = checkpoint.find_checkpoint(args.ref_load, "--ref-load")
        if ckpt is None:
            raise FileNotFoundError(f"--ref-load {args.ref_load}: neither an HF model folder (config.json) nor a "
                                    "torch_dist checkpoint (tools/convert_hf_to_torch_dist.py writes one)")
        return ckpt, None

    def _load_weights(self, model, ckpt, hf_path: str | None) -> None:
        if ckpt is not None:
            checkpoint.load_model(ckpt, model)
        elif config_check.is_hf_folder(hf_path):
            weights.load_hf_weights(model, self.args, hf_path)
        else:
            raise FileNotFoundError(
                f"--train-backend megatron: no weights to start from: --load {self.args.load} holds no torch_dist "
                f"checkpoint and --hf-checkpoint {hf_path} is not an HF model folder"
            )

    @staticmethod
    def _total_steps(args) -> int:
        per_rollout = max(1, args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size)
        return max(1, (args.num_rollout or 1) * per_rollout)

    # ---- batching -----------------------------------------------------------------------------------------
    def _dp(self) -> tuple[int, int, Any]:
        ps = _ps()
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    @property
    def _packed(self) -> bool:
        return self.args.qkv_format == "thd"

    def _split(self, tokens: list[list[int]], rows: list[int], log_probs: bool = False) -> list[list[int]]:
        return plan_micro_batches(self.args, tokens, rows, self.device, self._dp()[2], log_probs, self._packed)

    def _micro_batch(self, tokens, response_lengths, rows):
        tokens, response_lengths = [tokens[r] for r in rows], [response_lengths[r] for r in rows]
        if not self._packed:
            return make_micro_batch(tokens, response_lengths, device=self.device)
        multiple = self.args.tensor_model_parallel_size if self.args.sequence_parallel else 1
        return make_packed_micro_batch(tokens, response_lengths, device=self.device, multiple=multiple)

    # ---- log-probs --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _log_probs_of_rows(self, model, tokens, response_lengths, micro_batches) -> dict[int, torch.Tensor]:
        """{row: response log-probs} on the last pipeline stage; {} on the others."""
        mbs = [self._micro_batch(tokens, response_lengths, rows) for rows in micro_batches]

        def loss_fn(mb, logits):
            lp, _ = response_log_probs(logits, mb, self.args.rollout_temperature, self.args.vocab_size)
            return torch.zeros((), device=logits.device), {"log_probs": lp}

        outputs = run_pipeline(model, mbs, loss_fn, forward_only=True)
        result = {}
        for rows, out in zip(micro_batches, outputs):
            for i, r in enumerate(rows):
                result[r] = out["log_probs"][i, : response_lengths[r]]
        return result

    def _from_last_stage(self, obj):
        """An object of the last pipeline stage, on every stage of this rank's pipeline."""
        ps = _ps()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """Every data-parallel replica runs all rows; each rank returns all rows."""
        rows = list(range(len(tokens)))
        lp = self._log_probs_of_rows(self.model, tokens, response_lengths, self._split(tokens, rows, log_probs=True))
        result = [lp[r].float().cpu().tolist() for r in rows] if lp else None
        return self._from_last_stage(result)

    # ---- training ---------------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None = None) -> dict[str, float]:
        args = self.args
        if values is not None:
            raise ValueError("--train-backend megatron has no PPO critic; use --train-backend fsdp for "
                             "--advantage-estimator ppo")
        dp_rank, dp_size, dp_group = self._dp()
        last_stage = _ps().is_pipeline_last_stage(ignore_virtual=True)
        steps = rows_per_step(len(batch), args.global_batch_size, dp_size, dp_rank)
        plan = [self._split(batch.tokens, rows) for rows in steps]
        local_rows = [r for rows in steps for r in rows]
        log_prob_micro_batches = self._split(batch.tokens, local_rows, log_probs=True)

        rollout_lp = policy_batch.rollout_log_probs(args, batch, local_rows, self.device)
        extra: dict[str, float] = {}
        if args.use_rollout_logprobs:
            old_lp = rollout_lp
        else:
            old_lp = self._log_probs_of_rows(self.model, batch.tokens, batch.response_lengths, log_prob_micro_batches)
            if rollout_lp is not None and last_stage:
                extra["train/train_rollout_logprob_abs_diff"] = policy_batch.logprob_abs_diff(
                    old_lp, rollout_lp, batch, self.device, dp_group)
        policy_batch.require_ref(args, self.ref_model is not None)
        ref_lp = None
        if self.ref_model is not None:
            ref_lp = self._log_probs_of_rows(self.ref_model, batch.tokens, batch.response_lengths,
                                             log_prob_micro_batches)
        advantages = None
        if last_stage:
            advantages, _ = policy_batch.advantages_and_returns(args, batch, local_rows, old_lp, ref_lp, None,
                                                                self.device, dp_group)
        if rollout_id < (args.num_critic_only_steps or 0):
            extra["train/critic_only_step"] = 1.0
            return self._from_last_stage(extra)

        totals: dict[str, float] = defaultdict(float)
        with progress(sum(map(len, plan)), f"train {rollout_id}", "micro-batch", enabled=self.rank == 0) as bar:
            for s, micro_batches in enumerate(plan):
                global_rows = range(s * args.global_batch_size, (s + 1) * args.global_batch_size)
                step_metrics = self._train_step(batch, micro_batches, global_rows, advantages, old_lp, ref_lp,
                                                rollout_lp)
                bar.update(len(micro_batches))  # the pipeline schedule runs a step's micro-batches in one call
                for k, v in step_metrics.items():
                    totals[k] += v
        metrics = {k: v / len(plan) for k, v in totals.items()}
        metrics.update(extra)
        return self._from_last_stage(metrics)

    def _train_step(self, batch, micro_batches, global_rows, advantages, old_lp, ref_lp, rollout_lp):
        args = self.args
        _, dp_size, dp_group = self._dp()
        denominator = policy_batch.loss_denominator(args, batch, global_rows)
        mbs = [self._micro_batch(batch.tokens, batch.response_lengths, rows) for rows in micro_batches]
        rows_of = {id(mb): rows for mb, rows in zip(mbs, micro_batches)}
        # megatron-core divides each micro-batch loss by their number and DDP averages gradients over the
        # data-parallel ranks; each loss here is a share of the global-batch loss, so undo both.
        scale = dp_size * len(mbs)

        def loss_fn(mb, logits):
            log_probs, entropy = response_log_probs(logits, mb, args.rollout_temperature, args.vocab_size,
                                                     with_entropy=True)
            inputs = policy_batch.loss_inputs(args, batch, rows_of[id(mb)], mb, log_probs, entropy, advantages,
                                              old_lp, ref_lp, rollout_lp, denominator)
            loss, shares = compute_actor_loss(args, inputs)
            return loss * scale, shares

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = run_pipeline(self.model, mbs, loss_fn, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.global_step += 1
        metrics: dict[str, float] = {}
        if outputs:
            names = sorted(outputs[0])
            summed = torch.stack([sum(out[k].float() for out in outputs).reshape(()) for k in names])
            dist.all_reduce(summed, group=dp_group)
            metrics = dict(zip(names, summed.tolist()))
        metrics["train/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if not update_ok:
            metrics["train/skipped_step"] = 1.0
        return metrics

    # ---- weights and checkpoints ------------------------------------------------------------------------
    def update_weights(self, engines: list[Any], weight_version: int) -> None:
        """Collective: HF tensors of the whole model stream to rank 0, which sends them in buckets of
        --update-weight-buffer-size: as CUDA IPC handles when the engines share the GPUs (--colocate), else
        by broadcast over a process group formed with the engines (slime/weight_sync/push.py)."""
        if self.hf_config is None:
            raise ValueError("--train-backend megatron: weight sync needs --hf-checkpoint (its config.json picks "
                             "the HF names the engines load)")
        push = self.rank == 0 and bool(engines)
        route = self.engine_push(engines) if push else None
        version = str(weight_version)

        def send(bucket):
            route.send(bucket, version)

        limit = self.args.update_weight_buffer_size or DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
        bucket: list[tuple[str, torch.Tensor]] = []
        size = sent = 0
        with progress(None, f"push v{weight_version}", "bucket", enabled=push) as bar:
            for name, t in weights.iter_hf_weights(self.model, self.args, self.hf_config):
                if not push:
                    continue
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= limit:
                    send(bucket)
                    sent, bucket, size = sent + 1, [], 0
                    bar.update(1)
            if push and bucket:
                send(bucket)
                sent += 1
                bar.update(1)
        if push:
            logger.info("update_weights v%s: %d bucket(s) sent", weight_version, sent)
        dist.barrier()

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save() called without --save; pass --save DIR to write checkpoints")
        optimizer = None if self.args.no_save_optim else self.optimizer
        state = {"global_step": self.global_step, "scheduler": self.scheduler.state_dict(),
                 "megatron_args": self.args.megatron_args}
        checkpoint.save(self.args.save, rollout_id, self.model, optimizer, state)

