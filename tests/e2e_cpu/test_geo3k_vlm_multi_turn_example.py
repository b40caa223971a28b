"""slime's examples/geo3k_vlm_multi_turn, its Python files and config taken unchanged from the reference mirror at
test time, run by train.py on CPU: the tiny Qwen2.5-VL, real Ray, sglang-router, one `hf` engine and one fsdp rank,
with `--custom-generate-function-path examples.geo3k_vlm_multi_turn.rollout.generate`.

- `test_geo3k_env_grades_tool_calls`: the example's `env_geo3k` (tool-call parsing, `grade_answer_verl`,
  `extract_answer` from our rm_hub) in-process.
- `test_the_examples_own_config_trains`: train.py with the example's config unchanged (`env_geo3k`; a random
  model writes no valid tool call, so its episodes have one turn), one rollout.
- `test_multi_turn_rollouts_with_observation_images_train`: train.py with the example's rollout and an
  environment (tests/e2e_cpu/plugins/geo3k_image_feedback_env.py: slime's Geo3kEnv whose observations each bring a
  new image) for 3 turns: samples hold several turns and several images, the observation images inside the
  response region with loss mask 0; the trainer's log-probs equal the engine's on those rows
  (`train/train_rollout_logprob_abs_diff`), every training step is finite with a gradient, every process is
  reaped.

The example calls `qwen_vl_utils.process_vision_info` for each observation. qwen-vl-utils 0.0.14 imports torchvision
at import time (for videos), and torchvision does not load on a CPU-only torch build without its CPU wheel; when
`qwen_vl_utils` does not import, a stand-in module of that name (images only, read by our
`slime.utils.processing_utils.open_image`) is put on the run's PYTHONPATH, and the test says so in its
output. Skipped when the mirror of slime's repository is not on this machine.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes

MIRROR = os.environ.get("SLIME_REFERENCE_MIRROR", "/work/.mirror/THUDM+slime/repo")
EXAMPLE = "examples/geo3k_vlm_multi_turn"
FILES = ("__init__.py", "base_env.py", "env_geo3k.py", "rollout.py", "geo3k_vlm_multi_turn_config.yaml")
ENV_PLUGIN = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "plugins", "geo3k_image_feedback_env.py")
QWEN_VL_UTILS_STAND_IN = '''
"""Stand-in for qwen_vl_utils where it does not import (tests/e2e_cpu/test_geo3k_vlm_multi_turn_example.py):
the images of a conversation's image parts, read with slime.utils.processing_utils.open_image; no videos."""
from slime.utils.processing_utils import open_image


def process_vision_info(conversations, **_):
    parts = [p for m in conversations if isinstance(m.get("content"), list) for p in m["content"]]
    images = [open_image(p["image"]) for p in parts if isinstance(p, dict) and p.get("type") == "image"]
    return images or None, None
'''


def _qwen_vl_utils_imports() -> bool:
    try:
        importlib.import_module("qwen_vl_utils")
    except Exception:  # noqa: BLE001 -- an ImportError, or torchvision failing to load its operators
        return False
    return True


@pytest.fixture(scope="module")
def slime_examples(tmp_path_factory):
    """A folder holding slime's `examples/__init__.py` and the example's files (from the mirror's HEAD)."""
    if not os.path.isdir(MIRROR):
        pytest.skip(f"slime's repository mirror {MIRROR} is absent (set SLIME_REFERENCE_MIRROR)")
    root = tmp_path_factory.mktemp("slime_examples")
    (root / EXAMPLE).mkdir(parents=True)
    for path in ["examples/__init__.py"] + [f"{EXAMPLE}/{name}" for name in FILES]:
        text = subprocess.run(["git", "-C", MIRROR, "show", f"HEAD:{path}"], capture_output=True, text=True,
                              check=True).stdout
        (root / path).write_text(text)
    if not _qwen_vl_utils_imports():
        (root / "qwen_vl_utils.py").write_text(textwrap.dedent(QWEN_VL_UTILS_STAND_IN))
        print("qwen_vl_utils does not import here: the run uses the images-only stand-in")
    return root


def test_geo3k_env_grades_tool_calls(slime_examples):
    sys.path.insert(0, str(slime_examples))
    try:
        env_geo3k = importlib.import_module("examples.geo3k_vlm_multi_turn.env_geo3k")
        from slime.utils.types import Sample

        class Args:
            max_turns = 3

        env = env_geo3k.build_env(sample=Sample(prompt="p", label="12"), args=Args())
        env.reset()
        obs, done, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "12"}}</tool_call>')
        assert (done, info["score"]) == (False, 1.0) and "matches the reference" in obs["obs_str"]
        obs, done, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "13"}}</tool_call>')
        assert (done, info["score"]) == (False, 0.0)
        obs, done, info = env.step("no tool here")
        assert done and info["tool_executed"] is False
        message = env.format_observation({"obs_str": "see", "multi_modal_data": {"image": ["img"]}})
        parts = [{"type": "image", "image": "img"}, {"type": "text", "text": "see"}]
        assert message == {"role": "user", "content": parts}
        assert env._extract_answer_from_text(r"so \boxed{7}") == "7"
    finally:
        sys.path.remove(str(slime_examples))
        for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
            del sys.modules[name]


def _train(slime_examples, tmp_path, config: str, num_rollout: int) -> tuple[str, str]:
    """train.py with the example's rollout and `config` as --custom-config-path: (the model folder, the tb folder);
    the rollouts are saved to <tmp_path>/rollouts/<id>.pt. Every process it starts is reaped."""
    from tools.make_tiny_model import make_tiny_model
    from tools.make_toy_data import write_toy_data

    model = make_tiny_model(str(tmp_path / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    data = write_toy_data(str(tmp_path / "geo3k.jsonl"), 16, seed=0, task="geo3k")
    tb = tmp_path / "tb"
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(slime_examples), REPO_ROOT]))
    before = run_processes()
    out = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--train-backend", "fsdp", "--rollout-backend", "hf",
         "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
         "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "problem", "--label-key", "answer",
         "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--rm-type", "math",
         "--custom-generate-function-path", "examples.geo3k_vlm_multi_turn.rollout.generate",
         "--custom-config-path", config,
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
         "--rollout-max-response-len", "8", "--rollout-max-context-len", "96", "--num-rollout", str(num_rollout),
         # the reward is 0 for a random model, so GRPO's advantages are too: the entropy term gives a gradient
         "--advantage-estimator", "grpo", "--entropy-coef", "0.01", "--lr", "1e-3", "--micro-batch-size", "4",
         "--save-debug-rollout-data", str(tmp_path / "rollouts" / "{rollout_id}.pt"),
         "--use-tensorboard", "--tensorboard-dir", str(tb)],
        capture_output=True, text=True, env=env, timeout=560, cwd=str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}
    return model, str(tb)


@pytest.mark.timeout(600)
def test_the_examples_own_config_trains(slime_examples, tmp_path):
    """The example's config unchanged (env_geo3k: without a valid tool call an episode has one turn)."""
    _, tb = _train(slime_examples, tmp_path, str(slime_examples / EXAMPLE / "geo3k_vlm_multi_turn_config.yaml"), 1)
    diffs = read_scalars(tb, "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == [0] and diffs[0] < 1e-5, diffs


@pytest.mark.timeout(600)
def test_multi_turn_rollouts_with_observation_images_train(slime_examples, tmp_path):
    config = tmp_path / "multi_turn.yaml"
    config.write_text(f"max_turns: 3\nrollout_interaction_env_path: {ENV_PLUGIN}\n")
    model, tb = _train(slime_examples, tmp_path, str(config), 2)
    dump = tmp_path / "rollouts"

    with open(os.path.join(model, "config.json")) as f:
        ids = json.load(f)
    image_token, vision_start = ids["image_token_id"], ids["vision_start_token_id"]
    observed, images_per_sample = 0, []
    for rollout_id in (0, 1):
        samples = torch.load(dump / f"{rollout_id}.pt", weights_only=False)["samples"]
        assert len(samples) == 8
        for s in samples:
            tokens, mask, length = s["tokens"], s["loss_mask"], s["response_length"]
            response = tokens[len(tokens) - length:]
            assert len(mask) == length and len(s["rollout_log_probs"]) == length
            images = s["multimodal_train_inputs"]["image_grid_thw"].shape[0]
            images_per_sample.append(images)
            # an image in the response region starts after a vision-start token the rollout appended (mask 0)
            starts = [i for i, t in enumerate(response) if t == vision_start and i + 1 < length
                      and response[i + 1] == image_token and mask[i] == 0]
            assert all(mask[i + 1] == 0 for i in starts)
            if starts:
                observed += 1
                assert images == 1 + len(starts), (images, starts)
                assert any(m == 1 for m in mask) and any(m == 0 for m in mask)
    assert observed >= 4, f"only {observed} samples brought observation images into the response"
    print(f"{observed} of 16 samples with observation images; images per sample {sorted(images_per_sample)}")

    diffs = read_scalars(tb, "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == [0, 1] and all(v < 1e-5 for v in diffs.values()), diffs
    norms = read_scalars(tb, "train/grad_norm")
    assert sorted(norms) == [0, 1] and all(math.isfinite(v) and v > 0 for v in norms.values()), norms
    print(f"train_rollout_logprob_abs_diff {diffs}, grad_norm {norms}")
