"""Model shape and parameter counts from an HF config.json, with no weights loaded.

Counts follow the transformers implementations of the families slime converts (qwen2/qwen3, qwen3-moe,
llama, glm4, glm4-moe, deepseek-v3 incl. Kimi-K2 / Moonlight, mixtral-style MoE): embeddings, the output
layer unless tied, per layer the norms, attention (GQA with optional QKV bias and q/k norms, or
multi-latent attention) and the MLP (SwiGLU: gate, up, down) or MoE block (router, routed experts, shared
experts), and the final norm. Assumptions: every MLP is gated (three matrices); DeepSeek's multi-token
prediction layers (`num_nextn_predict_layers`) are not counted, as transformers does not load them; nor are
buffers such as DeepSeek's router `e_score_correction_bias`. A vision-language checkpoint's vision tower is counted
by transformers itself (built on the meta device), not by formula.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

from slime.backends.megatron_utils.config_check import language_config, read_config_json
from slime.backends.megatron_utils.converters.base import ConverterConfig

logger = logging.getLogger(__name__)


class ModelShapeError(ValueError):
    """config.json lacks a field the estimate needs (the message names it)."""


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # qwen2-moe: a sigmoid gate on the shared expert
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2  # glm4 (dense) adds post-attention and post-MLP norms
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None  # set: multi-latent attention
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    torch_dtype: str | None = None
    quant_method: str | None = None
    vision_params: int = 0  # a vision-language checkpoint's vision tower (vision_tower_params)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def shape_from_hf_config(cfg: dict) -> ModelShape:
    """ModelShape of a config.json mapping (a nested `text_config` already unwrapped)."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    if "intermediate_size" not in cfg and not (experts and cfg.get("moe_intermediate_size")):
        missing.append("intermediate_size")
    if missing:
        raise ModelShapeError(f"config.json has no {', '.join(missing)}")
    base = ConverterConfig.from_hf_config(cfg)
    model_type = str(cfg.get("model_type", ""))
    moe_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0
    shared = 0
    if experts and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    elif experts and cfg.get("shared_expert_intermediate_size"):
        shared = int(cfg["shared_expert_intermediate_size"])
    quant = cfg.get("quantization_config") or {}
    return ModelShape(
        model_type=model_type,
        hidden_size=base.hidden_size,
        num_layers=base.num_layers,
        num_heads=base.num_attention_heads,
        num_kv_heads=base.num_query_groups,
        head_dim=base.head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        vocab_size=base.vocab_size,
        tie_word_embeddings=base.tie_word_embeddings,
        moe_layers=tuple(bool(x) for x in base.moe_layers),
        num_experts=int(experts),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=bool(experts) and model_type == "qwen2_moe",
        qkv_bias=model_type.startswith("qwen2") or bool(cfg.get("attention_bias")),  # qwen2, -moe, -vl, 2.5-vl
        qk_norm=model_type.startswith("qwen3") or bool(cfg.get("use_qk_norm")),
        norms_per_layer=4 if model_type == "glm4" else 2,
        q_lora_rank=base.q_lora_rank,
        kv_lora_rank=base.kv_lora_rank,
        qk_nope_head_dim=base.qk_head_dim,
        qk_rope_head_dim=base.qk_pos_emb_head_dim,
        v_head_dim=base.v_head_dim,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        quant_method=quant.get("quant_method") if isinstance(quant, dict) else None,
    )


def load_model_shape(hf_checkpoint: str) -> ModelShape:
    raw = read_config_json(hf_checkpoint)
    shape = shape_from_hf_config(language_config(raw))
    if isinstance(raw.get("vision_config"), dict):
        shape = dataclasses.replace(shape, vision_params=vision_tower_params(raw))
    return shape


def vision_tower_params(raw: dict) -> int:
    """Parameters of a vision-language config's vision tower: transformers builds the whole model on the meta
    device (no memory, no weights) and the parameters under its vision module (`visual`, `vision_tower`, ...)
    are counted. A config transformers cannot build counts 0, with a warning: the estimate then leaves it out."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError, TypeError, ImportError) as e:
        logger.warning("config.json (model_type %r) has a vision_config, but transformers could not build the model "
                       "to count its vision tower (%s); the estimates leave the tower out", raw.get("model_type"), e)
        return 0
    return sum(p.numel() for name, p in model.named_parameters() if VISION_MODULE.search(name))


# a vision tower's parameter names in transformers' vision-language models (Qwen2.5-VL / Qwen3-VL: `visual`; LLaVA
# and others: `vision_tower`, `multi_modal_projector`)
VISION_MODULE = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)\.")


# ---- parameter counts --------------------------------------------------------------------------------------


def attention_params(s: ModelShape) -> int:
    h = s.hidden_size
    if s.mla:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            q = h * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.num_heads * qk  # q_a, q_a_layernorm, q_b
        else:
            q = h * s.num_heads * qk
        kv = (h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
              + s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim))  # kv_b_proj
        return q + kv + s.num_heads * s.v_head_dim * h
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    params = h * q_out + 2 * h * kv_out + q_out * h
    if s.qkv_bias:
        params += q_out + 2 * kv_out
    if s.qk_norm:
        params += 2 * s.head_dim
    return params


def mlp_params(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate


def routed_expert_params(s: ModelShape) -> int:
    """All routed experts of one MoE layer."""
    return s.num_experts * mlp_params(s.hidden_size, s.moe_intermediate_size)


def layer_params(s: ModelShape, layer: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of decoder layer `layer`."""
    h = s.hidden_size
    dense = s.norms_per_layer * h + attention_params(s)
    if not s.moe_layers[layer]:
        return dense + mlp_params(h, s.intermediate_size), 0
    dense += s.num_experts * h  # router (deepseek's e_score_correction_bias is a buffer, not counted)
    if s.shared_expert_intermediate_size:
        dense += mlp_params(h, s.shared_expert_intermediate_size) + (h if s.shared_expert_gate else 0)
    return dense, routed_expert_params(s)


def embedding_params(s: ModelShape, vocab: int | None = None) -> int:
    return (vocab or s.vocab_size) * s.hidden_size


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # input embedding
    output: int  # output layer (0 when tied)
    layers_dense: int  # non-expert parameters of all decoder layers
    layers_expert: int  # routed experts of all decoder layers
    active: int  # parameters one token passes through (top-k of the routed experts)
    vision: int = 0  # a vision-language model's vision tower


def count_params(s: ModelShape) -> ParamCount:
    dense = expert = 0
    for layer in range(s.num_layers):
        d, e = layer_params(s, layer)
        dense += d
        expert += e
    emb = embedding_params(s)
    out = 0 if s.tie_word_embeddings else emb
    total = emb + out + dense + expert + s.hidden_size + s.vision_params  # + final norm, + vision tower
    inactive = 0
    if s.num_experts:
        per_expert = mlp_params(s.hidden_size, s.moe_intermediate_size)
        inactive = s.num_moe_layers * (s.num_experts - min(s.experts_per_token, s.num_experts)) * per_expert
    return ParamCount(total=total, embedding=emb, output=out, layers_dense=dense, layers_expert=expert,
                      active=total - inactive, vision=s.vision_params)
