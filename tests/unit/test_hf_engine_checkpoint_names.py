"""The `hf` engine's weight names: a checkpoint's keys map to the served model's parameters as transformers maps them
on load, and the model's own names stay as they are (slime/backends/hf_engine/checkpoint_names.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slime.backends.hf_engine.checkpoint_names import checkpoint_name_mapper
from tools.make_tiny_model import make_tiny_model


def _load(tmp_path, arch: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    auto = AutoModelForImageTextToText if arch == "qwen2_5_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        keys = list(f.keys())
    return model, keys


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3"])
def test_every_checkpoint_key_names_a_parameter_and_own_names_stay(tmp_path, arch):
    model, keys = _load(tmp_path, arch)
    params = dict(model.named_parameters(remove_duplicate=False))
    to_model = checkpoint_name_mapper(model, set(params))
    mapped = {k: to_model(k) for k in keys}
    assert all(name in params for name in mapped.values()), [k for k, v in mapped.items() if v not in params]
    assert len(set(mapped.values())) == len(keys)  # no two keys land on one parameter
    assert all(to_model(name) == name for name in params)
    with safe_open(f"{model.name_or_path}/model.safetensors", "pt") as f:  # by value: the loader's renaming
        assert all(torch.equal(f.get_tensor(k), params[v].detach()) for k, v in mapped.items())


def test_qwen2_5_vl_hub_names_are_renamed_and_unknown_names_stay_unknown(tmp_path):
    model, keys = _load(tmp_path, "qwen2_5_vl")
    params = dict(model.named_parameters(remove_duplicate=False))
    to_model = checkpoint_name_mapper(model, set(params))
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.merger.ln_q.weight" in keys
    assert to_model("model.layers.0.self_attn.q_proj.weight") == "model.language_model.layers.0.self_attn.q_proj.weight"
    assert to_model("visual.merger.ln_q.weight") == "model.visual.merger.ln_q.weight"
    assert to_model("lm_head.weight") == "lm_head.weight"
    assert to_model("model.layers.99.mlp.up_proj.weight") not in params
    assert to_model("nonsense.weight") not in params
