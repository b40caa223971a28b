"""Parsed flags -> keyword arguments of megatron-core's configs, in one place.

Pure functions returning plain dicts (importable without CUDA and without megatron-core), plus thin
`build_*` functions that construct the real objects when megatron-core is importable:

- `transformer_config_kwargs(args)` -> `TransformerConfig` (or `MLATransformerConfig` with
  `--multi-latent-attention`); `activation_func` and dtypes are names ("silu", "bfloat16") resolved by
  `build_transformer_config`;
- `gpt_model_kwargs(args)` -> `GPTModel(config, spec, **kwargs)` (padded vocabulary, RoPE settings);
- `optimizer_config_kwargs(args)` -> `OptimizerConfig`; `ddp_config_kwargs(args)` -> `DistributedDataParallelConfig`;
- `lr_scheduler_kwargs(args, total_steps)` -> `OptimizerParamScheduler(optimizer, **kwargs)`.

Field names are megatron-core 0.16.1's (checked against its dataclasses by tests/unit/test_megatron_args.py
when megatron-core is installed). Simplifications: no FP8/FP4, no heterogeneous layers; of the
multimodal fields only `mrope_section`; `--attention-backend auto` becomes `local` when TransformerEngine is
missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os

from slime.backends.megatron_utils import wgrad_fusion
from slime.utils.errors import SlimeArgumentError

logger = logging.getLogger(__name__)

_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def check_megatron_runtime(args: argparse.Namespace, cuda_available: bool | None = None) -> None:
    """Called when the Megatron backend starts: CUDA and megatron-core must be there, MODEL_ARGS complete."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise SlimeArgumentError(
            "--train-backend megatron: CUDA is not available on this machine, and megatron-core needs one GPU "
            "per training rank. Use --train-backend fsdp (the default without CUDA) to train on CPU."
        )
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise SlimeArgumentError(
            "--train-backend megatron: megatron-core is not installed (pip install megatron-core); "
            "or use --train-backend fsdp."
        ) from e
    require_model_args(args)


def require_model_args(args: argparse.Namespace) -> None:
    missing = [f"--{d.replace('_', '-')}" for d in _REQUIRED if getattr(args, d) is None]
    if missing:
        raise SlimeArgumentError(
            f"--train-backend megatron needs the model architecture; missing {' '.join(missing)}. "
            "Source a scripts/models/<model>.sh and pass ${MODEL_ARGS[@]}."
        )


def resolve_training_options(args: argparse.Namespace) -> None:
    """Validation (--train-backend megatron) of the optimizer, schedule, position-embedding and --keep-old-actor
    flags, with Megatron-LM's rules; fills in what they imply."""
    if args.optimizer_cpu_offload and not args.use_precision_aware_optimizer:
        raise SlimeArgumentError(
            "--optimizer-cpu-offload needs --use-precision-aware-optimizer (megatron-core's hybrid CPU/GPU "
            "optimizer runs on that code path, as in Megatron-LM); add it."
        )
    if args.optimizer_cpu_offload and not (args.bf16 or args.fp16):
        raise SlimeArgumentError(
            "--optimizer-cpu-offload needs --bf16 (or --fp16): megatron-core's hybrid optimizer updates fp32 host "
            "copies of 16-bit model parameters (slime's megatron runs are always bf16); add --bf16."
        )
    if args.overlap_cpu_optimizer_d2h_h2d and not args.optimizer_cpu_offload:
        raise SlimeArgumentError("--overlap-cpu-optimizer-d2h-h2d overlaps the copies of --optimizer-cpu-offload; add "
                                 "--optimizer-cpu-offload or drop it.")
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise SlimeArgumentError(f"--optimizer-offload-fraction {args.optimizer_offload_fraction}: must lie in [0, 1] "
                                 "(the share of the optimizer state kept on the host).")
    if args.use_precision_aware_optimizer and not args.optimizer_cpu_offload and not _te_installed() \
            and not args.dry_run:
        raise SlimeArgumentError(
            "--use-precision-aware-optimizer without --optimizer-cpu-offload runs TransformerEngine's FusedAdam, and "
            "TransformerEngine is not installed here; install transformer-engine, add --optimizer-cpu-offload, or "
            "drop the flag."
        )
    if args.optimizer == "sgd" and not args.optimizer_cpu_offload and \
            (args.use_distributed_optimizer or args.use_precision_aware_optimizer):
        flag = "--use-distributed-optimizer" if args.use_distributed_optimizer else "--use-precision-aware-optimizer"
        raise SlimeArgumentError(
            f"{flag} with --optimizer sgd: megatron-core's distributed optimizer steps Adam (or its hybrid host "
            "optimizer) only; it asserts so when it is built, 0.16 and 0.19 alike. Drop the flag (SGD then keeps a "
            "whole copy on every rank), add --optimizer-cpu-offload, or use --optimizer adam."
        )
    if args.use_distributed_optimizer is None:
        # slime's megatron backend sets it for every run; megatron-core's takes Adam or its hybrid host optimizer
        args.use_distributed_optimizer = args.optimizer == "adam" or args.use_precision_aware_optimizer
    if args.use_precision_aware_optimizer and not args.use_distributed_optimizer:
        raise SlimeArgumentError(
            "--use-precision-aware-optimizer with --no-use-distributed-optimizer: megatron-core's precision-aware "
            "optimizer is its distributed optimizer's; drop one of the two."
        )
    if not args.add_position_embedding and args.position_embedding_type not in ("rope", "mrope"):
        raise SlimeArgumentError(
            f"--no-position-embedding with --position-embedding-type {args.position_embedding_type}: Megatron-LM "
            "refuses it (deprecated); say --position-embedding-type rope (or none) instead."
        )
    if args.position_embedding_type == "mrope":
        half = int(args.kv_channels * args.rotary_percent) // 2
        if not args.mrope_section or sum(args.mrope_section) != half:
            raise SlimeArgumentError(
                f"--position-embedding-type mrope with --mrope-section {args.mrope_section}: multimodal RoPE "
                f"needs the three sections (temporal, height, width) of the {half} rotary frequencies "
                "(kv-channels × rotary-percent / 2); copy mrope_section from the HF config's rope_parameters."
            )
    if args.keep_old_actor and args.overlap_param_gather:
        raise SlimeArgumentError(
            "--keep-old-actor with --overlap-param-gather: the old weights are swapped into the model between "
            "optimizer steps, where an overlapped parameter all-gather may still be writing it; drop one."
        )


DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def enable_deterministic_mode(environ=os.environ) -> None:
    """--deterministic-mode on a training rank, before its first CUDA kernel and collective: torch's deterministic
    kernels (cuBLAS then needs a fixed workspace, CUBLAS_WORKSPACE_CONFIG), no cuDNN autotuning, and an NCCL
    all-reduce algorithm with a fixed reduction order (NCCL_ALGO, default Ring). megatron-core's
    `deterministic_mode` (transformer_config_kwargs) picks its deterministic kernels."""
    import torch

    environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    algo = environ.setdefault("NCCL_ALGO", "Ring")
    if algo not in DETERMINISTIC_NCCL_ALGOS:
        raise SlimeArgumentError(f"--deterministic-mode: NCCL_ALGO={algo} does not reduce in a fixed order; set it "
                                 f"to one of {list(DETERMINISTIC_NCCL_ALGOS)} or unset it (Ring).")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


# ---- the layout MODEL_ARGS describe (also read by validation and the dry-run planner) ----------------


def query_groups(args: argparse.Namespace) -> int | None:
    """Key/value heads actually used: --num-query-groups with GQA, else one per attention head."""
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def moe_layer_pattern(args: argparse.Namespace) -> list[int] | None:
    """Per-layer 1 (MoE) / 0 (dense) from --moe-layer-freq, or None without --num-experts."""
    if not args.num_experts or not args.num_layers:
        return None
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def pipeline_layer_split(args: argparse.Namespace) -> list[int]:
    """Transformer layers per pipeline stage (first/last stage flags honoured); errors when it cannot fit."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if pp == 1:
        return [layers]
    fixed = [x for x in (first, last) if x is not None]
    middle_stages = pp - len(fixed)
    rest = layers - sum(fixed)
    how = f"--num-layers {layers} over --pipeline-model-parallel-size {pp}"
    if first is not None or last is not None:
        how += f" (--decoder-first-pipeline-num-layers {first}, --decoder-last-pipeline-num-layers {last})"
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages != 0):
        hint = [d for d in range(1, layers + 1) if layers % d == 0 and d > 1]
        raise SlimeArgumentError(
            f"{how}: the layers do not split evenly over the stages ({rest} layer(s) left for {middle_stages} "
            f"stage(s)). Use a PP size dividing {layers} ({hint}) or set --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers so the remaining layers divide evenly."
        )
    per = rest // middle_stages if middle_stages else 0
    split = [per] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Megatron-LM's padding: up to a multiple of --make-vocab-size-divisible-by × TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(args.vocab_size / multiple) * multiple)


def params_dtype_name(args: argparse.Namespace) -> str:
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    require_model_args(args)
    split = pipeline_layer_split(args)
    pp = args.pipeline_model_parallel_size
    kw = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func="silu" if args.swiglu else "gelu",
        qk_layernorm=args.qk_layernorm,
        init_method_std=args.init_method_std,
        rotary_interleaved=args.rotary_interleaved,
        apply_rope_fusion=args.apply_rope_fusion,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        masked_softmax_fusion=args.masked_softmax_fusion,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        persist_layer_norm=args.persist_layer_norm,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        attention_backend=args.attention_backend,
        # parallelism
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        # precision
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype_name(args),
        pipeline_dtype=params_dtype_name(args),
        # recompute
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deterministic_mode=args.deterministic_mode,
    )
    if args.recompute_modules is not None:
        kw["recompute_modules"] = list(args.recompute_modules)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = split[0] if pp > 1 else args.num_layers
        kw["virtual_pipeline_model_parallel_size"] = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.mtp_num_layers:
        kw["mtp_num_layers"] = args.mtp_num_layers
    if args.position_embedding_type == "mrope":
        kw["mrope_section"] = list(args.mrope_section)
    if args.num_experts:
        kw.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_shared_expert_overlap=args.moe_shared_expert_overlap,
            moe_router_topk=args.moe_router_topk,
            moe_layer_freq=moe_layer_pattern(args),
            moe_router_score_function=args.moe_router_score_function,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_router_dtype=args.moe_router_dtype,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_z_loss_coeff=args.moe_z_loss_coeff,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_permute_fusion=args.moe_permute_fusion,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_token_drop_policy=args.moe_token_drop_policy,
        )
    if args.multi_latent_attention:
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            rotary_scaling_factor=args.rotary_scaling_factor,
            original_max_position_embeddings=args.original_max_position_embeddings or args.max_position_embeddings,
            beta_fast=args.beta_fast,
            beta_slow=args.beta_slow,
            mscale=args.mscale,
            mscale_all_dim=args.mscale_all_dim,
            rope_type=args.rope_type or "yarn",
        )
    return kw


def gpt_model_kwargs(args: argparse.Namespace) -> dict:
    """GPTModel's keyword arguments besides config and layer spec (pre/post_process are per stage)."""
    require_model_args(args)
    return dict(
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings or args.seq_length or 4096,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )


def optimizer_config_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype_name(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        # --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer keeps (a fraction of) the optimizer state
        # and its update on the host
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        use_torch_optimizer_for_cpu_offload=args.use_torch_optimizer_for_cpu_offload,
        pin_cpu_grads=args.pin_cpu_grads,
        pin_cpu_params=args.pin_cpu_params,
    )


def ddp_config_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 and not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
    )


def lr_scheduler_kwargs(args: argparse.Namespace, total_steps: int) -> dict:
    """OptimizerParamScheduler kwargs; without --lr-decay-iters the decay spans the whole run. Warm-up:
    --lr-warmup-iters steps, or --lr-warmup-fraction of the decay steps (Megatron-LM's rule)."""
    decay = args.lr_decay_iters or max(total_steps, 1)
    warmup = args.lr_warmup_iters if args.lr_warmup_fraction is None else args.lr_warmup_fraction * decay
    return dict(
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, math.floor(warmup) + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )


# ---- thin constructors (need megatron-core) ----------------------------------------------------------------


def _resolve(kw: dict) -> dict:
    import torch
    import torch.nn.functional as F

    out = dict(kw)
    if "activation_func" in out:
        out["activation_func"] = {"silu": F.silu, "gelu": F.gelu}[out["activation_func"]]
    for key in ("params_dtype", "pipeline_dtype"):
        if key in out:
            out[key] = getattr(torch, out[key])
    return out


def build_transformer_config(args: argparse.Namespace, te_available: bool | None = None,
                             fuse_wgrad: bool | None = None):
    """megatron-core's TransformerConfig from slime's args. Without TransformerEngine the fusions whose kernels come
    from it or apex are turned off, except the gradient accumulation fusion when `fuse_wgrad` (default:
    wgrad_fusion.py's `supported()`, a CUDA check) says slime's own accumulator runs here."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    if te_available is None:
        try:
            import transformer_engine  # noqa: F401

            te_available = True
        except ImportError:
            te_available = False
    kw = _resolve(transformer_config_kwargs(args))
    backend = kw["attention_backend"]
    if not te_available:
        # These kernels come from TransformerEngine / apex; megatron-core refuses the flags without them.
        if backend == "auto":
            backend = "local"
        if fuse_wgrad is None:
            fuse_wgrad = wgrad_fusion.supported()
        kw.update(apply_rope_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=kw["gradient_accumulation_fusion"] and fuse_wgrad)
        if "moe_permute_fusion" in kw:
            kw.update(moe_permute_fusion=False, moe_grouped_gemm=False)
    if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
        # The fused softmax of the local attention is a compiled extension (apex / Megatron-LM builds).
        kw["masked_softmax_fusion"] = False
    kw["attention_backend"] = AttnBackend[backend]
    cls = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    return cls(**kw)


def build_optimizer_config(args: argparse.Namespace):
    from megatron.core.optimizer import OptimizerConfig

    kw = _resolve(optimizer_config_kwargs(args))
    if not (kw["use_precision_aware_optimizer"] and kw["optimizer_cpu_offload"]) or _te_installed():
        return OptimizerConfig(**kw)
    # --optimizer-cpu-offload runs megatron-core's HybridDeviceOptimizer (torch's Adam on host and device), which
    # needs no TransformerEngine, on the precision-aware code path; but megatron-core 0.16's OptimizerConfig reads
    # TE's version for that flag and fails without TE. Built without the flag, then given what its __post_init__
    # derives for it with the CPU offload (no parameter remainders: those are TE FusedAdam's).
    config = OptimizerConfig(**{**kw, "use_precision_aware_optimizer": False})
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = False
    return config


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_ddp_config(args: argparse.Namespace):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**ddp_config_kwargs(args))
