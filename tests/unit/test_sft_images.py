"""SFT with images (slime.rollout.sft_rollout with --multimodal-keys) on the tiny Qwen2.5-VL: each image's
placeholder becomes its run of image tokens (equal to the processor's expansion of the whole conversation), the
loss mask covers the assistant turns only and no image token, and the processed images reach the train batch."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from slime.rollout import sft_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.train_data import flatten_groups, samples_to_train_batch
from slime.utils.processing_utils import load_processor
from slime.utils.types import Sample
from tests.args import make_args
from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)


def image_file(path, colour, size) -> str:
    Image.new("RGB", size, colour).save(path)
    return str(path)


def sft_args(vlm, data, *flags):
    return make_args("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--prompt-data", data,
                     "--input-key", "messages", "--n-samples-per-prompt", "1", "--rollout-batch-size", "1",
                     "--global-batch-size", "1", "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns",
                     "--debug-train-only", "--multimodal-keys", '{"image": "images"}', *flags, hf_checkpoint=vlm)


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_two_turns_with_two_images_expand_and_mask_the_assistant_turns_only(vlm, tmp_path):
    images = [image_file(tmp_path / "a.png", "red", (28, 56)), image_file(tmp_path / "b.png", "blue", (56, 56))]
    messages = [{"role": "user", "content": "<image> which colour fills the image?"},
                {"role": "assistant", "content": "red"},
                {"role": "user", "content": "<image> and this one?"},
                {"role": "assistant", "content": "blue"}]
    args = sft_args(vlm, write_rows(tmp_path / "sft.jsonl", [{"messages": messages, "images": images}]))
    (group,) = sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    (sample,) = group

    processor = load_processor(vlm, trust_remote_code=True)
    pil = [Image.open(p) for p in images]
    text = processor.apply_chat_template(sample.prompt, tokenize=False)
    expected = processor(text=text, images=pil, return_tensors="pt")
    assert sample.tokens == expected["input_ids"][0].tolist()
    assert torch.equal(sample.multimodal_train_inputs["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(sample.multimodal_train_inputs["pixel_values"], expected["pixel_values"])

    names = processor.tokenizer.convert_ids_to_tokens(sample.tokens)
    image_at = [i for i, n in enumerate(names) if n == "<|image_pad|>"]
    assert len(image_at) == 2 + 4  # 28x56 px: 2x4 patches -> 2 tokens; 56x56: 4x4 patches -> 4 tokens
    # the response starts at the first answer; trained: each answer and its <|im_end|>
    prompt = names[: sample.prompt_length]
    assert prompt[-2:] == ["<|im_start|>", "assistant"] and prompt.count("<|image_pad|>") == 2
    response = names[sample.prompt_length:]
    trained = [n for n, m in zip(response, sample.loss_mask) if m]
    assert trained == ["red", "<|im_end|>", "blue", "<|im_end|>"]
    # the second image lies in the response region, at mask 0, as do the second user turn's other tokens
    assert response.count("<|image_pad|>") == 4
    assert [m for n, m in zip(response, sample.loss_mask) if n == "<|image_pad|>"] == [0] * 4
    assert len(sample.loss_mask) == sample.response_length

    batch = samples_to_train_batch(args, flatten_groups([group], args.rollout_function_path))
    assert batch.loss_masks == [sample.loss_mask]
    assert torch.equal(batch.multimodal_train_inputs[0]["image_grid_thw"], expected["image_grid_thw"])


def test_an_image_in_an_assistant_turn_is_refused(vlm, tmp_path):
    image = image_file(tmp_path / "a.png", "red", (28, 28))
    messages = [{"role": "user", "content": "which colour ?"}, {"role": "assistant", "content": "<image> red"}]
    args = sft_args(vlm, write_rows(tmp_path / "sft.jsonl", [{"messages": messages, "images": [image]}]))
    with pytest.raises(ValueError, match="sample 0: an image placeholder at token .* is in a trained span"):
        sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_placeholders_that_do_not_match_the_images_are_refused(vlm, tmp_path):
    """A sample from another data source whose text holds a literal image token besides its image part."""
    messages = [{"role": "user", "content": [{"type": "image", "image": "x"},
                                             {"type": "text", "text": "which colour is <|image_pad|> ?"}]},
                {"role": "assistant", "content": "red"}]
    sample = Sample(index=3, prompt=messages, multimodal_inputs={"images": [Image.new("RGB", (28, 28), "red")]})
    args = sft_args(vlm, write_rows(tmp_path / "sft.jsonl", [{"messages": messages[1:]}]))
    with pytest.raises(ValueError, match=r"sample 3: the rendered conversation holds 2 image placeholder\(s\) .* "
                                         r"the row has 1 image\(s\)"):
        sft_rollout.to_sft_sample(sample, sft_rollout.mask_generator(args), load_processor(vlm, trust_remote_code=True))
