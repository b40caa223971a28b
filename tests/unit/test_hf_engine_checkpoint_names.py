"""The `hf` engine's weight names: a checkpoint's keys map to the served model's parameters as transformers maps them
on load, and the model's own names stay as they are (slime/backends/hf_engine/checkpoint_names.py); a key that a
conversion maps into a part of a fused parameter (a MoE's per-expert weights) loads into that part."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slime.backends.hf_engine.checkpoint_names import checkpoint_name_mapper, checkpoint_slices
from tools.make_tiny_model import make_tiny_model

MOE_ARCHS = ["qwen3_moe", "glm4_moe", "deepseek_v3"]


def _from_pretrained(path: str, arch: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if arch == "qwen2_5_vl" else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def _load(tmp_path, arch: str):
    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    model = _from_pretrained(path, arch)
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


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _engine(path: str, arch: str, **kwargs):
    """The engine's state (its weight loader) over the model at `path`, without a server process."""
    from transformers import AutoTokenizer

    from slime.backends.hf_engine.scheduler import Scheduler
    from slime.backends.hf_engine.server import EngineState

    model, tokenizer = _from_pretrained(path, arch), AutoTokenizer.from_pretrained(path)
    return EngineState(model, tokenizer, Scheduler(model, tokenizer), model_path=path, device="cpu", dtype="float32",
                       **kwargs)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("arch", MOE_ARCHS + ["qwen2_5_vl"])
def test_checkpoint_slices_are_where_transformers_takes_each_key_from(tmp_path, arch):
    """Each key's slice of the parameter holds what transformers' own reversal (save_pretrained's) gives for that key,
    which is the checkpoint's tensor; a MoE's every per-expert key has one, other models' keys none."""
    from transformers.core_model_loading import revert_weight_conversion

    model, keys = _load(tmp_path, arch)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    slices = checkpoint_slices(model, tensors)
    experts = {k for k in keys if ".mlp.experts." in k}
    assert set(slices) == experts and (bool(experts) == (arch in MOE_ARCHS))
    reverted = revert_weight_conversion(model, {n: t.detach() for n, t in tensors.items()})
    checkpoint = _checkpoint(model.name_or_path)
    for key, part in slices.items():
        view = part.of(tensors[part.param].detach())
        assert torch.equal(view, reverted[key]) and torch.equal(view, checkpoint[key]), key


@pytest.mark.parametrize("arch", MOE_ARCHS + ["qwen2_5_vl"])
def test_a_push_of_every_checkpoint_key_in_three_calls_loads_the_checkpoint(tmp_path, arch):
    """The engine serves the seed-0 model; the seed-1 checkpoint pushed key by key, in three calls that split each
    fused parameter's parts between them, leaves exactly the seed-1 model's weights."""
    path0 = make_tiny_model(str(tmp_path / "seed0"), arch=arch, size="tiny", seed=0)
    path1 = make_tiny_model(str(tmp_path / "seed1"), arch=arch, size="tiny", seed=1)
    state, want = _engine(path0, arch), _weights(_from_pretrained(path1, arch))
    checkpoint = sorted(_checkpoint(path1).items())
    calls, seen = [[], [], []], {}  # the n-th key into a parameter (a fused one has several) goes to call n % 3
    for key, tensor in checkpoint:
        param = state.slices[key].param if key in state.slices else key
        seen[param] = seen.get(param, -1) + 1
        calls[seen[param] % 3].append((key, tensor))
    moe_layers = {"qwen3_moe": 4, "glm4_moe": 3, "deepseek_v3": 3}.get(arch, 0)  # the others' layer 0 is dense
    assert all(n >= 2 for p, n in seen.items() if p in state.slice_counts) and len(state.slice_counts) == (
        2 * moe_layers)  # gate_up and down each
    assert not all(torch.equal(t, want[n]) for n, t in _weights(state.model).items())
    assert sum(state.load_named_tensors(call, f"push {i}") for i, call in enumerate(calls)) == len(checkpoint)
    got = _weights(state.model)
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []


@pytest.mark.parametrize("bad", ["unknown", "shape"])
def test_a_bad_name_or_shape_next_to_expert_parts_changes_nothing(tmp_path, bad):
    path0 = make_tiny_model(str(tmp_path / "seed0"), arch="qwen3_moe", size="tiny", seed=0)
    path1 = make_tiny_model(str(tmp_path / "seed1"), arch="qwen3_moe", size="tiny", seed=1)
    state = _engine(path0, "qwen3_moe")
    before = _weights(state.model)
    push = list(_checkpoint(path1).items())
    key = "model.layers.1.mlp.experts.2.gate_proj.weight"
    i = next(i for i, (k, _) in enumerate(push) if k == key)
    if bad == "unknown":
        push.append(("model.layers.1.mlp.experts.99.gate_proj.weight", push[i][1]))
        message = "unknown parameter name(s) ['model.layers.1.mlp.experts.99.gate_proj.weight']"
    else:
        shape = tuple(push[i][1].shape)
        push[i] = (key, push[i][1].t().contiguous())
        message = f"shape mismatch for ['{key}: got {shape[::-1]}, model has {shape}']"
    with pytest.raises(ValueError) as e:
        state.load_named_tensors(push, "push")
    assert message in str(e.value)
    after = _weights(state.model)
    assert all(torch.equal(after[n], before[n]) for n in before)


class _Toy(torch.nn.Module):
    """Three experts' [5, 4] weights held as one [3, 4, 5] parameter (stacked, each transposed), by a conversion."""

    def __init__(self, operations):
        from transformers.core_model_loading import WeightConverter

        super().__init__()
        self.experts = torch.nn.Module()
        self.experts.w = torch.nn.Parameter(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)))
        self.config = None
        self._weight_conversions = [WeightConverter("experts.*.weight", "experts.w", operations)]


def _scale(in_place: bool):
    from transformers.core_model_loading import ConversionOps

    class Scale(ConversionOps):  # computes new values: its keys are no part of the parameter
        def __init__(self, factor: float):
            self.factor = factor

        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            out = {}
            for key, t in input_dict.items():
                t = t[0] if isinstance(t, list) else t
                out[key] = t.mul_(self.factor) if in_place else t * self.factor
            return out

        @property
        def reverse_op(self):
            return Scale(1 / self.factor)

    return Scale(2.0)


def test_a_transposing_conversion_gives_strided_slices_and_a_computing_one_none():
    from transformers.core_model_loading import MergeModulelist, Transpose, revert_weight_conversion

    model = _Toy([MergeModulelist(dim=0), Transpose(1, 2)])
    params = dict(model.named_parameters())
    slices = checkpoint_slices(model, params)
    assert sorted(slices) == ["experts.0.weight", "experts.1.weight", "experts.2.weight"]
    assert {(s.size, s.stride) for s in slices.values()} == {((5, 4), (1, 5))}  # views of the transposed layout
    reverted = revert_weight_conversion(model, {n: t.detach() for n, t in params.items()})
    assert all(torch.equal(s.of(model.experts.w.detach()), reverted[k]) for k, s in slices.items())
    for in_place in (False, True):  # a new tensor, or a view written to: no slices (the keys stay unknown)
        computed = _Toy([MergeModulelist(dim=0), _scale(in_place)])
        assert checkpoint_slices(computed, dict(computed.named_parameters())) == {}
