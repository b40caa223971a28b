"""GLM-4's "sandwich" norms (`--post-self-attn-layernorm`, `--post-mlp-layernorm`) on megatron-core layers.

GLM-4 normalises the attention output and the MLP output before each residual add:
`h = h + post_self_attn_norm(attn(norm(h)))`, `h = h + post_mlp_norm(mlp(norm(h)))`. megatron-core's
`TransformerLayer` has no such norms, but it calls its bias-dropout-add submodules exactly at those two
points, so `PostNormBiasDropoutAdd` (a norm whose call returns the bias-dropout-add function) takes their
place in the layer spec. Its weight is `self_attn_bda.norm.weight` / `mlp_bda.norm.weight` inside the
model; `HF_STYLE_NAMES` maps them to the converters' `post_self_attn_layernorm.weight` /
`post_mlp_layernorm.weight`.
"""

from __future__ import annotations

import copy

import torch

HF_STYLE_NAMES = {
    "self_attn_bda.norm.weight": "post_self_attn_layernorm.weight",
    "mlp_bda.norm.weight": "post_mlp_layernorm.weight",
}


class PostNormBiasDropoutAdd(torch.nn.Module):
    def __init__(self, config, norm_class):
        super().__init__()
        self.norm = norm_class(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        bias_dropout_add = get_bias_dropout_add(training, fused)

        def apply(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return bias_dropout_add((self.norm(x), None), residual, prob)

        return apply


def add_sandwich_norms(block_spec, config, args, use_te: bool):
    """The decoder block spec with the requested post norms in every layer spec (a modified copy)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not (args.post_self_attn_layernorm or args.post_mlp_layernorm):
        return block_spec
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm_class
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm_class
    spec = ModuleSpec(module=PostNormBiasDropoutAdd, params={"config": config, "norm_class": norm_class})
    block_spec = copy.copy(block_spec)
    layers = []
    for layer in block_spec.layer_specs:
        layer = copy.copy(layer)
        layer.submodules = copy.copy(layer.submodules)
        if args.post_self_attn_layernorm:
            layer.submodules.self_attn_bda = spec
        if args.post_mlp_layernorm:
            layer.submodules.mlp_bda = spec
        layers.append(layer)
    block_spec.layer_specs = layers
    return block_spec
