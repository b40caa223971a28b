"""`MegatronTrainRayActor`: one training rank of the `megatron` backend (megatron-core GPTModel).

Per rank: megatron-core's parallel groups (TP × PP × CP × EP over the training ranks, the rest data
parallel), this pipeline stage's model chunks under megatron-core DDP, its (distributed) optimizer and
`OptimizerParamScheduler`; with a KL term a frozen reference model of the same layout, with --use-opd
--opd-type megatron a frozen teacher too. Weights come from `--load` (a torch_dist checkpoint: resume, or a
"release" starting point) or else from the HF `--hf-checkpoint`, converted per model family; the reference
model from `--ref-load` (torch_dist or HF) or `--hf-checkpoint`; the teacher from `--opd-teacher-load`
(torch_dist, at `--opd-teacher-ckpt-step` when given, or HF). MODEL_ARGS are checked against the HF config.json
first.

One `train` call = one rollout, the shared `PolicyTrainer`'s steps (slime/backends/training/policy.py): the
batch is cut into optimizer steps of `--global-batch-size` rows, each data-parallel rank takes its share of a
step's rows, in micro-batches of `--micro-batch-size` rows (or, with `--use-dynamic-batch-size`, of at most
`--max-tokens-per-gpu` tokens), packed into one row each (`--qkv-format thd`, default) or right-padded
(`bshd`), which run through megatron-core's pipeline schedule. Log-probs, advantages and losses live on the
last pipeline stage; metrics travel to rank 0. slime's Megatron hooks (--custom-megatron-init-path,
--custom-megatron-before-log-prob-hook-path, --custom-megatron-before-train-step-hook-path) are called here, where
slime calls them; --custom-model-provider-path and --spec build the model (plugins.py, model.py).

Simplifications (docs/megatron_backend.md): the model stays in eval mode (dropout off) so recomputed and
training log-probs agree; no offloading between rollout and training.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron_utils import args as mg_args
from slime.backends.megatron_utils import checkpoint, config_check, lora, lora_weights, plugins, weights
from slime.backends.megatron_utils.forward import response_log_probs, run_pipeline
from slime.backends.megatron_utils.model import build_model, build_optimizer, chained, initialize_parallel, unwrap
from slime.backends.megatron_utils.vision_language import micro_batch_inputs, vision_spec
from slime.backends.training import hf_save
from slime.backends.training.offload import TrainState
from slime.backends.training.batching import (
    make_micro_batch,
    make_packed_micro_batch,
    plan_micro_batches,
    run_optimizer_steps,
)
from slime.backends.training.policy import PolicyTrainer
from slime.backends.training.record import RolloutRecord
from slime.utils.lora_adapter import ADAPTER_DIR
from slime.utils.types import TrainBatch
from slime.weight_sync import push as weight_push
from slime.weight_sync.adapter import push_adapter
from slime.weight_sync.frozen import FrozenPushes

logger = logging.getLogger(__name__)

def _ps():
    from megatron.core import parallel_state

    return parallel_state


class MegatronTrainRayActor(PolicyTrainer):
    defers_optimizer_onload = True  # the first step's forward and backward run beside the optimizer's onload
    # ---- setup ------------------------------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool, num_rollout: int | None = None) -> int:
        if role != "actor":
            raise ValueError(f"--train-backend megatron has no {role} role; the PPO critic runs with "
                             "--train-backend fsdp")
        mg_args.check_megatron_runtime(args)
        self.args = args
        plugins.set_args(args)
        self.hooks = plugins.MegatronHooks.from_args(args)
        torch.set_num_threads(int(os.environ.get("SLIME_TRAIN_NUM_THREADS", "1")))
        if args.deterministic_mode:
            mg_args.enable_deterministic_mode()
        if not dist.is_initialized():
            self.init_process_group(args.distributed_backend, args.distributed_timeout_minutes)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        initialize_parallel(args)
        if self.hooks.init is not None:
            self.hooks.init(args)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.hf_config = self._hf_config(args.hf_checkpoint)
        self.vision = vision_spec(args)

        ckpt = checkpoint.find_checkpoint(args.load)
        self.model = build_model(args)
        # Without a checkpoint in --load the policy starts from the reference model's weights (--ref-load at
        # --ref-ckpt-step, else --hf-checkpoint): a fresh start at rollout 0, no optimizer state.
        self._load_weights(self.model, *((ckpt, None) if ckpt is not None else self._ref_source(args)),
                           adapters=self._lora_checkpoint(ckpt))
        if args.lora_rank:
            self._start_adapter(ckpt)
        self.ref_model = None
        self.base_is_reference = with_ref and bool(args.lora_rank)  # the reference pass: adapters off, no copy
        if with_ref and not self.base_is_reference:
            self.ref_model = build_model(args, wrap=False)
            if ckpt is None:
                self.copy_actor_to_ref()  # the policy was just loaded from the reference weights: no second read
            else:
                self._load_weights(self.ref_model, *self._ref_source(args))
        self.teacher_model = None
        if args.use_opd and args.opd_type == "megatron":  # slime's trainer-held teacher (the student's layout)
            self.teacher_model = build_model(args, wrap=False)
            self._load_weights(self.teacher_model, *self._teacher_source(args))
        for chunk in self.model:
            chunk.eval()
        self.init_policy_hooks()

        self.optimizer, self.scheduler = build_optimizer(
            args, self.model, run_optimizer_steps(args, args.num_rollout if num_rollout is None else num_rollout))
        config = self.model[0].config
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [chunk.no_sync for chunk in self.model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.global_step = 0
        if ckpt is None or ckpt.iteration is None or args.finetune:  # --finetune: the weights only, rollout 0
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
        return config_check.read_config_json(path) if config_check.is_hf_folder(path) else None

    @staticmethod
    def _ref_source(args):
        """(torch_dist checkpoint, HF folder) of the reference model, and of the policy when --load holds no
        checkpoint: --ref-load (either kind; a save folder at its iteration --ref-ckpt-step when given, else its
        latest), else the --hf-checkpoint weights."""
        if not args.ref_load:
            return None, args.hf_checkpoint
        if args.ref_ckpt_step is not None:
            return checkpoint.checkpoint_at(args.ref_load, args.ref_ckpt_step, "--ref-load", "--ref-ckpt-step"), None
        if config_check.is_hf_folder(args.ref_load):
            return None, args.ref_load
        ckpt = checkpoint.find_checkpoint(args.ref_load, "--ref-load")
        if ckpt is None:
            raise FileNotFoundError(f"--ref-load {args.ref_load}: neither an HF model folder (config.json) nor a "
                                    "torch_dist checkpoint (tools/convert_hf_to_torch_dist.py writes one)")
        return ckpt, None

    @staticmethod
    def _teacher_source(args):
        """(torch_dist checkpoint, HF folder) of the --use-opd teacher: --opd-teacher-load, a torch_dist checkpoint
        (its iteration --opd-teacher-ckpt-step when given) or an HF folder."""
        path, step = args.opd_teacher_load, args.opd_teacher_ckpt_step
        if step is not None:
            return checkpoint.checkpoint_at(path, step, "--opd-teacher-load", "--opd-teacher-ckpt-step"), None
        if config_check.is_hf_folder(path):
            return None, path
        ckpt = checkpoint.find_checkpoint(path, "--opd-teacher-load")
        if ckpt is None:
            raise FileNotFoundError(f"--opd-teacher-load {path}: neither an HF model folder (config.json) nor a "
                                    "torch_dist checkpoint (tools/convert_hf_to_torch_dist.py writes one)")
        return ckpt, None

    def _lora_checkpoint(self, ckpt) -> bool:
        """Whether the --load checkpoint was saved with LoRA (its adapter is in its torch_dist files and, as a PEFT
        folder, in `adapter/`); one without --lora-rank stops the run."""
        saved = ckpt is not None and os.path.isdir(os.path.join(ckpt.path, ADAPTER_DIR))
        if saved and not self.args.lora_rank:
            raise ValueError(f"--load {self.args.load}: {ckpt.path} was saved with LoRA (its adapter is in "
                             f"{os.path.join(ckpt.path, ADAPTER_DIR)}); pass the run's --lora-rank / --lora-alpha / "
                             "--target-modules to resume it, or start full fine-tuning from its --save-hf folder "
                             "(the adapter merged in) with --hf-checkpoint")
        return saved

    def _start_adapter(self, ckpt) -> None:
        """LoRA: the adapter of the --load checkpoint (loaded with its weights), else --lora-adapter-path's PEFT
        folder, else the initial one (B = 0). A checkpoint of a run without LoRA resumes only with --finetune."""
        args = self.args
        self.lora_linears = lora.megatron_targets(args.target_modules, args.exclude_modules)
        self.lora_config = lora_weights.adapter_config(args, self.lora_linears)
        source = "the checkpoint" if self._lora_checkpoint(ckpt) else args.lora_adapter_path
        if source is None and ckpt is not None and ckpt.iteration is not None and not args.finetune:
            raise ValueError(f"--load {args.load}: {ckpt.path} was saved without LoRA, so it holds no adapter or "
                             "adapter optimizer state to resume; pass --finetune to start LoRA from its weights at "
                             "rollout 0, or drop --lora-rank")
        if self.hf_config is None:
            raise ValueError(f"--lora-rank {args.lora_rank} on the Megatron trainer needs --hf-checkpoint (its "
                             "config.json maps the adapter to HF module names for pushes, adapter folders and "
                             "--lora-adapter-path)")
        if source is not None and source != "the checkpoint":
            lora_weights.load_adapter_folder(self.model, args, self.hf_config, source)
        adapter = sum(p.numel() for chunk in self.model for p in chunk.parameters() if p.requires_grad)
        total = sum(p.numel() for chunk in self.model for p in chunk.parameters())
        logger.info("rank %d: LoRA r=%d alpha=%d on %s: %d adapter parameters on this rank (%.2f%% of %d)%s",
                    self.rank, args.lora_rank, args.lora_alpha, ",".join(self.lora_linears), adapter,
                    100 * adapter / total, total, f", from {source}" if source else "")

    def _load_weights(self, model, ckpt, hf_path: str | None, adapters: bool = False) -> None:
        if ckpt is not None:
            checkpoint.load_model(ckpt, model, adapters)
        elif config_check.is_hf_folder(hf_path):
            weights.load_hf_weights(model, self.args, hf_path)
        else:
            raise FileNotFoundError(
                f"--train-backend megatron: no weights to start from: --load {self.args.load} holds no torch_dist "
                f"checkpoint and --hf-checkpoint {hf_path} is not an HF model folder"
            )

    # ---- PolicyTrainer's hooks -------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int, Any]:
        ps = _ps()
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    @property
    def _packed(self) -> bool:
        return self.args.qkv_format == "thd"

    def plan(self, tokens: list[list[int]], rows: list[int], log_probs: bool = False) -> list[list[int]]:
        return plan_micro_batches(self.args, tokens, rows, self.device, self.data_parallel()[2], log_probs,
                                  self._packed)

    def _micro_batch(self, tokens, response_lengths, rows):
        tokens, response_lengths = [tokens[r] for r in rows], [response_lengths[r] for r in rows]
        if not self._packed:
            return make_micro_batch(tokens, response_lengths, device=self.device)
        multiple = self.args.tensor_model_parallel_size if self.args.sequence_parallel else 1
        return make_packed_micro_batch(tokens, response_lengths, device=self.device, multiple=multiple)

    def last_stage(self) -> bool:
        return _ps().is_pipeline_last_stage(ignore_virtual=True)

    def from_last_stage(self, obj):
        """An object of the last pipeline stage, on every stage of this rank's pipeline."""
        ps = _ps()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def log_probs_of_rows(self, model, batch: TrainBatch, micro_batches, store_prefix: str = "",
                          entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """{row: response log-probs} on the last pipeline stage; {} on the others."""
        if self.hooks.before_log_prob is not None:
            self.hooks.before_log_prob(self.args, model, store_prefix)
        return self._log_probs(model, batch.tokens, batch.response_lengths, micro_batches, entropy,
                               batch.multimodal_train_inputs)

    def _model_inputs(self, mbs, micro_batches, per_row: list[dict | None] | None) -> list[dict] | None:
        """A vision-language model's forward inputs per micro-batch (3-D positions, the rows' images); None for a
        text model."""
        if self.vision is None:
            return None
        return [micro_batch_inputs(mb, per_row, rows, self.vision) for mb, rows in zip(mbs, micro_batches)]

    def _log_probs(self, model, tokens, response_lengths, micro_batches,
                   entropy: dict[int, torch.Tensor] | None = None,
                   multimodal: list[dict | None] | None = None) -> dict[int, torch.Tensor]:
        mbs = [self._micro_batch(tokens, response_lengths, rows) for rows in micro_batches]
        with_entropy = entropy is not None

        def loss_fn(mb, logits):
            lp, ent = response_log_probs(logits, mb, self.args.rollout_temperature, self.args.vocab_size,
                                         with_entropy=with_entropy, kernel=self.args.log_probs_kernel)
            return torch.zeros((), device=logits.device), ({"log_probs": lp, "entropy": ent} if with_entropy
                                                           else {"log_probs": lp})

        outputs = run_pipeline(model, mbs, loss_fn, forward_only=True,
                               model_inputs=self._model_inputs(mbs, micro_batches, multimodal))
        result = {}
        for rows, out in zip(micro_batches, outputs):
            for i, r in enumerate(rows):
                result[r] = out["log_probs"][i, : response_lengths[r]]
                if with_entropy:
                    entropy[r] = out["entropy"][i, : response_lengths[r]]
        return result

    def train_state(self) -> TrainState:
        """The DDP chunks' parameter/gradient buffers, the optimizer's master weights and state (its inner torch
        optimizers), the frozen reference/teacher chunks whole."""
        frozen = [chunk for model in (self.ref_model, self.teacher_model) if model is not None for chunk in model]
        return TrainState(modules=frozen, ddp_chunks=list(self.model),
                          optimizers=[opt.optimizer for opt in chained(self.optimizer)
                                      if getattr(opt, "optimizer", None) is not None])

    def optimizer_step(self, record: RolloutRecord, step_id: int) -> dict[str, float]:
        args, batch = self.args, record.batch
        micro_batches, denominator = record.steps[step_id], record.denominators[step_id]
        _, dp_size, dp_group = self.data_parallel()
        mbs = [self._micro_batch(batch.tokens, batch.response_lengths, rows) for rows in micro_batches]
        rows_of = {id(mb): rows for mb, rows in zip(mbs, micro_batches)}
        # megatron-core divides each micro-batch loss by their number and DDP averages gradients over the
        # data-parallel ranks; each loss here is a share of the global-batch loss, so undo both.
        scale = dp_size * len(mbs)
        custom = args.loss_type == "custom_loss"  # a custom loss gets the logits, in slime's layout

        def loss_fn(mb, logits):
            log_probs, entropy = response_log_probs(logits, mb, args.rollout_temperature, args.vocab_size,
                                                     with_entropy=True, kernel=args.log_probs_kernel)
            loss, shares = record.micro_batch_loss(args, rows_of[id(mb)], mb, log_probs, entropy, denominator,
                                                   mb.slime_logits(logits) if custom else None)
            if args.check_for_nan_in_loss_and_grad and not torch.isfinite(loss):
                raise FloatingPointError(
                    f"rank {self.rank}: the loss of rollout {record.rollout_id}, optimizer step {step_id} is "
                    f"{loss.item()} (rows {rows_of[id(mb)]}); --no-check-for-nan-in-loss-and-grad skips this check")
            return loss * scale, shares

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.hooks.before_train_step is not None:
            self.optimizer_ready()  # the hook may read the optimizer
            self.hooks.before_train_step(args, record.rollout_id, step_id, self.model, self.optimizer, self.scheduler)
        outputs = run_pipeline(self.model, mbs, loss_fn, forward_only=False,
                               model_inputs=self._model_inputs(mbs, micro_batches, batch.multimodal_train_inputs))
        self.optimizer_ready()
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

    @torch.no_grad()
    def copy_actor_to_ref(self) -> None:
        """--ref-update-interval: the reference model takes the actor's weights (the same layout)."""
        for ref, chunk in zip(self.ref_model, self.model):
            ref.load_state_dict(unwrap(chunk).state_dict())

    def adapters_off(self):
        return lora.adapters_off([unwrap(chunk) for chunk in self.model])

    @torch.no_grad()
    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """Every data-parallel replica runs all rows; each rank returns all rows."""
        rows = list(range(len(tokens)))
        lp = self._log_probs(self.model, tokens, response_lengths, self.plan(tokens, rows, log_probs=True))
        result = [lp[r].float().cpu().tolist() for r in rows] if lp else None
        return self.from_last_stage(result)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's model chunks' state (its TP/PP/EP shards), by chunk index and name."""
        return {f"{i}.{name}": t for i, chunk in enumerate(self.model) for name, t in unwrap(chunk).state_dict().items()
                if isinstance(t, torch.Tensor)}

    # ---- weights and checkpoints ------------------------------------------------------------------------
    def push_weights(self, engines: list[Any], weight_version: int) -> None:
        """Collective: HF tensors of the whole model stream to rank 0, which sends them in buckets of
        --update-weight-buffer-size: as CUDA IPC handles when the engines share the GPUs (--colocate), else
        by broadcast over a process group formed with the engines (slime/weight_sync/push.py)."""
        if self.hf_config is None:
            raise ValueError("--train-backend megatron: weight sync needs --hf-checkpoint (its config.json picks "
                             "the HF names the engines load)")
        if self.args.lora_rank:
            self._push_adapter(engines, weight_version)
            return
        if self._frozen is None:  # the freezing flags were applied when the model was built; nothing changes them
            self._frozen = FrozenPushes(weights.frozen_global_names(self.model, self.args), self.args.offload_rollout)
        route = self.engine_push(engines) if self.rank == 0 and engines else None
        try:
            left_out = self._frozen.left_out(route, engines)
            weight_push.push_weights(weights.iter_hf_weights(self.model, self.args, self.hf_config, left_out),
                                     route, weight_version, self.args.update_weight_buffer_size)
            self._frozen.pushed(weight_version)
        finally:
            dist.barrier()

    def _push_adapter(self, engines: list[Any], weight_version: int) -> None:
        """Collective, with LoRA: the adapter only (HF module names; the engines keep their base weights), gathered
        on every rank, loaded by rank 0 into every engine as one adapter."""
        named = lora_weights.adapter_hf_tensors(self.model, self.args, self.hf_config)
        try:
            if self.rank == 0 and engines:
                push_adapter(named, engines, self.lora_config, str(weight_version))
        finally:
            dist.barrier()

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save() called without --save; pass --save DIR to write checkpoints")
        optimizer = None if self.args.no_save_optim else self.optimizer
        self.optimizer_ready()
        state = {"global_step": self.global_step, "scheduler": self.scheduler.state_dict(),
                 "megatron_args": self.args.megatron_args}
        path = checkpoint.save(self.args.save, rollout_id, self.model, optimizer, state)
        if self.args.lora_rank:  # the adapter also as a PEFT folder (for engines, --lora-adapter-path, PEFT)
            lora_weights.write_adapter(self.model, self.args, self.hf_config, self.lora_config,
                                       os.path.join(path, ADAPTER_DIR))
        hf_path = hf_save.hf_save_path(self.args, rollout_id)
        if hf_path is not None and self.args.lora_rank:
            lora_weights.save_hf_merged(self.model, self.args, self.hf_config, self.lora_config, hf_path)
        elif hf_path is not None:
            weights.save_hf_weights(self.model, self.args, self.hf_config, hf_path)

