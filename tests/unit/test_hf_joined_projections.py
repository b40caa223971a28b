"""The hf engine's joined projections (slime/backends/hf_engine/fused_projections.py), on CPU: every architecture's
q/k/v and gate/up groups are joined, the logits stay, the attention takes the key and value from the joined product,
weight loads and a release/resume of release.py keep the groups joined, and a module that computes something else
keeps its own forward."""

from __future__ import annotations

import copy

import pytest
import torch

from slime.backends.hf_engine.fused_projections import (
    ATTENTION,
    MLP,
    join_projections,
    joined,
    restore_projections,
)
from slime.backends.hf_engine.release import WeightMemory
from tools.make_tiny_model import make_tiny_model

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 61, 12], [8, 1, 44, 2, 90, 13, 5, 70]])


def _load(arch: str, tmp_path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    auto = AutoModelForImageTextToText if arch in ("qwen2_5_vl", "qwen3_vl") else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).eval()


def _groups(model, names) -> list[torch.nn.Module]:
    return [m for m in model.modules() if all(type(getattr(m, n, None)) is torch.nn.Linear for n in names)]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "glm4", "deepseek_v3", "qwen3_moe", "qwen2_5_vl"])
def test_every_group_is_joined_and_the_logits_stay(tmp_path, arch):
    model = _load(arch, tmp_path)
    twin = copy.deepcopy(model)
    groups = len(_groups(model, MLP)) + len(_groups(model, ATTENTION))
    assert join_projections(twin) == groups > 0
    assert join_projections(twin) == groups  # a second call finds them joined
    for attention in _groups(twin, ATTENTION):  # the key's and value's own products are not what the model runs
        attention.k_proj.forward.joined.own[1:] = [_not_called, _not_called]
    assert torch.allclose(_logits(twin), _logits(model), rtol=0, atol=1e-5)
    for attention in _groups(twin, ATTENTION):
        assert attention.q_proj.forward.joined.pending is None  # nothing held past the attention's calls
        assert joined([getattr(attention, n).weight for n in ATTENTION]) is not None
    for mlp in _groups(twin, MLP):
        assert joined([getattr(mlp, n).weight for n in MLP]) is not None


def _not_called(x):
    raise AssertionError("the joined product's part was not used")


def test_a_qwen2_attention_joins_its_biases(tmp_path):
    model = join_or_fail(_load("qwen2", tmp_path))
    attention = _groups(model, ATTENTION)[0]
    bias = joined([getattr(attention, n).bias for n in ATTENTION])
    assert bias is not None and bias.shape[0] == sum(getattr(attention, n).out_features for n in ATTENTION)


def join_or_fail(model):
    assert join_projections(model) > 0
    return model


def test_bf16_logits_are_the_modules_own(tmp_path):
    model = _load("qwen3", tmp_path, torch.bfloat16)
    twin = join_or_fail(copy.deepcopy(model))
    assert (_logits(twin) - _logits(model)).abs().max().item() < 0.05  # the product's order may change last bits


def test_loads_and_a_release_keep_the_groups_joined(tmp_path):
    model = _load("qwen3", tmp_path)
    trained = copy.deepcopy(model)  # the weights a push brings: other values under the same names
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    twin = join_or_fail(copy.deepcopy(model))
    memory = WeightMemory(twin, "free")  # as the engine builds it, after joining
    params = dict(twin.named_parameters(remove_duplicate=False))

    def push() -> None:
        with torch.no_grad():
            for name, t in trained.named_parameters():
                params[name].copy_(t)

    push()
    assert torch.allclose(_logits(twin), _logits(trained), rtol=0, atol=1e-5)
    memory.release()
    memory.resume()
    push()
    attention = _groups(twin, ATTENTION)[0]
    assert joined([getattr(attention, n).weight for n in ATTENTION]) is not None
    attention.k_proj.forward.joined.own[1:] = [_not_called, _not_called]
    assert torch.allclose(_logits(twin), _logits(trained), rtol=0, atol=1e-5)


def test_a_weight_replaced_outside_its_storage_goes_through_the_own_forwards(tmp_path):
    model = _load("qwen3", tmp_path)
    twin = join_or_fail(copy.deepcopy(model))
    with torch.no_grad():
        for m in (model, twin):  # the same new tensors, not copies into the joined storage
            layer = m.model.layers[0]
            layer.self_attn.k_proj.weight.data = layer.self_attn.k_proj.weight.data.clone() * 0.5
            layer.mlp.up_proj.weight.data = layer.mlp.up_proj.weight.data.clone() * 0.5
    assert torch.allclose(_logits(twin), _logits(model), rtol=0, atol=1e-5)


class NotGated(torch.nn.Module):  # gate and up but another formula: up(gate(x)) is not act(gate) * up
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 8, bias=False)
        self.up_proj = torch.nn.Linear(8, 8, bias=False)
        self.down_proj = torch.nn.Linear(8, 8, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.up_proj(self.gate_proj(x)))


def test_a_module_that_computes_something_else_keeps_its_forward():
    model = torch.nn.Sequential(NotGated())
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    assert join_projections(model) == 0
    assert "forward" not in model[0].__dict__
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_restore_gives_back_the_own_forwards(tmp_path):
    model = join_or_fail(_load("qwen3", tmp_path))
    want = _logits(model)
    restore_projections(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.allclose(_logits(model), want, rtol=0, atol=1e-6)
