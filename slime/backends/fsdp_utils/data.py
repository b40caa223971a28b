"""Per-response-token log-probs / entropies (and a critic's values) of the fsdp backend's micro-batches, read
off a transformers model's outputs.

Simplifications: micro-batches (slime/backends/training/batching.py) are padded to their longest sequence with
an attention mask; no sequence packing. Right padding keeps every real token's position id and causal context
unchanged, so a padded row computes the same log-probs as the row alone.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from slime.algorithm.log_probs_triton import vocab_kernel
from slime.backends.training.batching import MicroBatch, to_device
from slime.utils.image_tokens import (image_token_counts, own_embeddings_at, stand_in_id, stray_image_tokens,
                                      token_runs)


# ---- log-prob extraction --------------------------------------------------------------------------------
def extract_response_log_probs(
    logits: torch.Tensor,
    mb: MicroBatch,
    temperature: float,
    logits_offset: int = 0,
    with_entropy: bool = False,
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each response token, as [B, R] fp32 (0 past each response).

    `logits` [B, K, V] hold positions [logits_offset, logits_offset + K) of the padded sequence (a model
    run with `logits_to_keep` returns only the last K). With `with_entropy`, also the per-token entropy
    of the same temperature-scaled distribution. `kernel`: --log-probs-kernel (slime/algorithm/log_probs_triton.py's
    `vocab_kernel`)."""
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature {temperature}: must be > 0")
    _, kept, vocab = logits.shape
    device = logits.device
    valid = mb.response_mask.to(device).bool()
    predicting, target_at = mb.slot_positions(logits_offset)  # on the host: checked and copied without a GPU sync
    if int(predicting.min()) < 0 or int(predicting.max()) >= kept:
        raise ValueError(
            f"logits cover positions [{logits_offset}, {logits_offset + kept}) but a response needs "
            f"[{logits_offset + int(predicting.min())}, {logits_offset + int(predicting.max()) + 1})"
        )
    predicting, target_at = to_device(torch.stack([predicting, target_at]), device)
    targets = torch.where(valid, mb.input_ids.gather(1, target_at), 0)
    selected = logits.gather(1, predicting.unsqueeze(-1).expand(-1, -1, vocab))
    log_probs, entropy = vocab_kernel(kernel)(selected, targets, temperature=temperature, with_entropy=with_entropy)
    return log_probs * valid, (entropy * valid if with_entropy else None)


def supports_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def micro_batch_images(per_row: list[dict | None] | None, rows: list[int], device,
                       loss_masks: list[list[int]] | None = None) -> dict | None:
    """The vision inputs of a micro-batch's rows (`TrainBatch.multimodal_train_inputs`), concatenated in row order
    as the model takes them (its image tokens are filled image by image, left to right, row by row), plus
    `row_grids`: each row's own `image_grid_thw` (None: no images) and `row_loss_masks` (its response's loss mask,
    None when not given); None when no row has images."""
    chosen = [per_row[r] if per_row is not None else None for r in rows]
    found = [x for x in chosen if x is not None]
    if not found:
        return None
    return {"pixel_values": torch.cat([x["pixel_values"] for x in found]).to(device),
            "image_grid_thw": torch.cat([x["image_grid_thw"] for x in found]).to(device),
            "row_grids": [None if x is None else x["image_grid_thw"] for x in chosen],
            "row_loss_masks": [None if loss_masks is None else loss_masks[r] for r in rows]}


def forward_logits(model: torch.nn.Module, mb: MicroBatch, all_positions: bool = False,
                   images: dict | None = None, idle_vision: bool = False) -> tuple[torch.Tensor, int]:
    """Run the model on a micro-batch: (`[B, K, V]` logits, the position K starts at). Only the positions from the
    earliest response-predicting one onwards go through the LM head, which saves the `[B, L, V]` logits of long
    prompts; with `all_positions` every position does (a custom loss reads slime's whole-sequence layout).
    `images` (`micro_batch_images`) go to a vision-language model with the token types it needs to place its
    3-D RoPE positions (computed by the model from the attention mask, so right padding is fine).
    `idle_vision`: a micro-batch without images still runs the vision tower, on a stand-in image whose features
    count zero times (`_idle_vision_hook`), because with several FSDP ranks the tower's shards are gathered (and its
    gradients reduced) collectively: a rank that skipped it would leave its peers waiting."""
    if images is None and idle_vision:
        handle = model.get_input_embeddings().register_forward_hook(_idle_vision_hook(model))
        try:
            return forward_logits(model, mb, all_positions, None)
        finally:
            handle.remove()
    kwargs = {}
    offset = 0
    if supports_logits_to_keep(model) and not all_positions:
        offset = mb.first_predicting_position()
        kwargs["logits_to_keep"] = mb.input_ids.shape[1] - offset
    input_ids, stray = mb.input_ids, None
    if images is not None:
        image_token = model.config.image_token_id
        stray = _stray_image_tokens(model, mb, images["row_grids"], images["row_loss_masks"])
        if stray is not None:
            input_ids = input_ids.masked_fill(stray, stand_in_id(image_token))
        kwargs.update(pixel_values=images["pixel_values"].to(model.dtype), image_grid_thw=images["image_grid_thw"],
                      mm_token_type_ids=(input_ids == image_token).int())
    # An image token the policy sampled is an ordinary token (the engine fed it back with its own embedding at a
    # text position): the model sees a stand-in id there, so only images' tokens take image features, and the
    # token's own embedding is put back.
    own = contextlib.nullcontext() if stray is None else own_embeddings_at(model, stray, model.config.image_token_id)
    with own:
        out = model(input_ids=input_ids, attention_mask=mb.attention_mask, use_cache=False, **kwargs)
    return out.logits, offset


def _idle_vision_hook(model: torch.nn.Module):
    """A forward hook for the input embedding (which runs inside the model's forward, after FSDP gathered the root's
    shards, where the model would run its vision tower): the tower on the smallest image it takes (one
    merge-size square of patches), its features added to the embeddings times zero, so the logits do not change and
    the backward reaches (and reduces) every vision parameter as a peer's does. Qwen3-VL's tower also returns the
    deepstack features (its deepstack mergers' outputs, which a real image adds to the first text layers): they
    count zero times too, else those mergers would have no gradient on this rank and the reduction would differ."""
    vision = model.config.vision_config
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2

    def hook(module, args, output):
        pixels = torch.zeros(merge * merge, width, device=output.device, dtype=model.dtype)
        grid = torch.tensor([[1, merge, merge]], device=output.device)
        features = model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
        pooled = getattr(features, "pooler_output", features)
        tensors = list(pooled) if isinstance(pooled, (list, tuple)) else [pooled]
        for per_layer in getattr(features, "deepstack_features", None) or []:
            tensors += list(per_layer) if isinstance(per_layer, (list, tuple)) else [per_layer]
        return output + 0.0 * sum(t.sum() for t in tensors).to(output.dtype)

    return hook


def _stray_image_tokens(model: torch.nn.Module, mb: MicroBatch, row_grids: list,
                        row_loss_masks: list) -> torch.Tensor | None:
    """[B, L] bool: the image tokens of each row that hold none of the row's images (the policy sampled them), by
    the engine's rule (`slime.utils.image_tokens.stray_image_tokens`: the prompt's images and a multi-turn
    rollout's observation images in the response region hold their runs); None when there are none.
    A stray run between the vision markers at loss mask 0 is an environment's image whose pixels are missing from
    `multimodal_train_inputs`: an error (a policy-sampled run has loss mask 1)."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    markers = (config.vision_start_token_id, config.vision_end_token_id)
    stray = torch.zeros_like(mb.input_ids, dtype=torch.bool)
    for i, (grid, loss_mask) in enumerate(zip(row_grids, row_loss_masks)):
        ids = mb.input_ids[i, : int(mb.attention_mask[i].sum())].tolist()
        counts = [] if grid is None else image_token_counts(grid, merge)
        hint = ("Sample.multimodal_train_inputs must hold the images of every image run of Sample.tokens, in "
                "order: a multi-turn rollout adds each observation's images")
        try:
            positions = stray_image_tokens(ids, config.image_token_id, counts, *markers)
        except ValueError as e:
            raise ValueError(f"micro-batch row {i}: {e} ({hint})") from None
        start, stray_ids = mb.response_starts[i], [-1] * len(ids)
        for p in positions:
            stray_ids[p] = ids[p]
        for run_start, n in token_runs(stray_ids, config.image_token_id):
            end = run_start + n
            marked = run_start > 0 and ids[run_start - 1] == markers[0] and end < len(ids) and ids[end] == markers[1]
            observed = loss_mask is not None and run_start >= start and not any(loss_mask[run_start - start:end - start])
            if marked and observed:
                raise ValueError(f"micro-batch row {i}: image tokens at positions {run_start}..{end - 1}, between the "
                                 f"vision markers with loss mask 0 (an observation's image), have no image: the row's "
                                 f"{len(counts)} image(s) need runs of {counts} ({hint})")
        stray[i, positions] = True
    return stray if bool(stray.any()) else None


def forward_response_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False,
    images: dict | None = None, idle_vision: bool = False, kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model on a micro-batch and return [B, R] response log-probs (and entropies)."""
    logits, offset = forward_logits(model, mb, images=images, idle_vision=idle_vision)
    return extract_response_log_probs(logits, mb, temperature, offset, with_entropy, kernel)


# ---- critic values --------------------------------------------------------------------------------------
def extract_response_values(position_values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[B, L] per-position values -> [B, R]: V_t of response token t is read at the position that predicts
    it (the last token of the prefix before it), like the log-probs; 0 past each response."""
    device = position_values.device
    valid = mb.response_mask.to(device).bool()
    predicting = to_device(mb.slot_positions()[0], device)
    return position_values.gather(1, predicting).float() * valid


def forward_response_values(value_model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Run a value model (`forward(input_ids, attention_mask) -> [B, L]`) and return [B, R] response values."""
    return extract_response_values(value_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask), mb)
