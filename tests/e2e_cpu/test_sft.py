"""SFT the slime way on CPU: slime's command line of scripts/run-qwen3-4B-base-sft.sh (its SFT and optimizer
flags, CPU sizes) on the tiny random-init model and examples/sft/make_data.py's chat rows.

- fsdp, through examples/sft/run-cpu.sh (train.py with real Ray, no engine: --debug-train-only): the loss falls
  by half or more within 20 steps, the learning rate follows slime's warm-up and cosine schedule, the samples are
  the conversations rendered and masked by --loss-mask-type; a run resumed from a mid-epoch checkpoint gets the
  same conversations and the same losses as the run that went on.
- megatron (through the test-only CPU shim, tests/e2e_cpu/training_modes_worker.py): the same rollouts train to
  the same losses as fsdp.

slime runs this script with train_async.py: with ENTRY=train_async.py the same flags train through it (the next
batch prepared while one trains) to the same losses.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess

import pytest
import torch

from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.ranks import run_ranks
from tests.e2e_cpu.test_train_e2e import _env

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "training_modes_worker.py")
SCRIPT = os.path.join(REPO_ROOT, "examples", "sft", "run-cpu.sh")
ROWS, BATCH, EPOCHS = 64, 8, 3  # 8 rollouts an epoch, 24 in all
LR, MIN_LR = "3e-3", "3e-4"


def sft_flags(data: str) -> list[str]:
    """slime's SFT_ARGS and OPTIMIZER_ARGS (run-qwen3-4B-base-sft.sh) with CPU sizes, and its dynamic batching:
    what examples/sft/run-cpu.sh passes (test_the_example_script_passes_these_flags)."""
    return [
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--prompt-data", data, "--input-key", "messages", "--rollout-shuffle", "--num-epoch", str(EPOCHS),
        "--rollout-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
        "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
        "--debug-train-only",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
        "--optimizer", "adam", "--lr", LR, "--lr-decay-style", "cosine", "--min-lr", MIN_LR,
        "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location("sft_make_data", os.path.join(REPO_ROOT, "examples", "sft",
                                                                                 "make_data.py"))
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    return make_data.write_rows(str(tmp_path_factory.mktemp("sft") / "sft.jsonl"), ROWS, seed=0)


def train(model_dir: str, data: str, out, name: str, *extra: str, entry: str = "train.py") -> str:
    """examples/sft/run-cpu.sh (slime's SFT command line, the flags of `sft_flags`) with `extra` flags."""
    tb = str(out / name / "tb")
    env = dict(_env(), MODEL_DIR=model_dir, DATA=data, ENTRY=entry)
    done = subprocess.run(["bash", SCRIPT, "--tensorboard-dir", tb, *extra], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
    return tb


def dumped(template: str, rollout_id: int) -> list[dict]:
    return torch.load(template.format(rollout_id=rollout_id), weights_only=False)["samples"]


@pytest.mark.timeout(400)
def test_sft_loss_halves_follows_slimes_schedule_and_resumes_mid_epoch(tiny_model_dir, sft_data, tmp_path):
    before = run_processes()
    dump_a, dump_b = str(tmp_path / "a" / "rollout_{rollout_id}.pt"), str(tmp_path / "b" / "rollout_{rollout_id}.pt")
    tb_a = train(tiny_model_dir, sft_data, tmp_path, "a", "--save", str(tmp_path / "ckpt_a"), "--save-interval", "12",
                 "--save-debug-rollout-data", dump_a)
    loss = read_scalars(tb_a, "train/loss")
    assert sorted(loss) == list(range(ROWS // BATCH * EPOCHS))  # --num-epoch 3: 3 × (64 // 8) rollouts
    print("sft loss:", {k: round(v, 3) for k, v in loss.items()})
    assert loss[0] > 4.0 and loss[19] <= loss[0] / 2, loss  # from ~ln(vocabulary) to half of it within 20 steps

    lr = read_scalars(tb_a, "train/lr")  # warm-up over 0.1 × 24 steps from 0, then cosine down to --min-lr
    peak, floor = float(LR), float(MIN_LR)
    assert lr[0] == 0.0 and lr[1] == pytest.approx(peak / 2.4) and max(lr.values()) <= peak
    assert lr[3] == pytest.approx(floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * 0.6 / 21.6)), rel=1e-5)
    assert all(lr[k + 1] < lr[k] for k in range(3, 23)) and lr[23] < 1.1 * floor

    # every sample is its conversation rendered by the chat template, trained on after its first assistant header
    from transformers import AutoTokenizer

    generator = MultiTurnLossMaskGenerator(AutoTokenizer.from_pretrained(tiny_model_dir), "qwen")
    for sample in dumped(dump_a, 5):
        ids, mask = generator.get_loss_mask(sample["prompt"])
        response = len(mask) - mask.index(1)
        assert sample["tokens"] == ids and sample["response_length"] == response
        assert sample["loss_mask"] == mask[-response:] and 0 in sample["loss_mask"]  # the second user turn: 0

    # resume from the checkpoint after rollout 11: epoch 1, 32 of its 64 conversations handed out
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "ckpt_a", ckpt)
    shutil.rmtree(ckpt / "iter_0000023")
    (ckpt / "rollout" / "data_source_state_23.json").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("11")
    tb_b = train(tiny_model_dir, sft_data, tmp_path, "b", "--load", str(ckpt), "--save-debug-rollout-data", dump_b)
    resumed = read_scalars(tb_b, "train/loss")
    assert sorted(resumed) == list(range(12, 24))
    for rollout_id in range(12, 24):
        assert [s["prompt"] for s in dumped(dump_b, rollout_id)] == [s["prompt"] for s in dumped(dump_a, rollout_id)]
        assert resumed[rollout_id] == pytest.approx(loss[rollout_id], rel=1e-4), rollout_id
    assert read_scalars(tb_b, "train/lr")[12] == pytest.approx(lr[12], rel=1e-6)
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.timeout(300)
def test_sft_on_megatron_trains_like_fsdp(tiny_model_dir, sft_data, tmp_path):
    flags = " ".join(sft_flags(sft_data))
    results = {backend: run_ranks(WORKER, 1, str(tmp_path / backend),
                                  ["--model", tiny_model_dir, "--backend", backend, "--mode", "sft", "--flags", flags])
               for backend in ("megatron", "fsdp")}
    losses = {backend: [m["train/loss"] for m in r["metrics"]] for backend, r in results.items()}
    print("megatron:", [round(x, 4) for x in losses["megatron"]])
    print("fsdp:    ", [round(x, 4) for x in losses["fsdp"]])
    assert len(losses["megatron"]) == ROWS // BATCH * EPOCHS
    assert losses["megatron"][19] <= losses["megatron"][0] / 2
    # the same conversations, weights and schedule: the same first losses (the first step runs at the warm-up's
    # lr 0); then within 1%: megatron-core's Adam leaves norms out of the weight decay, torch's AdamW here does not
    assert losses["megatron"][:2] == pytest.approx(losses["fsdp"][:2], rel=1e-5)
    for k, (mg, fs) in enumerate(zip(losses["megatron"], losses["fsdp"])):
        assert mg == pytest.approx(fs, rel=1e-2), k


@pytest.mark.timeout(400)
def test_sft_through_train_async_as_slimes_script_runs_it(tiny_model_dir, sft_data, tmp_path):
    sync = read_scalars(train(tiny_model_dir, sft_data, tmp_path, "sync", "--num-epoch", "1"), "train/loss")
    overlapped = read_scalars(train(tiny_model_dir, sft_data, tmp_path, "async", "--num-epoch", "1",
                                    entry="train_async.py"), "train/loss")
    assert sorted(overlapped) == list(range(ROWS // BATCH))
    # the same conversations in the same order, the same optimizer: the same losses
    assert all(math.isclose(overlapped[k], sync[k], rel_tol=1e-4) for k in sync), (sync, overlapped)


def test_the_example_script_passes_these_flags():
    with open(SCRIPT) as f:
        text = f.read()
    flags = sft_flags("DATA")
    for k, token in enumerate(flags):
        if token.startswith("--") and token != "--prompt-data":
            value = flags[k + 1] if k + 1 < len(flags) and not flags[k + 1].startswith("--") else ""
            assert f"{token} {value}".strip() in text, token
