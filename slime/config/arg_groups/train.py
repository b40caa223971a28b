"""Training flags shared by the training backends (read by `fsdp` now, by `megatron` as well).

Names and meanings follow Megatron-LM's, so the same command line works with either backend. Megatron's
architecture and parallelism flags (--num-layers, --tensor-model-parallel-size, ...) are not defined here:
they are kept raw in `args.megatron_args` (see slime/config/arguments.py).
"""

from __future__ import annotations

import argparse
import logging
import os

from slime.config.arg_groups._common import fail, require_positive
from slime.config.arg_groups.logging import run_name
from slime.utils.backend_specs import default_train_backend, train_spec
from slime.utils.checkpoint_layout import hf_export_dir

logger = logging.getLogger(__name__)

FUNCTION_FLAGS = (
    "custom_megatron_init_path",
    "custom_megatron_before_log_prob_hook_path",
    "custom_megatron_before_train_step_hook_path",
    "custom_model_provider_path",
)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("train", "Optimiser, precision and checkpoints of the training backend.")
    g.add_argument(
        "--train-backend",
        choices=["megatron", "fsdp"],
        default=None,
        help="Training backend (default: megatron with CUDA, fsdp without).",
    )
    g.add_argument("--lr", type=float, default=1e-6, help="Peak learning rate.")
    g.add_argument("--reset-optimizer-states", action="store_true",
                   help="slime: clear the optimizer's history (Adam's moments and step counts) at the start of every "
                   "rollout's training, actor and critic; the learning-rate schedule goes on.")
    g.add_argument("--use-stateless-adam", action="store_true",
                   help="slime: Adam without moments kept across optimizer steps: every step is a fresh Adam's first "
                   "(update lr·g/(|g|+eps), weight decay decoupled). Here Adam's state is reset before every step "
                   "(its memory is not saved). Needs --optimizer adam and --no-save-optim.")
    g.add_argument(
        "--adam-kernel", choices=("auto", "fused", "unfused"), default="auto",
        help="How the trainer's torch AdamW steps (the fsdp trainer's; the Megatron trainer's when megatron-core "
        "builds torch's, without TransformerEngine or Apex, whose FusedAdam it takes otherwise): fused (torch's fused "
        "kernel, one pass over parameters, gradients and moments) or unfused (torch's default: multi-tensor kernels "
        "on CUDA, a loop on the host). auto (the default): fused on CUDA with --optimizer adam (the fsdp trainer's "
        "is always AdamW) and without --optimizer-cpu-offload, else unfused. Not in slime (its Megatron-LM steps TE's "
        "FusedAdam); on an H100 18 of Qwen3-4B's layers trained 16 x 4096 tokens in 1.94 s fused against 1.98 s "
        "unfused (docs/megatron_backend.md).",
    )
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor of the learning-rate decay.")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="constant",
        # Megatron defaults to linear, which needs a decay horizon RL runs rarely set; slime's scripts pass constant.
        help="Learning-rate schedule after warm-up (default constant, as slime's scripts use).",
    )
    g.add_argument(
        "--lr-decay-iters", type=int, default=None, help="Optimizer steps over which the lr decays to --min-lr."
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Optimizer steps of linear warm-up.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warm-up.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warm-up over this share of the decay steps (--lr-decay-iters, else the run's optimizer "
                   "steps) instead of --lr-warmup-iters (Megatron-LM's rule, both backends).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled (AdamW) weight decay.")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="Optimizer (adam is AdamW). The fsdp trainer steps adam only.")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9,
                   help="Momentum of --optimizer sgd (Megatron-LM's flag and default); 0 keeps no momentum buffer.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient-norm clip (0 disables it).")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="Samples per forward/backward pass (ignored with --use-dynamic-batch-size).",
    )
    g.add_argument("--seed", type=int, default=1234, help="Seed of the training ranks (and of the engines, + rank).")
    g.add_argument("--bf16", action="store_true", help="Train in bfloat16 (fp32 master weights). Megatron on GPU trains in bf16 unless --fp16, as slime does.")
    g.add_argument("--fp16", action="store_true", help="Train in float16 with loss scaling.")
    g.add_argument("--save", type=str, default=None, help="Checkpoint folder to write (default with --save-interval: outputs/checkpoints/<run name>, "
                   "the run name as in the TensorBoard folder).")
    g.add_argument("--load", type=str, default=None, help="Checkpoint folder to resume from (if it holds one).")
    g.add_argument("--save-interval", type=int, default=None, help="Save after every N rollouts (into --save).")
    g.add_argument(
        "--ref-load",
        type=str,
        default=None,
        help="Reference-model checkpoint (an HF folder or a save folder; its iteration --ref-ckpt-step, else its "
        "latest). When --load holds no checkpoint the policy starts from it too (a fresh start at rollout 0), as in "
        "slime; without --ref-load both start from --hf-checkpoint.",
    )
    g.add_argument("--save-hf", type=str, default=None,
                   help="slime: also write the policy as an HF model folder with each checkpoint, at this path "
                   "formatted with the rollout id (e.g. /out/hf_{rollout_id}): model.safetensors plus "
                   "--hf-checkpoint's config and tokenizer files. Needs --save.")
    g.add_argument("--ref-ckpt-step", type=int, default=None,
                   help="slime: the iteration of the --ref-load save folder the reference model loads (its "
                   "iter_<step> folder; default: the one latest_checkpointed_iteration.txt names).")
    g.add_argument("--no-load-optim", action="store_true", help="Do not restore the optimizer state on --load.")
    g.add_argument("--no-load-rng", action="store_true",
                   help="Megatron-LM: do not restore the RNG state on --load. Checkpoints here hold no RNG state "
                   "(training draws no random numbers: dropout stays off), so there is nothing to skip (warned).")
    g.add_argument("--no-save-optim", action="store_true", help="Do not save the optimizer state.")
    g.add_argument("--only-train-params-name-list", type=str, nargs="*", default=None,
                   help="slime: regular expressions (re.search) of the parameter names to train; every other "
                   "parameter is frozen (no gradient, not in the optimizer; still pushed and saved). Names are the "
                   "backend's: megatron-core's (decoder.layers.3.mlp.experts) or transformers' (model.layers.3.mlp). "
                   "A pattern matching no parameter is an error.")
    g.add_argument("--freeze-params-name-list", type=str, nargs="*", default=None,
                   help="slime: regular expressions (re.search) of the parameter names to freeze (e.g. embedding "
                   "output_layer); the others train. Not together with --only-train-params-name-list.")

    p = parser.add_argument_group("megatron plugins", "slime's hooks into the megatron backend "
                                  "(docs/megatron_backend.md, 'Plugins').")
    p.add_argument("--custom-megatron-init-path", type=str, default=None,
                   help="fn(args), called on every training rank once megatron-core's parallel groups exist, "
                   "before the model is built.")
    p.add_argument("--custom-megatron-before-log-prob-hook-path", type=str, default=None,
                   help="fn(args, model, store_prefix), called before each forward-only log-prob pass (store_prefix "
                   "'' for the old policy, 'ref_' for the reference model); model is the list of model chunks.")
    p.add_argument("--custom-megatron-before-train-step-hook-path", type=str, default=None,
                   help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler), called before each "
                   "optimizer step's forward/backward, once the gradients are zeroed.")
    p.add_argument("--custom-model-provider-path", type=str, default=None,
                   help="fn(pre_process, post_process[, vp_stage]) -> GPTModel, called per model chunk instead of "
                   "the built-in GPTModel construction (the policy and the reference model).")


def validate_train(args: argparse.Namespace) -> None:
    for dest in ("no_load_rng", "no_save_rng"):
        if getattr(args, dest):
            logger.warning("--%s: checkpoints here hold no RNG state (the training draws no random numbers: dropout "
                           "stays off in every forward), so the flag changes nothing.", dest.replace("_", "-"))
    if args.train_backend is None:
        # Megatron needs the architecture flags (MODEL_ARGS); without them fsdp reads the model from
        # --hf-checkpoint, so a GPU run without a model script still starts.
        args.train_backend = default_train_backend(args.use_cuda, has_model_args=args.num_layers is not None)
        if args.use_cuda and not train_spec(args).model_from_megatron_flags:
            logger.info("--train-backend not given and no MODEL_ARGS (--num-layers ...): using %s; source a "
                        "scripts/models/<model>.sh and pass ${MODEL_ARGS[@]} for megatron.", args.train_backend)
    elif train_spec(args).expects_cuda and not args.use_cuda:
        logger.warning("--train-backend %s without CUDA: megatron-core expects a GPU on every rank.",
                       args.train_backend)

    if args.bf16 and args.fp16:
        fail("--bf16 and --fp16 are both set; choose one precision.")
    if args.use_stateless_adam and args.optimizer != "adam":
        fail(f"--use-stateless-adam with --optimizer {args.optimizer}: stateless Adam is an Adam; use --optimizer "
             "adam or drop the flag.")
    if args.use_stateless_adam and not args.no_save_optim:
        fail("--use-stateless-adam keeps no Adam moments to checkpoint: add --no-save-optim (as slime requires).")
    if args.optimizer not in train_spec(args).optimizers:
        fail(f"--optimizer {args.optimizer} with --train-backend {args.train_backend}: this trainer steps "
             f"{' or '.join(train_spec(args).optimizers)} only (torch's AdamW; slime's FSDP backend refused other "
             "optimizers too); use --optimizer adam, or --train-backend megatron (with MODEL_ARGS) for SGD.")
    _resolve_adam_kernel(args)
    if train_spec(args).bf16_by_default_on_gpu and args.use_cuda and not args.fp16 and not args.bf16:
        # slime's Megatron backend always trains in bf16 unless --fp16 (its scripts pass neither); fp32 stays
        # the rule on CPU, where megatron-core runs only through the test shim.
        logger.info("--train-backend %s on GPU: training in bf16 as slime does (pass --fp16 for fp16).",
                    args.train_backend)
        args.bf16 = True
    require_positive(args, "micro_batch_size", "save_interval", "lr_decay_iters")
    if args.lr < 0 or args.min_lr < 0:
        fail(f"--lr {args.lr} / --min-lr {args.min_lr}: learning rates must be >= 0.")
    if args.min_lr > args.lr:
        fail(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay floor must not exceed the peak.")
    if args.lr_warmup_iters < 0:
        fail(f"--lr-warmup-iters {args.lr_warmup_iters}: must be >= 0.")
    if args.lr_warmup_fraction is not None:  # both backends schedule by Megatron-LM's rules
        if args.lr_warmup_iters:
            fail(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters {args.lr_warmup_iters}: give "
                 "one warm-up length (Megatron-LM's rule).")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            fail(f"--lr-warmup-fraction {args.lr_warmup_fraction}: must lie in [0, 1) (the share of the decay steps "
                 "spent warming up).")
    if args.clip_grad < 0:
        fail(f"--clip-grad {args.clip_grad}: must be >= 0 (0 disables clipping).")
    if not (0.0 <= args.adam_beta1 < 1.0 and 0.0 <= args.adam_beta2 < 1.0):
        fail(f"--adam-beta1 {args.adam_beta1} / --adam-beta2 {args.adam_beta2}: each must lie in [0, 1).")
    if not 0.0 <= args.sgd_momentum < 1.0:
        fail(f"--sgd-momentum {args.sgd_momentum}: must lie in [0, 1).")
    if args.save_interval is not None and args.save is None:
        args.save = os.path.join("outputs", "checkpoints", run_name(args))
        logger.info("--save-interval %d without --save: checkpoints go to %s (resume with --load %s)",
                    args.save_interval, args.save, args.save)
    if args.only_train_params_name_list and args.freeze_params_name_list:
        fail(f"--only-train-params-name-list {' '.join(args.only_train_params_name_list)} and "
             f"--freeze-params-name-list {' '.join(args.freeze_params_name_list)}: give one of them (as slime "
             "requires): the parameters to train, or the parameters to freeze.")
    if args.save_hf is not None:
        _validate_save_hf(args)
    if args.ref_ckpt_step is not None and args.ref_load is None:
        fail(f"--ref-ckpt-step {args.ref_ckpt_step} without --ref-load: the step names an iteration of the --ref-load "
             "save folder; give --ref-load DIR.")
    if args.ref_load is not None and not args.debug_rollout_only and not os.path.exists(args.ref_load):
        fail(f"--ref-load {args.ref_load}: no such checkpoint folder (cwd: {os.getcwd()}); fix the path.")


def _resolve_adam_kernel(args: argparse.Namespace) -> None:
    """--adam-kernel auto → fused or unfused; fused where the trainer steps no torch Adam is refused."""
    torch_adam = args.optimizer == "adam"
    if args.adam_kernel == "auto":
        args.adam_kernel = "fused" if torch_adam and args.use_cuda and not args.optimizer_cpu_offload else "unfused"
    elif args.adam_kernel == "fused" and not torch_adam:
        fail(f"--adam-kernel fused picks the kernel of the trainer's Adam, and this run trains with --optimizer "
             f"{args.optimizer}; drop the flag.")
    elif args.adam_kernel == "fused" and args.optimizer_cpu_offload:
        fail("--adam-kernel fused with --optimizer-cpu-offload: the offloaded optimizer (megatron-core's "
             "HybridDeviceOptimizer) picks its own kernels; drop one of the two.")


def _validate_save_hf(args: argparse.Namespace) -> None:
    try:
        first = hf_export_dir(args.save_hf, 0)
    except (KeyError, IndexError, ValueError) as e:
        fail(f"--save-hf {args.save_hf}: not a path template with only {{rollout_id}} in braces ({e!r}); e.g. "
             "/out/hf_{rollout_id}.")
    if args.save is None:
        fail(f"--save-hf {args.save_hf}: the HF folder is written with each checkpoint, and no checkpoint is saved "
             "without --save; give --save DIR (and --save-interval N).")
    if args.hf_checkpoint is None:
        fail(f"--save-hf {args.save_hf}: the HF folder takes its config and tokenizer files from --hf-checkpoint; "
             "give --hf-checkpoint.")
    if os.path.realpath(first) == os.path.realpath(args.hf_checkpoint):
        fail(f"--save-hf {args.save_hf}: names --hf-checkpoint {args.hf_checkpoint} itself, which it would "
             "overwrite; give another folder.")
