"""LoRA on the Megatron trainer (docs/lora.md) on real gloo ranks through the test-only CPU shim, in fp32.

A nonzero adapter written by the fsdp side's PEFT writer (random B; q/k/v and gate/up sharing their A, as Megatron's
fused layers need) is loaded with --lora-adapter-path at TP1 and TP2: the log-probs equal the fsdp LoRA model's,
and TP2's loss, gradient norm and trained log-probs equal TP1's. A train step changes the adapter and nothing else.
The adapter pushed to an `hf` engine (from TP1, TP2, PP2) reproduces the trainer's log-probs; the saved PEFT folder loads into the fsdp
trainer's LoRA model and the --save-hf folder (adapter merged) into transformers, both giving the trainer's
log-probs; a resume from the torch_dist checkpoint, at TP1 and at TP2, gives the next step's metrics of the run that
went on.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.fsdp_utils.data import forward_response_log_probs
from slime.backends.training.batching import make_micro_batch, unpad_per_token
from slime.utils import lora_adapter
from slime.utils.tracking import read_scalars
from tests.args import make_args
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.ranks import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_lora_worker.py")
RANK, ALPHA = 4, 8  # as the worker's flags
# train/kl_loss at TP2 vs TP1 (k1: the token mean of log-prob - reference log-prob), absolute: the two runs sum in
# another order (vocab-parallel log-softmax, row-parallel linears), so each fp32 log-prob may differ by a few ulp of
# its own magnitude, not of the KL's. |log-prob| <= ~5.9 on the tiny model (vocab 192), an ulp there is 2^-21 = 4.8e-7,
# and TP1/TP2 log-probs were measured up to 2 ulp apart (9.5e-7); one policy and one reference term of 2 ulp each
# bound the mean to 4 ulp = 1.9e-6. The former rel=1e-5 of a KL of ~0.011 (1.1e-7) was under a quarter ulp of one
# log-prob and failed on a 1.23e-7 gap. A TP bug (a missing or doubled reduction) moves log-probs by far more than
# that; the log-prob checks below catch it too.
KL_ABS_TOL = 2e-6


def abs_tol(key: str) -> float:
    """The absolute tolerance of metric `key` between two layouts (KL_ABS_TOL for kl_loss, else 1e-7)."""
    return KL_ABS_TOL if key == "train/kl_loss" else 1e-7


def max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def log_probs(model, batch: dict) -> list[list[float]]:
    mb = make_micro_batch(batch["tokens"], batch["response_lengths"])
    with torch.no_grad():
        lp, _ = forward_response_log_probs(model, mb, 1.0)
    return unpad_per_token(lp, batch["response_lengths"])


def fsdp_lora_model(model_dir: str, adapter_dir: str | None = None):
    """The fsdp trainer's LoRA model of the tiny model (all-linear), with the PEFT folder's adapter when given."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = lora.apply_lora(model, RANK, ALPHA, "all-linear")
    if adapter_dir:
        lora.load_adapter_folder(model, adapter_dir)
    return model, names


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """(folder, fsdp LoRA model): a nonzero adapter written by the fsdp side's writer. Seeded (the A matrices are
    LoRA's random init): otherwise it would depend on what the test process drew before, and the layouts' gaps
    checked below with it (4.8e-7 here; one order of the suite's files drew an adapter giving 1.6e-5)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, names = fsdp_lora_model(tiny_model_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in names:
            b = model.get_submodule(name).lora_B.weight
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
        for layer in model.model.layers:  # one A per fused Megatron layer
            attn, mlp = layer.self_attn, layer.mlp
            attn.k_proj.lora_A.weight.copy_(attn.q_proj.lora_A.weight)
            attn.v_proj.lora_A.weight.copy_(attn.q_proj.lora_A.weight)
            mlp.up_proj.lora_A.weight.copy_(mlp.gate_proj.lora_A.weight)
    folder = str(tmp_path_factory.mktemp("adapter"))
    args = make_args("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--target-modules", "all-linear",
                     hf_checkpoint=tiny_model_dir)
    lora_adapter.write_adapter_folder(model.state_dict(), lora_adapter.adapter_config(args, names), folder)
    return folder, model


@pytest.fixture(scope="module")
def runs(tiny_model_dir, adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora")
    model = ["--model", tiny_model_dir]

    def run(name, world, *flags):
        return run_ranks(WORKER, world, str(root / name), [*model, *flags], timeout_s=300)

    out = {"tp1": run("tp1", 1, "--adapter", adapter[0], "--engine"),
           "tp2": run("tp2", 2, "--tp", "2", "--adapter", adapter[0], "--engine"),
           "pp2": run("pp2", 2, "--pp", "2", "--adapter", adapter[0], "--engine"),
           "dp2": run("dp2", 2, "--adapter", adapter[0], "--extra=--use-distributed-optimizer")}
    ckpt = str(root / "tp1" / "ckpt")
    out["resume"] = run("resume", 1, "--load", ckpt)
    out["resume_tp2"] = run("resume_tp2", 2, "--tp", "2", "--load", ckpt)
    out["root"], out["model"] = root, tiny_model_dir
    return out


@pytest.mark.timeout(900)
def test_loaded_adapter_log_probs_equal_fsdp_lora_and_tp1_equals_tp2(runs, adapter, tiny_model_dir):
    tp1, tp2 = runs["tp1"], runs["tp2"]
    fsdp_lp = log_probs(adapter[1], tp1["batch"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert max_abs_diff(fsdp_lp, log_probs(base, tp1["batch"])) > 1e-2  # the adapter matters
    assert max_abs_diff(tp1["lp_before"], fsdp_lp) < 1e-5
    assert max_abs_diff(tp2["lp_before"], tp1["lp_before"]) < 1e-5
    for key in ("train/kl_loss", "train/entropy_loss", "train/grad_norm"):
        assert tp2["metrics"][key] == pytest.approx(tp1["metrics"][key], rel=1e-5, abs=abs_tol(key)), key
    base_lp = log_probs(base, tp1["batch"])
    for name in ("tp1", "tp2", "pp2"):  # the reference pass (adapters off) is the base model; adapters back on after
        assert max_abs_diff(runs[name]["lp_base"], base_lp) < 1e-5, name
        assert runs[name]["lp_adapters_back"] == runs[name]["lp_before"], name
    for name in ("pp2", "dp2"):  # pipeline stages; data parallel with the distributed optimizer
        other = runs[name]
        assert max_abs_diff(other["lp_before"], tp1["lp_before"]) < 1e-5, name
        assert other["metrics"]["train/grad_norm"] == pytest.approx(tp1["metrics"]["train/grad_norm"], rel=1e-5), name
        assert max_abs_diff(other["lp_after"], tp1["lp_after"]) < 1e-5, name
    assert abs(tp1["metrics"]["train/kl_loss"]) > 1e-4  # against the base model: the reference has no adapter
    moved = max_abs_diff(tp1["lp_after"], tp1["lp_before"])
    assert moved > 1e-3  # the step moved the policy
    # The same step under TP 2. Adam's first step is g / (|g| + eps) per element, so a gradient element within float
    # noise of eps may step by up to lr in one layout and not the other: the gap after the step (5.1e-5 of this
    # step's 0.64; with --optimizer sgd, whose step is linear in the gradient, 9.5e-7 of a 0.09 step) is bounded
    # relative to how far the step moved. An update lost or doubled on one tensor-parallel shard moves the
    # log-probs by a good part of the step itself.
    assert max_abs_diff(tp2["lp_after"], tp1["lp_after"]) < 1e-3 * moved


@pytest.mark.timeout(900)
def test_a_train_step_changes_only_the_adapter(runs):
    for name, replicas in (("tp1", 1), ("tp2", 2), ("pp2", 1), ("dp2", 2)):  # rank:name, over all ranks
        r = runs[name]
        assert len(r["adapter_names"]) == 4 * 4 * 2 * replicas  # 4 layers x (qkv, proj, fc1, fc2) x (A, B)
        assert r["changed"] == r["adapter_names"], name


@pytest.mark.timeout(900)
def test_pushed_adapter_serves_the_trainers_log_probs(runs):
    for name in ("tp1", "tp2", "pp2"):  # TP shards gathered; each pipeline stage's layers broadcast to rank 0
        r = runs[name]
        assert max_abs_diff(r["lp_engine"], r["lp_trainer"]) < 1e-5, name
        info = r["engine_adapter"]
        assert (info["r"], info["lora_alpha"], info["modules"]) == (RANK, ALPHA, 4 * 7), name


@pytest.mark.timeout(900)
def test_saved_adapter_and_merged_export_give_the_trainers_log_probs(runs, adapter, tiny_model_dir):
    tp1, root = runs["tp1"], runs["root"]
    saved = os.path.join(root, "tp1", "ckpt", "iter_0000000", lora_adapter.ADAPTER_DIR)
    assert set(load_file(os.path.join(saved, "adapter_model.safetensors"))) == \
        set(load_file(os.path.join(adapter[0], "adapter_model.safetensors")))
    with open(os.path.join(saved, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    model, _ = fsdp_lora_model(tiny_model_dir, saved)
    assert max_abs_diff(log_probs(model, tp1["batch"]), tp1["lp_after"]) < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(root, "tp1", "hf", "iter_0"), dtype=torch.float32)
    assert max_abs_diff(log_probs(merged.eval(), tp1["batch"]), tp1["lp_after"]) < 1e-5
    assert os.path.isfile(os.path.join(root, "tp1", "hf", "iter_0", lora_adapter.ADAPTER_DIR, "adapter_model.safetensors"))


@pytest.mark.timeout(900)
def test_resume_gives_the_next_steps_metrics(runs):
    went_on = runs["tp1"]["next_metrics"]
    for name in ("resume", "resume_tp2"):
        r = runs[name]
        assert r["start"] == 1, name
        for key in ("train/kl_loss", "train/entropy_loss", "train/grad_norm", "train/loss"):
            assert r["next_metrics"][key] == pytest.approx(went_on[key], rel=1e-5, abs=abs_tol(key)), (name, key)


def test_fsdp_adapter_with_separate_q_k_v_a_is_refused(adapter, tmp_path):
    """An adapter whose q/k/v A differ (the fsdp trainer's own) is not one fused Megatron adapter."""
    model = copy.deepcopy(adapter[1])
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.lora_A.weight.add_(0.1)
    folder = str(tmp_path / "separate")
    with open(os.path.join(adapter[0], "adapter_config.json")) as f:
        config = json.load(f)
    lora_adapter.write_adapter_folder(model.state_dict(), config, folder)
    with pytest.raises(pytest.fail.Exception, match="have different lora_A"):
        run_ranks(WORKER, 1, str(tmp_path / "run"), ["--model", config["base_model_name_or_path"], "--adapter",
                                                     folder], timeout_s=300)


def test_checkpoint_and_lora_flags_must_agree(runs, tmp_path):
    """A LoRA checkpoint without --lora-rank (it would resume without its adapter), and a checkpoint of a run
    without LoRA resumed with it (no adapter or its optimizer state to resume), stop the run naming the fix."""
    root, model = runs["root"], ["--model", runs["model"]]
    with pytest.raises(pytest.fail.Exception, match="was saved with LoRA"):
        run_ranks(WORKER, 1, str(tmp_path / "no_lora"), [*model, "--no-lora", "--load", str(root / "tp1" / "ckpt")])
    full = str(tmp_path / "full")
    run_ranks(WORKER, 1, full, [*model, "--no-lora"])
    with pytest.raises(pytest.fail.Exception, match="saved without LoRA.*--finetune"):
        run_ranks(WORKER, 1, str(tmp_path / "lora_on_full"), [*model, "--load", os.path.join(full, "ckpt")])
    finetune = run_ranks(WORKER, 1, str(tmp_path / "finetune"), [*model, "--load", os.path.join(full, "ckpt"),
                                                                  "--extra=--finetune"])
    assert finetune["start"] == 0


def test_adapter_folder_of_another_alpha_is_refused(adapter, tiny_model_dir, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="has lora_alpha 8, the run --lora-alpha 16; pass --lora-alpha 8"):
        run_ranks(WORKER, 1, str(tmp_path / "run"), ["--model", tiny_model_dir, "--adapter", adapter[0],
                                                     "--extra=--lora-alpha 16"], timeout_s=300)


SHIM_SITE = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "plugins", "megatron_shim")


@pytest.mark.timeout(400)
def test_train_py_with_megatron_lora(tiny_model_dir, toy_data_path, tmp_path):
    """train.py end to end: Ray, sglang-router, an hf engine and the Megatron trainer with LoRA on two TP ranks;
    after every adapter push the trainer's log-probs of the engine's samples are the engine's, and the policy leaves
    the base model (the KL to the reference, which is the base, grows from 0)."""
    before = run_processes()
    tb = str(tmp_path / "tb")
    cmd = [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--train-backend", "megatron",
           *model_args("tiny-qwen3"), "--transformer-impl", "local", "--hf-checkpoint", tiny_model_dir,
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
           "--rollout-num-gpus", "1", "--prompt-data", toy_data_path, "--input-key", "prompt", "--label-key", "label",
           "--apply-chat-template", "--rm-type", "random", "--num-rollout", "3", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--rollout-max-response-len", "4",
           "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
           "--lr", "2e-2", "--seed", "7", "--use-tensorboard", "--tensorboard-dir", tb,
           "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear"]  # fmt: skip
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (SHIM_SITE, REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=360, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    diff = read_scalars(tb, "train/train_rollout_logprob_abs_diff")
    kl = read_scalars(tb, "train/kl_loss")
    print("abs diff", diff, "kl", kl)
    assert sorted(diff) == [0, 1, 2] and max(diff.values()) < 1e-5
    assert kl[0] == 0.0 and kl[2] > 0  # rollout 0 runs the base model (B = 0); the pushed adapters moved it
    assert wait_for_no_new_processes(before) == {}
