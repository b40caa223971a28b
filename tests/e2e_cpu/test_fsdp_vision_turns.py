"""The fsdp trainer places a multi-turn rollout's observation images (new images inside the response region, loss
mask 0) and tells them from image tokens the policy sampled: its log-probs equal the hf engine's, which generated
each turn from input_ids holding every image so far plus image_data for all of them. On the tiny Qwen2.5-VL and the
tiny Qwen3-VL (whose deepstack features go to every image's tokens, observation images included). One gloo rank
(tests/e2e_cpu/fsdp_vision_turns_worker.py)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "fsdp_vision_turns_worker.py")
TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def run(request, tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_vision_turns")
    vlm = make_tiny_model(str(root / "vlm"), arch=request.param, size="tiny", seed=0)
    return run_ranks(WORKER, 1, str(root / "w1"), ["--model", vlm], timeout_s=300)


def _diffs(a, b, masks=None, keep=1):
    return [abs(x - y) for i, (ra, rb) in enumerate(zip(a, b)) for j, (x, y) in enumerate(zip(ra, rb))
            if masks is None or masks[i][j] == keep]


@pytest.mark.timeout(400)
def test_trainer_log_probs_equal_the_engines_on_rows_with_observation_images(run):
    assert run["images_per_row"] == [2, 2, 2, 2]
    assert run["image_tokens_in_turn_1"][1] >= 1  # row 1's policy sampled an image token before image B
    assert max(_diffs(run["trainer_lp"], run["rollout_lp"], run["loss_masks"], keep=1)) < TOL
    # every response token, the observation's own tokens (image B's and the text after it) included
    assert max(_diffs(run["trainer_lp"], run["engine_lp"])) < TOL


@pytest.mark.timeout(400)
def test_image_b_reaches_the_tokens_after_it_only(run):
    before_b, after_b = [], []
    for lp, other, mask in zip(run["trainer_lp"], run["trainer_lp_other_b"], run["loss_masks"]):
        first_obs = mask.index(0)
        before_b += [abs(x - y) for x, y in zip(lp[:first_obs], other[:first_obs])]
        after_b += [abs(x - y) for x, y in zip(lp[first_obs:], other[first_obs:])]
    assert max(before_b) < 1e-6 and max(after_b) > 1e-4


@pytest.mark.timeout(400)
def test_a_missing_observation_image_is_an_error(run):
    assert run["missing_b_error"] is not None and "need runs of" in run["missing_b_error"]
    assert "multimodal_train_inputs must hold the images" in run["missing_b_error"]
