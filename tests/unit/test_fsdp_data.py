"""slime/backends/fsdp_utils/data.py: row split, padding, masks and log-prob extraction, checked against a
straightforward per-sample computation."""

import pytest
import torch

from slime.backends.fsdp_utils.data import extract_response_log_probs, forward_response_log_probs
from slime.backends.training.batching import (
    make_micro_batch,
    pad_per_token,
    rows_per_step,
    split_micro_batches,
    unpad_per_token,
)

TOKENS = [[5, 6, 7, 8, 9], [5, 6, 10], [11, 12, 13, 14, 15, 16, 17], [3, 4]]
RESPONSE_LENGTHS = [2, 1, 4, 0]


def test_rows_per_step_contiguous_shares():
    # 2 steps of gbs 4 over 2 ranks: rank r takes rows [s*4 + 2r, s*4 + 2r + 2)
    assert rows_per_step(8, 4, 2, 0) == [[0, 1], [4, 5]]
    assert rows_per_step(8, 4, 2, 1) == [[2, 3], [6, 7]]
    assert rows_per_step(6, 6, 1, 0) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="--global-batch-size 4"):
        rows_per_step(6, 4, 2, 0)
    with pytest.raises(ValueError, match="not divisible by the 4 training ranks"):
        rows_per_step(6, 6, 4, 0)


def test_split_micro_batches():
    assert split_micro_batches([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7], [8]]
    with pytest.raises(ValueError, match="--micro-batch-size 0"):
        split_micro_batches([1], 0)


def test_make_micro_batch_right_pads_and_masks():
    mb = make_micro_batch(TOKENS, RESPONSE_LENGTHS, pad_token_id=0)
    assert mb.input_ids.shape == (4, 7)
    assert mb.input_ids[1].tolist() == [5, 6, 10, 0, 0, 0, 0]
    assert mb.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert mb.attention_mask[2].tolist() == [1] * 7
    assert mb.response_starts == [3, 2, 3, 2]
    assert mb.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert mb.first_predicting_position() == 1
    with pytest.raises(ValueError, match="at least one prompt token"):
        make_micro_batch([[1, 2]], [2])


def test_pad_and_unpad_per_token():
    padded = pad_per_token([[1.0, 2.0], torch.tensor([3.0]), []], 3)
    assert padded.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert unpad_per_token(padded, [2, 1, 0]) == [[1.0, 2.0], [3.0], []]


def _reference_log_probs(logits_per_row, tokens, response_lengths, temperature):
    """The obvious loop: token p of the response is scored by the distribution at p - 1."""
    out, ent = [], []
    for logits, toks, r in zip(logits_per_row, tokens, response_lengths):
        start = len(toks) - r
        lp, en = [], []
        for p in range(start, len(toks)):
            dist = torch.log_softmax(logits[p - 1].double() / temperature, -1)
            lp.append(float(dist[toks[p]]))
            en.append(float(-(dist.exp() * dist).sum()))
        out.append(lp)
        ent.append(en)
    return out, ent


@pytest.mark.parametrize("offset", [0, 1])
def test_extract_matches_per_sample_loop(offset):
    torch.manual_seed(0)
    vocab, temperature = 20, 0.7
    mb = make_micro_batch(TOKENS, RESPONSE_LENGTHS)
    logits = torch.randn(len(TOKENS), mb.input_ids.shape[1], vocab)
    lp, ent = extract_response_log_probs(logits[:, offset:], mb, temperature, logits_offset=offset, with_entropy=True)
    want_lp, want_ent = _reference_log_probs(logits, TOKENS, RESPONSE_LENGTHS, temperature)
    assert unpad_per_token(lp, RESPONSE_LENGTHS) == [pytest.approx(x, abs=1e-5) for x in want_lp]
    assert unpad_per_token(ent, RESPONSE_LENGTHS) == [pytest.approx(x, abs=1e-5) for x in want_ent]
    assert torch.all(lp[mb.response_mask == 0] == 0) and torch.all(ent[mb.response_mask == 0] == 0)


def test_extract_rejects_too_few_logits():
    mb = make_micro_batch(TOKENS, RESPONSE_LENGTHS)
    with pytest.raises(ValueError, match="logits cover positions"):
        extract_response_log_probs(torch.zeros(4, 3, 5), mb, 1.0, logits_offset=4)
    with pytest.raises(ValueError, match="--rollout-temperature 0"):
        extract_response_log_probs(torch.zeros(4, 7, 5), mb, 0.0)


def test_padded_model_forward_matches_unpadded_per_sample():
    """A real (tiny, in-memory) Qwen3: the padded micro-batch equals each sequence run alone."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    temperature = 0.8
    mb = make_micro_batch(TOKENS, RESPONSE_LENGTHS, pad_token_id=0)
    with torch.no_grad():
        lp, ent = forward_response_log_probs(model, mb, temperature, with_entropy=True)
        per_row_logits = [model(input_ids=torch.tensor([t])).logits[0] for t in TOKENS]
    want_lp, want_ent = _reference_log_probs(per_row_logits, TOKENS, RESPONSE_LENGTHS, temperature)
    assert unpad_per_token(lp, RESPONSE_LENGTHS) == [pytest.approx(x, abs=1e-5) for x in want_lp]
    assert unpad_per_token(ent, RESPONSE_LENGTHS) == [pytest.approx(x, abs=1e-5) for x in want_ent]
