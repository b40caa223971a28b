"""The Megatron vision-language model (language model on megatron-core, HF vision tower) of the tiny Qwen2.5-VL and
the tiny Qwen3-VL (interleaved multimodal RoPE, deepstack features, q/k norm) against transformers' forward of the
same rows, in fp32, on one rank and at TP2 over gloo through the test-only CPU shim
(tests/e2e_cpu/megatron_vlm_worker.py). Every test runs for both (`-k qwen3_vl` runs one).

Rows: one image, two images of different shapes with text between them, text only, and a one-token image; each a
chat prompt from the model's processor plus response tokens. The logits must equal transformers' (1e-5), run row by row and as
one right-padded batch. Two controls show that the comparison sees the images and the 3-D positions: the same
rows without the image features placed, and with 1-D positions, are far from transformers'.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from PIL import Image

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks
from tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_vlm_worker.py")
TOLERANCE = 1e-5


def _row(processor, content: list, response: str) -> dict:
    from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine

    images = [part["image"] for part in content if part["type"] == "image"]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=text, **build_processor_kwargs({"images": images} if images else {}))
    ids = out["input_ids"][0] + processor.tokenizer.encode(response, add_special_tokens=False)
    return {"ids": torch.tensor(ids), "pixel_values": out.get("pixel_values") if images else None,
            "image_grid_thw": out.get("image_grid_thw") if images else None,
            "image_data": [encode_image_for_rollout_engine(image) for image in images]}


# the tiny VLMs: a merged patch (2x2 ViT patches) is 28 pixels square for Qwen2.5-VL, 32 for Qwen3-VL
MERGED_PATCH = {"qwen2_5_vl": 28, "qwen3_vl": 32}
# the names the push sends: Qwen2.5-VL's Hub files spell them model.*, visual.*; Qwen3-VL's model.language_model.*,
# model.visual.*
PUSHED = {"qwen2_5_vl": (("model.layers.", "model.embed_tokens.", "model.norm.", "visual.", "lm_head."), "visual."),
          "qwen3_vl": (("model.language_model.", "model.visual.", "lm_head."), "model.visual.")}


# how many of the logits runs (tp1, tp2) each model makes
COMPARED_LAYOUTS = {"qwen2_5_vl": 2, "qwen3_vl": 1}


@pytest.fixture(scope="module", params=list(MERGED_PATCH))
def vlm_rows(request, tmp_path_factory):
    from slime.utils.processing_utils import load_processor

    arch = request.param
    model_dir = make_tiny_model(str(tmp_path_factory.mktemp("vlm") / f"tiny-{arch}"), arch=arch, size="tiny", seed=0)
    processor = load_processor(model_dir, trust_remote_code=True)
    u = MERGED_PATCH[arch]
    red, blue = Image.new("RGB", (2 * u, 2 * u), (220, 10, 10)), Image.new("RGB", (u, 2 * u), (10, 10, 230))
    green = Image.new("RGB", (u, u), (10, 200, 10))
    rows = [
        _row(processor, [{"type": "image", "image": red}, {"type": "text", "text": "which colour fills the image?"}],
             "red is the answer"),
        _row(processor, [{"type": "image", "image": blue}, {"type": "text", "text": "and this one"},
                         {"type": "image", "image": red}, {"type": "text", "text": "which colour?"}], "blue and red"),
        _row(processor, [{"type": "text", "text": "1+1?"}], "2 is it"),
        _row(processor, [{"type": "image", "image": green}, {"type": "text", "text": "which colour?"}], "green"),
    ]
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # grids (1,4,4); (1,4,2) + (1,4,4); none; (1,2,2), in tokens after the 2x2 merge
    assert [int((r["ids"] == image_token).sum()) for r in rows] == [4, 6, 0, 1]
    return model_dir, rows, image_token, arch


def hf_logits(model_dir: str, rows: list[dict], image_token: int) -> list[torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = r["ids"].unsqueeze(0)
            images = {}
            if r["pixel_values"] is not None:
                images = {"pixel_values": r["pixel_values"], "image_grid_thw": r["image_grid_thw"],
                          "mm_token_type_ids": (ids == image_token).int()}
            out.append(model(input_ids=ids, **images).logits[0].float())
    return out


@pytest.fixture(scope="module")
def compared(vlm_rows, tmp_path_factory):
    model_dir, rows, image_token, arch = vlm_rows
    reference = hf_logits(model_dir, rows, image_token)
    runs = {}
    # Qwen3-VL at TP2: against transformers through the actor's right-padded TP2 run below (bshd_tp2)
    for name, world, extra in [("tp1", 1, []), ("tp2", 2, ["--tp", "2"])][:COMPARED_LAYOUTS[arch]]:
        out = tmp_path_factory.mktemp(name)
        torch.save(rows, out / "rows.pt")
        run_ranks(WORKER, world, str(out), ["--model", model_dir, *extra], timeout_s=300)
        runs[name] = torch.load(out / "logits.pt")
    return reference, runs, rows, image_token


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


@pytest.mark.parametrize("kind", ["full", "batched"])
def test_logits_equal_transformers(compared, kind):
    reference, runs, _, _ = compared
    for layout in runs:
        diffs = [max_diff(ours, hf) for ours, hf in zip(runs[layout][kind], reference)]
        assert max(diffs) <= TOLERANCE, (layout, diffs)


def test_the_comparison_sees_the_image_features_and_the_3d_positions(compared):
    """Without the features placed, or with 1-D positions, the image rows' logits after the first image token are
    far from transformers' (so the parity above depends on both); the text row has no images and agrees."""
    reference, runs, rows, image_token = compared
    for layout, i in ((layout, i) for layout in runs for i in range(len(rows))):
        row = rows[i]
        image_at = torch.nonzero(row["ids"] == image_token).flatten()
        if not len(image_at):
            assert max_diff(runs[layout]["no_features"][i], reference[i]) <= TOLERANCE
            assert max_diff(runs[layout]["rope_1d"][i], reference[i]) <= TOLERANCE
            continue
        after = slice(int(image_at[0]), None)
        assert max_diff(runs[layout]["no_features"][i][after], reference[i][after]) > 1e-3
        # 1-D RoPE gives the same positions up to the first image token's, and to all tokens when every image is
        # one token (a 1x1 merged grid); after an image of several tokens they differ
        if bool((row["image_grid_thw"].prod(-1) > 4).any()):
            last = int(image_at[-1]) + 1
            assert max_diff(runs[layout]["rope_1d"][i][last:], reference[i][last:]) > 1e-3
        else:
            assert max_diff(runs[layout]["rope_1d"][i], reference[i]) <= TOLERANCE


def test_a_text_only_forward_gives_every_tower_parameter_a_zero_gradient(compared):
    """A micro-batch without images runs no tower but counts its parameters zero times, so each gets a gradient
    (zeros) as in a micro-batch with images (megatron-core's DDP with --overlap-grad-reduce waits for all)."""
    _, runs, _, _ = compared
    for layout in runs:
        grads = runs[layout]["text_row_tower_grads"]
        assert grads["with_grad"] == grads["parameters"] > 0 and grads["largest"] == 0.0, (layout, grads)


def test_qwen3_vl_parity_needs_the_deepstack_features(vlm_rows, compared):
    """Qwen3-VL: with every deepstack feature zero the image rows' logits from the first image token on are far from
    transformers' (so the parity above depends on the features added to the first layers); the text row agrees."""
    if vlm_rows[3] != "qwen3_vl":
        pytest.skip("Qwen2.5-VL has no deepstack features")
    reference, runs, rows, image_token = compared
    for i, row in enumerate(rows):
        image_at = torch.nonzero(row["ids"] == image_token).flatten()
        if not len(image_at):
            assert max_diff(runs["tp1"]["no_deepstack"][i], reference[i]) <= TOLERANCE
            continue
        before, after = slice(0, int(image_at[0])), slice(int(image_at[0]), None)
        assert max_diff(runs["tp1"]["no_deepstack"][i][before], reference[i][before]) <= TOLERANCE
        assert max_diff(runs["tp1"]["no_deepstack"][i][after], reference[i][after]) > 1e-3


RESPONSE = 3  # the last tokens of each row are its response in the actor's TrainBatch


def hf_response_log_probs(logits: torch.Tensor, ids: torch.Tensor, response: int) -> list[float]:
    start = len(ids) - response
    lp = torch.log_softmax(logits[start - 1: len(ids) - 1].double(), dim=-1)
    return lp.gather(1, ids[start:].unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def actor_runs(vlm_rows, compared, tmp_path_factory):
    model_dir, rows, _, _ = vlm_rows
    runs = {}
    # packed micro-batches (the default --qkv-format thd) on one rank; right-padded ones at TP2; packed at TP2 with
    # sequence parallelism (each rank places the image features of its part of the sequence); packed at PP2 (the
    # tower on the first stage, the 3-D positions on both)
    # thd and frozen_tower also push the trained weights into an `hf` engine (by broadcast over gloo)
    for name, world, extra in [("thd", 1, ["--engine"]),
                               ("bshd_tp2", 2, ["--tp", "2", "--extra=--qkv-format bshd"]),
                               ("thd_tp2_sp", 2, ["--tp", "2", "--extra=--sequence-parallel"]),
                               ("thd_pp2", 2, ["--extra=--pipeline-model-parallel-size 2"]),
                               ("frozen_tower", 1, ["--engine", "--extra=--freeze-params-name-list ^visual\\."])]:
        out = tmp_path_factory.mktemp(f"actor_{name}")
        torch.save(rows, out / "rows.pt")
        runs[name] = run_ranks(WORKER, world, str(out), ["--model", model_dir, "--actor",
                                                        "--response-tokens", str(RESPONSE), *extra], timeout_s=300)
    return runs


@pytest.mark.parametrize("layout", ["thd", "bshd_tp2", "thd_tp2_sp", "thd_pp2"])
def test_actor_log_probs_of_a_batch_with_images_equal_transformers(compared, vlm_rows, actor_runs, layout):
    reference, _, rows, _ = compared
    want = [hf_response_log_probs(logits, row["ids"], RESPONSE) for logits, row in zip(reference, rows)]
    got = actor_runs[layout]["log_probs"]
    diffs = [max(abs(a - b) for a, b in zip(g, w)) for g, w in zip(got, want)]
    assert max(diffs) <= TOLERANCE, diffs


@pytest.mark.parametrize("layout", ["thd", "bshd_tp2", "thd_tp2_sp", "thd_pp2"])
def test_actor_trains_the_vision_tower_and_the_language_model(actor_runs, layout):
    run = actor_runs[layout]
    assert all(v == v and abs(v) != float("inf") for v in run["metrics"].values()), run["metrics"]
    assert run["vision_change"] > 0 and run["language_change"] > 0, run


def test_freeze_params_name_list_freezes_the_vision_tower(actor_runs):
    run = actor_runs["frozen_tower"]
    assert run["vision_change"] == 0.0 and run["language_change"] > 0, run


@pytest.mark.parametrize("layout", ["bshd_tp2", "thd_tp2_sp", "thd_pp2"])
def test_a_training_step_is_the_same_at_tp2_and_pp2(actor_runs, layout):
    """The vision tower is replicated on the TP ranks (its gradients must count once in the norm; with sequence
    parallelism each rank's is its part's, summed over the ranks) and lives on the first pipeline stage only: the
    step's loss and grad norm are those of one rank."""
    one, two = actor_runs["thd"]["metrics"], actor_runs[layout]["metrics"]
    for name in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
    # the tower's share of the grad norm is small: its gradient itself (sequence parallelism: rank 0 places only
    # the image tokens of its half, so without the sum over the ranks it had about 70% of it)
    assert actor_runs[layout]["vision_grad"] == pytest.approx(actor_runs["thd"]["vision_grad"], rel=1e-5)
    assert actor_runs[layout]["sequence_parallel"] == (layout == "thd_tp2_sp")


@pytest.mark.parametrize("layout", ["thd", "frozen_tower"])
def test_weight_push_reaches_the_hf_engine_by_checkpoint_names(vlm_rows, actor_runs, layout):
    """The push sends the Hub's spelling (Qwen2.5-VL: `model.layers.*`, `visual.*`, `lm_head.*`, which the engine
    renames as transformers does on load; Qwen3-VL: `model.language_model.*`, `model.visual.*`, `lm_head.*`); after it the engine's log-probs of the rows (images sent as image_data) equal the
    trainer's. Before the push they do not (the step moved the weights), so the parity needs the pushed weights.
    The run's first push sends the vision tower whether it trains or not (the engines start in line with the
    trainer); a frozen one is left out of the second (slime/weight_sync/frozen.py), and the log-probs still agree."""
    run = actor_runs[layout]
    names, tower_prefix = PUSHED[vlm_rows[3]]
    assert run["engine_weight_version"] == "1"
    assert run["pushed_visual"] > 0 and run["pushed_language"] > 0, run
    assert all(n.startswith(names) for n in run["pushed_names"]), run["pushed_names"]
    after = [max(abs(a - b) for a, b in zip(e, t)) for e, t in zip(run["engine_lp_after_push"], run["lp_after"])]
    before = [max(abs(a - b) for a, b in zip(e, t)) for e, t in zip(run["engine_lp_before_push"], run["lp_after"])]
    assert max(after) <= TOLERANCE, after
    assert max(before) > 1e-3, before
    # thd trains the tower (the step moved it, so the image rows' parity needs the pushed tower); frozen_tower not
    assert (run["vision_change"] > 0) == (layout == "thd"), run["vision_change"]
    first, second = run["pushes"]
    assert sorted(first["names"]) == sorted(run["pushed_names"])
    tower = {n for n in first["names"] if n.startswith(tower_prefix)}
    kept = set(first["names"]) - tower if layout == "frozen_tower" else set(first["names"])
    assert tower and sorted(second["names"]) == sorted(kept)
    assert (second["bytes"] < first["bytes"]) == (layout == "frozen_tower"), (first["bytes"], second["bytes"])
    after2 = [max(abs(a - b) for a, b in zip(e, t)) for e, t in zip(run["engine_lp_after_push2"], run["lp_after2"])]
    assert max(after2) <= TOLERANCE, after2



def test_hf_export_loads_in_transformers_with_the_trained_weights(vlm_rows, actor_runs):
    """The HF folder the trainer writes (--save-hf's writer) after the step loads into transformers' model class with
    no missing or unexpected keys, and its response log-probs of the rows equal the trainer's."""
    from transformers import AutoModelForImageTextToText

    _, rows, image_token, _ = vlm_rows
    run = actor_runs["thd"]
    _, info = AutoModelForImageTextToText.from_pretrained(run["hf_saved"], dtype=torch.float32,
                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = [hf_response_log_probs(logits, row["ids"], RESPONSE)
             for logits, row in zip(hf_logits(run["hf_saved"], rows, image_token), rows)]
    diffs = [max(abs(a - b) for a, b in zip(s, t)) for s, t in zip(saved, run["lp_after"])]
    assert max(diffs) <= TOLERANCE, diffs
