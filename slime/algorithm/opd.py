"""On-policy distillation's term in the advantages (`--use-opd`), as slime defines it.

For every response token of a sample the student generated, the per-token reverse KL estimate is
`student log-prob − teacher log-prob` of the sampled token (its mean over the student's samples is
KL(student ‖ teacher)); the advantages of any `--advantage-estimator` become

    advantage − --opd-kl-coef × (student log-prob − teacher log-prob)

after they are computed and before they are whitened (`--normalize-advantages`). The student's log-probs are the
old policy's (the engines' with `--use-rollout-logprobs`). The returns a critic trains on are not changed.
The reverse KL is logged, per step, as `train/opd_reverse_kl` (the loss's aggregation over the loss-masked
tokens). Reference: Thinking Machines' on-policy distillation (tinker-cookbook), which slime follows.
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = list[torch.Tensor]


def opd_advantages(advantages: Tensors, student_log_probs: Tensors, teacher_log_probs: Tensors, kl_coef: float
                   ) -> tuple[Tensors, Tensors]:
    """(advantages with the reverse-KL penalty, the per-token reverse KL), one [T_i] tensor per sample."""
    if not len(advantages) == len(student_log_probs) == len(teacher_log_probs):
        raise ValueError(f"on-policy distillation: {len(advantages)} advantages, {len(student_log_probs)} student and "
                         f"{len(teacher_log_probs)} teacher log-prob rows; one of each per sample")
    new, reverse_kls = [], []
    for i, (adv, student, teacher) in enumerate(zip(advantages, student_log_probs, teacher_log_probs)):
        teacher = torch.as_tensor(teacher, dtype=torch.float32, device=student.device)
        if teacher.shape != student.shape:
            raise ValueError(f"on-policy distillation: sample {i} has {student.numel()} response tokens but "
                             f"{teacher.numel()} teacher log-probs; Sample.teacher_log_probs holds one per response "
                             "token")
        reverse_kl = student.float() - teacher
        new.append(adv - kl_coef * reverse_kl.to(adv.device))
        reverse_kls.append(reverse_kl)
    return new, reverse_kls


def apply_opd_kl_to_advantages(args: Any, rollout_data: dict[str, Any], advantages: Tensors,
                               student_log_probs: Tensors | None) -> None:
    """slime's call (slime.backends.megatron_utils.loss): `advantages` updated in place from
    rollout_data["teacher_log_probs"], the reverse KL stored as rollout_data["opd_reverse_kl"]; nothing without
    student log-probs (off the last pipeline stage)."""
    if student_log_probs is None:
        return
    teacher = rollout_data.get("teacher_log_probs")
    if teacher is None:
        raise ValueError(missing_teacher_message(args.opd_type))
    new, reverse_kls = opd_advantages(advantages, student_log_probs, teacher, args.opd_kl_coef)
    advantages[:] = new
    rollout_data["opd_reverse_kl"] = reverse_kls


def missing_teacher_message(opd_type: str) -> str:
    if opd_type == "sglang":
        how = ("the rollout fills Sample.teacher_log_probs: --custom-rm-path "
               "slime.rollout.on_policy_distillation.reward_func --custom-reward-post-process-path "
               "slime.rollout.on_policy_distillation.post_process_rewards --rm-url <teacher server>/generate")
    else:
        how = "the trainer computes them with the teacher of --opd-teacher-load"
    return f"--use-opd --opd-type {opd_type}: the train batch has no teacher log-probs; {how}"
