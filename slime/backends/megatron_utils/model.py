"""Parallel state, the GPTModel from Megatron flags, and its optimizer / LR schedule.

`initialize_parallel(args)` sets megatron-core's TP / PP / CP / EP groups over the already-initialised
default process group and seeds its RNG tracker. `build_model(args, wrap=True)` returns the model chunks
of this pipeline rank (one, or several with `--num-layers-per-virtual-pipeline-stage`): megatron-core's
`GPTModel` with the TransformerEngine layer spec when TE is importable, the local spec otherwise, wrapped
in megatron-core's `DistributedDataParallel` for training (`wrap=False` for the frozen reference model); with
`--lora-rank` the training chunks are frozen and get LoRA adapters first (lora.py). A
`--custom-model-provider-path` provider or a `--spec` builds the chunks instead (plugins.py). A vision-language
--hf-checkpoint gets the GPTModel that carries its HF vision tower (vision_language.py).
`build_optimizer` gives megatron-core's (distributed) optimizer, its torch Adam fused or not (`set_adam_kernel`), and
`OptimizerParamScheduler`.

Without TE, MoE experts run as `SequentialMLP` (no grouped GEMM) and attention is torch's SDPA / varlen
flash attention (`sdpa_attention.SDPAttention`, in place of megatron-core's unfused local attention);
`--context-parallel-size > 1` splits packed micro-batches in slime's zigzag layout across the CP ranks with that
attention gathering keys and values over the CP group (`cp_layout.py`; not with TE's layers). Parameters live in
`--bf16` / `--fp16` precision with fp32 master weights in the optimizer (on the host with --optimizer-cpu-offload).
"""

from __future__ import annotations

import argparse
import logging

import torch

from slime.backends.megatron_utils import args as mg_args
from slime.backends.megatron_utils import grad_norm, lora, packed_rope, plugins, sdpa_attention, wgrad_fusion
from slime.backends.megatron_utils.sandwich_norm import add_sandwich_norms
from slime.backends.megatron_utils.sequence_parallel_norm import with_sequence_parallel_norms
from slime.backends.megatron_utils.vision_language import VisionSpec, vision_spec
from slime.backends.megatron_utils.vision_language_model import vision_language_model_class
from slime.backends.training import freeze, optimizer_state
from slime.utils.errors import SlimeArgumentError
from slime.utils.hooks import hooks_of

logger = logging.getLogger(__name__)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def uses_te(args: argparse.Namespace) -> bool:
    """TransformerEngine's layers: asked for (--transformer-impl transformer_engine, the default) and installed."""
    return args.transformer_impl == "transformer_engine" and te_available()


def initialize_parallel(args: argparse.Namespace) -> None:
    """megatron-core's model-parallel groups over the default process group, and its RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world % (tp * pp * cp):
        raise SlimeArgumentError(
            f"{world} training ranks do not split into --tensor-model-parallel-size {tp} × "
            f"--pipeline-model-parallel-size {pp} × --context-parallel-size {cp} = {tp * pp * cp}; make "
            "--actor-num-nodes × --actor-num-gpus-per-node a multiple of it"
        )
    if not uses_te(args):
        if args.multi_latent_attention:
            raise SlimeArgumentError(
                "--multi-latent-attention needs TransformerEngine (megatron-core's local layers have no MLA "
                "attention), which is not installed here; install transformer-engine"
            )
        if args.sequence_parallel and args.num_experts:
            raise SlimeArgumentError(
                f"--sequence-parallel with --num-experts {args.num_experts} on megatron-core's local layers (no "
                "TransformerEngine installed here) has not been run; install transformer-engine or drop "
                "--sequence-parallel (dense models take it on the local layers)"
            )
    if cp > 1 and (uses_te(args) or args.qkv_format != "thd"):  # validation refuses these too
        raise SlimeArgumentError(
            f"--context-parallel-size {cp}: context parallelism here runs packed micro-batches through slime's own "
            f"attention (cp_layout.py), not with --qkv-format {args.qkv_format} or TransformerEngine's layers "
            f"(TE installed: {te_available()}); pass --qkv-format thd --transformer-impl local, or "
            "--context-parallel-size 1"
        )
    vpp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        vpp = mg_args.pipeline_layer_split(args)[0] // args.num_layers_per_virtual_pipeline_stage
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        )
    model_parallel_cuda_manual_seed(args.seed)


def _patch_moe_without_te() -> None:
    """megatron-core 0.16 without TransformerEngine: the MoE router's linear reads a `te_general_gemm` name
    that is only defined when TE imports (fixed in 0.17+); define it as absent so the torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _layer_spec(args: argparse.Namespace, config, vp_stage: int | None):
    """The built-in spec: megatron-core's GPT decoder block (TE or local layers; SDPA attention without TE) with
    GLM-4's sandwich norms when asked for; local norms that take sequence parallelism with it
    (sequence_parallel_norm.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = uses_te(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=args.normalization,
                                      vp_stage=vp_stage)
    if not te:
        spec = sdpa_attention.with_sdpa_attention(spec)
    spec = add_sandwich_norms(spec, config, args, te)
    return with_sequence_parallel_norms(spec) if config.sequence_parallel and not te else spec


def transformer_config(args: argparse.Namespace):
    config = mg_args.build_transformer_config(args, te_available=uses_te(args))
    # The forward runs micro-batches of varying length and size; pipeline stages exchange shapes first.
    config.variable_seq_lengths = True
    if not torch.cuda.is_available():
        config.use_cpu_initialization = True
    return config


def build_model(args: argparse.Namespace, wrap: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks (virtual pipeline stages), on the current device, in the params dtype."""
    from megatron.core import parallel_state as ps

    config = transformer_config(args)
    if config.gradient_accumulation_fusion and not uses_te(args):
        config.gradient_accumulation_fusion = wgrad_fusion.install()
    if config.num_moe_experts:
        _patch_moe_without_te()
    if args.qkv_format == "thd":
        packed_rope.install(args.rope_kernel)
    sdpa_attention.install(args.attention_kernel)
    provider = hooks_of(args).custom_model_provider
    spec = plugins.load_spec(args)
    vision = vision_spec(args)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for vp_stage in range(vpp) if vpp > 1 else [None]:
        model = _build_chunk(args, config, provider, spec, vp_stage, vision)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if device is not None:
            model.to(device)
        model.to(config.params_dtype)
        chunks.append(model)
    if not wrap:
        for model in chunks:
            model.requires_grad_(False)
            model.eval()
        return chunks
    # --only-train-params-name-list / --freeze-params-name-list, or LoRA (the base frozen, adapters added): before
    # DDP, which gives a gradient buffer only to parameters that require one (and megatron-core's optimizer skips
    # the others).
    if args.lora_rank:
        lora.apply_lora(chunks, args)
    else:
        freeze.apply_freeze(args, [(name, p) for model in chunks for name, p in model.named_parameters()])
    return [_wrap_ddp(args, config, model, i) for i, model in enumerate(chunks)]


def _build_chunk(args: argparse.Namespace, config, provider, spec, vp_stage: int | None,
                 vision: VisionSpec | None = None) -> torch.nn.Module:
    """One model chunk: --custom-model-provider-path's provider, else GPTModel with --spec's layer spec (which may
    return a model provider instead, as in slime) or the built-in one; for a vision-language --hf-checkpoint
    (`vision`), the GPTModel carrying its HF vision tower (vision_language_model.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    layer_spec = None
    if provider is None:
        layer_spec = _layer_spec(args, config, vp_stage) if spec is None else \
            plugins.custom_layer_spec(spec, args, config, vp_stage)
        if plugins.is_model_provider(layer_spec):
            provider = layer_spec
    if provider is not None:
        return plugins.call_model_provider(provider, pre, post, vp_stage, config)
    if vision is not None:
        return vision_language_model_class()(config, layer_spec, vision, pre_process=pre, post_process=post,
                                             vp_stage=vp_stage, **mg_args.gpt_model_kwargs(args))
    return GPTModel(config, layer_spec, pre_process=pre, post_process=post, vp_stage=vp_stage,
                    **mg_args.gpt_model_kwargs(args))


def _wrap_ddp(args, config, model, index: int):
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel(
        config=config,
        ddp_config=mg_args.build_ddp_config(args),
        module=model,
        # Every chunk but the first keeps its own buckets, as Megatron-LM does.
        disable_bucketing=index > 0,
    )


def build_optimizer(args: argparse.Namespace, model: list[torch.nn.Module], total_steps: int):
    """megatron-core's optimizer over the chunks, and an `OptimizerParamScheduler` over `total_steps`; its gradient
    norm without a host wait per parameter (grad_norm.py)."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    grad_norm.install()
    optimizer = get_megatron_optimizer(mg_args.build_optimizer_config(args), model)
    set_adam_kernel(optimizer, args.adam_kernel == "fused")
    scheduler = OptimizerParamScheduler(optimizer, **mg_args.lr_scheduler_kwargs(args, total_steps))
    return optimizer, scheduler


def chained(optimizer) -> list:
    """megatron-core's optimizers in `optimizer`: the ones it chains, or itself."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam / AdamW optimizers inside megatron-core's optimizer (not SGD, nor the HybridDeviceOptimizer of
    --optimizer-cpu-offload)."""
    return [o.optimizer for o in chained(optimizer) if type(o.optimizer) in (torch.optim.AdamW, torch.optim.Adam)]


def set_adam_kernel(optimizer, fused: bool) -> None:
    """--adam-kernel for each torch Adam megatron-core built (it builds them without `fused` when TransformerEngine
    and Apex are absent): slime.backends.training.optimizer_state.set_adam_kernel."""
    optimizer_state.set_adam_kernel(torch_adams(optimizer), fused)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / precision wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
