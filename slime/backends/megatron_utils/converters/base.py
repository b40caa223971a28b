"""HF <-> megatron-core GPTModel state dicts, shared by every family (pure torch, CPU).

Megatron names are those of megatron-core's `GPTModel` (0.16), full (TP-gathered) tensors, global expert
indices. Two spellings of the same layer norms exist and both are accepted on export:

- TransformerEngine spec (and `torch_dist` checkpoints, whose local-spec layers map their norms to these
  names): `self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`,
  MLA `self_attention.linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`;
- local spec: `input_layernorm.weight`, `pre_mlp_layernorm.weight`, `self_attention.q_layernorm.weight` /
  `kv_layernorm.weight` (MLA).

MoE layers keep `pre_mlp_layernorm.weight` in both specs. Import (`hf_to_megatron`) writes the TE spelling
by default, `spec="local"` the local one. Experts: `mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`
(SequentialMLP) or, with `grouped=True`, `mlp.experts.linear_fc{1,2}.weight{e}` (TEGroupedMLP).

Layouts (same as megatron-core): `linear_qkv` rows are, per query group, [q heads of the group; k; v];
`linear_fc1` rows are [gate; up]; the vocabulary is zero-padded to `padded_vocab_size` on import and
stripped on export. HF names are those of the checkpoint files (per-expert tensors), which is also what
SGLang's weight loaders take; transformers >= 5 fuses experts in memory and converts on load.

Simplifications: dense layers of MoE models use the model's `intermediate_size`; multi-token-prediction
layers of the HF checkpoint (index >= num_layers) are skipped on import; biases only where a family has
them (QKV bias for qwen2 / glm4 / glm4-moe).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from slime.backends.megatron_utils.args import moe_layer_pattern, padded_vocab_size, query_groups

Tensor = torch.Tensor


@dataclass
class ConverterConfig:
    """The shapes a converter needs, from an HF config.json (`from_hf_config`) or Megatron flags (`from_args`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int | None = None
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_layers: list[bool] = field(default_factory=list)  # per layer: MoE (True) or dense
    # multi-latent attention
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if not self.moe_layers:
            self.moe_layers = [False] * self.num_layers

    @classmethod
    def from_hf_config(cls, cfg: dict, padded_vocab_size: int | None = None) -> ConverterConfig:
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
        moe_layers = [False] * layers
        if experts:
            if "first_k_dense_replace" in cfg:  # deepseek-v3, glm4-moe, kimi-k2, moonlight
                freq = cfg.get("moe_layer_freq", 1)
                moe_layers = [i >= cfg["first_k_dense_replace"] and i % freq == 0 for i in range(layers)]
            else:  # qwen3-moe / qwen2-moe
                step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
                moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        mla = cfg.get("kv_lora_rank") is not None
        return cls(
            num_layers=layers,
            hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            padded_vocab_size=padded_vocab_size,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            moe_layers=moe_layers,
            q_lora_rank=cfg.get("q_lora_rank") if mla else None,
            kv_lora_rank=cfg.get("kv_lora_rank"),
            qk_head_dim=cfg.get("qk_nope_head_dim") if mla else None,
            qk_pos_emb_head_dim=cfg.get("qk_rope_head_dim") if mla else None,
            v_head_dim=cfg.get("v_head_dim") if mla else None,
        )

    @classmethod
    def from_args(cls, args) -> ConverterConfig:
        """From parsed Megatron flags (after validation filled the derived sizes)."""
        pattern = moe_layer_pattern(args)
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=query_groups(args),
            head_dim=args.kv_channels,
            vocab_size=args.vocab_size,
            padded_vocab_size=padded_vocab_size(args),
            tie_word_embeddings=not args.untie_embeddings_and_output_weights,
            num_experts=args.num_experts or 0,
            moe_layers=[bool(x) for x in pattern] if pattern else [],
            q_lora_rank=args.q_lora_rank if args.multi_latent_attention else None,
            kv_lora_rank=args.kv_lora_rank if args.multi_latent_attention else None,
            qk_head_dim=args.qk_head_dim if args.multi_latent_attention else None,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim if args.multi_latent_attention else None,
            v_head_dim=args.v_head_dim if args.multi_latent_attention else None,
        )


# ---- fused-tensor layouts --------------------------------------------------------------------------------


def split_qkv(qkv: Tensor, cfg: ConverterConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron's per-group [q_g; k_g; v_g] rows (weight or bias) -> HF q, k, v."""
    groups, d = cfg.num_query_groups, cfg.head_dim
    per = cfg.num_attention_heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = torch.split(x, [per * d, d, d], dim=1)
    return (t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ConverterConfig) -> Tensor:
    groups, d = cfg.num_query_groups, cfg.head_dim
    per = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


def pad_vocab(t: Tensor, cfg: ConverterConfig) -> Tensor:
    if t.shape[0] != cfg.vocab_size:
        raise ValueError(f"vocabulary tensor has {t.shape[0]} rows, the config says vocab_size {cfg.vocab_size}")
    extra = cfg.padded_vocab_size - cfg.vocab_size
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra > 0 else t


# ---- names ------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")

# local spelling -> TE spelling, for dense (non-MoE, non-MLA) layers
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LOCAL_TO_TE_MLA = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}


def te_to_local_names(sd: dict[str, Tensor], cfg: ConverterConfig, mla: bool) -> dict[str, Tensor]:
    """Rename TE-spec norm names to the local spec's (inverse of what `_canonical` does)."""
    inverse = {v: k for k, v in {**_LOCAL_TO_TE, **(_LOCAL_TO_TE_MLA if mla else {})}.items()}
    out = {}
    for name, t in sd.items():
        m = _LAYER.match(name)
        if m and m.group(2) in inverse:
            i, rest = int(m.group(1)), m.group(2)
            if not (rest.startswith("self_attention.linear_qkv") and mla) and not (
                rest.startswith("mlp.linear_fc1.layer_norm") and cfg.moe_layers[i]
            ):
                name = f"decoder.layers.{i}.{inverse[rest]}"
        out[name] = t
    return out


def _canonical(rest: str, mla: bool, moe: bool) -> str:
    """A layer-relative Megatron name in the TE spelling (MoE and MLA layers keep their own norms)."""
    if mla and rest in _LOCAL_TO_TE_MLA:
        return _LOCAL_TO_TE_MLA[rest]
    if rest.startswith("input_layernorm.") and not mla:
        return _LOCAL_TO_TE[rest]
    if rest.startswith("pre_mlp_layernorm.") and not moe:
        return _LOCAL_TO_TE[rest]
    m = _GROUPED.match(rest)
    if m:
        return f"mlp.experts.local_experts.{m.group(2)}.linear_fc{m.group(1)}.weight"
    return rest


class GPTConverter:
    """Megatron GPTModel <-> HF checkpoint names/shapes for one family; subclasses set the class attributes."""

    name = "gpt"
    hf_model_types: tuple[str, ...] = ()
    mla = False  # DeepSeek-V3-style multi-latent attention
    hf_fused_gate_up = False  # GLM-4 dense stores [gate; up] as mlp.gate_up_proj
    post_norms = False  # GLM-4 sandwich norms after attention and after the MLP
    router_bias = False  # `mlp.gate.e_score_correction_bias` <-> `mlp.router.expert_bias`

    # ---- Megatron -> HF, one parameter at a time (the weight-sync path) ----

    def megatron_to_hf(self, name: str, t: Tensor, cfg: ConverterConfig) -> list[tuple[str, Tensor]]:
        """One full Megatron tensor -> its HF (name, tensor) pairs; [] for `_extra_state`."""
        if name.endswith("_extra_state"):
            return []
        name = re.sub(r"^(?:module\.)+", "", name)
        if name == "embedding.word_embeddings.weight":
            return [("model.embed_tokens.weight", t[: cfg.vocab_size])]
        if name == "output_layer.weight":
            return [("lm_head.weight", t[: cfg.vocab_size])]
        if name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
            return [("model.norm." + name.rsplit(".", 1)[1], t)]
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"{self.name} converter: unknown Megatron parameter {name!r}")
        i = int(m.group(1))
        rest = _canonical(m.group(2), self.mla, cfg.moe_layers[i])
        out = self._layer_to_hf(rest, t, cfg)
        if out is None:
            raise KeyError(f"{self.name} converter: unknown Megatron parameter {name!r}")
        return [(f"model.layers.{i}.{k}", v) for k, v in out]

    def _layer_to_hf(self, rest: str, t: Tensor, cfg: ConverterConfig):
        a = "self_attention."
        if rest == a + "linear_proj.weight":
            return [("self_attn.o_proj.weight", t)]
        if rest in ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight") and self.post_norms:
            return [(rest, t)]
        if self.mla:
            table = {
                a + "linear_q_proj.weight": "self_attn.q_proj.weight",
                a + "linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
                a + "linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
                a + "linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
                a + "linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
                a + "linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
                a + "linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
                "input_layernorm.weight": "input_layernorm.weight",
            }
            if rest in table:
                return [(table[rest], t)]
        else:
            if rest == a + "linear_qkv.layer_norm_weight":
                return [("input_layernorm.weight", t)]
            if rest in (a + "linear_qkv.weight", a + "linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = split_qkv(t, cfg)
                return [(f"self_attn.{p}_proj.{kind}", x) for p, x in zip("qkv", (q, k, v))]
            if rest == a + "q_layernorm.weight":
                return [("self_attn.q_norm.weight", t)]
            if rest == a + "k_layernorm.weight":
                return [("self_attn.k_norm.weight", t)]
        if rest in ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"):
            return [("post_attention_layernorm.weight", t)]
        if rest == "mlp.linear_fc1.weight":
            if self.hf_fused_gate_up:
                return [("mlp.gate_up_proj.weight", t)]
            return self._gate_up("mlp", t)
        if rest == "mlp.linear_fc2.weight":
            return [("mlp.down_proj.weight", t)]
        if rest == "mlp.router.weight":
            return [("mlp.gate.weight", t)]
        if rest == "mlp.router.expert_bias" and self.router_bias:
            return [("mlp.gate.e_score_correction_bias", t)]
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return self._gate_up("mlp.shared_experts", t)
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return [("mlp.shared_experts.down_proj.weight", t)]
        m = _SEQUENTIAL.match(rest)
        if m:
            e, fc = m.groups()
            prefix = f"mlp.experts.{e}"
            return self._gate_up(prefix, t) if fc == "1" else [(prefix + ".down_proj.weight", t)]
        return None

    @staticmethod
    def _gate_up(prefix: str, t: Tensor):
        gate, up = split_gate_up(t)
        return [(f"{prefix}.gate_proj.weight", gate), (f"{prefix}.up_proj.weight", up)]

    def state_dict_to_hf(self, sd: dict[str, Tensor], cfg: ConverterConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, t in sd.items():
            out.update(self.megatron_to_hf(name, t, cfg))
        return out

    # ---- HF -> Megatron, a whole state dict (the checkpoint-loading path) ----

    def hf_to_megatron(
        self, hf: dict[str, Tensor], cfg: ConverterConfig, spec: str = "te", grouped: bool = False
    ) -> dict[str, Tensor]:
        """HF checkpoint tensors -> Megatron GPTModel tensors; every HF tensor must be used (else KeyError)."""
        if spec not in ("te", "local"):
            raise ValueError(f"spec {spec!r}: expected 'te' or 'local'")
        src = dict(hf)
        take = _Taker(src, self.name)
        out: dict[str, Tensor] = {"embedding.word_embeddings.weight": pad_vocab(take("model.embed_tokens.weight"), cfg)}
        for i in range(cfg.num_layers):
            for k, v in self._layer_to_megatron(take, f"model.layers.{i}.", cfg, cfg.moe_layers[i], grouped).items():
                out[f"decoder.layers.{i}.{k}"] = v
        out["decoder.final_layernorm.weight"] = take("model.norm.weight")
        if "lm_head.weight" in src and not cfg.tie_word_embeddings:
            out["output_layer.weight"] = pad_vocab(take("lm_head.weight"), cfg)
        elif not cfg.tie_word_embeddings:
            take("lm_head.weight")  # raises: an untied model needs its output layer
        else:
            src.pop("lm_head.weight", None)  # tied: the embedding is the output layer
        # multi-token-prediction layers past num_layers are not part of the GPTModel
        leftover = [k for k in src if not _is_mtp(k, cfg.num_layers)]
        if leftover:
            raise KeyError(f"{self.name} converter: HF tensors with no Megatron counterpart: {sorted(leftover)[:8]}")
        return te_to_local_names(out, cfg, self.mla) if spec == "local" else out

    def _layer_to_megatron(self, take, p: str, cfg: ConverterConfig, moe: bool, grouped: bool) -> dict[str, Tensor]:
        a = "self_attention."
        out = {a + "linear_proj.weight": take(p + "self_attn.o_proj.weight")}
        if self.mla:
            out["input_layernorm.weight"] = take(p + "input_layernorm.weight")
            if cfg.q_lora_rank is None:
                out[a + "linear_q_proj.weight"] = take(p + "self_attn.q_proj.weight")
            else:
                out[a + "linear_q_down_proj.weight"] = take(p + "self_attn.q_a_proj.weight")
                out[a + "linear_q_up_proj.layer_norm_weight"] = take(p + "self_attn.q_a_layernorm.weight")
                out[a + "linear_q_up_proj.weight"] = take(p + "self_attn.q_b_proj.weight")
            out[a + "linear_kv_down_proj.weight"] = take(p + "self_attn.kv_a_proj_with_mqa.weight")
            out[a + "linear_kv_up_proj.layer_norm_weight"] = take(p + "self_attn.kv_a_layernorm.weight")
            out[a + "linear_kv_up_proj.weight"] = take(p + "self_attn.kv_b_proj.weight")
        else:
            out[a + "linear_qkv.layer_norm_weight"] = take(p + "input_layernorm.weight")
            for kind in ("weight", "bias"):
                if take.has(p + f"self_attn.q_proj.{kind}"):
                    q, k, v = (take(p + f"self_attn.{x}_proj.{kind}") for x in "qkv")
                    out[a + f"linear_qkv.{kind}"] = merge_qkv(q, k, v, cfg)
            if take.has(p + "self_attn.q_norm.weight"):
                out[a + "q_layernorm.weight"] = take(p + "self_attn.q_norm.weight")
                out[a + "k_layernorm.weight"] = take(p + "self_attn.k_norm.weight")
        if self.post_norms:
            out["post_self_attn_layernorm.weight"] = take(p + "post_self_attn_layernorm.weight")
            out["post_mlp_layernorm.weight"] = take(p + "post_mlp_layernorm.weight")
        norm = take(p + "post_attention_layernorm.weight")
        if not moe:
            out["mlp.linear_fc1.layer_norm_weight"] = norm
            if self.hf_fused_gate_up:
                out["mlp.linear_fc1.weight"] = take(p + "mlp.gate_up_proj.weight")
            else:
                out["mlp.linear_fc1.weight"] = torch.cat(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                )
            out["mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight")
            return out
        out["pre_mlp_layernorm.weight"] = norm
        out["mlp.router.weight"] = take(p + "mlp.gate.weight")
        if self.router_bias:
            out["mlp.router.expert_bias"] = take(p + "mlp.gate.e_score_correction_bias")
        for e in range(cfg.num_experts):
            x = f"{p}mlp.experts.{e}."
            fc1 = torch.cat([take(x + "gate_proj.weight"), take(x + "up_proj.weight")])
            fc2 = take(x + "down_proj.weight")
            if grouped:
                out[f"mlp.experts.linear_fc1.weight{e}"], out[f"mlp.experts.linear_fc2.weight{e}"] = fc1, fc2
            else:
                out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
        if take.has(p + "mlp.shared_experts.gate_proj.weight"):
            s = p + "mlp.shared_experts."
            out["mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [take(s + "gate_proj.weight"), take(s + "up_proj.weight")]
            )
            out["mlp.shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
        return out


class _Taker:
    """Pops HF tensors by name so that unused ones can be reported; a missing one is a KeyError naming it."""

    def __init__(self, src: dict[str, Tensor], family: str):
        self.src, self.family = src, family

    def has(self, name: str) -> bool:
        return name in self.src

    def __call__(self, name: str) -> Tensor:
        if name not in self.src:
            raise KeyError(f"{self.family} converter: HF tensor {name!r} is missing")
        return self.src.pop(name)


def _is_mtp(name: str, num_layers: int) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= num_layers
