"""Sequence parallelism on megatron-core's local layers (no TransformerEngine).

With `--sequence-parallel` the activations between the tensor-parallel linears are split along the sequence over
the tensor-parallel ranks, so every norm there sees only this rank's tokens and its weight gets only their part of
the gradient. megatron-core sums those parts over the tensor-parallel group for each parameter marked
`sequence_parallel` (`finalize_model_grads`), which TransformerEngine's norms are; its local `WrappedTorchNorm`
refuses sequence parallelism instead. `SequenceParallelTorchNorm` is that norm (torch's LayerNorm / RMSNorm, the
same checks) with its parameters marked, and `with_sequence_parallel_norms` puts it in place of `WrappedTorchNorm`
throughout a decoder block spec (the layers' norms, the q/k norms, GLM-4's sandwich norms, the final norm).
"""

from __future__ import annotations

import copy
import dataclasses


class SequenceParallelTorchNorm:
    """megatron-core's `WrappedTorchNorm` (same arguments, same module) for a sequence-parallel model."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        unsplit = copy.copy(config)
        unsplit.sequence_parallel = False  # the one check of WrappedTorchNorm this class lifts
        norm = WrappedTorchNorm(unsplit, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(spec):
    """A copy of `spec` (a decoder block spec, a layer's ModuleSpec or any part of one) with every
    `WrappedTorchNorm` replaced by `SequenceParallelTorchNorm`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(obj):
        if obj is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(obj, list):
            return [swap(x) for x in obj]
        if isinstance(obj, dict):
            return {k: swap(v) for k, v in obj.items()}
        if isinstance(obj, ModuleSpec) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
            new = copy.copy(obj)
            for name, value in vars(obj).items():
                setattr(new, name, swap(value))
            return new
        return obj

    return swap(spec)
