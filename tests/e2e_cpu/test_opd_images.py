"""On-policy distillation with images (docs/on_policy_distillation.md): a teacher `hf` engine serving the tiny
Qwen2.5-VL scores samples with images through slime's plugins (slime.rollout.on_policy_distillation), and the
log-probs it returns are a transformers fp32 forward of the teacher on the same sequence and images (< 1e-5); a
short train.py OPD run on the colour task with images finishes with a finite reverse KL every step."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from slime.backends.hf_engine.engine import HFEngine
from slime.rollout import on_policy_distillation as opd_plugin
from slime.utils.async_utils import run_sync
from slime.utils.processing_utils import load_processor
from slime.utils.tracking import read_scalars
from slime.utils.types import Sample
from tests.args import make_args
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.test_train_e2e import _env

TOL = 1e-5
SHIM_SITE = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "plugins", "megatron_shim")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return (make_tiny_model(str(root / "student"), arch="qwen2_5_vl", size="tiny", seed=0),
            make_tiny_model(str(root / "teacher"), arch="qwen2_5_vl", size="tiny", seed=1))


def transformers_log_probs(folder: str, processor, tokens: list[int], images: list, response: int) -> list[float]:
    """log p(tokens[j] | tokens[:j]) of the last `response` tokens, from transformers' fp32 forward with the
    images (its own 3-D positions)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    extra = {}
    if images:
        pixels = processor.image_processor(images=images, return_tensors="pt")
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                 "mm_token_type_ids": (ids == processor.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return log_probs[-response:].tolist()


def image_sample(processor, index: int, images: list, response: list[int]) -> Sample:
    """A sample as the rollout leaves it: the prompt's ids with each image expanded, then a response."""
    content = [{"type": "image", "image": "x"} for _ in images] + [{"type": "text", "text": "which colour ?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = processor(text=text, images=images or None, return_tensors="pt")["input_ids"][0].tolist()
    return Sample(index=index, group_index=index, tokens=prompt + response, response_length=len(response),
                  status=Sample.Status.COMPLETED, multimodal_inputs={"images": images or None, "videos": None})


@pytest.mark.timeout(300)
def test_the_teacher_engine_scores_samples_with_their_images_as_transformers(models):
    student, teacher = models
    processor = load_processor(teacher, trust_remote_code=True)
    red, blue = Image.new("RGB", (28, 56), "red"), Image.new("RGB", (56, 56), "blue")
    vocab = processor.tokenizer.convert_tokens_to_ids
    samples = [image_sample(processor, 0, [red], [vocab("red"), 7, 8, 9]),
               image_sample(processor, 1, [red, blue], [vocab("blue"), 5]),
               image_sample(processor, 2, [], [vocab("green"), 6, 8])]
    before = run_processes()
    engine = HFEngine(make_args(validate=False, hf_checkpoint=teacher, rollout_seed=0, sglang_server_concurrency=4),
                      rank=0)
    try:
        args = make_args("--use-opd", "--opd-type", "sglang", rm_url=engine.init() + "/generate",
                         hf_checkpoint=student)
        payloads = [opd_plugin.teacher_payload(args, s) for s in samples]
        assert [len(p.get("image_data", [])) for p in payloads] == [1, 2, 0]
        # each image's run of image tokens sent as one token (SGLang expands it back; so does the hf engine)
        pad = processor.image_token_id
        assert [p["input_ids"].count(pad) for p in payloads] == [1, 2, 0]
        assert [[t for t in p["input_ids"] if t != pad] for p in payloads] == [
            [t for t in s.tokens if t != pad] for s in samples]
        for s in samples:
            s.reward = run_sync(opd_plugin.reward_func(args, s))
    finally:
        engine.shutdown()
    raw, rewards = opd_plugin.post_process_rewards(args, samples)
    assert raw == rewards == [0.0] * 3
    for s in samples:
        want = transformers_log_probs(teacher, processor, s.tokens, s.multimodal_inputs["images"] or [],
                                      s.response_length)
        diff = max(abs(a - b) for a, b in zip(s.teacher_log_probs, want, strict=True))
        print(f"sample {s.index}: |teacher engine - transformers| max {diff:.2e}")
        assert diff < TOL
    # the image reached the teacher: another image of the same size gives the first sample other log-probs
    green = transformers_log_probs(teacher, processor, samples[0].tokens, [Image.new("RGB", (28, 56), "green")], 4)
    assert max(abs(a - b) for a, b in zip(samples[0].teacher_log_probs, green)) > 1e-3
    assert wait_for_no_new_processes(before) == {}


ROLLOUTS = 3


def opd_train_cmd(student: str, data: str, tb, *opd_flags: str) -> list[str]:
    return [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--actor-num-nodes", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-backend", "hf",
            "--hf-checkpoint", student, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
            "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--rollout-shuffle",
            "--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--rollout-temperature", "1", "--global-batch-size", "16",
            "--use-opd", "--opd-kl-coef", "1.0", *opd_flags, "--advantage-estimator", "grpo", "--lr", "3e-3",
            "--micro-batch-size", "16", "--use-tensorboard", "--tensorboard-dir", str(tb)]  # fmt: skip


def check_kl(tb) -> None:
    kl = read_scalars(str(tb), "train/opd_reverse_kl")
    print("opd_reverse_kl:", kl)
    assert sorted(kl) == list(range(ROLLOUTS)) and all(math.isfinite(v) for v in kl.values()), kl


@pytest.mark.timeout(400)
def test_train_py_distills_with_images_to_a_finite_kl(models, tmp_path):
    """train.py, GRPO with --use-opd --opd-type sglang on the colour task with images: the student's rollouts
    carry images, the teacher engine scores each sample with them (its answers in rollout 0 equal a transformers
    forward of the teacher on those tokens and images), and every step logs a finite reverse KL."""
    from tools.make_toy_data import write_toy_data

    student, teacher = models
    data = write_toy_data(str(tmp_path / "colour.jsonl"), 64, seed=0, task="colour")
    before = run_processes()
    engine = HFEngine(make_args(validate=False, hf_checkpoint=teacher, rollout_seed=0, sglang_server_concurrency=4),
                      rank=0)
    tb, dump = tmp_path / "tb", str(tmp_path / "rollout_{rollout_id}.pt")
    try:
        url = engine.init()
        out = subprocess.run(
            opd_train_cmd(student, data, tb, "--opd-type", "sglang",
                          "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
                          "--custom-reward-post-process-path",
                          "slime.rollout.on_policy_distillation.post_process_rewards",
                          "--rm-url", url + "/generate", "--save-debug-rollout-data", dump),
            capture_output=True, text=True, env=_env(), timeout=360, cwd=str(tmp_path),
        )  # fmt: skip
    finally:
        engine.shutdown()
    assert out.returncode == 0, out.stderr[-4000:]

    check_kl(tb)
    rows = torch.load(dump.format(rollout_id=0), weights_only=False)["samples"]
    processor = load_processor(teacher, trust_remote_code=True)
    worst = 0.0
    for row in rows[:4]:
        images = row["multimodal_inputs"]["images"]
        assert len(images) == 1, "the rollout's samples carry their image"
        # the rollout is dumped before the reward post-process: the reward is still the teacher's answer
        entries = row["reward"]["meta_info"]["input_token_logprobs"]
        assert len(entries) == len(row["tokens"])
        got = [e[0] for e in entries[-row["response_length"]:]]
        want = transformers_log_probs(teacher, processor, row["tokens"], images, row["response_length"])
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want, strict=True)))
    print(f"rollout 0: |teacher log-probs - transformers| max {worst:.2e}")
    assert worst < TOL
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core not installed"))])
@pytest.mark.timeout(400)
def test_the_trainer_held_teacher_scores_with_the_images(models, tmp_path, backend):
    """--opd-type megatron on either trainer (Megatron through the test-only CPU shim): the teacher is a second
    (frozen) tiny Qwen2.5-VL in the trainer, fed the rows' images like the policy; its log-probs in rollout 0's train
    batch equal a transformers forward of the teacher on those tokens and images."""
    from tools.make_toy_data import write_toy_data

    student, teacher = models
    data = write_toy_data(str(tmp_path / "colour.jsonl"), 64, seed=0, task="colour")
    tb = tmp_path / "tb"
    rollout_dump, train_dump = str(tmp_path / "rollout_{rollout_id}.pt"), str(tmp_path / "train_{rollout_id}.pt")
    env, backend_flags = _env(), []
    if backend == "megatron":
        env["PYTHONPATH"] = os.pathsep.join([SHIM_SITE, REPO_ROOT])
        backend_flags = ["--train-backend", "megatron", *model_args("tiny-qwen2.5-vl"), "--micro-batch-size", "8"]
    before = run_processes()
    out = subprocess.run(
        opd_train_cmd(student, data, tb, "--opd-type", "megatron", "--opd-teacher-load", teacher, "--rm-type", "toy",
                      "--save-debug-rollout-data", rollout_dump, "--save-debug-train-data", train_dump,
                      *backend_flags),
        capture_output=True, text=True, env=env, timeout=360, cwd=str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}
    check_kl(tb)
    images_of = {tuple(r["tokens"]): r["multimodal_inputs"]["images"]
                 for r in torch.load(rollout_dump.format(rollout_id=0), weights_only=False)["samples"]}
    rows = torch.load(train_dump.format(rollout_id=0), weights_only=False)["samples"]
    processor = load_processor(teacher, trust_remote_code=True)
    worst = 0.0
    for row in rows[:4]:
        tokens = row["tokens"].tolist()
        want = transformers_log_probs(teacher, processor, tokens, images_of[tuple(tokens)], row["response_lengths"])
        worst = max(worst, max(abs(a - b) for a, b in zip(row["teacher_log_probs"].tolist(), want, strict=True)))
    print(f"{backend}, rollout 0: |trainer teacher log-probs - transformers| max {worst:.2e}")
    assert worst < TOL
