"""`FSDPCriticRayActor`: one rank of the PPO critic (`--advantage-estimator ppo`) on the `fsdp` backend.

The value model is the policy's architecture without its LM head: the transformers base model
(`AutoModelForCausalLM(...).base_model`, the body of the causal LM) plus `nn.Linear(hidden_size, 1)`, sharded with FSDP2 like
the actor. V_t, the value of the prefix before response token t, is read at the position that predicts
token t. The body comes from the critic checkpoint under `--load` when there is one, else from `--critic-load`
(an HF folder; a `value_head.pt` there restores the head too), else from `--hf-checkpoint`; a fresh head
starts at zero, so the first values are 0.

Per rollout, driven by train.py: `compute_values(batch)` (every row's values, gathered to every rank),
then, after the actor has turned them into returns, `train(rollout_id, batch, values, returns)`: the value
loss ½·max((clip(V) − R)², (V − R)²) (`--value-clip`) over the same optimizer steps and micro-batches as
the actor, AdamW with `--critic-lr` (default `--lr`).

Checkpoints: with `--save`, the critic is saved with the actor under `SAVE/critic/` in the same layout
(`iter_XXXXXXX/` with the body as an HF folder, `value_head.pt`, the optimizer state and trainer state;
`latest_checkpointed_iteration.txt` written last), and `--load DIR` resumes it from `DIR/critic/`.

Simplification: no offloading between actor and critic.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections import defaultdict
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from slime.algorithm.loss import critic_loss, global_share
from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.data import forward_response_values
from slime.backends.fsdp_utils.parallel import gather_rows, lr_at, make_optimizer, optimizer_step, setup_rank, shard_model
from slime.backends.training.actor import TrainRayActor
from slime.backends.training.offload import TrainState
from slime.backends.training.batching import (
    make_micro_batch,
    rollout_mask_sums,
    rows_per_step,
    run_optimizer_steps,
    same_count,
    split_micro_batches,
    step_rows,
)
from slime.backends.training.optimizer_state import reset_optimizer_states
from slime.backends.training.record import loss_denominator, padded_rows
from slime.utils.checkpoint_layout import critic_dir
from slime.utils.types import TrainBatch

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.pt"


class ValueModel(torch.nn.Module):
    """A transformers base model with a scalar head: `forward(input_ids, attention_mask) -> [B, L]`."""

    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).clone()  # FSDP2 warns about returning a view


def load_value_model(path: str) -> ValueModel:
    if not checkpoint.is_hf_folder(path):
        raise FileNotFoundError(f"--critic-load / --hf-checkpoint {path}: not an HF model folder (no config.json)")
    body = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).base_model  # the LM head is dropped
    model = ValueModel(body, body.config.hidden_size)
    head = os.path.join(path, VALUE_HEAD_FILE)
    if os.path.exists(head):
        model.value_head.load_state_dict(torch.load(head, map_location="cpu"))
    return model


def write_value_model_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str,
                             hf_checkpoint: str | None) -> None:
    """The body as an HF folder (base-model names, which the causal LM's from_pretrained accepts) plus the head."""
    body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
    head = {k.removeprefix("value_head."): v for k, v in state.items() if k.startswith("value_head.")}
    checkpoint.write_hf_folder(model.body, body, path, hf_checkpoint, config=model.body.config)
    torch.save(head, os.path.join(path, VALUE_HEAD_FILE))


def critic_args(args: Any) -> argparse.Namespace:
    """The actor's args with the critic's learning rate."""
    return argparse.Namespace(**{**vars(args), "lr": args.lr if args.critic_lr is None else args.critic_lr})


class FSDPCriticRayActor(TrainRayActor):
    def init(self, args: Any, role: str, with_ref: bool = False, num_rollout: int | None = None) -> int:
        if role != "critic":
            raise ValueError(f"FSDPCriticRayActor: role {role!r}; the actor is FSDPTrainRayActor (actor.py)")
        self.args = critic_args(args)
        setup_rank(self, self.args)
        load = args.load
        ckpt = checkpoint.find_checkpoint(critic_dir(load)) if load else None
        path = ckpt.path if ckpt else (args.critic_load or args.hf_checkpoint)
        model = load_value_model(path)
        self.model = shard_model(model, model.body, self.mesh, self.device, path)
        self.optimizer = make_optimizer(self.model, self.args, self.args.lr)
        self.total_steps = run_optimizer_steps(args, args.num_rollout if num_rollout is None else num_rollout)
        self.global_step = 0
        if ckpt is None:
            return 0
        if not args.no_load_optim:
            checkpoint.load_optimizer(self.model, self.optimizer, ckpt.path)
        self.global_step = int(ckpt.trainer_state.get("global_step", 0))
        logger.info("critic rank %d: resumed from %s (rollout %d)", self.rank, ckpt.path, ckpt.iteration)
        return ckpt.iteration + 1

    def _plan(self, batch: TrainBatch) -> list[list[list[int]]]:
        """The actor's steps (rollouts split into several rows kept in one step); as many micro-batches on every
        rank (FSDP forwards are collective)."""
        lengths = [len(t) for t in batch.tokens]
        steps = rows_per_step(len(batch), self.args.global_batch_size, self.world_size, self.rank,
                              lengths if self.args.balance_data else None, batch.rollout_ids)
        return [same_count(rows, [lengths[r] for r in rows], split_micro_batches(rows, self.args.micro_batch_size),
                           self.device) for rows in steps]

    def _forward(self, batch: TrainBatch, rows: list[int]):
        mb = make_micro_batch([batch.tokens[r] for r in rows], [batch.response_lengths[r] for r in rows],
                              device=self.device)
        return mb, forward_response_values(self.model, mb)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> list[list[float]]:
        """Values of every row's response tokens; each rank computes its rows, all ranks return all rows."""
        mine: dict[int, torch.Tensor] = {}
        for micro_batches in self._plan(batch):
            for rows in micro_batches:
                mb, values = self._forward(batch, rows)
                for i, r in enumerate(rows):
                    mine[r] = values[i, : mb.response_lengths[i]]
        return gather_rows(mine, len(batch), self.world_size)

    def train(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None = None,
              returns: list[list[float]] | None = None) -> dict[str, float]:
        if values is None or returns is None:
            raise ValueError("critic train needs the values it computed and the actor's returns for every row")
        args = self.args
        if args.reset_optimizer_states:  # the rollout starts from a fresh optimizer history
            reset_optimizer_states([self.optimizer])
        totals: dict[str, float] = defaultdict(float)
        plan = self._plan(batch)
        global_steps = step_rows(len(batch), args.global_batch_size, batch.rollout_ids)
        mask_sums = rollout_mask_sums(batch.loss_masks, batch.rollout_of_rows())
        for s, micro_batches in enumerate(plan):
            if args.use_stateless_adam:  # every step is a fresh Adam's first (slime's StatelessAdam update)
                reset_optimizer_states([self.optimizer])
            denominator = loss_denominator(args, batch, global_steps[s])

            def micro_loss(rows):
                mb, new_values = self._forward(batch, rows)
                padded = functools.partial(padded_rows, rows=rows, width=mb.max_response_len, device=self.device)
                mask = mb.response_mask * padded(batch.loss_masks)
                sample_denominators = torch.tensor([mask_sums[r] for r in rows], device=self.device)
                aggregate = functools.partial(global_share, mask=mask, per_token=args.calculate_per_token_loss,
                                              global_denominator=denominator, sample_denominators=sample_denominators)
                return critic_loss(args, new_values, padded(values), padded(returns), aggregate)

            lr = lr_at(args, self.global_step, self.total_steps)
            metrics, grad_norm = optimizer_step(self.model, self.optimizer, lr, args.clip_grad, micro_batches,
                                                micro_loss)
            self.global_step += 1
            for k, v in {**metrics, "critic/grad_norm": grad_norm, "critic/lr": lr}.items():
                totals[k] += v
        return {k: v / len(plan) for k, v in totals.items()}

    def train_state(self) -> TrainState:
        return TrainState(modules=[self.model], optimizers=[self.optimizer])

    def update_weights(self, engines: list[Any], weight_version: int) -> None:
        raise NotImplementedError("the critic's weights are never sent to the rollout engines")

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save() called without --save; pass --save DIR to write checkpoints")
        optimizer = None if self.args.no_save_optim else self.optimizer
        checkpoint.save_checkpoint(self.model, optimizer, critic_dir(self.args.save), rollout_id,
                                   self.args.hf_checkpoint, {"global_step": self.global_step},
                                   write_folder=write_value_model_folder)

