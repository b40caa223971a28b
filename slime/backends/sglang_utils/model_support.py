"""Checkpoint layouts SGLang's model code loads wrongly without an error, refused before a server starts.

SGLang 0.5.16 (the release this project runs and checks against) builds every decoder layer of a Qwen3-MoE
(`Qwen3MoeForCausalLM`) as a mixture-of-experts layer: it reads neither `mlp_only_layers` nor
`decoder_sparse_step`. A checkpoint with dense layers (allowed by transformers' config) then has experts SGLang
never loads: they keep uninitialised memory (NaN seen on an H100 on 2026-12-05, through `/weights_checker`), the
dense MLP's tensors are dropped, and generation runs on garbage with no error. Real Qwen3-MoE checkpoints
(30B-A3B, 235B-A22B) have every layer sparse; the `hf` engine follows transformers and serves both.
"""

from __future__ import annotations


def sglang_layout_problem(config: dict) -> str | None:
    """Why SGLang would load this config.json's model wrongly, or None."""
    if config.get("model_type") != "qwen3_moe":
        return None
    dense = list(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1) or 1
    if not dense and step == 1:
        return None
    return (f"a Qwen3-MoE with dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}): SGLang 0.5.16 "
            "builds every layer as MoE and would leave those layers' experts uninitialised (no error, garbage "
            "tokens). Use a checkpoint whose layers are all sparse (mlp_only_layers [], decoder_sparse_step 1, as "
            "Qwen3-MoE releases are), or --rollout-backend hf, which serves this layout")
