"""Cross-check the Megatron architecture flags (MODEL_ARGS) against the HF config.json of --hf-checkpoint.

A Megatron model built from flags that disagree with the checkpoint either fails to load with a shape
error deep inside megatron-core or, worse, loads and computes something else (a wrong RoPE base or norm
epsilon changes no shape). Every field both sides define is compared; the error lists each mismatch with
the config.json field, the flag, and both values.

Covered families: qwen2/qwen3, qwen3-moe, llama, glm4, glm4-moe, deepseek-v3 (Kimi-K2, Moonlight).
Fields absent from config.json are skipped (a partial config checks what it has). Simplifications:
`--vocab-size` may exceed the config's (padding up) but not fall short; the MoE router's bias-update and
aux-loss settings are training choices and are not compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from slime.backends.megatron_utils.args import moe_layer_pattern, query_groups
from slime.backends.megatron_utils.converters.base import ConverterConfig


class ConfigMismatchError(ValueError):
    """MODEL_ARGS disagree with config.json; the message names every field, flag and both values."""


def is_hf_folder(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def load_hf_config(path: str) -> dict:
    return language_config(read_config_json(path))


def read_config_json(path: str) -> dict:
    """config.json of an HF folder (or the .json file itself), as written."""
    with open(path if path.endswith(".json") else os.path.join(path, "config.json")) as f:
        return json.load(f)


def language_config(cfg: dict) -> dict:
    """The language model's fields of a config.json mapping."""
    # multimodal / nested layouts keep the language model's config under text_config, and whether the output layer
    # is tied to the embeddings at the top level (transformers' vision-language configs)
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        return {**text, "tie_word_embeddings": cfg["tie_word_embeddings"]}
    return text


def _rope(cfg: dict) -> dict:
    """RoPE settings from either layout: transformers >= 5 (`rope_parameters`) or the Hub's (`rope_theta`,
    `rope_scaling`, `partial_rotary_factor` at top level)."""
    out = dict(cfg.get("rope_scaling") or {})
    out.update(cfg.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in cfg:
            out.setdefault(key, cfg[key])
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out["type"]
    return out


def expected_flags(cfg: dict) -> list[tuple[str, str, object, object]]:
    """(config field, flag dest, config value, comparison kind) for every field config.json defines."""
    mt = cfg.get("model_type", "")
    mla = cfg.get("kv_lora_rank") is not None
    rope = _rope(cfg)
    out: list[tuple[str, str, object, object]] = []

    def want(field: str, dest: str, value, kind="eq"):
        if value is not None:
            out.append((field, dest, value, kind))

    want("hidden_size", "hidden_size", cfg.get("hidden_size"))
    want("num_hidden_layers", "num_layers", cfg.get("num_hidden_layers"))
    want("num_attention_heads", "num_attention_heads", cfg.get("num_attention_heads"))
    want("intermediate_size", "ffn_hidden_size", cfg.get("intermediate_size"))
    want("vocab_size", "vocab_size", cfg.get("vocab_size"), "ge")
    want("rms_norm_eps", "norm_epsilon", cfg.get("rms_norm_eps"), "close")
    want("rope_theta", "rotary_base", rope.get("rope_theta"), "close")
    if "tie_word_embeddings" in cfg:
        want("tie_word_embeddings", "untie_embeddings_and_output_weights", not cfg["tie_word_embeddings"])
    if "rms_norm_eps" in cfg:
        want("rms_norm_eps (RMSNorm)", "normalization", "RMSNorm")
    if cfg.get("hidden_act") in ("silu", "swish"):
        want("hidden_act", "swiglu", True)
    if rope.get("mrope_section"):  # vision-language text models: 3-D (temporal, height, width) positions
        want("rope mrope_section (multimodal RoPE)", "position_embedding_type", "mrope")
        want("rope mrope_section", "mrope_section", list(rope["mrope_section"]))
    elif rope.get("rope_theta") is not None:
        want("rope_theta (RoPE)", "position_embedding_type", "rope")
    if "partial_rotary_factor" in rope:
        want("partial_rotary_factor", "rotary_percent", rope["partial_rotary_factor"], "close")
    if rope.get("rope_type") == "llama3":
        want("rope_scaling.rope_type llama3", "use_rope_scaling", True)
        want("rope_scaling.factor", "rope_scaling_factor", rope.get("factor"), "close")

    if mla:
        want("q_lora_rank", "q_lora_rank", cfg.get("q_lora_rank"), "eq_none")
        want("kv_lora_rank", "kv_lora_rank", cfg.get("kv_lora_rank"))
        want("qk_nope_head_dim", "qk_head_dim", cfg.get("qk_nope_head_dim"))
        want("qk_rope_head_dim", "qk_pos_emb_head_dim", cfg.get("qk_rope_head_dim"))
        want("v_head_dim", "v_head_dim", cfg.get("v_head_dim"))
        want("kv_lora_rank (MLA)", "multi_latent_attention", True)
        want("q_a_layernorm / kv_a_layernorm", "qk_layernorm", True)
        if rope.get("rope_type") == "yarn":
            want("rope_scaling.factor", "rotary_scaling_factor", rope.get("factor"), "close")
            want("rope_scaling.original_max_position_embeddings", "original_max_position_embeddings",
                 rope.get("original_max_position_embeddings"))  # fmt: skip
            want("rope_scaling.mscale", "mscale", rope.get("mscale"), "close")
            want("rope_scaling.mscale_all_dim", "mscale_all_dim", rope.get("mscale_all_dim"), "close")
            want("rope_scaling.beta_fast", "beta_fast", rope.get("beta_fast"), "close")
            want("rope_scaling.beta_slow", "beta_slow", rope.get("beta_slow"), "close")
    else:
        heads = cfg.get("num_attention_heads")
        want("num_key_value_heads", "num_query_groups", cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and "hidden_size" in cfg else None)
        want("head_dim", "kv_channels", head_dim)
        qk_norm = mt.startswith("qwen3") or bool(cfg.get("use_qk_norm"))
        if mt:
            want("q_norm / k_norm", "qk_layernorm", qk_norm)
        if mt in ("qwen2", "qwen2_5_vl_text") or cfg.get("attention_bias"):
            want("attention_bias (QKV bias)", "add_qkv_bias", True)
        if mt:  # GLM-4 dense rotates interleaved pairs; the other GQA families rotate halves
            want("RoPE pairing (interleaved in GLM-4 dense)", "rotary_interleaved", mt == "glm4")
        if mt == "glm4":
            want("post_self_attn_layernorm", "post_self_attn_layernorm", True)
            want("post_mlp_layernorm", "post_mlp_layernorm", True)

    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if experts:
        want("num_experts / n_routed_experts", "num_experts", experts)
        want("moe_intermediate_size", "moe_ffn_hidden_size", cfg.get("moe_intermediate_size"))
        want("num_experts_per_tok", "moe_router_topk", cfg.get("num_experts_per_tok"))
        if cfg.get("n_shared_experts") and cfg.get("moe_intermediate_size"):
            want("n_shared_experts × moe_intermediate_size", "moe_shared_expert_intermediate_size",
                 cfg["n_shared_experts"] * cfg["moe_intermediate_size"])  # fmt: skip
        if "first_k_dense_replace" in cfg:  # sigmoid router with a score-correction bias
            want("scoring_func", "moe_router_score_function", cfg.get("scoring_func", "sigmoid"))
            want("e_score_correction_bias", "moe_router_enable_expert_bias", True)
            if cfg.get("routed_scaling_factor") not in (None, 1.0):
                want("routed_scaling_factor", "moe_router_topk_scaling_factor", cfg["routed_scaling_factor"], "close")
            if (cfg.get("n_group") or 1) > 1:
                want("n_group", "moe_router_num_groups", cfg["n_group"])
                want("topk_group", "moe_router_group_topk", cfg.get("topk_group"))
        elif "norm_topk_prob" in cfg:  # softmax router: Megatron renormalises the top-k unless pre-softmax
            want("norm_topk_prob", "moe_router_pre_softmax", not cfg["norm_topk_prob"])
        layers = cfg.get("num_hidden_layers")
        try:
            pattern = [int(x) for x in ConverterConfig.from_hf_config(cfg).moe_layers] if layers else None
        except KeyError:  # a partial config.json: the layer pattern cannot be derived, so it is not compared
            pattern = None
        want("first_k_dense_replace / mlp_only_layers / decoder_sparse_step", "moe_layer_pattern", pattern)
    return out


def _flag_value(args: argparse.Namespace, dest: str):
    if dest == "num_query_groups":
        return query_groups(args)
    if dest == "moe_layer_pattern":
        return moe_layer_pattern(args)
    return getattr(args, dest)


def _flag(dest: str) -> str:
    if dest == "moe_layer_pattern":
        return "--moe-layer-freq"
    if dest == "num_query_groups":
        return "--num-query-groups (with --group-query-attention)"
    return "--" + dest.replace("_", "-")


def _agree(kind: str, cfg_value, flag_value) -> bool:
    if kind == "close":
        return flag_value is not None and math.isclose(float(cfg_value), float(flag_value), rel_tol=1e-6)
    if kind == "ge":
        return flag_value is not None and flag_value >= cfg_value
    return cfg_value == flag_value


def _is_moe(cfg: dict) -> bool:
    return any(cfg.get(k) for k in ("moe_intermediate_size", "num_experts", "n_routed_experts", "num_local_experts"))


def find_mismatches(args: argparse.Namespace, cfg: dict) -> list[str]:
    """Every config.json field the args disagree with. A dest the args lack is not compared (a partial namespace,
    e.g. a role's), and an MoE model whose layers are all MoE layers has no dense FFN, so its `intermediate_size`
    is not compared."""
    problems = []
    freq = getattr(args, "moe_layer_freq", None)  # read directly: a partial namespace may lack --num-experts
    all_moe = _is_moe(cfg) and (all(freq) if isinstance(freq, (list, tuple)) else freq == 1)
    for field, dest, cfg_value, kind in expected_flags(cfg):
        if dest == "ffn_hidden_size" and all_moe:
            continue
        try:
            value = _flag_value(args, dest)
        except AttributeError:
            continue
        if not _agree(kind, cfg_value, value):
            relation = "at least " if kind == "ge" else ""
            problems.append(f"{field}: config.json says {relation}{cfg_value!r}, {_flag(dest)} gives {value!r}")
    return problems


def check_against_hf_config(args: argparse.Namespace, hf_checkpoint: str) -> None:
    """Raise ConfigMismatchError listing every MODEL_ARGS field that disagrees with config.json."""
    cfg = load_hf_config(hf_checkpoint)
    problems = find_mismatches(args, cfg)
    if problems:
        raise ConfigMismatchError(
            f"MODEL_ARGS disagree with {hf_checkpoint}/config.json ({cfg.get('model_type', '?')}): "
            + "; ".join(problems)
            + ". Fix the flags (or source the scripts/models/*.sh matching this checkpoint)."
        )
