"""slime.utils.image_tokens: which image tokens hold an image (the prompt's, a multi-turn rollout's observation
images in the response region) and which the policy sampled; and the embedding put back at sampled ones."""

from __future__ import annotations

import pytest
import torch

from slime.utils.image_tokens import (collapse_image_runs, expand_image_tokens, image_token_counts,
                                      own_embeddings_at, stray_image_tokens, token_runs)

I, S, E = 9, 7, 8  # image token, vision start, vision end


def test_token_runs():
    assert token_runs([1, I, I, 2, I, 3, I, I, I], I) == [(1, 2), (4, 1), (6, 3)]
    assert token_runs([], I) == [] and token_runs([1, 2], I) == []


def test_exact_runs_are_all_images():
    assert stray_image_tokens([1, S, I, I, E, 2, S, I, E], I, [2, 1], S, E) == []


def test_observation_image_after_a_sampled_image_token():
    # prompt image (2 tokens), response: a sampled image token, then an observation with a 3-token image
    ids = [1, S, I, I, E, 5, I, 6, 2, S, I, I, I, E, 4]
    assert stray_image_tokens(ids, I, [2, 3], S, E) == [6]


def test_sampled_marked_run_of_the_wrong_length_is_stray():
    ids = [S, I, E, 5, S, I, I, E, 6, S, I, I, I, E]
    assert stray_image_tokens(ids, I, [1, 3], S, E) == [5, 6]


def test_sampled_tokens_after_the_last_image_are_stray():
    ids = [S, I, I, E, 3, S, I, E, I, I]
    assert stray_image_tokens(ids, I, [2, 1], S, E) == [8, 9]


def test_a_row_without_images_has_every_image_token_stray():
    assert stray_image_tokens([1, I, 2, S, I, E], I, [], S, E) == [1, 4]


def test_an_image_without_its_run_is_an_error():
    with pytest.raises(ValueError, match=r"need runs of \[2, 3\].*images 1\.\. found none"):
        stray_image_tokens([S, I, I, E, 5, S, I, I, E], I, [2, 3], S, E)


def test_image_token_counts():
    assert image_token_counts(torch.tensor([[1, 4, 6], [1, 2, 2]]), 2) == [6, 1]


def test_own_embeddings_put_back_at_stray_positions():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 3)

        def get_input_embeddings(self):
            return self.embed

    model = Model()
    ids = torch.tensor([[1, 0, 2, 0]])
    stray = torch.tensor([[False, True, False, False]])
    with own_embeddings_at(model, stray, I):
        out = model.embed(ids)
    w = model.embed.weight
    assert torch.equal(out[0, 1], w[I]) and torch.equal(out[0, 3], w[0]) and torch.equal(out[0, 2], w[2])
    assert torch.equal(model.embed(ids)[0, 1], w[0])  # the hook is gone afterwards


def test_collapse_cuts_each_images_run_to_one_token():
    ids = [1, S, I, I, E, S, I, E, 5, S, I, I, I, E, 4]  # two adjacent images, then an observation image
    assert collapse_image_runs(ids, I, S, E, 3) == [1, S, I, E, S, I, E, 5, S, I, E, 4]
    assert collapse_image_runs([S, I, I, E], I, S, E, 1) == [S, I, E]
    assert collapse_image_runs([1, 2, 3], I, S, E, 0) == [1, 2, 3]
    assert expand_image_tokens([1, S, I, E, S, I, E, 5, S, I, E, 4], I, [2, 1, 3]) == ids  # and back
    with pytest.raises(ValueError, match="2 image token"):
        expand_image_tokens([S, I, E, S, I, E], I, [2])


def test_collapse_refuses_ids_with_sampled_image_tokens():
    assert collapse_image_runs([1, S, I, I, E, 5, I, 6], I, S, E, 1) is None  # an unmarked run: more runs than images
    assert collapse_image_runs([1, I, I, E, 5], I, S, E, 1) is None  # no start marker
    assert collapse_image_runs([1, S, I, I], I, S, E, 1) is None  # no end marker (the sequence ends in the run)
    assert collapse_image_runs([1, S, I, I, E], I, S, E, 2) is None  # fewer runs than images
