"""slime's SFT rollout: `--rollout-function-path slime.rollout.sft_rollout.generate_rollout`.

Supervised fine-tuning through the RL loop, with no engine (`--debug-train-only`): each rollout takes the next
`--rollout-batch-size` chat rows of `--prompt-data` (`--input-key messages`, the messages kept as a list: no
`--apply-chat-template`; tools from `--tool-key` in `metadata["tools"]`), renders them with the tokenizer of
`--hf-checkpoint` and marks what is trained with `--loss-mask-type` (slime.utils.mask_utils). The sample's
response starts at the first trained token (slime's `get_response_lengths`); everything before it is the prompt,
and the response's loss mask keeps later untrained tokens (user turns, tool results) at 0. Rewards are 0; train
with `--loss-type sft_loss --disable-compute-advantages-and-returns` (docs/sft.md).

The data source is the default one, so epochs wrap (reshuffled with `--rollout-shuffle`), `--num-epoch` sizes
the run and a checkpoint saves the position in the data: a run resumed with `--load` continues mid-epoch with the
next rows.

With `--multimodal-keys` the rows' images are read by the data source (each `<image>` of a message takes the
row's next image, in any user turn) and the messages render each image as one `<|image_pad|>` between the vision
markers; `expand_images` then puts each image's run of image tokens (its merged-patch count from `--hf-checkpoint`'s
image processor) in place of its placeholder, at loss mask 0, and keeps the processed images in
`Sample.multimodal_train_inputs` for the trainer, as a rollout with images does. Assumed: the loss-mask type renders
an image part as the processor's chat template does (one placeholder per image, in the images' order).

Checked where slime asserts: no evaluation rollout, the global dataset, one sample per prompt. Added: a row with
nothing to train on, or whose first token would be trained (it has no prediction), is an error naming the row; so is
a row whose rendered placeholders do not match its images one to one.
"""

from __future__ import annotations

import logging
from typing import Any

from slime.rollout.generation import get_processor, sample_images
from slime.utils.image_tokens import image_token_counts
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

__all__ = ["generate_rollout"]

logger = logging.getLogger(__name__)

_GENERATORS: dict[tuple[str, str], MultiTurnLossMaskGenerator] = {}  # (--hf-checkpoint, --loss-mask-type)
_logged = False  # the first sample of the process is logged, as in slime


def mask_generator(args: Any) -> MultiTurnLossMaskGenerator:
    """The loss-mask generator of `--hf-checkpoint`'s tokenizer and `--loss-mask-type`, made once per process."""
    key = (args.hf_checkpoint, args.loss_mask_type)
    if key not in _GENERATORS:
        tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        _GENERATORS[key] = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=args.loss_mask_type)
    return _GENERATORS[key]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """The next `--rollout-batch-size` conversations as training samples (groups of one)."""
    if evaluation:
        raise ValueError("slime.rollout.sft_rollout has no evaluation rollout: drop --eval-interval / "
                         "--eval-prompt-data, or give --eval-function-path a function that evaluates")
    if not args.rollout_global_dataset:
        raise ValueError("slime.rollout.sft_rollout reads the conversations of --prompt-data: drop "
                         "--disable-rollout-global-dataset")
    if args.n_samples_per_prompt != 1:
        raise ValueError(f"--n-samples-per-prompt {args.n_samples_per_prompt}: slime.rollout.sft_rollout trains each "
                         "conversation once; use --n-samples-per-prompt 1")
    generator = mask_generator(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            to_sft_sample(sample, generator, get_processor(args) if sample_images(sample) else None)
    global _logged
    if not _logged and groups:
        _logged = True
        sample = groups[0][0]
        logger.info("sft_rollout: first sample of rollout %d: %d tokens, response %d, trained %d; trained text %r",
                    rollout_id, len(sample.tokens), sample.response_length, sum(sample.loss_mask),
                    generator.get_text_from_loss_mask(sample.tokens[sample.prompt_length:], sample.loss_mask))
    return groups


def expand_images(token_ids: list[int], loss_mask: list[int], images: list, processor: Any,
                  where: str) -> tuple[list[int], list[int], dict]:
    """`token_ids` / `loss_mask` with each image's single `<|image_pad|>` replaced by the image's run of image tokens
    (mask 0), and the processed images for training ({"pixel_values", "image_grid_thw"})."""
    if processor is None:
        raise ValueError(f"{where} has images but --hf-checkpoint has no multimodal processor; use a "
                         "vision-language model or drop --multimodal-keys")
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    placeholders = [i for i, t in enumerate(token_ids) if t == image_token]
    if len(placeholders) != len(images):
        raise ValueError(f"{where}: the rendered conversation holds {len(placeholders)} image placeholder(s) "
                         f"({processor.image_token}) but the row has {len(images)} image(s); each image part of a "
                         "message must render as one placeholder (a chat template with images, and no literal "
                         f"{processor.image_token} in the text)")
    out = processor.image_processor(images=images, return_tensors="pt")
    counts = image_token_counts(out["image_grid_thw"], processor.image_processor.merge_size)
    ids, mask, start = [], [], 0
    for position, count in zip(placeholders, counts, strict=True):
        if loss_mask[position]:
            raise ValueError(f"{where}: an image placeholder at token {position} is in a trained span; images "
                             "belong in user (or system) turns")
        ids += token_ids[start:position] + [image_token] * count
        mask += loss_mask[start:position] + [0] * count
        start = position + 1
    ids += token_ids[start:]
    mask += loss_mask[start:]
    return ids, mask, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def to_sft_sample(sample: Sample, generator: MultiTurnLossMaskGenerator, processor: Any = None) -> Sample:
    """Fill `sample` (its prompt: the chat messages) with the tokens, response and loss mask to train on; a sample
    with images (read by the data source) gets them expanded with `processor` (`expand_images`)."""
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(f"sample {sample.index}: slime.rollout.sft_rollout needs chat messages (a list of "
                         f"{{'role', 'content'}}) under --input-key, got {type(messages).__name__}; do not pass "
                         "--apply-chat-template (it renders them to text)")
    tools = (sample.metadata or {}).get("tools")
    token_ids, loss_mask = generator.get_loss_mask(messages, tools=tools)
    if len(token_ids) != len(loss_mask):
        raise ValueError(f"sample {sample.index}: --loss-mask-type {generator.tokenizer_type} gave {len(token_ids)} "
                         f"tokens but {len(loss_mask)} mask entries")
    images = sample_images(sample)
    if images:
        token_ids, loss_mask, sample.multimodal_train_inputs = expand_images(
            list(token_ids), list(loss_mask), images, processor, f"sample {sample.index}")
    response_length = generator.get_response_lengths([loss_mask])[0]
    if response_length == 0:
        raise ValueError(f"sample {sample.index}: nothing to train on with --loss-mask-type "
                         f"{generator.tokenizer_type} (no assistant message, or every one has step_loss_mask 0); "
                         "drop the row or give it an assistant turn")
    if response_length == len(token_ids):
        raise ValueError(f"sample {sample.index}: its first token would be trained on, but nothing predicts it; "
                         "the conversation needs a prompt before the first assistant turn")
    sample.tokens = list(token_ids)
    sample.response_length = response_length
    sample.loss_mask = list(loss_mask[-response_length:])
    sample.reward = 0
    return sample
