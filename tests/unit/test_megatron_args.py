"""Megatron-LM flags: parsing into typed attributes, unknown flags, derived defaults, parallel-layout
checks, and the mapping onto megatron-core's configs (pure CPU; megatron-core only where installed)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from slime.backends.megatron_utils import args as margs
from slime.config.arguments import SlimeArgumentError, parse_args

HAS_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

QWEN3_4B = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--qk-layernorm",
]  # fmt: skip


def base(*extra: str, backend: str = "megatron", ranks: int = 8) -> list[str]:
    return [
        "--actor-num-gpus-per-node", str(ranks), "--rollout-num-gpus", "8", "--hf-checkpoint", "model",
        "--prompt-data", "train.jsonl", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--num-rollout", "3", "--train-backend", backend, *extra,
    ]  # fmt: skip


def error_of(argv) -> str:
    with pytest.raises(SlimeArgumentError) as info:
        parse_args(argv)
    return str(info.value)


def test_flags_become_typed_attributes_and_raw_tokens_are_kept(files):
    args = parse_args(base(*QWEN3_4B, "--tensor-model-parallel-size", "2", "--norm-epsilon", "-1e-6"))
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.kv_channels) == (36, 2560, 8, 128)
    assert args.swiglu and args.qk_layernorm and args.add_bias_linear is False
    assert args.rotary_base == 1e6 and args.norm_epsilon == -1e-6  # a negative value is a value
    assert args.position_embedding_type == "rope"  # --use-rotary-position-embeddings
    assert args.tensor_model_parallel_size == 2 and args.expert_tensor_parallel_size == 2
    assert args.megatron_args[:3] == ["--swiglu", "--num-layers", "36"]
    assert args.megatron_args[-4:] == ["--tensor-model-parallel-size", "2", "--norm-epsilon", "-1e-6"]
    assert "--lr" not in args.megatron_args  # training flags are slime's own


def test_unknown_flag_is_an_error_with_a_suggestion(files):
    msg = error_of(base("--num-layer", "28"))
    assert "unknown flag(s): --num-layer (did you mean --num-layers" in msg
    msg = error_of(base("--totally-made-up"))
    assert "--totally-made-up" in msg and "did you mean" not in msg


def test_megatron_defaults_are_megatron_lms(files):
    args = parse_args(base("--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4", "--swiglu"))
    assert args.ffn_hidden_size == 256  # int(4 * 96 * 2/3 / 64) * 64
    assert args.kv_channels == 24 and args.num_query_groups == 1 and not args.group_query_attention
    assert (args.attention_dropout, args.hidden_dropout, args.normalization) == (0.1, 0.1, "LayerNorm")
    assert (args.make_vocab_size_divisible_by, args.ckpt_format, args.moe_router_topk) == (128, "torch_dist", 2)
    assert (
        parse_args(base("--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4")).ffn_hidden_size
        == 384
    )
    assert parse_args(base("--recompute-activations")).recompute_granularity == "selective"


def test_moe_layer_freq_accepts_megatron_list_expressions(files):
    args = parse_args(base("--num-layers", "8", "--num-experts", "4", "--moe-layer-freq", "([0]*3+[1]*5)"))
    assert args.moe_layer_freq == [0, 0, 0, 1, 1, 1, 1, 1]
    args = parse_args(base("--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "2"))
    from slime.config.arg_groups.megatron import moe_layer_pattern

    assert moe_layer_pattern(args) == [1, 0, 1, 0]
    assert "--moe-layer-freq" in error_of(base("--moe-layer-freq", "__import__('os')"))
    msg = error_of(base("--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "[0,1,1]"))
    assert "gives 3 layer(s) but --num-layers is 4" in msg


def test_tensor_parallel_must_divide_heads_and_query_groups(files):
    msg = error_of(base(*QWEN3_4B, "--tensor-model-parallel-size", "3", "--actor-num-gpus-per-node", "6"))
    assert "--tensor-model-parallel-size 3 does not divide --num-attention-heads 32" in msg
    argv = base(*QWEN3_4B, "--tensor-model-parallel-size", "16", "--actor-num-gpus-per-node", "16",
                "--rollout-num-gpus", "16", "--global-batch-size", "16")  # fmt: skip
    msg = error_of(argv)
    assert "--tensor-model-parallel-size 16 does not divide --num-query-groups 8" in msg and "[1, 2, 4, 8]" in msg
    # fsdp does not use the layout: no error
    assert parse_args(base(*QWEN3_4B, backend="fsdp")).num_layers == 36


def test_pipeline_must_split_layers(files):
    argv = base(*QWEN3_4B, "--pipeline-model-parallel-size", "8")
    assert "--num-layers 36 over --pipeline-model-parallel-size 8" in error_of(argv)
    # 36 = 8 (first) + 6 × 4 (middle) + 4 (last) with 8 stages
    ok = parse_args(argv + ["--decoder-first-pipeline-num-layers", "8", "--decoder-last-pipeline-num-layers", "4"])
    from slime.config.arg_groups.megatron import pipeline_layer_split

    assert pipeline_layer_split(ok) == [8, 4, 4, 4, 4, 4, 4, 4]
    assert pipeline_layer_split(parse_args(base(*QWEN3_4B, "--pipeline-model-parallel-size", "4"))) == [9] * 4


def test_expert_parallel_must_divide_experts(files):
    msg = error_of(base("--num-layers", "2", "--num-experts", "6", "--expert-model-parallel-size", "4",
                        "--moe-token-dispatcher-type", "alltoall"))
    assert "--expert-model-parallel-size 4 does not divide --num-experts 6" in msg


def test_moe_models_use_the_alltoall_dispatcher_as_in_slime(files):
    """slime replaces Megatron-LM's default allgather dispatcher by alltoall (variable-length micro-batches)."""
    args = parse_args(base("--num-layers", "2", "--num-experts", "8", "--expert-model-parallel-size", "4"))
    assert args.moe_token_dispatcher_type == "alltoall"
    dense = parse_args(base("--num-layers", "2"))
    assert dense.moe_token_dispatcher_type == "allgather"  # no experts: nothing is dispatched


def test_context_parallelism_is_accepted_for_packed_micro_batches_and_refused_elsewhere(files, monkeypatch):
    assert parse_args(base(*QWEN3_4B)).qkv_format == "thd"  # slime's default: packed micro-batches
    args = parse_args(base(*QWEN3_4B, "--context-parallel-size", "2", "--transformer-impl", "local"))
    assert args.context_parallel_size == 2
    message = error_of(base(*QWEN3_4B, "--context-parallel-size", "2", "--qkv-format", "bshd"))
    assert "--context-parallel-size 2 with --qkv-format bshd" in message and "use --qkv-format thd" in message
    message = error_of(base(*QWEN3_4B, "--context-parallel-size", "4", ranks=6))
    assert "TP 1 × PP 1 × CP 4 = 4 does not divide" in message
    message = error_of(base(*QWEN3_4B, "--context-parallel-size", "2", backend="fsdp"))
    assert "--context-parallel-size 2 with --train-backend fsdp" in message and "--train-backend megatron" in message
    message = error_of(base(*QWEN3_4B, "--context-parallel-size", "2", "--loss-type", "custom_loss",
                            "--custom-loss-function-path", "slime.backends.megatron_utils.loss.policy_loss_function"))
    assert "--context-parallel-size 2 with --loss-type custom_loss" in message
    # where TransformerEngine is installed, its layers would take the attention over: asked to build ours instead
    from slime.backends.megatron_utils import model

    monkeypatch.setattr(model, "te_available", lambda: True)
    message = error_of(base(*QWEN3_4B, "--context-parallel-size", "2"))
    assert "--context-parallel-size 2: TransformerEngine's attention" in message and "--transformer-impl local" in message
    assert parse_args(base(*QWEN3_4B, "--context-parallel-size", "2", "--transformer-impl", "local"))


def test_recompute_method_needs_full_granularity(files):
    assert "needs --recompute-granularity full" in error_of(base("--recompute-method", "uniform"))
    assert "--recompute-num-layers" in error_of(base("--recompute-granularity", "full", "--recompute-method", "block"))


def test_transformer_config_kwargs(files):
    args = parse_args(base(*QWEN3_4B, "--tensor-model-parallel-size", "2", "--bf16", "--sequence-parallel",
                           "--attention-dropout", "0", "--hidden-dropout", "0"))  # fmt: skip
    kw = margs.transformer_config_kwargs(args)
    assert kw["num_query_groups"] == 8 and kw["kv_channels"] == 128 and kw["ffn_hidden_size"] == 9728
    assert kw["gated_linear_unit"] and kw["activation_func"] == "silu" and not kw["add_bias_linear"]
    assert kw["layernorm_epsilon"] == 1e-6 and kw["normalization"] == "RMSNorm" and kw["qk_layernorm"]
    assert (kw["bf16"], kw["params_dtype"], kw["sequence_parallel"]) == (True, "bfloat16", True)
    assert kw["attention_dropout"] == kw["hidden_dropout"] == 0.0
    assert "num_moe_experts" not in kw and "multi_latent_attention" not in kw
    gm = margs.gpt_model_kwargs(args)
    assert gm["vocab_size"] == 152064  # 151936 padded to a multiple of 128 × TP 2
    assert gm["share_embeddings_and_output_weights"] and gm["position_embedding_type"] == "rope"
    assert gm["rotary_base"] == 1000000
    # sequence parallel is dropped at TP 1 (Megatron-LM does the same)
    assert parse_args(base(*QWEN3_4B, "--sequence-parallel")).sequence_parallel is False


def test_moe_and_mla_kwargs(files):
    argv = base("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "100",
                "--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1,1,1]",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--multi-latent-attention", "--kv-lora-rank", "16", "--q-lora-rank", "24",
                "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall")  # fmt: skip
    kw = margs.transformer_config_kwargs(parse_args(argv))
    assert kw["num_moe_experts"] == 8 and kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["expert_model_parallel_size"] == 4
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["multi_latent_attention"] and (kw["q_lora_rank"], kw["kv_lora_rank"]) == (24, 16)
    assert kw["rope_type"] == "yarn"  # megatron-core's MLA default


def test_multimodal_rope_takes_its_sections(files):
    qwen2_5_vl = [t for t in QWEN3_4B if t not in ("--use-rotary-position-embeddings", "--qk-layernorm")]
    args = parse_args(base(*qwen2_5_vl, "--position-embedding-type", "mrope", "--mrope-section", "16", "24", "24"))
    assert margs.transformer_config_kwargs(args)["mrope_section"] == [16, 24, 24]
    assert margs.gpt_model_kwargs(args)["position_embedding_type"] == "mrope"
    assert "mrope_section" not in margs.transformer_config_kwargs(parse_args(base(*QWEN3_4B)))
    for sections in ([], ["16", "24", "20"]):  # missing; not the 64 rotary frequencies of kv-channels 128
        error = error_of(base(*qwen2_5_vl, "--position-embedding-type", "mrope",
                              *(["--mrope-section", *sections] if sections else [])))
        assert "--mrope-section" in error and "64 rotary frequencies" in error


def test_the_distributed_optimizer_is_on_unless_refused_as_slime_sets_it(files):
    assert parse_args(base()).use_distributed_optimizer is True
    # SGD: megatron-core's distributed optimizer steps Adam only (it asserts so when built)
    assert parse_args(base("--optimizer", "sgd")).use_distributed_optimizer is False
    assert "--use-distributed-optimizer with --optimizer sgd: megatron-core's distributed optimizer steps Adam" in \
        error_of(base("--optimizer", "sgd", "--use-distributed-optimizer"))
    # ... or its hybrid host optimizer, which takes SGD
    hybrid = base("--optimizer", "sgd", "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--bf16")
    assert parse_args(hybrid).use_distributed_optimizer is True
    off = parse_args(base("--no-use-distributed-optimizer"))
    assert off.use_distributed_optimizer is False and not margs.ddp_config_kwargs(off)["use_distributed_optimizer"]
    error = error_of(base("--no-use-distributed-optimizer", "--use-precision-aware-optimizer",
                          "--optimizer-cpu-offload", "--bf16"))
    assert "--use-precision-aware-optimizer with --no-use-distributed-optimizer" in error


def test_optimizer_ddp_and_schedule_kwargs(files):
    args = parse_args(base("--lr", "2e-6", "--min-lr", "1e-7", "--lr-decay-style", "cosine", "--lr-warmup-iters",
                           "5", "--use-distributed-optimizer", "--overlap-grad-reduce", "--clip-grad", "0.5"))  # fmt: skip
    opt = margs.optimizer_config_kwargs(args)
    assert (opt["lr"], opt["min_lr"], opt["clip_grad"], opt["optimizer"]) == (2e-6, 1e-7, 0.5, "adam")
    assert opt["use_distributed_optimizer"] and (opt["adam_beta1"], opt["adam_beta2"]) == (0.9, 0.95)
    assert opt["sgd_momentum"] == 0.9  # Megatron-LM's default
    assert margs.optimizer_config_kwargs(parse_args(base("--optimizer", "sgd", "--sgd-momentum", "0")))["sgd_momentum"] == 0
    assert "--sgd-momentum 1.0: must lie in [0, 1)" in error_of(base("--optimizer", "sgd", "--sgd-momentum", "1.0"))
    ddp = margs.ddp_config_kwargs(args)
    assert ddp["overlap_grad_reduce"] and ddp["use_distributed_optimizer"] and not ddp["grad_reduce_in_fp32"]
    sched = margs.lr_scheduler_kwargs(args, total_steps=100)
    assert (sched["max_lr"], sched["lr_warmup_steps"], sched["lr_decay_steps"]) == (2e-6, 5, 100)
    assert sched["lr_decay_style"] == "cosine"
    fp32 = parse_args(base("--accumulate-allreduce-grads-in-fp32"))
    assert margs.ddp_config_kwargs(fp32)["grad_reduce_in_fp32"]
    bf16 = parse_args(base("--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"))
    assert not margs.ddp_config_kwargs(bf16)["grad_reduce_in_fp32"]  # --grad-reduce-in-bf16 wins, as in Megatron-LM
    # Megatron-LM's rule: --bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
    assert margs.ddp_config_kwargs(parse_args(base("--bf16")))["grad_reduce_in_fp32"]
    assert not margs.ddp_config_kwargs(parse_args(base("--bf16", "--grad-reduce-in-bf16")))["grad_reduce_in_fp32"]


def test_transformer_impl_local_never_builds_te_layers(files, monkeypatch):
    from slime.backends.megatron_utils import model

    monkeypatch.setattr(model, "te_available", lambda: True)
    assert model.uses_te(parse_args(base()))
    assert not model.uses_te(parse_args(base("--transformer-impl", "local")))
    monkeypatch.setattr(model, "te_available", lambda: False)
    assert not model.uses_te(parse_args(base()))


def test_megatron_runtime_needs_cuda_and_model_args(files):
    args = parse_args(base(*QWEN3_4B))
    with pytest.raises(SlimeArgumentError, match="CUDA is not available.*--train-backend fsdp"):
        margs.check_megatron_runtime(args, cuda_available=False)
    args = parse_args(base("--num-layers", "2"))
    with pytest.raises(SlimeArgumentError, match="missing --hidden-size --num-attention-heads --vocab-size"):
        margs.require_model_args(args)


@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core not installed")
def test_kwargs_are_megatron_core_fields(files):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig

    mrope = [t for t in QWEN3_4B if t != "--use-rotary-position-embeddings"]
    argv = base(*mrope, "--num-experts", "8", "--multi-latent-attention", "--recompute-modules", "core_attn",
                "--position-embedding-type", "mrope", "--mrope-section", "16", "24", "24")
    args = parse_args(argv)
    assert margs.transformer_config_kwargs(args)["mrope_section"] == [16, 24, 24]
    for kwargs, cls in (
        (margs.transformer_config_kwargs(args), MLATransformerConfig),
        (margs.optimizer_config_kwargs(args), OptimizerConfig),
        (margs.ddp_config_kwargs(args), DistributedDataParallelConfig),
    ):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(kwargs) <= fields, sorted(set(kwargs) - fields)
    assert margs.build_optimizer_config(args).lr == args.lr
    assert margs.build_ddp_config(args).use_distributed_optimizer is True  # the default, as slime


def test_megatron_on_gpu_trains_in_bf16_unless_fp16_as_slime_does(files):
    model = ("--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4")
    gpu = ("--dry-run", "--dry-run-cuda")
    assert parse_args(base(*model, *gpu)).bf16
    fp16 = parse_args(base(*model, *gpu, "--fp16"))
    assert fp16.fp16 and not fp16.bf16
    assert not parse_args(base(*model)).bf16  # CPU (the megatron-core shim): fp32 unless --bf16
