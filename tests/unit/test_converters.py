"""HF <-> Megatron converters on tiny random-init HF models of every family (pure CPU, no megatron-core):
exact round trips, the export loads into transformers with no missing/unexpected keys, TP=2 shard/gather,
and the MODEL_ARGS <-> config.json cross-check catching a planted mismatch per family."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from slime.backends.megatron_utils.config_check import ConfigMismatchError, check_against_hf_config, load_hf_config
from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config, get_converter
from slime.backends.megatron_utils.converters import tp as tpm

ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe", "glm4", "glm4_moe", "deepseek_v3"]
SCRIPT = {a: "tiny-" + a.replace("_", "-") for a in ARCHS}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PADDED_VOCAB = 256  # 192 padded up, as --make-vocab-size-divisible-by 128 × TP 2 would


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_families")
    return {a: make_tiny_model(str(root / a), arch=a, size="tiny", seed=0) for a in ARCHS}


def load(folder: str):
    from safetensors.torch import load_file

    cfg = load_hf_config(folder)
    return cfg, load_file(os.path.join(folder, "model.safetensors"))


def model_args(arch: str, folder: str, *extra: str):
    from slime.config.arguments import parse_args

    out = subprocess.run(
        ["bash", "-c", f"source scripts/models/{SCRIPT[arch]}.sh && printf '%s\\n' \"${{MODEL_ARGS[@]}}\""],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    data = os.path.join(folder, "train.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "a", "label": "b"}\n')
    argv = ["--hf-checkpoint", folder, "--prompt-data", data, "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]  # fmt: skip
    return parse_args(argv + out.stdout.splitlines() + list(extra))  # extra flags win over the script's


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_round_trip_is_exact(tiny, arch):
    cfg_json, hf = load(tiny[arch])
    conv = converter_for_hf_config(cfg_json)
    cfg = ConverterConfig.from_hf_config(cfg_json, padded_vocab_size=PADDED_VOCAB)
    for spec, grouped in (("te", False), ("local", False), ("te", True)):
        mg = conv.hf_to_megatron(hf, cfg, spec=spec, grouped=grouped)
        emb = mg["embedding.word_embeddings.weight"]
        assert emb.shape[0] == PADDED_VOCAB and torch.count_nonzero(emb[cfg.vocab_size :]) == 0
        assert same(conv.state_dict_to_hf(mg, cfg), hf), (spec, grouped)
    # the converter reads every tensor the checkpoint has, and each layer gets its own norms
    mg = conv.hf_to_megatron(hf, cfg)
    assert sum(t.numel() for t in mg.values()) == sum(t.numel() for t in hf.values()) + 2 * 64 * 128


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_into_transformers_without_missing_or_unexpected_keys(tiny, arch, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg_json, hf = load(tiny[arch])
    conv = converter_for_hf_config(cfg_json)
    cfg = ConverterConfig.from_hf_config(cfg_json, padded_vocab_size=PADDED_VOCAB)
    exported = conv.state_dict_to_hf(conv.hf_to_megatron(hf, cfg), cfg)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(tiny[arch], name)) as src, open(tmp_path / name, "w") as dst:
            dst.write(src.read())
    save_file({k: v.contiguous() for k, v in exported.items()}, str(tmp_path / "model.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = AutoModelForCausalLM.from_pretrained(tiny[arch], dtype=torch.float32)
    ref_sd = reference.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in model.state_dict().items())
    if cfg.num_experts == 0:  # dense: HF checkpoint names are the module names, strict load works directly
        reference.load_state_dict(exported, strict=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_shard_gather_round_trip(tiny, arch):
    cfg_json, hf = load(tiny[arch])
    conv = converter_for_hf_config(cfg_json)
    cfg = ConverterConfig.from_hf_config(cfg_json, padded_vocab_size=PADDED_VOCAB)
    mg = conv.hf_to_megatron(hf, cfg)
    for etp in (1, 2):
        shards = tpm.shard_state_dict(mg, tp=2, etp=etp)
        assert same(tpm.gather_state_dict(shards, etp=etp), mg)
    shards = tpm.shard_state_dict(mg, tp=2)
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == PADDED_VOCAB // 2
    assert shards[1]["decoder.final_layernorm.weight"].shape == mg["decoder.final_layernorm.weight"].shape


def test_qwen3_moe_dense_layers_from_config():
    """Qwen3-MoE's dense layers come from `mlp_only_layers` and `decoder_sparse_step` (the tiny Qwen3-MoE is all
    sparse, as the releases are, so the mixed layout is checked on the config alone)."""
    base = {"num_attention_heads": 4, "num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 128, "num_experts": 4}
    layers = lambda **kw: ConverterConfig.from_hf_config({**base, **kw}).moe_layers  # noqa: E731
    assert layers() == [True] * 6
    assert layers(mlp_only_layers=[0]) == [False] + [True] * 5
    assert layers(decoder_sparse_step=2, mlp_only_layers=[3]) == [False, True, False, False, False, True]


def test_tp_shards_hold_whole_query_groups_and_gate_up_halves(tiny):
    cfg_json, hf = load(tiny["qwen3"])
    cfg = ConverterConfig.from_hf_config(cfg_json)  # 4 heads, 2 groups, head dim 32
    mg = get_converter("qwen3").hf_to_megatron(hf, cfg)
    p = "model.layers.0."
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    qkv = tpm.shard(
        "decoder.layers.0.self_attention.linear_qkv.weight", mg["decoder.layers.0.self_attention.linear_qkv.weight"], 2
    )
    # rank 1 holds group 1: query heads 2-3, key head 1, value head 1
    assert torch.equal(qkv[1], torch.cat([q[64:128], k[32:64], v[32:64]]))
    fc1 = tpm.shard("decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], 2)
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    assert torch.equal(fc1[0], torch.cat([gate[:256], up[:256]])) and torch.equal(
        fc1[1], torch.cat([gate[256:], up[256:]])
    )
    proj = tpm.shard(
        "decoder.layers.0.self_attention.linear_proj.weight",
        mg["decoder.layers.0.self_attention.linear_proj.weight"],
        2,
    )
    assert proj[0].shape == (128, 64)  # row parallel: split along the input dim
    assert tpm.expert_global_index(1, ep_rank=1, num_experts=4, ep=2) == 3


def test_megatron_names_are_megatron_cores():
    """The names megatron-core 0.16.1's GPTModel (local spec) has for a Qwen3 dense layer and a Qwen3-MoE
    layer, as listed from a model built on CPU; our TE spelling folds the two norms into linear_qkv/fc1."""
    cfg = ConverterConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                          vocab_size=100, num_experts=2, moe_layers=[False, True])  # fmt: skip
    hf = {"model.embed_tokens.weight": torch.zeros(100, 64), "model.norm.weight": torch.zeros(64),
          "lm_head.weight": torch.zeros(100, 64)}  # fmt: skip
    for i in range(2):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": torch.zeros(64), p + "post_attention_layernorm.weight": torch.zeros(64),
                   p + "self_attn.q_proj.weight": torch.zeros(64, 64), p + "self_attn.k_proj.weight": torch.zeros(32, 64),
                   p + "self_attn.v_proj.weight": torch.zeros(32, 64), p + "self_attn.o_proj.weight": torch.zeros(64, 64),
                   p + "self_attn.q_norm.weight": torch.zeros(16), p + "self_attn.k_norm.weight": torch.zeros(16)})  # fmt: skip
    hf.update({"model.layers.0.mlp.gate_proj.weight": torch.zeros(128, 64), "model.layers.0.mlp.up_proj.weight":
               torch.zeros(128, 64), "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128),
               "model.layers.1.mlp.gate.weight": torch.zeros(2, 64)})  # fmt: skip
    for e in range(2):
        hf.update({f"model.layers.1.mlp.experts.{e}.{x}_proj.weight": torch.zeros(32, 64) for x in ("gate", "up")})
        hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = torch.zeros(64, 32)
    local = get_converter("qwen3_moe").hf_to_megatron(hf, cfg, spec="local")
    expected = {
        "embedding.word_embeddings.weight": (100, 64), "decoder.final_layernorm.weight": (64,), "output_layer.weight": (100, 64),
        "decoder.layers.0.input_layernorm.weight": (64,), "decoder.layers.0.self_attention.linear_qkv.weight": (128, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64), "decoder.layers.0.self_attention.q_layernorm.weight": (16,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (16,), "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.0.mlp.linear_fc1.weight": (256, 64), "decoder.layers.0.mlp.linear_fc2.weight": (64, 128),
        "decoder.layers.1.input_layernorm.weight": (64,), "decoder.layers.1.self_attention.linear_qkv.weight": (128, 64),
        "decoder.layers.1.self_attention.linear_proj.weight": (64, 64), "decoder.layers.1.self_attention.q_layernorm.weight": (16,),
        "decoder.layers.1.self_attention.k_layernorm.weight": (16,), "decoder.layers.1.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.1.mlp.router.weight": (2, 64),
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight": (64, 64),
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight": (64, 32),
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": (64, 64),
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight": (64, 32),
    }  # fmt: skip
    assert {k: tuple(v.shape) for k, v in local.items()} == expected


def test_unknown_family_and_missing_tensor_are_named():
    with pytest.raises(KeyError, match="no HF<->Megatron converter for model type 'gpt2'"):
        get_converter("gpt2")
    cfg = ConverterConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1, head_dim=4, vocab_size=4
    )
    with pytest.raises(KeyError, match="'model.layers.0.self_attn.o_proj.weight' is missing"):
        get_converter("llama").hf_to_megatron({"model.embed_tokens.weight": torch.zeros(4, 8)}, cfg)
    with pytest.raises(KeyError, match="unknown Megatron parameter"):
        get_converter("llama").megatron_to_hf("decoder.layers.0.mystery.weight", torch.zeros(1), cfg)


# one planted mismatch per family: (flag dest, wrong value, config field named in the error)
PLANTED = {
    "qwen3": ("rotary_base", 10000.0, "rope_theta"),
    "qwen2": ("add_qkv_bias", False, "attention_bias (QKV bias)"),
    "llama": ("num_query_groups", 4, "num_key_value_heads"),
    "qwen3_moe": ("moe_ffn_hidden_size", 128, "moe_intermediate_size"),
    "glm4": ("post_mlp_layernorm", False, "post_mlp_layernorm"),
    "glm4_moe": ("moe_shared_expert_intermediate_size", 32, "n_shared_experts × moe_intermediate_size"),
    "deepseek_v3": ("kv_lora_rank", 16, "kv_lora_rank"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_check_catches_a_planted_mismatch(tiny, arch):
    args = model_args(arch, tiny[arch], "--train-backend", "fsdp")
    check_against_hf_config(args, tiny[arch])  # the tiny script agrees with its model
    dest, wrong, field = PLANTED[arch]
    setattr(args, dest, wrong)
    with pytest.raises(ConfigMismatchError) as info:
        check_against_hf_config(args, tiny[arch])
    msg = str(info.value)
    assert f"{field}: config.json says" in msg and f"gives {wrong!r}" in msg, msg
    assert "--" + dest.replace("_", "-") in msg and len(msg.split("; ")) == 1  # exactly the planted field


def test_config_mismatch_is_an_error_for_megatron_and_a_warning_for_fsdp(tiny, caplog):
    import logging

    from slime.config.arguments import SlimeArgumentError

    with pytest.raises(SlimeArgumentError, match="num_hidden_layers: config.json says 4, --num-layers gives 5"):
        model_args("qwen3", tiny["qwen3"], "--train-backend", "megatron", "--num-layers", "5")
    with caplog.at_level(logging.WARNING):
        args = model_args("qwen3", tiny["qwen3"], "--train-backend", "fsdp", "--num-layers", "5")
    assert args.num_layers == 5
    assert any("--num-layers gives 5" in r.getMessage() for r in caplog.records)


MCORE_SCRIPT = r"""
import contextlib, json, sys, torch, traceback
torch.cuda.current_device = lambda: "cpu"  # test-only: megatron-core 0.16 asks for a CUDA device
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel import random as tpr
tpr.get_cuda_rng_tracker().add = lambda *a, **k: None
tpr.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
import megatron.core.transformer.moe.moe_utils as mu
mu.te_general_gemm = getattr(mu, "te_general_gemm", None)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from slime.backends.megatron_utils import args as margs
from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.config.arguments import parse_args


def max_err(folder, argv):
    args = parse_args(argv)
    config = margs.build_transformer_config(args, te_available=False)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, pre_process=True, post_process=True, **margs.gpt_model_kwargs(args)).eval()
    hf_cfg = json.load(open(folder + "/config.json"))
    cfg = ConverterConfig.from_args(args)
    mg = converter_for_hf_config(hf_cfg).hf_to_megatron(load_file(folder + "/model.safetensors"), cfg, spec="local")
    ref = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert ref == set(mg), sorted(ref ^ set(mg))
    model.load_state_dict(mg, strict=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 150, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(12, 12), 1).bool()[None, None]
    with torch.no_grad():
        out = model(ids, torch.arange(12)[None], attention_mask=mask)[..., : cfg.vocab_size]
        return (out - hf(ids).logits).abs().max().item()


results = {}
for arch, (folder, argv) in json.loads(sys.argv[1]).items():
    try:
        results[arch] = {"err": max_err(folder, argv)}
    except Exception:  # reported to that arch's own test
        results[arch] = {"error": traceback.format_exc()}
print("RESULTS", json.dumps(results))
"""
MCORE_ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe"]


@pytest.fixture(scope="module")
def mcore_logit_errors(tiny):
    """Each of MCORE_ARCHS's largest logit difference (or its error) from one process: megatron-core, transformers
    and torch.distributed are imported once for all of them (each model is built and compared on its own)."""
    jobs = {}
    for arch in MCORE_ARCHS:
        args = model_args(arch, tiny[arch], "--train-backend", "fsdp", "--attention-dropout", "0",
                          "--hidden-dropout", "0")
        jobs[arch] = (tiny[arch], [
            "--hf-checkpoint", tiny[arch], "--prompt-data", args.prompt_data, "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
            "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
            "--no-persist-layer-norm", *args.megatron_args])  # fmt: skip
    run = subprocess.run([sys.executable, "-c", MCORE_SCRIPT, json.dumps(jobs)], capture_output=True,
                         text=True, cwd=REPO, timeout=300, check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULTS")[1])


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.parametrize("arch", MCORE_ARCHS)
def test_megatron_core_logits_match_hf_after_conversion(mcore_logit_errors, arch):
    """Where megatron-core is installed: build GPTModel (local spec, fp32, CPU) from our config mapping,
    load the converted weights, and compare logits with transformers' (test-only CUDA redirections)."""
    result = mcore_logit_errors[arch]
    assert "error" not in result, result.get("error", "")[-3000:]
    err = result["err"]
    print(f"[{arch}] max |logit difference|: {err:.3g}")
    assert err < 1e-4, err


def test_model_name_picks_the_converter_over_model_type():
    """--model-name: slime's name for the family whose weight conversion to use (else config.json's model_type)."""
    assert converter_for_hf_config({"model_type": "qwen3"}).name == get_converter("qwen3").name
    assert converter_for_hf_config({"model_type": "qwen3"}, "llama").name == get_converter("llama").name
    assert converter_for_hf_config({}, "glm4").name == get_converter("glm4").name
    with pytest.raises(KeyError, match="--model-name"):
        converter_for_hf_config({})


def test_config_check_follows_slimes_partial_and_moe_rules():
    from types import SimpleNamespace

    from slime.backends.megatron_utils.config_check import find_mismatches

    # a partial config.json and a partial namespace (slime's hf_validate_args takes both): only what both hold
    assert find_mismatches(SimpleNamespace(hidden_size=64), {"hidden_size": 64, "model_type": "qwen3_moe",
                                                             "num_experts": 4}) == []
    assert find_mismatches(SimpleNamespace(hidden_size=32), {"hidden_size": 64}) == [
        "hidden_size: config.json says 64, --hidden-size gives 32"]
    # every layer an MoE layer: no dense FFN, so intermediate_size is not compared; one dense layer: it is
    moe = dict(num_experts=4, num_layers=2, ffn_hidden_size=1, moe_layer_freq=[1, 1])
    cfg = {"model_type": "qwen3_moe", "num_experts": 4, "intermediate_size": 256}
    assert find_mismatches(SimpleNamespace(**moe), cfg) == []
    assert find_mismatches(SimpleNamespace(**{**moe, "moe_layer_freq": [0, 1]}), cfg) == [
        "intermediate_size: config.json says 256, --ffn-hidden-size gives 1"]
