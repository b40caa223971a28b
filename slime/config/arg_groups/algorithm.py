"""Algorithm: advantage estimator, policy/value loss terms, KL, off-policy corrections.

`--disable-grpo-std-normalization` and `--disable-rewards-normalization` are stored under their own names
and mirrored, after validation, as slime's positive fields `grpo_std_normalization` / `rewards_normalization`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

from slime.algorithm.estimators import ESTIMATORS, estimator_of
from slime.algorithm.log_probs import KERNELS
from slime.config.arg_groups._common import fail
from slime.utils.backend_specs import TRAIN_BACKEND_SPECS, train_spec

logger = logging.getLogger(__name__)

FUNCTION_FLAGS = ("custom_loss_function_path", "custom_advantage_function_path", "custom_tis_function_path",
                  "custom_pg_loss_reducer_function_path")



def add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm", "Advantages, losses, KL and importance-sampling corrections.")
    g.add_argument("--advantage-estimator", choices=list(ESTIMATORS), default="grpo",
                   help="How advantages are computed (slime/algorithm/estimators.py; ppo trains a critic).")
    g.add_argument(
        "--custom-advantage-function-path",
        type=str,
        default=None,
        help="fn(args, rollout_data) -> None replacing the built-in advantages: it sets rollout_data['advantages'] "
        "and rollout_data['returns'] in place (slime's contract; docs/algorithms.md lists the keys).",
    )
    g.add_argument(
        "--loss-type",
        choices=["policy_loss", "sft_loss", "custom_loss"],
        default="policy_loss",
        help="custom_loss uses --custom-loss-function-path.",
    )
    g.add_argument("--custom-loss-function-path", type=str, default=None,
                   help="Loss fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics) for --loss-type "
                   "custom_loss (slime's contract).")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range (lower side: 1 - eps).")
    g.add_argument("--eps-clip-high", type=float, default=None, help="Upper clip range (default: --eps-clip).")
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip bound for negative advantages (> 1).")
    g.add_argument("--value-clip", type=float, default=0.2, help="Clip range of the PPO value loss.")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward (PPO / REINFORCE++).")
    g.add_argument("--use-kl-loss", action="store_true", help="Add kl_loss_coef × KL(actor || ref) to the loss.")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss term.")
    g.add_argument(
        "--kl-loss-type",
        choices=["k1", "k2", "k3", "low_var_kl"],
        default="k1",
        help="KL estimator of the KL loss (low_var_kl is k3 clamped to [-10, 10]).",
    )
    g.add_argument("--use-unbiased-kl", action="store_true", help="Importance-weight the KL estimate by the ratio.")
    g.add_argument(
        "--ref-update-interval", type=int, default=None, help="Copy the actor into the reference every N rollouts."
    )
    g.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus weight.")
    g.add_argument("--gamma", type=float, default=1.0, help="Discount (PPO GAE, REINFORCE++ returns).")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda.")
    g.add_argument("--normalize-advantages", action="store_true", help="Whiten advantages over the batch.")
    g.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="Do not divide group-centred rewards by the group std (Dr.GRPO).",
    )
    g.add_argument(
        "--disable-rewards-normalization", action="store_true", help="Do not group-normalise rewards at all."
    )
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engines' log-probs as the old policy instead of recomputing them.",
    )
    g.add_argument(
        "--use-tis", action="store_true", help="Truncated importance sampling between rollout and training log-probs."
    )
    g.add_argument("--tis-clip", type=float, default=2.0, help="Upper clamp of the TIS weight.")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="Lower clamp of the TIS weight.")
    g.add_argument(
        "--custom-tis-function-path", type=str, default=None,
        help="With --use-tis: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, "
        "response_lengths, **kw) -> (pg_loss, loss_masks, metrics) replacing the built-in truncation (slime's "
        "contract; e.g. slime.algorithm.tis.icepop_function).",
    )
    g.add_argument(
        "--custom-pg-loss-reducer-function-path", type=str, default=None,
        help="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the flat "
        "pg_loss (e.g. Dr.GRPO's constant denominator); the other metrics keep the default reduction.",
    )
    g.add_argument(
        "--use-rollout-entropy", action="store_true",
        help="Compute the per-token entropy in the forward-only log-prob passes (old policy, reference, teacher): "
        "rollout_data['entropy'] / ['ref_entropy'] / ['teacher_entropy'] for --rollout-data-postprocess-path "
        "(e.g. an entropy-based loss mask) and the debug train data; logged as rollout/entropy etc.",
    )
    g.add_argument(
        "--use-opsm", action="store_true",
        help="Off-policy sequence masking: drop the policy loss of a sample with negative advantage whose masked mean "
        "of (old − current log-prob) is above --opsm-delta; logs train/opsm_clipfrac.",
    )
    g.add_argument("--opsm-delta", type=float, default=1e-4,
                   help="With --use-opsm: the sequence-level KL (old − current log-prob, masked mean) above which a "
                   "negative-advantage sample is masked.")
    g.add_argument(
        "--get-mismatch-metrics", action="store_true",
        help="Run --custom-tis-function-path (and log its metrics) even without --use-tis.",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over all tokens of the step instead of per sample first.",
    )
    g.add_argument(
        "--log-probs-kernel", choices=("auto", *KERNELS), default="auto",
        help="How the trainers compute log-probs and entropy over the vocabulary: torch (chunked torch operations) "
        "or triton (two fused Triton kernels, one read of the logits forward, one read and one write backward; needs "
        "CUDA and triton; the top-p replay's keep mask still goes through torch). auto (the default): triton where "
        "the run trains on CUDA and triton is installed, else torch. Not in slime; on an H100 the Megatron train "
        "step of a 0.6B GRPO batch took 1.09 s with triton against 1.59 s (docs/algorithms.md).",
    )
    g.add_argument(
        "--rope-kernel", choices=("auto", *KERNELS), default="auto",
        help="How the Megatron trainer rotates packed (--qkv-format thd) queries and keys: torch (megatron-core's "
        "rotation, about a dozen element-wise kernels each way) or triton (one Triton kernel forward and one "
        "backward; needs CUDA and triton; interleaved and MLA rotations keep megatron-core's). auto (the default): "
        "triton where the Megatron trainer packs (thd) on CUDA, triton is installed and rope fusion is on "
        "(Megatron's default; --no-rope-fusion turns it off), else torch. Not in slime; on an H100 the Megatron train "
        "step of a 0.6B GRPO batch took 0.98 s with triton against 1.15 s (docs/megatron_backend.md).",
    )
    g.add_argument(
        "--attention-kernel", choices=("flash", "cudnn"), default="flash",
        help="Which fused attention the Megatron trainer runs without TransformerEngine: flash (the default: torch's "
        "flash kernels; packed --qkv-format thd micro-batches through variable-length flash attention) or cudnn "
        "(cuDNN's fused attention first; a packed micro-batch is attended as rows right-padded to its longest "
        "sequence when that adds at most half again to its attention FLOPs, else variable-length flash; sequences of "
        "one length are those rows as they are, others are copied there and back; CUDA only). Not in slime; on an "
        "H100 18 of Qwen3-4B's layers trained 16 x 4096 tokens in 2.04 s with cudnn against 2.23 with flash, and "
        "sequences of 900-1088 tokens in 1.94 against 1.97 (docs/megatron_backend.md).",
    )
    g.add_argument(
        "--num-critic-only-steps", type=int, default=0, help="Initial rollouts that train only the PPO critic."
    )
    g.add_argument(
        "--critic-load",
        type=str,
        default=None,
        help="HF folder the PPO critic's body (and value_head.pt, if there) starts from (default: --hf-checkpoint).",
    )
    g.add_argument("--critic-lr", type=float, default=None, help="Learning rate of the PPO critic (default: --lr).")
    g.add_argument(
        "--disable-compute-advantages-and-returns", dest="compute_advantages_and_returns", action="store_false",
        help="Skip the advantages and returns (slime: for --loss-type sft_loss or a custom loss that reads none; the "
        "custom loss's batch then has advantages None); refused with --loss-type policy_loss, which needs them.",
    )
    add_opd_arguments(parser)


def add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "on-policy distillation", "A teacher's log-probs of the student's samples in the advantages (docs/"
        "on_policy_distillation.md): advantages −= --opd-kl-coef × (student − teacher log-prob), per token, on top "
        "of any --advantage-estimator.")
    g.add_argument("--use-opd", action="store_true", help="On-policy distillation; needs --opd-type.")
    g.add_argument(
        "--opd-type", choices=["sglang", "megatron"], default=None,
        help="Where the teacher's log-probs come from: sglang, a teacher server at --rm-url queried by the reward "
        "function slime.rollout.on_policy_distillation.reward_func (its post-process fills Sample.teacher_log_probs); "
        "megatron, a teacher model the trainer holds, loaded from --opd-teacher-load (with --train-backend fsdp an "
        "HF folder or an fsdp checkpoint).",
    )
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the reverse KL in the advantages.")
    g.add_argument(
        "--opd-teacher-load", type=str, default=None,
        help="--opd-type megatron: the teacher's weights (a torch_dist checkpoint or an HF folder for megatron; an HF "
        "folder or an fsdp checkpoint folder for fsdp), the student's architecture and vocabulary.",
    )
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None,
                   help="--opd-type megatron: the iteration of the --opd-teacher-load checkpoint folder to load "
                   "(default: its latest).")


def _triton_runs(args: argparse.Namespace) -> bool:
    """Whether Triton kernels can run in this job's trainers: on CUDA, with triton installed."""
    return bool(args.use_cuda) and importlib.util.find_spec("triton") is not None


def _check_triton_runs(args: argparse.Namespace, flag: str) -> None:
    if importlib.util.find_spec("triton") is None:
        fail(f"{flag} triton: triton is not installed (it comes with torch's CUDA builds); install it or use {flag} "
             "torch.")
    if not args.use_cuda:
        fail(f"{flag} triton runs on CUDA only and this run trains on the CPU; use {flag} torch.")


def validate_algorithm(args: argparse.Namespace) -> None:
    if args.log_probs_kernel == "auto":
        args.log_probs_kernel = "triton" if _triton_runs(args) else "torch"
    if args.log_probs_kernel == "triton":
        _check_triton_runs(args, "--log-probs-kernel")
    packs_in_megatron = train_spec(args).model_from_megatron_flags and args.qkv_format == "thd"
    if args.rope_kernel == "auto":
        # the kernel is what Megatron's rope fusion (--no-rope-fusion: off) means without TransformerEngine
        fused = args.apply_rope_fusion
        args.rope_kernel = "triton" if packs_in_megatron and fused and _triton_runs(args) else "torch"
    if args.rope_kernel == "triton":
        _check_triton_runs(args, "--rope-kernel")
        if not packs_in_megatron:
            fail(f"--rope-kernel triton rotates the Megatron trainer's packed micro-batches only, and this run trains "
                 f"with --train-backend {args.train_backend} --qkv-format {args.qkv_format}; use --train-backend "
                 "megatron --qkv-format thd, or drop the flag.")
    if args.attention_kernel == "cudnn" and not args.use_cuda:
        fail("--attention-kernel cudnn runs on CUDA only and this run trains on the CPU; drop the flag (flash, the "
             "default).")
    if args.attention_kernel == "cudnn" and args.deterministic_mode:
        fail("--attention-kernel cudnn with --deterministic-mode: cuDNN's attention backward is not bitwise repeatable "
             "in torch (cuDNN's deterministic backward is not wired into torch's SDPA); drop one of the two.")
    if args.get_mismatch_metrics and not args.custom_tis_function_path:
        fail("--get-mismatch-metrics runs --custom-tis-function-path, which is not set; add it (e.g. "
             "slime.algorithm.tis.vanilla_tis_function) or drop the flag.")
    if args.get_mismatch_metrics and args.use_rollout_logprobs:
        fail("--get-mismatch-metrics with --use-rollout-logprobs: the metrics compare recomputed with rollout "
             "log-probs, and --use-rollout-logprobs skips the recompute here; drop one of them.")
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        logger.warning("--custom-tis-function-path %s is not called without --use-tis (or --get-mismatch-metrics).",
                       args.custom_tis_function_path)
    if args.eps_clip <= 0:
        fail(f"--eps-clip {args.eps_clip}: must be > 0.")
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    elif args.eps_clip_high <= 0:
        fail(f"--eps-clip-high {args.eps_clip_high}: must be > 0.")
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        fail(f"--eps-clip-c {args.eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3.0), or drop the flag.")

    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        fail(
            f"--kl-coef {args.kl_coef} (KL in the reward) and --kl-loss-coef {args.kl_loss_coef} (KL in the loss) "
            "are both non-zero; keep only one of the two KL terms."
        )
    if args.kl_loss_coef != 0 and not args.use_kl_loss:
        logger.warning("--kl-loss-coef %s has no effect without --use-kl-loss.", args.kl_loss_coef)

    estimator = estimator_of(args)
    if estimator.whitens and not args.normalize_advantages:
        fail(f"--advantage-estimator {args.advantage_estimator} whitens its advantages: add --normalize-advantages.")
    if args.use_rollout_logprobs and args.use_tis:
        fail(
            "--use-rollout-logprobs and --use-tis are both set: TIS corrects between rollout and recomputed "
            "log-probs, which --use-rollout-logprobs makes identical; drop one of them."
        )
    if args.tis_clip_low < 0 or args.tis_clip_low > args.tis_clip:
        fail(f"--tis-clip-low {args.tis_clip_low} / --tis-clip {args.tis_clip}: need 0 <= low <= high.")
    if args.use_opsm and args.loss_type != "policy_loss":
        logger.warning("--use-opsm masks the policy loss only; --loss-type %s does not use it.", args.loss_type)
    if args.loss_type == "custom_loss" and args.custom_loss_function_path is None:
        fail("--loss-type custom_loss needs --custom-loss-function-path pkg.module.fn.")
    if not args.compute_advantages_and_returns and args.loss_type == "policy_loss":
        fail("--disable-compute-advantages-and-returns with --loss-type policy_loss: the policy loss is weighted by "
             "the advantages; use it with --loss-type sft_loss (or custom_loss), or drop it.")
    if args.ref_update_interval is not None and args.ref_update_interval <= 0:
        fail(f"--ref-update-interval {args.ref_update_interval}: must be a positive number of rollouts.")
    if args.num_critic_only_steps < 0:
        fail(f"--num-critic-only-steps {args.num_critic_only_steps}: must be >= 0.")
    if args.num_critic_only_steps and not estimator.needs_critic:
        fail(f"--num-critic-only-steps {args.num_critic_only_steps} needs a critic: use --advantage-estimator "
             f"{_critic_estimators()}.")

    validate_ppo_and_discounting(args)
    validate_opd(args)
    if args.custom_loss_function_path and args.loss_type != "custom_loss":
        logger.warning("--custom-loss-function-path %s is ignored unless --loss-type custom_loss.",
                       args.custom_loss_function_path)
    if args.use_unbiased_kl and not (args.use_kl_loss or args.kl_coef):
        logger.warning("--use-unbiased-kl has no effect without a KL term (--use-kl-loss or --kl-coef).")

    if args.n_samples_per_prompt == 1 and not args.disable_grpo_std_normalization:
        # The std of a one-sample group is 0: dividing by it would blow advantages up.
        logger.info("--n-samples-per-prompt 1: group std normalisation is turned off.")
        args.disable_grpo_std_normalization = True
    args.grpo_std_normalization = not args.disable_grpo_std_normalization
    args.rewards_normalization = not args.disable_rewards_normalization


OPD_REWARD_FUNCTION = "slime.rollout.on_policy_distillation.reward_func"
OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"


def validate_opd(args: argparse.Namespace) -> None:
    """slime's OPD checks (in slime's order), then what OPD needs here to act at all."""
    if not args.use_opd:
        if args.opd_teacher_load is not None:
            fail(f"--opd-teacher-load {args.opd_teacher_load} is set but --use-opd is not; add --use-opd (with "
                 "--opd-type megatron) or drop it.")
        if args.opd_type is not None or args.opd_teacher_ckpt_step is not None:
            flag = "--opd-type" if args.opd_type is not None else "--opd-teacher-ckpt-step"
            fail(f"{flag} configures on-policy distillation, which is off; add --use-opd or drop it.")
        return
    if args.opd_type is None:
        fail("--use-opd needs --opd-type: sglang (teacher log-probs from a teacher server during the rollout) or "
             "megatron (a teacher model loaded from --opd-teacher-load into the trainer).")
    if args.opd_type == "megatron":
        if args.opd_teacher_load is None:
            fail("--opd-type megatron needs --opd-teacher-load: the teacher model's checkpoint (the student's "
                 "architecture).")
        if not args.debug_rollout_only and not os.path.exists(args.opd_teacher_load):
            fail(f"--opd-teacher-load {args.opd_teacher_load}: no such checkpoint folder (cwd: {os.getcwd()}); fix "
                 "the path.")
    else:
        if args.opd_teacher_load is not None:
            fail(f"--opd-teacher-load {args.opd_teacher_load} with --opd-type sglang: the teacher's log-probs come "
                 "from the teacher server during the rollout; drop --opd-teacher-load (or use --opd-type megatron).")
        if args.opd_teacher_ckpt_step is not None:
            fail(f"--opd-teacher-ckpt-step {args.opd_teacher_ckpt_step} with --opd-type sglang: the step picks the "
                 "trainer-held teacher's checkpoint (--opd-type megatron); drop it.")
        if args.custom_rm_path == OPD_REWARD_FUNCTION and not args.rm_url:
            fail(f"--custom-rm-path {OPD_REWARD_FUNCTION} posts every sample to the teacher server: add --rm-url "
                 "http://HOST:PORT/generate of it.")
        if args.custom_reward_post_process_path is None and not args.debug_train_only:
            logger.warning("--use-opd --opd-type sglang without --custom-reward-post-process-path: the rollout "
                           "must fill Sample.teacher_log_probs itself (slime's pair: --custom-rm-path %s "
                           "--custom-reward-post-process-path %s --rm-url <teacher>/generate).",
                           OPD_REWARD_FUNCTION, OPD_POST_PROCESS)
    if not args.compute_advantages_and_returns:
        fail("--use-opd with --disable-compute-advantages-and-returns: the teacher's KL enters through the "
             "advantages; drop one of them.")
    if args.loss_type == "sft_loss":
        fail("--use-opd with --loss-type sft_loss: the SFT loss reads no advantages, where the teacher's KL enters; "
             "use --loss-type policy_loss (or a custom loss that reads them).")


def validate_ppo_and_discounting(args: argparse.Namespace) -> None:
    for name, value in (("--gamma", args.gamma), ("--lambd", args.lambd)):
        if not 0.0 <= value <= 1.0:
            fail(f"{name} {value}: must lie in [0, 1] (1.0 = no discounting).")
    if args.value_clip is not None and args.value_clip <= 0:
        fail(f"--value-clip {args.value_clip}: must be > 0 (e.g. 0.2).")
    if args.critic_lr is not None and args.critic_lr < 0:
        fail(f"--critic-lr {args.critic_lr}: must be >= 0.")
    critic = estimator_of(args).needs_critic
    if not critic and (args.critic_load or args.critic_lr is not None):
        flag = "--critic-load" if args.critic_load else "--critic-lr"
        fail(f"{flag} configures the PPO critic, which --advantage-estimator {args.advantage_estimator} does not "
             f"use; drop it or use --advantage-estimator {_critic_estimators()}.")
    if args.critic_load and not args.debug_rollout_only and not os.path.isfile(
        os.path.join(args.critic_load, "config.json")
    ):
        fail(f"--critic-load {args.critic_load}: not an HF model folder (no config.json there); fix the path.")
    if critic and not train_spec(args).has_critic:
        with_critic = " or ".join(name for name, spec in TRAIN_BACKEND_SPECS.items() if spec.has_critic)
        fail(f"--advantage-estimator {args.advantage_estimator}: the critic is implemented for --train-backend "
             f"{with_critic} only; add --train-backend {with_critic}.")


def _critic_estimators() -> str:
    return " or ".join(name for name, e in ESTIMATORS.items() if e.needs_critic)
