"""The fsdp trainer pushes its weights as the model's checkpoint spells them (slime/backends/fsdp_utils/
checkpoint_format.py): the names and values of the folder it was loaded from, which is what SGLang's loaders take."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slime.backends.fsdp_utils.checkpoint_format import CheckpointFormat
from tools.make_tiny_model import make_tiny_model

VISION = ("qwen2_5_vl", "qwen3_vl")


def _load(tmp_path, arch: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    auto = AutoModelForImageTextToText if arch in VISION else AutoModelForCausalLM
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    return auto.from_pretrained(path, dtype=torch.float32), saved


@pytest.mark.parametrize("arch", ["qwen3", "llama", "glm4", "qwen2_5_vl", "qwen3_vl", "qwen3_moe", "glm4_moe",
                                  "deepseek_v3"])
def test_pushed_tensors_are_the_checkpoint_s(tmp_path, arch):
    model, saved = _load(tmp_path, arch)
    pushed = dict(CheckpointFormat(model).convert(model.state_dict().items()))
    tied = {"lm_head.weight"} if model.get_output_embeddings().weight is model.get_input_embeddings().weight else set()
    assert set(pushed) - tied == set(saved), (sorted(set(pushed) - tied - set(saved))[:3],
                                               sorted(set(saved) - set(pushed))[:3])
    assert all(torch.equal(pushed[k], saved[k]) for k in saved)


def test_renamed_and_split_names(tmp_path):
    vl, _ = _load(tmp_path, "qwen2_5_vl")
    names = CheckpointFormat(vl)
    assert not names.identity
    q = vl.state_dict()["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert [n for n, _ in names.convert([("model.language_model.layers.0.self_attn.q_proj.weight", q)])] == [
        "model.layers.0.self_attn.q_proj.weight"]

    moe, _ = _load(tmp_path, "qwen3_moe")
    fused = next(n for n in moe.state_dict() if n.endswith("mlp.experts.gate_up_proj"))
    experts = moe.config.num_experts
    split = dict(CheckpointFormat(moe).convert([(fused, moe.state_dict()[fused])]))
    layer = fused.removesuffix("mlp.experts.gate_up_proj")
    assert set(split) == {f"{layer}mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up")}

    text, _ = _load(tmp_path, "qwen3")
    assert CheckpointFormat(text).identity  # nothing to convert: the push costs no reversal


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_moe"])
def test_a_saved_folder_is_spelled_as_the_one_it_was_loaded_from(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from slime.backends.fsdp_utils.checkpoint import write_hf_folder

    model, saved = _load(tmp_path, arch)
    out = tmp_path / "saved"
    out.mkdir()
    write_hf_folder(model, model.state_dict(), str(out), model.name_or_path)
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        assert set(f.keys()) == set(saved)
        assert all(torch.equal(f.get_tensor(k), saved[k]) for k in saved)
    auto = AutoModelForImageTextToText if arch in VISION else AutoModelForCausalLM
    again = auto.from_pretrained(str(out), dtype=torch.float32).state_dict()  # --load reads it back
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())
