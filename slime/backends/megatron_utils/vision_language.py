"""Vision-language models on the Megatron backend: the language model on megatron-core, the vision tower as the
HF module. This module: what the checkpoint says of its tower (`vision_spec`), the 3-D position ids
(`mrope_position_ids`) and a micro-batch's forward inputs (`micro_batch_inputs`), importable without megatron-core;
the model itself is vision_language_model.py.

`VisionLanguageModel` is megatron-core's `GPTModel` (so pipeline schedules, DDP, the optimizer, weight loading and
export treat it as one) with, on the first pipeline stage, the checkpoint's HF vision tower as `visual` (its HF
parameter names under `visual.`, loaded from the checkpoint as they are: converters/qwen2_5_vl.py). Its forward
takes the rows' `pixel_values` / `image_grid_thw` (the processor's output, `TrainBatch.multimodal_train_inputs`),
runs the tower, and puts the image features into the decoder's input embeddings at the image tokens, image by
image, left to right, row by row, as transformers does. The decoder rotates by multimodal RoPE
(`--position-embedding-type mrope`): 3-D (temporal, height, width) position ids from `mrope_position_ids`.

With --sequence-parallel the embeddings (and the decoder layers' outputs the deepstack features are added to) hold
this tensor-parallel rank's part of the sequence: each rank places the features of the image tokens in its part,
and the tower's gradients, each rank's from its part, are summed over the tensor-parallel group as megatron-core
sums its layer norms' (the parameters are marked `sequence_parallel`).

Simplifications: Qwen2.5-VL and Qwen3-VL (dense) only (`VISION_TOWERS`); images, no video; no context parallelism
with images (the sequence is split across ranks before the model sees it); the tower is replicated on every
tensor-parallel rank (each computes it whole).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from slime.backends.megatron_utils.args import pipeline_layer_split
from slime.backends.megatron_utils.config_check import is_hf_folder, read_config_json
from slime.backends.training.batching import MicroBatch
from slime.utils.errors import SlimeArgumentError
from slime.utils.image_tokens import image_token_counts, stray_image_tokens


def _qwen2_5_vl_tower():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def _qwen3_vl_tower():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel


# HF model_type -> the class of its vision tower (a transformers module built from the config's vision_config)
VISION_TOWERS = {"qwen2_5_vl": _qwen2_5_vl_tower, "qwen3_vl": _qwen3_vl_tower}
# model types whose text model takes the multimodal RoPE axes interleaved over the frequencies (transformers'
# Qwen3-VL always does; Qwen2.5-VL takes them in blocks, as megatron-core's MultimodalRotaryEmbedding does)
INTERLEAVED_MROPE = {"qwen3_vl"}


@dataclass(frozen=True)
class VisionSpec:
    """What the Megatron model needs of an HF vision-language checkpoint besides MODEL_ARGS."""

    model_type: str
    vision_config: object  # transformers' config of the tower
    image_token_id: int
    spatial_merge_size: int
    vision_start_token_id: int
    vision_end_token_id: int
    deepstack_layers: int = 0  # decoder layers 0..n-1 take the tower's deepstack features (Qwen3-VL)
    mrope_interleaved: bool = False  # INTERLEAVED_MROPE


def check_vision_tower(path: str | None) -> str | None:
    """The model_type of --hf-checkpoint when it is a vision-language model whose tower this backend builds (None
    for a text model, or without an HF folder); a SlimeArgumentError naming the type and the fix for any other
    vision-language model (Qwen3-VL among them). Run at argument validation, before Ray starts, and again here."""
    if not is_hf_folder(path):
        return None
    raw = read_config_json(path)
    if "vision_config" not in raw:
        return None
    model_type = raw.get("model_type")
    if model_type not in VISION_TOWERS:
        arch = ", ".join(raw.get("architectures") or []) or "no architectures in config.json"
        raise SlimeArgumentError(
            f"--hf-checkpoint {path}: a vision-language model of type {model_type!r} ({arch}); --train-backend "
            f"megatron builds the vision-language models {sorted(VISION_TOWERS)} only; use --train-backend fsdp "
            "for this model (docs/vlm.md)"
        )
    return model_type


def deepstack_layer_count(raw: dict) -> int:
    """How many decoder layers take deepstack features: one per `deepstack_visual_indexes` block of the tower."""
    return len((raw.get("vision_config") or {}).get("deepstack_visual_indexes") or [])


def check_deepstack_layout(args: argparse.Namespace) -> None:
    """A SlimeArgumentError, naming the flag, for a layout where --hf-checkpoint's deepstack layers cannot take
    their features: they must all sit in the first pipeline stage's first chunk (beside the vision tower), and
    are not recomputed whole (the features are added by a hook on each of those layers' outputs, which a
    recomputation in the backward pass would run without them)."""
    if check_vision_tower(args.hf_checkpoint) is None:
        return
    count = deepstack_layer_count(read_config_json(args.hf_checkpoint))
    if not count:
        return
    if args.recompute_granularity == "full":
        raise SlimeArgumentError(
            f"--recompute-granularity full with --hf-checkpoint {args.hf_checkpoint}: its first {count} decoder "
            "layers add the vision tower's deepstack features to their outputs, which recomputing those layers "
            "whole would leave out; use --recompute-granularity selective or drop it"
        )
    first = args.num_layers_per_virtual_pipeline_stage or pipeline_layer_split(args)[0]
    if first < count:
        raise SlimeArgumentError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} puts {first} decoder layer(s) in "
            f"the first pipeline stage (chunk), but --hf-checkpoint {args.hf_checkpoint} adds deepstack features "
            f"to its first {count} layers, which must all run on the first stage with the vision tower; set "
            f"--decoder-first-pipeline-num-layers >= {count} (or a smaller --pipeline-model-parallel-size / a "
            "larger --num-layers-per-virtual-pipeline-stage)"
        )


def vision_spec(args: argparse.Namespace) -> VisionSpec | None:
    """The vision tower of --hf-checkpoint (None for a text model, or without an HF folder)."""
    path = args.hf_checkpoint
    model_type = check_vision_tower(path)
    if model_type is None:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if args.context_parallel_size > 1:
        raise SlimeArgumentError(
            f"--hf-checkpoint {path} is a vision-language model: its image features are placed into the embeddings "
            "of the whole sequence, which --context-parallel-size > 1 splits across ranks before the model sees it; "
            "drop --context-parallel-size (--sequence-parallel is supported)"
        )
    check_deepstack_layout(args)
    return VisionSpec(model_type, config.vision_config, config.image_token_id, config.vision_config.spatial_merge_size,
                      config.vision_start_token_id, config.vision_end_token_id,
                      deepstack_layers=deepstack_layer_count(read_config_json(path)),
                      mrope_interleaved=model_type in INTERLEAVED_MROPE)


def interleaved_mrope_freqs(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                            mrope_section: list[int]) -> torch.Tensor:
    """[L, B, 1, 2 * F] rotary angles of `[3, B, L]` position ids for rotate-half RoPE with the multimodal axes
    interleaved over the F frequencies (Qwen3-VL): frequency j takes the height position when j % 3 == 1 and
    j < 3 * mrope_section[1], the width position when j % 3 == 2 and j < 3 * mrope_section[2], else the temporal
    one; the F angles are repeated for the two halves, as megatron-core's rotary embeddings lay them out."""
    if sum(mrope_section) != inv_freq.numel():
        raise ValueError(f"mrope_section {mrope_section} sums to {sum(mrope_section)}, the rotary embedding has "
                         f"{inv_freq.numel()} frequencies")
    freqs = position_ids.to(inv_freq.device, torch.float32)[..., None] * inv_freq.float()  # [3, B, L, F]
    axis = torch.zeros(inv_freq.numel(), dtype=torch.long, device=inv_freq.device)
    for dim in (1, 2):
        axis[dim: 3 * mrope_section[dim]: 3] = dim
    chosen = freqs.gather(0, axis.expand(1, *freqs.shape[1:3], -1)).squeeze(0)  # [B, L, F]
    return torch.cat([chosen, chosen], dim=-1).transpose(0, 1).unsqueeze(2).contiguous()


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_mask: torch.Tensor,
                       spatial_merge_size: int, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """[3, B, L] multimodal RoPE position ids (temporal, height, width) of `[B, L]` rows, the images' grids
    (`[n, 3]`, in row order) placed at the tokens of `image_mask`, as transformers' Qwen2.5-VL computes them: a text
    token takes the next position on all three axes; an image of t x h x w merged patches (h, w: the grid's divided
    by the merge size) starting at position p gives its token (i, j, k) the positions (p + i, p + j, p + k), and the
    text after it continues from p + max(h, w). A row without images counts 0, 1, 2, ... on all three axes. A packed
    row (`cu_seqlens`, B = 1) restarts the count at each sequence."""
    batch, length = input_ids.shape
    device = input_ids.device
    out = torch.empty(3, batch, length, dtype=torch.long, device=device)
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
    mask = image_mask.cpu()
    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, length]
    if bounds[-1] != length:
        bounds.append(length)
    used = 0
    for b in range(batch):
        for start, end in zip(bounds[:-1], bounds[1:]):
            used = _segment_positions(out[:, b], mask[b], start, end, grids, used, spatial_merge_size)
    if used != len(grids):
        raise ValueError(f"image_grid_thw describes {len(grids)} image(s), the rows hold image tokens of {used}")
    return out


def _segment_positions(out: torch.Tensor, flags: torch.Tensor, start: int, end: int, grids: list[tuple],
                       used: int, merge: int) -> int:
    """Fill `out[:, start:end]` (one sequence, counting from 0) taking images from `grids[used:]`; returns how many
    grids are used after it."""
    i, pos = start, 0
    while i < end:
        image_tokens = torch.nonzero(flags[i:end]).flatten()
        text = int(image_tokens[0]) if len(image_tokens) else end - i
        out[:, i:i + text] = torch.arange(pos, pos + text, device=out.device)
        i, pos = i + text, pos + text
        if i == end:
            break
        if used == len(grids):
            raise ValueError(f"more image tokens than image_grid_thw {grids} describes (at token {i})")
        t, h, w = grids[used]
        h, w = h // merge, w // merge
        n = t * h * w
        if i + n > end or not bool(flags[i:i + n].all()):
            raise ValueError(f"the image at token {i} has grid {grids[used]} ({n} tokens after merging "
                             f"{merge}x{merge}), but not as many image tokens follow")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, i:i + n] = grid.reshape(3, n).to(out.device) + pos
        i, pos, used = i + n, pos + max(h, w), used + 1
    return used


def image_placeholder_mask(mb: MicroBatch, row_grids: list[torch.Tensor | None], vision: VisionSpec) -> torch.Tensor:
    """[B, L] True at the image tokens that take image features: each sequence's runs of its own images
    (`row_grids[k]`, None: no images), by the rule the engine and the fsdp trainer share
    (`slime.utils.image_tokens`): the prompt's images and a multi-turn rollout's observation images in the response
    hold their runs; an image token the policy sampled is an ordinary token (its own embedding, a text position), as
    the engine fed it back."""
    ids = mb.input_ids
    mask = torch.zeros_like(ids, dtype=torch.bool)
    ends = [s + n for s, n in zip(mb.response_starts, mb.response_lengths)]
    spans = ([(k, 0, end) for k, end in enumerate(ends)] if mb.cu_seqlens is None
             else [(0, start, end) for start, end in zip(mb.cu_seqlens, ends)])
    for k, ((row, start, end), grid) in enumerate(zip(spans, row_grids)):
        tokens = ids[row, start:end].tolist()
        counts = [] if grid is None else image_token_counts(grid, vision.spatial_merge_size)
        try:
            stray = set(stray_image_tokens(tokens, vision.image_token_id, counts, vision.vision_start_token_id,
                                           vision.vision_end_token_id))
        except ValueError as e:
            raise ValueError(f"micro-batch sequence {k}: {e} (Sample.multimodal_train_inputs must hold the images "
                             "of every image run of Sample.tokens, in order)") from None
        places = [start + p for p, t in enumerate(tokens) if t == vision.image_token_id and p not in stray]
        mask[row, places] = True
    return mask


def micro_batch_inputs(mb: MicroBatch, per_row: list[dict | None] | None, rows: list[int],
                       vision: VisionSpec) -> dict:
    """The forward's inputs of a micro-batch for the vision-language model besides its token ids: 3-D
    `position_ids`, and with images their `pixel_values` / `image_grid_thw` (the rows' `multimodal_train_inputs`,
    concatenated in row order) and the `image_mask` of the tokens that take their features
    (`image_placeholder_mask`)."""
    chosen = [per_row[r] if per_row is not None else None for r in rows]
    found = [x for x in chosen if x is not None]
    grids = torch.cat([x["image_grid_thw"] for x in found]) if found else None
    mask = image_placeholder_mask(mb, [None if x is None else x["image_grid_thw"] for x in chosen], vision)
    out = {"position_ids": mrope_position_ids(mb.input_ids, grids, mask, vision.spatial_merge_size, mb.cu_seqlens)}
    if found:
        device = mb.input_ids.device
        out.update(pixel_values=torch.cat([x["pixel_values"] for x in found]).to(device),
                   image_grid_thw=grids.to(device), image_mask=mask)
    return out
