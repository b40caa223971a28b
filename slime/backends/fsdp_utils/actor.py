"""`FSDPTrainRayActor`: one training rank of the `fsdp` backend (a transformers causal LM under FSDP2).

Per rank: the policy model (and, with a KL term, a frozen reference model; with --use-opd --opd-type megatron, a
frozen teacher model from --opd-teacher-load) loaded with `AutoModelForCausalLM.from_pretrained` (a vision-language
model, config.json with a vision_config, with `AutoModelForImageTextToText`: rows with images, the batch's
`multimodal_train_inputs`, feed their pixels to its vision tower in every forward), each decoder
layer and the root wrapped with `torch.distributed.fsdp.fully_shard` on a 1-D mesh over all ranks (pure data
parallel, parameters, gradients and optimizer state sharded), and AdamW. fp32 on CPU (gloo); on CUDA, bf16 compute with fp32
master weights and fp32 gradient reduction (FSDP2 MixedPrecisionPolicy).

One `train` call = one rollout: the batch's rows are cut into `num_steps = len(batch) // gbs` optimizer
steps; each rank trains on a contiguous share of every step's rows (--balance-data: a share with a close token
count), in micro-batches. Old-policy (and reference) log-probs are computed first, with the same micro-batches,
so the first step's ppo_kl is 0.

The rollout's steps (log-probs, advantages, optimizer steps) are the shared `PolicyTrainer`'s
(slime/backends/training/policy.py); this class supplies FSDP's mechanics. For `--advantage-estimator ppo` the
values come from the critic group (critic.py) and the actor keeps the returns for the critic to fetch
(`get_returns`).

Micro-batches are `--micro-batch-size` rows or, with `--use-dynamic-batch-size`, token-budgeted
(slime/backends/training/batching.py `plan_micro_batches`, equal in count on every rank since FSDP forwards are
collective); the old-policy and reference passes use the training micro-batches, so the first step's ppo_kl is
exactly 0. Simplifications (see docs/fsdp_backend.md, docs/algorithms.md): padded micro-batches, no packing;
dropout is kept off (eval mode) in every forward, so recomputed and training log-probs agree; no offloading
between rollout and training; no gradient checkpointing.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from slime.backends.fsdp_utils import checkpoint, lora, weight_sync
from slime.backends.fsdp_utils.checkpoint_format import CheckpointFormat
from slime.backends.fsdp_utils.data import (
    extract_response_log_probs,
    forward_logits,
    forward_response_log_probs,
    micro_batch_images,
)
from slime.backends.fsdp_utils.parallel import (
    gather_rows,
    lr_at,
    make_optimizer,
    optimizer_step,
    setup_rank,
    shard_model,
)
from slime.backends.training import freeze, hf_save
from slime.backends.training.batching import make_micro_batch, plan_micro_batches, run_optimizer_steps, unpad_per_token
from slime.backends.training.offload import TrainState
from slime.backends.training.policy import PolicyTrainer
from slime.backends.training.record import RolloutRecord
from slime.utils.lora_adapter import ADAPTER_DIR, adapter_config
from slime.utils.types import TrainBatch

logger = logging.getLogger(__name__)


class FSDPTrainRayActor(PolicyTrainer):
    # ---- setup ------------------------------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool, num_rollout: int | None = None) -> int:
        if role != "actor":
            raise ValueError(f"FSDPTrainRayActor: role {role!r}; the critic is FSDPCriticRayActor (critic.py)")
        self.args = args
        setup_rank(self, args)
        ckpt = checkpoint.find_checkpoint(args.load)
        ref_folder = self._ref_folder(args)
        # Without a checkpoint in --load the policy starts from the reference model's weights: a fresh start.
        # LoRA: the adapter saved with the checkpoint, else --lora-adapter-path, else none (B = 0).
        saved = os.path.join(ckpt.path, ADAPTER_DIR) if ckpt else None
        if saved and os.path.isdir(saved) and not args.lora_rank:
            raise ValueError(f"--load {args.load}: {ckpt.path} was saved with LoRA (its weights are the base, the "
                             f"trained adapter is in {saved}); pass the run's --lora-rank / --lora-alpha / "
                             "--target-modules to resume it, or start full fine-tuning from its --save-hf folder "
                             "(the adapter merged in) with --hf-checkpoint")
        adapter = saved if saved and os.path.isdir(saved) else args.lora_adapter_path
        self.model = self._build_model(ckpt.path if ckpt else ref_folder, trainable=True, adapter=adapter)
        self.ref_model = None
        self.base_is_reference = with_ref and bool(args.lora_rank)  # the reference pass: adapters off, no copy
        if with_ref and not self.base_is_reference:
            self.ref_model = self._build_model(ref_folder, trainable=False)
        self.teacher_model = None
        if args.use_opd and args.opd_type == "megatron":  # slime's trainer-held teacher, here an fsdp model
            self.teacher_model = self._build_model(self._teacher_folder(args), trainable=False)
            self._check_teacher_vocabulary()
        self.optimizer = make_optimizer(self.model, args, args.lr)
        self.total_steps = run_optimizer_steps(args, args.num_rollout if num_rollout is None else num_rollout)
        self.global_step = 0
        self.init_policy_hooks()
        if ckpt is None or args.finetune:  # --finetune: the weights only, a fresh start at rollout 0
            return args.start_rollout_id or 0
        if not args.no_load_optim:
            checkpoint.load_optimizer(self.model, self.optimizer, ckpt.path)
        self.global_step = int(ckpt.trainer_state.get("global_step", 0))
        logger.info("rank %d: resumed from %s (rollout %d)", self.rank, ckpt.path, ckpt.iteration)
        return ckpt.iteration + 1

    @staticmethod
    def _ref_folder(args: Any) -> str:
        """The HF folder of the reference model, and of the policy when --load holds no checkpoint: --ref-load's
        iteration --ref-ckpt-step, else its latest iteration (an fsdp save folder), else --ref-load itself when
        it is an HF folder, else --hf-checkpoint."""
        ref_load = args.ref_load
        if ref_load and args.ref_ckpt_step is not None:
            return _iteration_folder(ref_load, args.ref_ckpt_step, "--ref-load", "--ref-ckpt-step")
        if not ref_load or checkpoint.is_hf_folder(ref_load):
            return ref_load or args.hf_checkpoint
        try:
            latest = checkpoint.find_checkpoint(ref_load)
        except (ValueError, FileNotFoundError):  # e.g. Megatron's torch_dist folder: not an fsdp save
            latest = None
        if latest is not None and checkpoint.is_hf_folder(latest.path):
            return latest.path
        logger.warning("--ref-load %s is neither an HF folder (no config.json) nor an fsdp save folder; the fsdp "
                       "backend takes the reference model (and the policy, without a --load checkpoint) from "
                       "--hf-checkpoint %s", ref_load, args.hf_checkpoint)
        return args.hf_checkpoint

    @staticmethod
    def _teacher_folder(args: Any) -> str:
        """The HF folder of the teacher: --opd-teacher-load itself, or the iteration of the fsdp checkpoint folder
        it names (--opd-teacher-ckpt-step, else its latest)."""
        path, step = args.opd_teacher_load, args.opd_teacher_ckpt_step
        if step is None and checkpoint.is_hf_folder(path):
            return path
        if step is not None:
            return _iteration_folder(path, step, "--opd-teacher-load", "--opd-teacher-ckpt-step")
        ckpt = checkpoint.find_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"--opd-teacher-load {path}: neither an HF model folder (config.json) nor an "
                                    "fsdp checkpoint folder (latest_checkpointed_iteration.txt); the fsdp backend "
                                    "loads the teacher from one of them")
        return ckpt.path

    def _check_teacher_vocabulary(self) -> None:
        # a vision-language config keeps the vocabulary in its text config
        student = self.model.config.get_text_config().vocab_size
        teacher = self.teacher_model.config.get_text_config().vocab_size
        if student != teacher:
            raise ValueError(f"--opd-teacher-load {self.args.opd_teacher_load}: the teacher's vocabulary has {teacher} "
                             f"tokens, the student's {student}; its log-probs of the student's tokens need the same "
                             "tokenizer")

    def train_state(self) -> TrainState:
        frozen = [m for m in (self.ref_model, self.teacher_model) if m is not None]
        return TrainState(weights=[self.model], modules=frozen, optimizers=[self.optimizer])

    def _build_model(self, path: str, trainable: bool, adapter: str | None = None) -> torch.nn.Module:
        if not checkpoint.is_hf_folder(path):
            raise FileNotFoundError(f"--hf-checkpoint {path}: not an HF model folder (no config.json there)")
        # a vision-language model (config.json with a vision_config) loads with its vision tower
        vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch.float32)
        model.requires_grad_(trainable)
        if trainable and self.args.lora_rank:  # the teacher stays a plain model
            self._apply_lora(model, adapter)
        elif trainable:  # --only-train-params-name-list / --freeze-params-name-list, before FSDP wraps it
            freeze.apply_freeze(self.args, model.named_parameters())
        return shard_model(model, model, self.mesh, self.device, path)

    def _apply_lora(self, model: torch.nn.Module, source: str | None) -> None:
        """LoRA layers on the target modules (docs/lora.md), the base frozen; the adapter from the PEFT folder
        `source` (B = 0 without one)."""
        args = self.args
        names = lora.target_names(model, args.target_modules, args.exclude_modules)
        lora.check_engine_adapts(names, lora.outside_decoder(model, names), args)
        targets = lora.peft_target_modules(model, names)
        self.lora_modules = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.target_modules,
                                            args.exclude_modules)
        self.lora_config = adapter_config(args, self.lora_modules, targets)
        if source:
            lora.load_adapter_folder(model, source)
        adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logger.info("rank %d: LoRA r=%d alpha=%d on %d modules: %d adapter parameters (%.2f%% of %d)%s", self.rank,
                    args.lora_rank, args.lora_alpha, len(self.lora_modules), adapter, 100 * adapter / total, total,
                    f", from {source}" if source else "")

    # ---- PolicyTrainer's hooks -------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int, Any]:
        return self.rank, self.world_size, None

    def plan(self, tokens, rows, log_probs: bool = False) -> list[list[int]]:
        return plan_micro_batches(self.args, tokens, rows, self.device, log_probs=log_probs)

    def log_prob_plan(self, record: RolloutRecord) -> list[list[int]]:
        """The training micro-batches themselves: recomputed old log-probs then equal the first training
        forward's bit for bit (the first step's ppo_kl is exactly 0)."""
        return [mb for step in record.steps for mb in step]

    def _micro_batch(self, batch: TrainBatch, rows: list[int]):
        return make_micro_batch([batch.tokens[r] for r in rows], [batch.response_lengths[r] for r in rows],
                                device=self.device)

    @torch.no_grad()
    def log_probs_of_rows(self, model, batch: TrainBatch, micro_batches: list[list[int]], store_prefix: str = "",
                          entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        out = {}
        for rows in micro_batches:
            images = micro_batch_images(batch.multimodal_train_inputs, rows, self.device, batch.loss_masks)
            lp, ent = forward_response_log_probs(model, self._micro_batch(batch, rows), self.args.rollout_temperature,
                                                 with_entropy=entropy is not None, images=images,
                                                 idle_vision=self._idle_vision(model),
                                                 kernel=self.args.log_probs_kernel)
            for i, r in enumerate(rows):
                out[r] = lp[i, : batch.response_lengths[r]]
                if entropy is not None:
                    entropy[r] = ent[i, : batch.response_lengths[r]]
        return out

    def optimizer_step(self, record: RolloutRecord, step_id: int) -> dict[str, float]:
        args = self.args
        denominator = record.denominators[step_id]
        custom = args.loss_type == "custom_loss"  # a custom loss gets the logits, in slime's layout

        def micro_loss(rows):
            mb = self._micro_batch(record.batch, rows)
            images = micro_batch_images(record.batch.multimodal_train_inputs, rows, self.device,
                                        record.batch.loss_masks)
            logits, offset = forward_logits(self.model, mb, all_positions=custom, images=images,
                                            idle_vision=self._idle_vision(self.model))
            log_probs, entropy = extract_response_log_probs(logits, mb, args.rollout_temperature, offset,
                                                            with_entropy=True, kernel=args.log_probs_kernel)
            return record.micro_batch_loss(args, rows, mb, log_probs, entropy, denominator,
                                           mb.slime_logits(logits) if custom else None)

        lr = lr_at(args, self.global_step, self.total_steps)
        metrics, grad_norm = optimizer_step(self.model, self.optimizer, lr, args.clip_grad, record.steps[step_id],
                                            micro_loss)
        self.global_step += 1
        return {**metrics, "train/grad_norm": grad_norm, "train/lr": lr}

    @torch.no_grad()
    def copy_actor_to_ref(self) -> None:
        """--ref-update-interval: the reference model takes the actor's weights. Both are sharded alike, so each rank
        copies its own shards (the state dicts hold the sharded tensors even while FSDP keeps a root's parameters
        unsharded after a forward)."""
        ref_state = self.ref_model.state_dict()
        for name, tensor in self.model.state_dict().items():
            ref_state[name].copy_(tensor)

    def adapters_off(self):
        return lora.adapters_off(self.model)

    def _idle_vision(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s micro-batches without images run its vision tower on a stand-in image: with several
        ranks FSDP gathers the tower's shards collectively, and a rank whose rows have no image would skip the
        gathers its peers wait in (data.forward_logits)."""
        return self.world_size > 1 and getattr(model.config, "vision_config", None) is not None

    def prepare(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None) -> RolloutRecord:
        record = super().prepare(rollout_id, batch, values)
        # Only a critic (ppo, given values) needs the returns of every row.
        self._returns = (gather_rows(record.returns, len(batch), self.world_size)
                         if record.returns is not None and values is not None else None)
        return record

    def get_returns(self) -> list[list[float]] | None:
        """The returns (ppo: advantages + values) of every row of the last `train` call, for the critic."""
        return self._returns

    # ---- queries, weights and checkpoints -----------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """All ranks run it on the same rows (FSDP forwards are collective); each returns all rows."""
        result: list[list[float]] = []
        for rows in plan_micro_batches(self.args, tokens, range(len(tokens)), self.device, log_probs=True):
            mb = make_micro_batch([tokens[r] for r in rows], [response_lengths[r] for r in rows], device=self.device)
            lp, _ = forward_response_log_probs(self.model, mb, self.args.rollout_temperature,
                                               kernel=self.args.log_probs_kernel)
            result.extend(unpad_per_token(lp, mb.response_lengths))
        return result

    def push_weights(self, engines: list[Any], weight_version: int) -> None:
        if self.args.lora_rank:
            weight_sync.update_adapter(self.model, engines, weight_version, self.lora_config)
            return
        if self._frozen is None:  # the freezing flags were applied when the model was built; nothing changes them
            self._frozen = weight_sync.frozen_pushes(self.model, self.args.offload_rollout)
            self._names = CheckpointFormat(self.model)
        weight_sync.update_weights(self.model, engines, weight_version, self.args.update_weight_buffer_size,
                                   self.engine_push, self._frozen, self._names)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the policy's state (the local tensors of FSDP's sharded DTensors)."""
        return {name: t.to_local() if isinstance(t, DTensor) else t for name, t in self.model.state_dict().items()}

    def after_weights_loaded(self) -> None:
        """Drop any parameters FSDP holds gathered (the root's may stay so after a forward): the next forward
        gathers the shards just written."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save() called without --save; pass --save DIR to write checkpoints")
        optimizer = None if self.args.no_save_optim else self.optimizer
        writer = (lora.lora_folder_writer(self.lora_config, checkpoint.write_hf_folder) if self.args.lora_rank
                  else None)
        path = checkpoint.save_checkpoint(self.model, optimizer, self.args.save, rollout_id,
                                          self.args.hf_checkpoint, {"global_step": self.global_step}, writer)
        hf_path = hf_save.hf_save_path(self.args, rollout_id)
        if hf_path is not None and self.rank == 0:
            weights_file = hf_save.prepare_hf_folder(hf_path, self.args.hf_checkpoint)
            if self.args.lora_rank:  # the policy the engines serve: the base with the adapter merged in
                lora.export_merged(path, weights_file, os.path.join(hf_path, ADAPTER_DIR))
            else:  # the iteration folder's weights are already the HF tensors: copy them, no second gather
                shutil.copyfile(os.path.join(path, hf_save.WEIGHTS_FILE), weights_file)
        dist.barrier()


def _iteration_folder(root: str, step: int, load_flag: str, step_flag: str) -> str:
    """Iteration `step` of the fsdp save folder `root` (an HF folder); a missing one fails naming the folder and
    the complete iterations there."""
    folder = checkpoint.iteration_dir(root, step)
    if not checkpoint.is_hf_folder(folder):
        found = checkpoint.complete_iterations(root) if os.path.isdir(root) else []
        raise FileNotFoundError(f"{step_flag} {step}: {folder} is no saved iteration of {load_flag} {root} "
                                f"(complete ones: {found}); give one of them")
    return folder
