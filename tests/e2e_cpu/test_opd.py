"""On-policy distillation the slime way on CPU: a random-init tiny student (tools/make_tiny_model.py, seed 0) is
pulled toward a different, sharper tiny teacher (examples/on_policy_distillation/make_teacher.py) by training on
its own samples with the teacher's log-probs in the advantages.

- `--opd-type sglang` (examples/on_policy_distillation/run-cpu.sh): slime's plugins
  (slime.rollout.on_policy_distillation) ask a teacher server, a second `hf` engine process serving the teacher,
  at --rm-url; train.py with Ray, sglang-router, the student's hf engine and fsdp. The student-teacher KL
  (train/opd_reverse_kl, per step) falls; the teacher log-probs the trainer got are the teacher's (a transformers
  forward of the teacher on the same tokens) and the advantages are exactly −(student − teacher log-probs) (no
  task reward).
- `--opd-type megatron` on the fsdp backend (the same script with OPD_TYPE=megatron: the trainer holds the
  teacher, from --opd-teacher-load): the same.
- `--opd-type megatron` on the megatron backend (test-only CPU shim, tests/e2e_cpu/training_modes_worker.py): the
  teacher pass and the reverse KL agree with fsdp's and with transformers on a fixed batch.
- `--opd-type sglang` on both backends, the same way: the batch carries the teacher's log-probs and no task reward;
  the first step's KL is the transformers one, the KL falls at every step, and the two backends agree.
- slime's plugins against a teacher `hf` engine process on samples holding the vocabulary's last id, which the
  engine reports as 0 as SGLang does (the failure first seen with a real SGLang teacher on the H200).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from slime.backends.hf_engine.engine import HFEngine
from slime.rollout import on_policy_distillation as opd_plugin
from slime.utils.async_utils import run_sync
from slime.utils.tracking import read_scalars
from slime.utils.types import Sample
from tests.args import make_args
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.ranks import run_ranks
from tests.e2e_cpu.test_megatron_actor import hf_log_probs
from tests.e2e_cpu.test_train_e2e import _env

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "training_modes_worker.py")
SCRIPT = os.path.join(REPO_ROOT, "examples", "on_policy_distillation", "run-cpu.sh")
ROLLOUTS = 24


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location(
        "opd_make_teacher", os.path.join(REPO_ROOT, "examples", "on_policy_distillation", "make_teacher.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_teacher(str(tmp_path_factory.mktemp("models") / "teacher"))


def run(tmp_path, name: str, **env: str) -> tuple[str, str]:
    """examples/on_policy_distillation/run-cpu.sh (GRPO with OPD as slime's OPD scripts, CPU sizes: one rollout =
    one optimizer step) with `env` (the models, the data, OPD_TYPE), a TensorBoard folder and the train dumps."""
    tb, dump = str(tmp_path / name / "tb"), str(tmp_path / name / "train_{rollout_id}_{rank}.pt")
    env = dict(_env(), NUM_ROLLOUT=str(ROLLOUTS), TEACHER_LOG=str(tmp_path / f"{name}_teacher.log"), **env)
    done = subprocess.run(["bash", SCRIPT, "--tensorboard-dir", tb, "--save-debug-train-data", dump],
                          capture_output=True, text=True, env=env, timeout=400, cwd=str(tmp_path))
    assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
    return tb, dump


def check_kl_falls(tb: str) -> None:
    kl = read_scalars(tb, "train/opd_reverse_kl")
    print("opd_reverse_kl:", {k: round(v, 3) for k, v in kl.items()})
    assert sorted(kl) == list(range(ROLLOUTS))
    first, last = sum(kl[k] for k in range(4)) / 4, sum(kl[k] for k in range(ROLLOUTS - 4, ROLLOUTS)) / 4
    assert first > 3.0 and last < 0.6 * first, kl  # seen: from ~5.8 to ~2.0 (the engine's sampling varies)


def check_first_rollout(dump: str, teacher: str, task_advantage: float | None) -> None:
    """The trainer's teacher log-probs of rollout 0 are the teacher model's on those tokens; with no task reward
    (`task_advantage` 0) the advantages are −(student − teacher)."""
    rows = torch.load(dump.format(rollout_id=0, rank=0), weights_only=False)["samples"]
    batch = {"tokens": [r["tokens"].tolist() for r in rows], "response_lengths": [r["response_lengths"] for r in rows]}
    expected = hf_log_probs(teacher, batch)
    for row, want in zip(rows, expected):
        assert row["teacher_log_probs"].tolist() == pytest.approx(want, abs=1e-4)
        if task_advantage is not None:
            reverse_kl = row["log_probs"] - row["teacher_log_probs"]
            assert row["advantages"].tolist() == pytest.approx((task_advantage - reverse_kl).tolist(), abs=1e-6)


@pytest.mark.timeout(500)
def test_sglang_type_teacher_server_pulls_the_student_toward_the_teacher(tiny_model_dir, teacher_dir, toy_data_path,
                                                                          tmp_path):
    before = run_processes()  # the script starts the teacher server and stops it on exit
    tb, dump = run(tmp_path, "sglang", OPD_TYPE="sglang", MODEL_DIR=tiny_model_dir, TEACHER_DIR=teacher_dir,
                   DATA=toy_data_path)
    check_kl_falls(tb)
    assert set(read_scalars(tb, "rollout/raw_reward").values()) == {0.0}  # pure distillation: no task reward
    check_first_rollout(dump, teacher_dir, task_advantage=0.0)
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.timeout(500)
def test_megatron_type_on_fsdp_the_trainer_holds_the_teacher(tiny_model_dir, teacher_dir, toy_data_path, tmp_path):
    before = run_processes()
    tb, dump = run(tmp_path, "megatron_type", OPD_TYPE="megatron", MODEL_DIR=tiny_model_dir, TEACHER_DIR=teacher_dir,
                   DATA=toy_data_path)
    check_kl_falls(tb)
    check_first_rollout(dump, teacher_dir, task_advantage=None)  # GRPO on the toy reward adds its own advantages
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.timeout(300)
def test_plugins_take_the_teachers_log_probs_of_the_last_vocabulary_id(teacher_dir):
    """A random-init student samples any id of its padded vocabulary, the last one (vocab_size - 1) included.
    SGLang 0.5.16 reports that id as 0 in `input_token_logprobs` (with the sent token's log-prob), and so does the
    teacher hf engine; slime's plugins take the log-probs of the response tokens all the same, and they are the
    teacher model's on the sent tokens."""
    with open(os.path.join(teacher_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    last = vocab - 1
    samples = [Sample(index=i, group_index=i, tokens=tokens, response_length=response, status=Sample.Status.COMPLETED)
               for i, (tokens, response) in enumerate([
                   ([20, 21, 22, 5, last, 7, last, 0, vocab - 2], 6),
                   ([last, 20, 21, 22, 5, 6, 7], 3),
                   ([20, 21, 22, 5, 6, 7, 8], 4),
               ])]  # fmt: skip
    before = run_processes()
    teacher = HFEngine(make_args(validate=False, hf_checkpoint=teacher_dir, rollout_seed=0,
                                 sglang_server_concurrency=4), rank=0)
    try:
        args = make_args("--use-opd", "--opd-type", "sglang", rm_url=teacher.init() + "/generate")
        for sample in samples:
            sample.reward = run_sync(opd_plugin.reward_func(args, sample))
    finally:
        teacher.shutdown()
    reported = [[entry[1] for entry in s.reward["meta_info"]["input_token_logprobs"]] for s in samples]
    assert reported == [[0 if t == last else t for t in s.tokens] for s in samples]  # SGLang's answer
    raw, rewards = opd_plugin.post_process_rewards(args, samples)
    assert raw == rewards == [0.0] * len(samples)
    expected = hf_log_probs(teacher_dir, {"tokens": [s.tokens for s in samples],
                                          "response_lengths": [s.response_length for s in samples]})
    for sample, want in zip(samples, expected):
        assert sample.teacher_log_probs == pytest.approx(want, abs=1e-4)
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.timeout(300)
def test_megatron_backend_teacher_pass_agrees_with_fsdp_and_transformers(tiny_model_dir, teacher_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    flags = (f"--prompt-data {data} --rollout-batch-size 4 --n-samples-per-prompt 2 --global-batch-size 8 "
             f"--micro-batch-size 4 --num-rollout 2 --debug-train-only --lr 1e-3 --use-opd --opd-type megatron "
             f"--opd-teacher-load {teacher_dir} --opd-kl-coef 1.0")
    results = {backend: run_ranks(WORKER, 1, str(tmp_path / backend),
                                  ["--model", tiny_model_dir, "--backend", backend, "--mode", "opd", "--flags", flags])
               for backend in ("megatron", "fsdp")}
    batch = results["fsdp"]["batch"]
    student, teacher = hf_log_probs(tiny_model_dir, batch), hf_log_probs(teacher_dir, batch)
    # train/opd_reverse_kl of the first rollout: the mean over samples of each one's mean over its loss-masked
    # tokens of student − teacher log-probs (the student not yet trained)
    per_sample = []
    for s, t, mask in zip(student, teacher, batch["loss_masks"]):
        kept = [a - b for a, b, m in zip(s, t, mask) if m]
        per_sample.append(sum(kept) / len(kept))
    expected = sum(per_sample) / len(per_sample)
    assert expected > 3.0
    for backend, result in results.items():
        got = [m["train/opd_reverse_kl"] for m in result["metrics"]]
        print(backend, got)
        assert got[0] == pytest.approx(expected, rel=1e-4), backend
        assert got[1] < got[0]  # one step moved the student toward the teacher on these tokens


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.timeout(400)
def test_megatron_backend_trains_on_the_batch_teacher_log_probs_as_fsdp(tiny_model_dir, teacher_dir, tmp_path):
    """--opd-type sglang on both backends: the teacher's log-probs come with the batch (what slime's plugins take
    from a teacher server) and there is no task reward, so the reverse KL in the advantages is the only signal. The
    first step's KL is the student-teacher one on the batch, the same on both backends, and it falls on both."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    flags = (f"--prompt-data {data} --rollout-batch-size 4 --n-samples-per-prompt 2 --global-batch-size 8 "
             f"--micro-batch-size 4 --num-rollout 4 --debug-train-only --lr 1e-3 --use-opd --opd-type sglang "
             f"--opd-kl-coef 1.0")
    results = {backend: run_ranks(WORKER, 1, str(tmp_path / backend),
                                  ["--model", tiny_model_dir, "--backend", backend, "--mode", "opd-batch-teacher",
                                   "--teacher", teacher_dir, "--flags", flags])
               for backend in ("megatron", "fsdp")}
    batch = results["fsdp"]["batch"]
    assert batch["rewards"] == [0.0] * len(batch["tokens"])
    student, teacher = hf_log_probs(tiny_model_dir, batch), hf_log_probs(teacher_dir, batch)
    per_sample = []
    for s, t, mask in zip(student, teacher, batch["loss_masks"]):
        kept = [a - b for a, b, m in zip(s, t, mask) if m]
        per_sample.append(sum(kept) / len(kept))
    expected = sum(per_sample) / len(per_sample)
    assert expected > 3.0
    kls = {backend: [m["train/opd_reverse_kl"] for m in result["metrics"]] for backend, result in results.items()}
    print(kls, {backend: [m["train/grad_norm"] for m in result["metrics"]] for backend, result in results.items()})
    for backend, got in kls.items():
        assert got[0] == pytest.approx(expected, rel=1e-4), backend
        assert all(b < a for a, b in zip(got, got[1:])), (backend, got)  # every step moves toward the teacher
    first = {backend: result["metrics"][0] for backend, result in results.items()}
    for key in ("train/pg_loss", "train/grad_norm", "train/opd_reverse_kl"):
        assert first["megatron"][key] == pytest.approx(first["fsdp"][key], rel=1e-3), key
    assert kls["megatron"] == pytest.approx(kls["fsdp"], rel=1e-3)
