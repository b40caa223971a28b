"""--only-train-params-name-list / --freeze-params-name-list on the real trainers (one gloo rank each, fp32):
after one optimizer step the frozen parameters are bit-equal, the trained ones moved, the optimizer holds only
the trained ones, and the weight export a push sends still carries every weight."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "freeze_worker.py")


def _run(backend: str, flags: str, model_dir: str, out_dir) -> dict:
    return run_ranks(WORKER, 1, str(out_dir), ["--model", model_dir, "--backend", backend, "--flags", flags], 300)


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
    from safetensors.torch import load_file

    hf = sorted(load_file(os.path.join(tiny_model_dir, "model.safetensors")))
    only = _run("fsdp", "--only-train-params-name-list mlp\\.down_proj layers\\.1\\.", tiny_model_dir,
                tmp_path / "only")
    _check_step(only, lambda n: "mlp.down_proj" in n or "layers.1." in n)
    assert only["pushed"] == hf  # the push sends every weight, frozen ones too

    frozen = _run("fsdp", "--freeze-params-name-list embed_tokens norm", tiny_model_dir, tmp_path / "freeze")
    _check_step(frozen, lambda n: "embed_tokens" not in n and "norm" not in n)

    bad = _run("fsdp", "--freeze-params-name-list embed_tokens no_such_layer", tiny_model_dir, tmp_path / "bad")
    assert "--freeze-params-name-list: the pattern(s) ['no_such_layer'] match no parameter name" in bad["error"]
    assert "model.embed_tokens.weight" in bad["error"]  # the names there are, to fix the pattern


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_megatron_only_train_and_freeze(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    hf = sorted(load_file(os.path.join(tiny_model_dir, "model.safetensors")))
    only = _run("megatron", "--only-train-params-name-list linear_fc2 layers\\.1\\.", tiny_model_dir,
                tmp_path / "only")
    _check_step(only, lambda n: "linear_fc2" in n or "layers.1." in n)
    assert only["pushed"] == hf

    frozen = _run("megatron", "--freeze-params-name-list embedding output_layer", tiny_model_dir,
                  tmp_path / "freeze")
    _check_step(frozen, lambda n: "embedding" not in n and "output_layer" not in n)

    bad = _run("megatron", "--only-train-params-name-list nothing_to_train", tiny_model_dir, tmp_path / "bad")
    assert "--only-train-params-name-list: the pattern(s) ['nothing_to_train'] match no parameter" in bad["error"]
    assert "embedding.word_embeddings.weight" in bad["error"]
