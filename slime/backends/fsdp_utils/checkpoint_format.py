"""The fsdp trainer's weights as the model's checkpoint spells them.

transformers 5 renames and reshapes some checkpoints on load: a Qwen2.5-VL's `model.layers.*` / `visual.*` become
`model.language_model.layers.*` / `model.visual.*`, and the experts of a Qwen3-MoE, GLM-4.5 or DeepSeek-V3 layer
(`mlp.experts.{e}.gate_proj.weight`, ...) become two fused tensors (`mlp.experts.gate_up_proj`, `down_proj`).
SGLang's loaders take the checkpoint's spelling only (an unknown name is skipped or fails), so the trainer pushes
its weights in that spelling, as `save_pretrained` writes them (`transformers.core_model_loading.
revert_weight_conversion`), one gathered tensor at a time: every reversal these models register (a rename, a split
of a fused tensor) needs only that tensor. `CheckpointFormat` checks that once per model, on meta tensors, and
refuses a model whose reversal needs several tensors together rather than push a wrong set of names. A saved
checkpoint folder is written the same way (`checkpoint_state`), so SGLang can serve it as it served the original.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Named = tuple[str, torch.Tensor]


def checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state dict of `model` as its checkpoint spells it (what `save_pretrained` writes)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)


class CheckpointFormat:
    """Maps (in-memory name, tensor) pairs of `model`'s state dict to the checkpoint's (name, tensor) pairs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}
        together = set(checkpoint_state(model, dict(meta)))
        alone = {name: set(checkpoint_state(model, {name: tensor})) for name, tensor in meta.items()}
        made = set().union(*alone.values())
        if made != together:
            differ = sorted(made ^ together)
            raise ValueError(f"{type(model).__name__}: its checkpoint names cannot be made one tensor at a time "
                             f"(e.g. {differ[:3]}); the fsdp trainer cannot push it in its checkpoint's spelling")
        self.identity = all(names == {name} for name, names in alone.items())

    def convert(self, named: Iterable[Named]) -> Iterator[Named]:
        """Each in-memory tensor as the checkpoint's tensor(s): renamed, a fused tensor split into views."""
        for name, tensor in named:
            if self.identity:
                yield name, tensor
            else:
                yield from checkpoint_state(self.model, {name: tensor}).items()
