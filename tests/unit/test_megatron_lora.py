"""LoRA on the Megatron trainer, its pure parts: --target-modules (HF names) -> Megatron's fused linears, the
adapter's tensor-parallel layout, the adapter's HF rows through a family converter, the flags' validation, and the
--dry-run memory plan with LoRA (both trainers) (docs/lora.md). The layers themselves run on gloo ranks in tests/e2e_cpu/test_megatron_lora.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.backends.megatron_utils.converters import tp
from slime.backends.megatron_utils.lora import hf_target_names, initial_a, megatron_targets
from slime.backends.megatron_utils.lora_weights import hf_rows
from slime.config.arguments import parse_args
from slime.config.plan import format_plan
from slime.config.plan.lora_size import megatron_adapter_params_per_layer
from slime.config.plan.memory import state_bytes_per_param, training_memory
from slime.config.plan.model_size import count_params, load_model_shape
from slime.utils.errors import SlimeArgumentError
from tests.args import make_args
from tests.conftest import model_args
from tests.unit.test_dry_run import QWEN3_4B, base, write_config

LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--train-backend", "megatron", "--transformer-impl", "local")


@pytest.mark.parametrize("targets, exclude, linears", [
    ("all-linear", None, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    ("q_proj,k_proj,v_proj,o_proj", None, ["linear_qkv", "linear_proj"]),
    ("all-linear", "gate_proj,up_proj,down_proj", ["linear_qkv", "linear_proj"]),
    ("gate_proj, up_proj", None, ["linear_fc1"]),
])
def test_hf_targets_map_to_megatron_linears(targets, exclude, linears):
    assert megatron_targets(targets, exclude) == linears
    assert set(hf_target_names(linears)) >= set(t.strip() for t in targets.split(",") if t.strip() != "all-linear")


@pytest.mark.parametrize("targets, exclude, message", [
    ("q_proj,v_proj", None, r"selects \['q_proj', 'v_proj'\] but not \['k_proj'\].*linear_qkv"),
    ("all-linear", "up_proj", r"but not \['up_proj'\].*linear_fc1"),
    ("q_proj,k_proj,v_proj,lm_head", None, "LM head is not built"),
    ("qkv", None, r"\['qkv'\] is none of them"),
    ("o_proj", "o_proj", "leaves no linear layer"),
])
def test_partial_or_unknown_targets_are_refused(targets, exclude, message):
    with pytest.raises(ValueError, match=message):
        megatron_targets(targets, exclude)


def test_megatron_lora_flags_validate():
    args = make_args(*LORA, "--target-modules", "all-linear")
    assert args.lora_rank == 8 and args.train_backend == "megatron"
    colocated = make_args(*LORA, "--target-modules", "all-linear", "--colocate")  # the engines keep the base on host
    assert colocated.offload_rollout and colocated.offload_train


@pytest.mark.parametrize("extra, message", [
    (("--target-modules", "q_proj"), "one fused layer"),
    (("--target-modules", "all-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "64"), "--num-experts 4"),
    (("--target-modules", "all-linear", "--rollout-external-engine-addrs", "127.0.0.1:30000"),
     "not built for external engines; pass --rollout-backend sglang or hf"),
])
def test_megatron_lora_refusals_name_the_fix(extra, message):
    with pytest.raises(SlimeArgumentError, match=message):
        make_args(*LORA, *extra)


def test_adapter_tensor_parallel_layout():
    kinds = {n: tp.shard_kind(f"decoder.layers.0.{n}") for n in (
        "self_attention.linear_qkv.lora_A.weight", "self_attention.linear_qkv.lora_B.weight",
        "self_attention.linear_proj.lora_A.weight", "self_attention.linear_proj.lora_B.weight",
        "mlp.linear_fc1.lora_A.weight", "mlp.linear_fc1.lora_B.weight",
        "mlp.linear_fc2.lora_A.weight", "mlp.linear_fc2.lora_B.weight")}
    assert kinds == {
        "self_attention.linear_qkv.lora_A.weight": "replicated", "self_attention.linear_qkv.lora_B.weight": "column",
        "self_attention.linear_proj.lora_A.weight": "row", "self_attention.linear_proj.lora_B.weight": "replicated",
        "mlp.linear_fc1.lora_A.weight": "replicated", "mlp.linear_fc1.lora_B.weight": "fc1",
        "mlp.linear_fc2.lora_A.weight": "row", "mlp.linear_fc2.lora_B.weight": "replicated"}
    # fc1's B shards as its weight: each rank holds [gate_i; up_i]; gathering undoes it
    b = torch.arange(8.0).unsqueeze(1)
    shards = tp.shard("decoder.layers.0.mlp.linear_fc1.lora_B.weight", b, 2)
    assert [s.reshape(-1).tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(tp.gather("decoder.layers.0.mlp.linear_fc1.lora_B.weight", shards), b)


def test_fused_adapter_rows_follow_the_weight_conversion():
    """GQA: 4 heads in 2 groups of head_dim 2: linear_qkv's rows per group are [q q; k; v]. The rows of B the
    converter gives each HF module are the rows the same conversion gives that module's weight."""
    hf = {"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 16}
    converter, cfg = converter_for_hf_config(hf, None), ConverterConfig.from_hf_config(hf)
    rows = dict(hf_rows(converter, cfg, "decoder.layers.0.self_attention.linear_qkv", 16))
    assert {k: v.tolist() for k, v in rows.items()} == {
        "model.layers.0.self_attn.q_proj": [0, 1, 2, 3, 8, 9, 10, 11],
        "model.layers.0.self_attn.k_proj": [4, 5, 12, 13],
        "model.layers.0.self_attn.v_proj": [6, 7, 14, 15]}
    weight = torch.randn(16, 8)
    for name, w in converter.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", weight, cfg):
        assert torch.equal(w, weight[rows[name.removesuffix(".weight")]])
    fc1 = dict(hf_rows(converter, cfg, "decoder.layers.0.mlp.linear_fc1", 6))
    assert {k: v.tolist() for k, v in fc1.items()} == {"model.layers.0.mlp.gate_proj": [0, 1, 2],
                                                        "model.layers.0.mlp.up_proj": [3, 4, 5]}


def test_initial_a_depends_on_seed_and_module_only():
    a = initial_a(4, 32, 1234, "decoder.layers.3.mlp.linear_fc2")
    assert torch.equal(a, initial_a(4, 32, 1234, "decoder.layers.3.mlp.linear_fc2"))
    assert not torch.equal(a, initial_a(4, 32, 1234, "decoder.layers.2.mlp.linear_fc2"))
    assert float(a.abs().max()) <= 1 / 32**0.5 and float(a.std()) > 0.1 / 32**0.5


# ---- the --dry-run memory plan -------------------------------------------------------------------------------
def test_megatron_lora_memory_plan_of_qwen3_4b_closed_form(files):
    """Qwen3-4B (h 2560, q 4096, kv 1024, ffn 9728, 36 layers), r = 16 on all linear layers, TP 2, DP 4: the base
    keeps its weights only; each rank's adapter shard has fp32 gradient buffers and 12 B of optimizer state ÷ DP."""
    write_config(files / "model", QWEN3_4B)
    common = (*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8",
              "--rollout-num-gpus", "8", "--rollout-backend", "hf", "--tensor-model-parallel-size", "2", "--bf16",
              "--use-distributed-optimizer", "--micro-batch-size", "1", "--rollout-max-context-len", "4096",
              "--transformer-impl", "local")
    args = parse_args(base(*common, "--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear"))
    full = training_memory(parse_args(base(*common)), load_model_shape("model"), 4096, 64, with_ref=False)
    est = training_memory(args, load_model_shape("model"), tokens=4096, micro_batches=64, with_ref=False)
    r, h, q, kv, ffn = 16, 2560, 4096, 1024, 9728
    per_layer = (r * h + r * (q + 2 * kv) / 2) + (r * q / 2 + r * h) + (r * h + r * 2 * ffn / 2) + (r * ffn / 2 + r * h)
    assert per_layer == 479_232
    assert megatron_adapter_params_per_layer(args, load_model_shape("model"), 2) == (per_layer, 794_624)
    adapter = 36 * per_layer
    assert est.get("weights") == full.get("weights")  # the base, unchanged
    assert est.get("LoRA adapters") == adapter * 2
    assert est.get("gradients") == adapter * 4  # fp32 buffers (--bf16); none for the base
    assert est.get("optimizer") == adapter * 12 / 4
    assert est.get("activations") == full.get("activations")
    assert full.get("gradients") / est.get("gradients") > 100  # 2.01 B base params per rank against 17.3 M
    assert state_bytes_per_param(args, with_ref=True) == 2 + 2  # the frozen base and its reference copy
    plan = format_plan(args)
    assert "LoRA adapters" in plan and "the base is frozen: none" in plan, plan
    # a KL term's reference is the base with the adapters off: no second copy of the weights
    kl = ("--use-kl-loss", "--kl-loss-coef", "0.01")
    with_kl = format_plan(parse_args(base(*common, *kl, "--lora-rank", "16", "--lora-alpha", "32",
                                         "--target-modules", "all-linear")))
    assert "reference model" not in with_kl and "reference is the frozen base (adapters off)" in with_kl, with_kl
    assert "reference model" in format_plan(parse_args(base(*common, *kl)))


def test_fsdp_lora_memory_plan_counts_the_models_adapter(tiny_model_dir, toy_data_path):
    """The adapter count the plan uses equals the parameters the fsdp trainer's LoRA layers add to the model."""
    flags = ["--hf-checkpoint", tiny_model_dir, "--prompt-data", toy_data_path, "--rollout-batch-size", "4",
             "--num-rollout", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--dry-run"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shape = load_model_shape(tiny_model_dir)
    p = count_params(shape).total
    for targets in ("all-linear", "q_proj,v_proj,down_proj,lm_head"):
        args = parse_args(flags + ["--lora-rank", "8", "--target-modules", targets])
        if args.use_cuda:
            pytest.skip("checks the CPU (fp32) numbers")
        lora_model = copy.deepcopy(model)
        lora.apply_lora(lora_model, 8, 16, targets)
        adapter = sum(t.numel() for t in lora_model.parameters() if t.requires_grad)
        est = training_memory(args, shape, tokens=100, micro_batches=None, with_ref=False)
        assert est.get("weights") == 4 * p / 2, targets
        assert est.get("LoRA adapters") == est.get("gradients") == 4 * adapter / 2, targets
        assert est.get("optimizer") == 8 * adapter / 2, targets
