"""The hf engine's fused RMSNorm (slime/backends/hf_engine/fused_norms.py): every transformers RMSNorm of our
architectures computes what F.rms_norm computes, the model's outputs stay the same, and a norm that computes
something else (Gemma's `1 + weight`) keeps its own forward."""

from __future__ import annotations

import copy

import pytest
import torch

from slime.backends.hf_engine.fused_norms import fuse_rms_norms
from tools.make_tiny_model import make_tiny_model


def _norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "glm4", "deepseek_v3", "qwen2_5_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_norm_is_fused_and_the_logits_stay(tmp_path, arch, dtype):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    auto = AutoModelForImageTextToText if arch == "qwen2_5_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype).eval()
    for m in _norms(model):  # random weights: a norm that ignored its weight (or added 1 to it) would show
        torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    fused = copy.deepcopy(model)
    assert fuse_rms_norms(fused) == len(_norms(model)) > 0
    ids = torch.randint(1, 100, (2, 12))
    with torch.no_grad():
        want, got = model(ids).logits.float(), fused(ids).logits.float()
    tol = 1e-5 if dtype == torch.float32 else 0.1  # bf16: the weight applied before the one rounding
    assert (got - want).abs().max().item() < tol
    assert all(m.forward.func.__name__ == "_fused_forward" for m in _norms(fused))


class OnePlusWeightRMSNorm(torch.nn.Module):  # Gemma's: scales by 1 + weight
    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.eps = 1e-6

    def forward(self, x):
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + self.weight.float())


def test_a_norm_that_computes_something_else_keeps_its_forward():
    model = torch.nn.Sequential(OnePlusWeightRMSNorm(16))
    own = model[0].forward
    assert fuse_rms_norms(model) == 0
    assert model[0].forward == own


def test_an_input_of_another_dtype_goes_to_the_modules_own_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / "m"), size="tiny", seed=0),
                                                 dtype=torch.bfloat16)
    norm = model.model.norm
    x = torch.randn(3, norm.weight.shape[0], dtype=torch.float32)
    with torch.no_grad():
        want = norm(x)
        fuse_rms_norms(model)
        assert torch.equal(norm(x), want)
