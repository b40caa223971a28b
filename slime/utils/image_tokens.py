"""Which image tokens of a token sequence hold an image's features, and which are ordinary tokens.

A vision-language sequence marks each image with a run of image tokens (`<|image_pad|>`), one per merged patch,
between `<|vision_start|>` and `<|vision_end|>`. A prompt's images are there, and so are the images that an
environment's observation turn brings into the response region of a multi-turn rollout (loss mask 0). The policy
may also sample the image token itself (a tiny or young model does): such a token is an ordinary token, fed back
with its own embedding at a text position, never an image's placeholder.

`stray_image_tokens` tells them apart from the ids and the images' token counts alone, so the engine (which sees
a request's `input_ids` and `image_data`) and the trainer (which sees the finished row and its images) draw the
same line and their log-probs agree. The rule: when the runs of image tokens are exactly one run per image with the
images' counts, all are placeholders; otherwise images take runs left to right, a run being an image's when it
lies between the start and end markers and has the image's token count; every other image token is stray.
Assumed: a sampled run that copies the next image's exact marked shape is taken for that image (both sides agree
on it, so log-probs still match); images left without a run are an error.

`own_embeddings_at(model, stray, image_token)` is the forward-time half: with the stray positions' ids replaced by
a stand-in (so the model places image features only at placeholders), a hook on the input embedding puts the image
token's own embedding back at those positions.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def stray_image_tokens(ids: list[int], image_token: int, counts: list[int], vision_start: int,
                       vision_end: int) -> list[int]:
    """Positions of the image tokens in `ids` that are no image's placeholder (see the module docstring);
    `counts[k]` is image k's number of tokens. Raises ValueError when some image finds no run."""
    runs = token_runs(ids, image_token)
    if [n for _, n in runs] == list(counts):
        return []
    stray, k = [], 0
    for start, n in runs:
        end = start + n
        marked = start > 0 and ids[start - 1] == vision_start and end < len(ids) and ids[end] == vision_end
        if k < len(counts) and marked and n == counts[k]:
            k += 1
        else:
            stray.extend(range(start, end))
    if k != len(counts):
        raise ValueError(
            f"the sequence's runs of image tokens (id {image_token}) have lengths {[n for _, n in runs]}, but its "
            f"{len(counts)} image(s) need runs of {list(counts)} tokens, each between the vision start and end "
            f"tokens ({vision_start}, {vision_end}); images {k}.. found none. Send every image's tokens as the "
            "processor expands them, in the order of the images"
        )
    return stray


def collapse_image_runs(ids: list[int], image_token: int, vision_start: int, vision_end: int,
                        num_images: int) -> list[int] | None:
    """`ids` with each image's run of image tokens cut to one image token: the form an engine expands itself
    (SGLang keeps the other ids as sent and expands the k-th image token to image k's count; the hf engine too).
    None when the image tokens are not exactly one run per image between the vision start and end tokens (the
    policy sampled image tokens): such ids cannot be sent in the short form."""
    runs = token_runs(ids, image_token)
    if len(runs) != num_images:
        return None
    if not all(start > 0 and ids[start - 1] == vision_start and start + n < len(ids) and ids[start + n] == vision_end
               for start, n in runs):
        return None
    out, prev = [], 0
    for start, n in runs:
        out.extend(ids[prev:start + 1])
        prev = start + n
    return out + ids[prev:]


def expand_image_tokens(ids: list[int], image_token: int, counts: list[int]) -> list[int]:
    """The inverse of `collapse_image_runs`: the k-th image token of `ids` repeated `counts[k]` times, every other id as
    it is (what SGLang 0.5.16 does with `input_ids` and images: `_expand_input_ids` in its
    multimodal/processors/base_processor.py, under `SGLANG_MM_AVOID_RETOKENIZE`, on by default)."""
    if ids.count(image_token) != len(counts):
        raise ValueError(f"{ids.count(image_token)} image token(s) (id {image_token}) for {len(counts)} image(s)")
    out, k = [], 0
    for t in ids:
        if t == image_token:
            out += [t] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Each image's number of image tokens: its patches (t * h * w of `image_grid_thw`) over merge_size**2."""
    return [int(g.prod()) // (merge_size * merge_size) for g in image_grid_thw]


@contextmanager
def own_embeddings_at(model: torch.nn.Module, stray: torch.Tensor, image_token: int):
    """While active, the model's input embedding returns the image token's own embedding at the `stray`
    positions ([B, L] bool), whatever ids the forward was given there."""
    embedding = model.get_input_embeddings()

    def restore(module, args, output):
        own = module.weight[image_token].to(output.dtype)
        return torch.where(stray.to(output.device).unsqueeze(-1), own, output)

    handle = embedding.register_forward_hook(restore)
    try:
        yield
    finally:
        handle.remove()


def stand_in_id(image_token: int) -> int:
    """The id a stray image token is given for the forward (its embedding is put back by `own_embeddings_at`)."""
    return 0 if image_token != 0 else 1
