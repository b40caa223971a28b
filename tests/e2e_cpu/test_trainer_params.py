"""slime's flags choosing which parameters train and which saved iteration the reference model reads, on the real
trainers (one gloo rank each, fp32; megatron through the CPU shim):

- --only-train-params-name-list / --freeze-params-name-list: after one optimizer step the frozen parameters are
  bit-equal, the trained ones moved, the optimizer holds only the trained ones, and the weight export a push
  sends still carries every weight; a pattern matching nothing is refused naming the parameters;
- --ref-ckpt-step: a save folder with two iterations of different weights; the reference model holds the
  iteration asked for (the latest without the flag); a missing one is refused naming the iterations present;
- --ref-load without a checkpoint in --load: the policy starts from the reference weights (a fresh start at
  rollout 0); with one, the policy resumes from --load and only the reference model reads --ref-load;
- --save-hf (the same save run): each iteration's HF folder loads with transformers and gives the trainer's
  log-probs at that save, with --hf-checkpoint's tokenizer files beside it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "trainer_params_worker.py")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core not installed")


def _run(backend: str, mode: str, flags: str, model_dir: str, out_dir) -> dict:
    return run_ranks(WORKER, 1, str(out_dir), ["--model", model_dir, "--backend", backend, "--mode", mode,
                                               "--flags", flags], 300)


def _hf_names(model_dir: str) -> list[str]:
    from safetensors.torch import load_file

    return sorted(load_file(os.path.join(model_dir, "model.safetensors")))


def _check_step(result: dict, should_train) -> None:
    params = result["params"]
    trained = [n for n in params if should_train(n)]
    frozen = [n for n in params if not should_train(n)]
    assert trained and frozen
    for n in frozen:
        assert not params[n]["requires_grad"], n
        assert params[n]["change"] == 0.0, n  # bit-equal after the step
    for n in trained:
        assert params[n]["requires_grad"], n
    # Every trained tensor got a gradient (norms too, through the loss); with lr 1e-3 each moves.
    assert all(params[n]["change"] > 0 for n in trained), [n for n in trained if params[n]["change"] == 0]
    assert result["optimizer_tensors"] == len(trained)


@pytest.mark.timeout(600)
def test_fsdp_only_train_and_freeze(tiny_model_dir, tmp_path):
    only = _run("fsdp", "step", "--only-train-params-name-list mlp\\.down_proj layers\\.1\\.", tiny_model_dir,
                tmp_path / "only")
    _check_step(only, lambda n: "mlp.down_proj" in n or "layers.1." in n)
    assert only["pushed"] == _hf_names(tiny_model_dir)  # the push sends every weight, frozen ones too

    frozen = _run("fsdp", "step", "--freeze-params-name-list embed_tokens norm", tiny_model_dir,
                  tmp_path / "freeze")
    _check_step(frozen, lambda n: "embed_tokens" not in n and "norm" not in n)

    bad = _run("fsdp", "step", "--freeze-params-name-list embed_tokens no_such_layer", tiny_model_dir,
               tmp_path / "bad")
    assert "--freeze-params-name-list: the pattern(s) ['no_such_layer'] match no parameter name" in bad["error"]
    assert "model.embed_tokens.weight" in bad["error"]  # the names there are, to fix the pattern


@pytest.mark.timeout(600)
@needs_megatron
def test_megatron_only_train_and_freeze(tiny_model_dir, tmp_path):
    only = _run("megatron", "step", "--only-train-params-name-list linear_fc2 layers\\.1\\.", tiny_model_dir,
                tmp_path / "only")
    _check_step(only, lambda n: "linear_fc2" in n or "layers.1." in n)
    assert only["pushed"] == _hf_names(tiny_model_dir)

    frozen = _run("megatron", "step", "--freeze-params-name-list embedding output_layer", tiny_model_dir,
                  tmp_path / "freeze")
    _check_step(frozen, lambda n: "embedding" not in n and "output_layer" not in n)

    bad = _run("megatron", "step", "--only-train-params-name-list nothing_to_train", tiny_model_dir, tmp_path / "bad")
    assert "--only-train-params-name-list: the pattern(s) ['nothing_to_train'] match no parameter" in bad["error"]
    assert "embedding.word_embeddings.weight" in bad["error"]


def _hf_log_probs(folder: str, probe: dict) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.data import forward_response_log_probs
    from slime.backends.training.batching import make_micro_batch, unpad_per_token

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mb = make_micro_batch(probe["tokens"], probe["response_lengths"])
    with torch.no_grad():
        lp, _ = forward_response_log_probs(model, mb, 1.0)
    return unpad_per_token(lp, probe["response_lengths"])


def _max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _check_save_hf(result: dict, template: str, model_dir: str) -> None:
    for rollout_id in (0, 1):
        folder = template.format(rollout_id=rollout_id)
        assert sorted(os.listdir(folder)) == sorted(os.listdir(model_dir))  # config, tokenizer, one weights file
        assert _max_abs_diff(_hf_log_probs(folder, result["probe"]), result[f"lp_{rollout_id}"]) < 1e-5
    assert _max_abs_diff(result["lp_0"], result["lp_1"]) > 1e-4  # the two saves hold different weights


def _check_ref_ckpt_step(backend: str, model_dir: str, tmp_path) -> None:
    template = str(tmp_path / "hf" / "iter_{rollout_id}")
    saved_run = _run(backend, "save2", f"--save-hf {template}", model_dir, tmp_path / "save")
    _check_save_hf(saved_run, template, model_dir)
    ckpt = str(tmp_path / "save" / "ckpt")
    saved = [torch.load(tmp_path / "save" / f"policy_{i}.pt") for i in (0, 1)]
    assert any(not torch.equal(saved[0][n], saved[1][n]) for n in saved[0])  # two different iterations

    def ref(name: str, flags: str, start: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        result = _run(backend, "ref", f"--ref-load {ckpt} {flags}", model_dir, tmp_path / name)
        assert result["start"] == start, result
        return torch.load(tmp_path / name / "ref.pt"), torch.load(tmp_path / name / "policy.pt")

    def equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
        assert sorted(got) == sorted(expected)
        return all(torch.equal(got[n], expected[n]) for n in got)

    # Without --load, the policy starts from the reference weights: the iteration asked for, else the latest.
    for name, flags, expected in (("step0", "--ref-ckpt-step 0", saved[0]), ("step1", "--ref-ckpt-step 1", saved[1]),
                                  ("latest", "", saved[1])):
        got, policy = ref(name, flags)
        assert equal(got, expected) and equal(policy, expected), name
    # With a checkpoint in --load, the policy resumes from it (the latest, rollout 2 next); the reference reads
    # --ref-load's iteration.
    got, policy = ref("resume", f"--ref-ckpt-step 0 --load {ckpt}", start=2)
    assert equal(got, saved[0]) and equal(policy, saved[1])

    missing = _run(backend, "ref", f"--ref-load {ckpt} --ref-ckpt-step 5", model_dir, tmp_path / "missing")
    assert f"--ref-ckpt-step 5: {os.path.join(ckpt, 'iter_0000005')}" in missing["error"]
    assert ("(complete iterations: [0, 1])" if backend == "megatron" else "(complete ones: [0, 1])") in missing["error"]


@pytest.mark.timeout(600)
def test_fsdp_ref_ckpt_step_and_save_hf(tiny_model_dir, tmp_path):
    _check_ref_ckpt_step("fsdp", tiny_model_dir, tmp_path)


@pytest.mark.timeout(600)
@needs_megatron
def test_megatron_ref_ckpt_step_and_save_hf(tiny_model_dir, tmp_path):
    _check_ref_ckpt_step("megatron", tiny_model_dir, tmp_path)
