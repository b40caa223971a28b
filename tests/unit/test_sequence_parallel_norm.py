"""Sequence parallelism on megatron-core's local layers (slime/backends/megatron_utils/sequence_parallel_norm.py):
every norm of the local decoder block spec becomes one that takes sequence parallelism and marks its parameters
for megatron-core's sum over the tensor-parallel ranks. The layers run at TP2 with sequence parallelism on gloo
ranks in tests/e2e_cpu/test_megatron_vision_language.py (`thd_tp2_sp`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _config(sequence_parallel: bool, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                             qk_layernorm=True, tensor_model_parallel_size=2 if sequence_parallel else 1,
                             sequence_parallel=sequence_parallel, use_cpu_initialization=True, **kw)


def _norm_classes(spec) -> list:
    from megatron.core.transformer.spec_utils import ModuleSpec

    found = []
    for value in vars(spec).values():
        if isinstance(value, type) and "Norm" in value.__name__:
            found.append(value)
        elif isinstance(value, list):
            for item in value:
                found += _norm_classes(item)
        elif isinstance(value, ModuleSpec) or hasattr(value, "__dataclass_fields__"):
            found += _norm_classes(value)
    return found


def test_every_local_norm_of_the_block_spec_is_replaced():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from slime.backends.megatron_utils.sequence_parallel_norm import (SequenceParallelTorchNorm,
                                                                      with_sequence_parallel_norms)

    # what get_gpt_decoder_block_spec builds without TransformerEngine (it needs the parallel groups)
    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec = TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=WrappedTorchNorm)
    before = _norm_classes(spec)
    # per layer: input, q, k and pre-MLP norms; then the final norm
    assert before.count(WrappedTorchNorm) == 2 * 4 + 1
    swapped = with_sequence_parallel_norms(spec)
    assert _norm_classes(swapped) == [SequenceParallelTorchNorm] * len(before)
    assert _norm_classes(spec) == before  # a copy: megatron-core's spec is left as it was


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_norm_is_torchs_with_its_parameters_marked(sequence_parallel):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from slime.backends.megatron_utils.sequence_parallel_norm import SequenceParallelTorchNorm

    config = _config(sequence_parallel)
    norm = SequenceParallelTorchNorm(config=config, hidden_size=64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert [p.sequence_parallel for p in norm.parameters()] == [sequence_parallel]
    assert config.sequence_parallel is sequence_parallel  # the caller's config is not changed
    if sequence_parallel:
        with pytest.raises(AssertionError, match="sequence parallel"):
            WrappedTorchNorm(config=config, hidden_size=64)
    with pytest.raises(AssertionError, match="zero_centered_gamma"):  # megatron-core's other checks still hold
        SequenceParallelTorchNorm(config=_config(sequence_parallel, layernorm_zero_centered_gamma=True),
                                  hidden_size=64)
