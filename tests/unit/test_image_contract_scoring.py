"""How tests/contract/test_image_api.py compares a prompt's log-probs with images to a transformers forward, checked
against SGLang 0.5.16's scoring of that prompt (written here from its source, since CI has no SGLang server).

SGLang puts each image's hash in place of the image's placeholder ids and, for `input_token_logprobs`, clamps the
targets into the vocabulary (managers/schedule_batch.py, `extend_input_logprob_token_ids.clamp_(0, vocab_size - 1)`)
before gathering the log-probs at them (layers/logprob_processor.py): a position whose next token is a placeholder
is scored as the token `vocab_size - 1`. The contract must pass for such an engine when everything else agrees, and
an image's placeholders must be targets whose scores differ from the placeholder's by more than the tolerance, or
this check would show nothing.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from slime.utils.processing_utils import load_processor
from tests.contract.test_engine_api import max_diff
from tests.contract.test_image_api import expanded_ids, image, prompt_text, reference_logprobs, text_target_logprobs
from tools.make_tiny_model import make_tiny_model

TOL = 0.05  # the GPU row's --logprob-tol


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    assert glob.glob(os.path.join(path, "*.safetensors"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_processor(path, trust_remote_code=True)


def sglang_prompt_logprobs(model, processor, ids, images) -> list[float]:
    """The prompt log-probs SGLang 0.5.16 reports for `ids` (max_new_tokens 0, logprob_start_len 0), after its first
    entry: the forward's, but a placeholder target scored as the token vocab_size - 1."""
    pixels = processor.image_processor(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(t == processor.image_token_id).int()).logits[0, :-1].float()
    targets = t[0, 1:].clone()
    targets[targets == processor.image_token_id] = model.config.get_text_config().vocab_size - 1
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()


def test_prompt_scores_are_compared_where_the_target_is_no_image_placeholder(tiny_vlm):
    model, processor = tiny_vlm
    images = [image((0, 255, 0))]
    ids = expanded_ids(processor, prompt_text(processor), images)
    engine = sglang_prompt_logprobs(model, processor, ids, images)
    reference = reference_logprobs(model, processor, ids, images)
    placeholder_targets = [k for k, target in enumerate(ids[1:]) if target == processor.image_token_id]
    assert placeholder_targets  # the image expanded to placeholders that are scored as targets
    # compared whole, SGLang's scores would fail the contract (what a real server's run would have shown) ...
    assert max(abs(engine[k] - reference[k]) for k in placeholder_targets) > TOL
    # ... the contract's comparison leaves out exactly those targets, and the rest agree
    kept = [text_target_logprobs(lps, ids, processor.image_token_id) for lps in (engine, reference)]
    assert len(kept[0]) == len(ids) - 1 - len(placeholder_targets)
    assert max_diff(*kept) < 1e-5
