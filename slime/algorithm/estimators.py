"""The advantage estimators (`--advantage-estimator`): one record per name, and the one place to add one.

Everything that depends on the estimator reads its record: the parser's choices, the reward normalisation of
the rollout (`group_normalized`, `divide_by_std`), the advantage and return computation (`advantages`), the
policy loss (`policy_loss`), whether a PPO critic is trained next to the policy (`needs_critic`) and whether
`--normalize-advantages` is required (`whitens`). Adding an estimator = one `Estimator(...)` in `ESTIMATORS`.

The math is in slime/algorithm/returns.py and objectives.py (closed-form tests); the records only wire it.
`compute_advantages_and_returns` also honours `--custom-advantage-function-path` with slime's contract:
`fn(args, rollout_data) -> None` sets `rollout_data["advantages"]` and `rollout_data["returns"]` (one [T_i] tensor
per sample) in place, after the KL is in `rollout_data["kl"]` (slime/algorithm/slime_formats.py `rollout_data` lists
the keys).
`compute_advantages_and_returns_in_place` is slime's dict-shaped `compute_advantages_and_returns(args,
rollout_data)` (slime.backends.megatron_utils.loss) as an adapter onto the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithm.objectives import compute_approx_kl, compute_cispo_loss, compute_policy_loss, sequence_ppo_kl
from slime.algorithm import slime_formats
from slime.algorithm.opd import apply_opd_kl_to_advantages
from slime.algorithm.returns import (
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    kl_penalized_token_rewards,
    masked_whiten,
)
from slime.utils.hooks import hooks_of

Tensors = list[torch.Tensor]


@dataclass
class AdvantageInputs:
    """What the advantage estimators read of the rows one rank trains on (one entry per row, in training order):
    a view of the rank's record (slime/backends/training/record.py `advantages_and_returns`) or of slime's
    `rollout_data` dict (`compute_advantages_and_returns_in_place`). The estimators do not write into it."""

    rewards: list[float]  # the rollout's training rewards (group-normalised when the estimator says so)
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]  # [T_i] 0/1
    total_lengths: list[int] | None = None  # prompt + response tokens
    kl: list[torch.Tensor] | None = None  # [T_i] KL(old policy || reference), when a reference model runs
    values: list[torch.Tensor] | None = None  # [T_i] critic values (ppo)


def inputs_of_rollout_data(args, rollout_data: dict[str, Any]) -> tuple[AdvantageInputs, Tensors | None]:
    """The estimators' view of slime's `rollout_data` dict, and the student's log-probs (the rollout's with
    --use-rollout-logprobs, else the old policy's). The KL of the token rewards is computed here:
    those log-probs against the reference's, with `--kl-loss-type`, only when --kl-coef is non-zero."""
    log_probs = rollout_data.get("rollout_log_probs") if args.use_rollout_logprobs else rollout_data.get("log_probs")
    ref = rollout_data.get("ref_log_probs")
    kl = None
    if args.kl_coef and log_probs:
        if ref is None:
            raise ValueError(f"--kl-coef {args.kl_coef}: rollout_data has no 'ref_log_probs' to compute the KL "
                             "from; run a reference model or set --kl-coef 0")
        kl = [compute_approx_kl(lp, r, args.kl_loss_type) for lp, r in zip(log_probs, ref)]
    inputs = AdvantageInputs(
        rewards=[float(r) for r in rollout_data["rewards"]], response_lengths=list(rollout_data["response_lengths"]),
        loss_masks=[torch.as_tensor(m, dtype=torch.float32) for m in rollout_data["loss_masks"]],
        total_lengths=rollout_data.get("total_lengths"), kl=kl, values=rollout_data.get("values"),
    )
    return inputs, log_probs


# (args, inputs) -> (advantages, returns or None), per row
AdvantageFn = Callable[[Any, AdvantageInputs], tuple[Tensors, Tensors | None]]
# (log_probs, old_log_probs, advantages, mask, args) -> per-token (pg_losses, clipfrac, ppo_kl), all [B, R]
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: AdvantageFn
    policy_loss: PolicyLossFn
    group_normalized: bool = False  # rewards are centred on their prompt group's mean before `advantages`
    divide_by_std: bool = False  # ... and divided by the group's std (unless --disable-grpo-std-normalization)
    needs_critic: bool = False  # a value model (the PPO critic) trains next to the policy
    whitens: bool = False  # the advantages are meant to be whitened: --normalize-advantages is required


# ---- advantages ----------------------------------------------------------------------------------------
def needs_reference_model(args) -> bool:
    """A KL term (in the loss, --use-kl-loss, or in the rewards, --kl-coef) needs a frozen reference model."""
    return bool(args.use_kl_loss or args.kl_coef)


def holds_reference_copy(args) -> bool:
    """Whether the trainers hold the reference model as a second copy of the weights (the `--dry-run` planner
    counts its memory). With LoRA the reference is the policy's own frozen base, its adapters switched off for the
    reference pass: no copy."""
    return needs_reference_model(args) and not getattr(args, "lora_rank", 0)


def token_reward_kl(args, inputs: AdvantageInputs) -> Tensors:
    """The KL term of the token rewards, per row: the given KL with --kl-coef, zeros otherwise."""
    if inputs.kl is not None and args.kl_coef:
        return [k.float() for k in inputs.kl]
    return [torch.zeros(m.shape[0], dtype=torch.float32) for m in inputs.loss_masks]


def _total_lengths(inputs: AdvantageInputs) -> list[int]:
    return inputs.total_lengths if inputs.total_lengths is not None else list(inputs.response_lengths)


def scalar_reward_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, None]:
    """GRPO-like: each row's (normalised) reward broadcast to its response tokens; no returns."""
    return get_grpo_returns(inputs.rewards, token_reward_kl(args, inputs)), None


def reinforce_plus_plus_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """REINFORCE++: discounted returns of the KL-penalised token rewards (the reward on the last loss-masked-in
    token); advantages = returns."""
    returns = get_reinforce_plus_plus_returns(
        inputs.rewards, token_reward_kl(args, inputs), [m.float() for m in inputs.loss_masks],
        list(inputs.response_lengths), _total_lengths(inputs), float(args.kl_coef), float(args.gamma))
    return returns, returns


def reinforce_plus_plus_baseline_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """REINFORCE++-baseline: the (group-mean-centred) reward − kl_coef·KL on every token."""
    advantages = get_reinforce_plus_plus_baseline_advantages(
        inputs.rewards, token_reward_kl(args, inputs), [m.float() for m in inputs.loss_masks], float(args.kl_coef))
    return advantages, advantages


def gae_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """PPO: GAE over the KL-penalised token rewards (the reward on the last token) and the critic's values;
    returns = advantages + values."""
    if inputs.values is None:
        raise ValueError("--advantage-estimator ppo: no critic values were given to the actor's train step")
    token_rewards = kl_penalized_token_rewards(inputs.rewards, token_reward_kl(args, inputs),
                                                         float(args.kl_coef))
    values = [torch.as_tensor(v, dtype=torch.float32) for v in inputs.values]
    return get_advantages_and_returns_batch(_total_lengths(inputs), list(inputs.response_lengths), values,
                                                      token_rewards, float(args.gamma), float(args.lambd))


# ---- policy losses ---------------------------------------------------------------------------------------
def ppo_clip_loss(log_probs, old_log_probs, advantages, mask, args):
    """Token-level PPO clipped surrogate (dual clip with --eps-clip-c)."""
    ppo_kl = old_log_probs - log_probs
    pg, clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high,
                                                 eps_clip_c=args.eps_clip_c)
    return pg, clipfrac, ppo_kl


def gspo_loss(log_probs, old_log_probs, advantages, mask, args):
    """The clipped surrogate on GSPO's sequence-level ratio."""
    ppo_kl = sequence_ppo_kl(log_probs, old_log_probs, mask)
    pg, clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high,
                                                 eps_clip_c=args.eps_clip_c)
    return pg, clipfrac, ppo_kl


def cispo_loss(log_probs, old_log_probs, advantages, mask, args):
    """CISPO: REINFORCE with a clipped, gradient-free importance weight."""
    ppo_kl = old_log_probs - log_probs
    pg, clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    return pg, clipfrac, ppo_kl


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("grpo", scalar_reward_advantages, ppo_clip_loss, group_normalized=True, divide_by_std=True),
    Estimator("gspo", scalar_reward_advantages, gspo_loss, group_normalized=True, divide_by_std=True),
    Estimator("cispo", scalar_reward_advantages, cispo_loss, group_normalized=True, divide_by_std=True),
    Estimator("reinforce_plus_plus", reinforce_plus_plus_advantages, ppo_clip_loss, whitens=True),
    Estimator("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline_advantages, ppo_clip_loss,
              group_normalized=True, whitens=True),
    Estimator("ppo", gae_advantages, ppo_clip_loss, needs_critic=True),
)}


def estimator_of(args) -> Estimator:
    try:
        return ESTIMATORS[args.advantage_estimator]
    except KeyError:
        raise ValueError(f"--advantage-estimator {args.advantage_estimator!r}: unknown; choose one of "
                         f"{', '.join(ESTIMATORS)}") from None


def compute_advantages_and_returns(args, inputs: AdvantageInputs,
                                   rollout_data_of: Callable[[Tensors], dict[str, Any]] | None = None,
                                   ) -> tuple[Tensors, Tensors | None]:
    """Per-token advantages (and returns for a critic) of every row: `--custom-advantage-function-path` when
    given, else the estimator's. Whitening (`--normalize-advantages`) is applied afterwards by the trainer,
    across data-parallel ranks (to the custom function's advantages too, as in slime). The custom function gets
    slime's `rollout_data` of these rows, built only then: `rollout_data_of(kl)` (the trainer's, with every key it
    has) or, without it, `slime_formats.rollout_data` of the inputs alone; "kl" is the token rewards' KL term (zeros
    without --kl-coef, as in slime)."""
    custom = args.custom_advantage_function_path
    if not custom:
        return estimator_of(args).advantages(args, inputs)
    kl = token_reward_kl(args, inputs)
    if rollout_data_of is not None:
        rollout_data = rollout_data_of(kl)
    else:
        rollout_data = slime_formats.rollout_data(
            response_lengths=inputs.response_lengths, total_lengths=inputs.total_lengths, rewards=inputs.rewards,
            loss_masks=inputs.loss_masks, kl=kl, values=inputs.values)
    hooks_of(args).custom_advantage_function(args, rollout_data)
    return _custom_results(args, custom, rollout_data, inputs)


def _custom_results(args, path: str, rollout_data: dict, inputs: AdvantageInputs) -> tuple[Tensors, Tensors | None]:
    """rollout_data's "advantages" / "returns" after a custom advantage function, checked row by row."""
    where = f"--custom-advantage-function-path {path}"
    if rollout_data.get("advantages") is None:
        raise ValueError(f"{where}: set no rollout_data['advantages']; slime's contract is fn(args, rollout_data) -> "
                         "None filling rollout_data['advantages'] and rollout_data['returns'] (one [T_i] tensor each "
                         "per sample) in place")
    returns = rollout_data.get("returns")
    if returns is None and estimator_of(args).needs_critic:
        raise ValueError(f"{where}: set no rollout_data['returns'], which the critic of --advantage-estimator "
                         f"{args.advantage_estimator} trains on; fill it (e.g. advantages + rollout_data['values'])")
    out = []
    for name, rows in (("advantages", rollout_data["advantages"]), ("returns", returns)):
        if rows is None:
            out.append(None)
            continue
        if len(rows) != len(inputs.loss_masks):
            raise ValueError(f"{where}: rollout_data['{name}'] has {len(rows)} entries for {len(inputs.loss_masks)} "
                             "samples; give one [T_i] tensor per sample")
        tensors = [torch.as_tensor(r, dtype=torch.float32) for r in rows]
        for i, (t, m) in enumerate(zip(tensors, inputs.loss_masks)):
            if t.shape != m.shape:
                raise ValueError(f"{where}: rollout_data['{name}'][{i}] has shape {tuple(t.shape)} but sample {i} "
                                 f"has {m.shape[0]} response tokens")
        out.append(tensors)
    return out[0], out[1]


def compute_advantages_and_returns_in_place(args, rollout_data: dict[str, Any],
                                            whiten: Callable[[Tensors, Tensors], Tensors] | None = None) -> None:
    """slime's `compute_advantages_and_returns(args, rollout_data)`: reads slime's rollout_data dict ("rewards",
    "loss_masks", "response_lengths", "log_probs", "ref_log_probs", "values", ...), sets "kl", "advantages" and
    "returns" in it. With --normalize-advantages the advantages are whitened by `whiten(advantages, loss_masks)`
    when given (every rank calls it, rows or none: slime.backends.megatron_utils.loss whitens across its
    data-parallel group), else over these rows (the trainers here whiten across data-parallel ranks themselves
    and call `compute_advantages_and_returns`)."""
    inputs, log_probs = inputs_of_rollout_data(args, rollout_data)
    kl = token_reward_kl(args, inputs)
    rollout_data["kl"] = kl
    if args.custom_advantage_function_path:
        hooks_of(args).custom_advantage_function(args, rollout_data)
        advantages, returns = _custom_results(args, args.custom_advantage_function_path, rollout_data, inputs)
    else:
        advantages, returns = estimator_of(args).advantages(args, inputs)
    if args.use_opd:  # slime: the teacher's reverse KL enters the advantages before they are whitened
        advantages = list(advantages)
        apply_opd_kl_to_advantages(args, rollout_data, advantages, log_probs)
    if args.normalize_advantages and whiten is not None:
        advantages = whiten(advantages, inputs.loss_masks)
    elif args.normalize_advantages and advantages:
        masks = inputs.loss_masks
        flat = masked_whiten(torch.cat(advantages), torch.cat(masks))
        advantages = list(flat.split([m.shape[0] for m in masks]))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = returns if returns is not None else advantages
