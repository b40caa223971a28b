"""LoRA: the flags' validation, the trainer's LoRALinear layers, the PEFT folder round trip and the hf engine's
merged adapter (docs/lora.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.fsdp_utils.parallel import make_optimizer
from slime.backends.hf_engine.lora import MergedAdapter, read_adapter_folder
from slime.rollout.generation import generate_payload, set_engine_adapter
from slime.utils import lora_adapter
from slime.utils.errors import SlimeArgumentError
from slime.utils.lora_adapter import is_adapter_name, module_of, request_adapter
from tests.args import make_args

LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear")


# ---- flags ----------------------------------------------------------------------------------------------------
def test_lora_flags_parse_and_default_off():
    assert make_args().lora_rank == 0
    args = make_args(*LORA, "--exclude-modules", "down_proj")
    assert (args.lora_rank, args.lora_alpha, args.target_modules, args.exclude_modules) == (8, 16, "all-linear",
                                                                                            "down_proj")


@pytest.mark.parametrize("extra, message", [
    (("--lora-rank", "8"), "needs --target-modules"),
    (("--lora-rank", "-1", "--target-modules", "q_proj"), "--lora-rank -1"),
    ((*LORA, "--lora-dropout", "0.05"), "--lora-dropout 0.05"),
    ((*LORA, "--lora-alpha", "0"), "--lora-alpha 0"),
    (("--lora-rank", "8", "--target-modules", "all-linear,q_proj"), "all-linear stands alone"),
    ((*LORA, "--only-train-params-name-list", "q_proj"), "drop the name lists"),
    ((*LORA, "--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/x"), "pushed as tensors"),
    (("--lora-type", "canonical_lora"), "--lora-type canonical_lora"),
    (("--lora-train-only",), "--lora-train-only"),
    (("--multi-lora-n-adapters", "2"), "multi-LoRA"),
    ((*LORA, "--rollout-external-engine-addrs", "127.0.0.1:30000"),
     "not built for external engines; pass --rollout-backend sglang or hf"),
])
def test_lora_flags_refused_with_the_fix(extra, message):
    with pytest.raises(SlimeArgumentError, match=message):
        make_args(*extra)


def test_colocated_lora_keeps_the_base_on_the_engines_host(caplog):
    """--colocate (or --offload-rollout) with LoRA: the engines release their weights and a push sends only the
    adapter, so they keep a host copy of the base; miles' --lora-base-cpu-backup asks for exactly that, so it
    changes nothing there and is warned about where engines never release their weights."""
    colocated = make_args(*LORA, "--colocate")
    assert lora_adapter.engine_keeps_base_on_host(colocated)
    assert lora_adapter.engine_keeps_base_on_host(make_args(*LORA, "--offload-rollout"))
    assert not lora_adapter.engine_keeps_base_on_host(make_args(*LORA))
    assert not lora_adapter.engine_keeps_base_on_host(make_args("--colocate"))  # full pushes bring everything back
    with caplog.at_level("WARNING"):
        make_args(*LORA, "--colocate", "--lora-base-cpu-backup")
    assert "--lora-base-cpu-backup" not in caplog.text
    with caplog.at_level("WARNING"):
        assert make_args(*LORA, "--lora-base-cpu-backup").lora_base_cpu_backup
    assert "--lora-base-cpu-backup: no effect without --offload-rollout" in caplog.text


def test_lora_rollouts_name_the_adapter_once_the_engines_hold_it():
    """SGLang serves a request with the adapter its lora_path names and the base model without one: after a push
    with LoRA (RolloutManager.after_weight_update) every rollout request names the adapter; before the first push
    the engines hold none and requests name none."""
    assert request_adapter(make_args(*LORA, "--rollout-backend", "sglang")) == "slime_lora"
    assert request_adapter(make_args("--rollout-backend", "sglang")) is None
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    assert generate_payload([1, 2], {"max_new_tokens": 4}) == body
    try:
        set_engine_adapter("slime_lora")
        assert generate_payload([1, 2], {"max_new_tokens": 4}) == {**body, "lora_path": "slime_lora"}
    finally:
        set_engine_adapter(None)
    assert "lora_path" not in generate_payload([1], {})


def test_lora_lm_head_refused_on_megatron_naming_fsdp():
    with pytest.raises(SlimeArgumentError, match="LM head is not built on the Megatron trainer.*--train-backend fsdp"):
        make_args("--lora-rank", "8", "--target-modules", "q_proj,k_proj,v_proj,lm_head", "--train-backend",
                  "megatron")


# ---- trainer layers -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _lora_model(base_model, targets="all-linear", exclude=None, rank=8, alpha=16):
    model = copy.deepcopy(base_model)
    names = lora.apply_lora(model, rank, alpha, targets, exclude)
    return model, names


def _tokens(model, n=12):
    return torch.randint(0, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))


def test_lora_model_equals_base_at_init(base_model):
    model, names = _lora_model(base_model)
    kinds = {n.rsplit(".", 1)[-1] for n in names}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "lm_head" not in " ".join(names)
    x = _tokens(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, base_model(x).logits)


def test_only_adapter_parameters_train(base_model, tiny_model_dir):
    model, names = _lora_model(base_model, targets="q_proj,v_proj")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{h}.weight" for m in names for h in "AB"}
    assert all(is_adapter_name(n) for n in trainable)
    # HF names of the base are unchanged, so checkpoints and the reference model read the same state dict
    assert set(base_model.state_dict()) <= set(model.state_dict())
    model(_tokens(model)).logits.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        if name in trainable:
            assert p.grad is not None
        else:
            assert p.grad is None, name
    # B = 0 at init: A's gradient is zero, B's is not
    a, b = (model.get_submodule(names[0]).lora_A.weight, model.get_submodule(names[0]).lora_B.weight)
    assert torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(b.grad) > 0
    optimizer = make_optimizer(model, make_args(*LORA, hf_checkpoint=tiny_model_dir), 1e-3)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in trainable}


def test_adapters_off_computes_the_base_and_turns_them_back_on(base_model):
    """The KL term's reference pass with LoRA: the policy with its adapters off is the base model, exactly."""
    model, _ = _lora_model(base_model)
    _trained(model)
    x = _tokens(model)
    with torch.no_grad():
        adapted = model(x).logits
        assert not torch.equal(adapted, base_model(x).logits)
        with lora.adapters_off(model):
            assert torch.equal(model(x).logits, base_model(x).logits)
        assert torch.equal(model(x).logits, adapted)


def test_target_and_exclude_modules(base_model):
    _, names = _lora_model(base_model, exclude="down_proj,o_proj")
    assert not any(n.endswith(("down_proj", "o_proj")) for n in names) and any(n.endswith("up_proj") for n in names)
    with pytest.raises(ValueError, match=r"no linear layer named \['qkv'\].*q_proj"):
        _lora_model(base_model, targets="qkv")
    _, with_head = _lora_model(base_model, targets="q_proj,lm_head")  # the tiny model's head is untied
    assert "lm_head" in with_head and len(with_head) == 1 + base_model.config.num_hidden_layers
    with pytest.raises(ValueError, match="leaves no linear layer"):
        _lora_model(base_model, targets="q_proj", exclude="q_proj")


def _trained(model, seed=3):
    """Non-zero adapters, as after some training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter_name(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_peft_folder_round_trip(base_model, tmp_path, tiny_model_dir):
    model, names = _lora_model(base_model)
    _trained(model)
    config = lora_adapter.adapter_config(make_args(*LORA, hf_checkpoint=tiny_model_dir), names)
    nbytes = lora_adapter.write_adapter_folder(model.state_dict(), config, str(tmp_path))
    named, read_config = read_adapter_folder(str(tmp_path))
    assert read_config["r"] == 8 and read_config["lora_alpha"] == 16 and read_config["peft_type"] == "LORA"
    assert all(n.startswith("base_model.model.model.layers.") for n, _ in named)
    assert nbytes == sum(p.numel() * 4 for n, p in model.named_parameters() if is_adapter_name(n))
    fresh, _ = _lora_model(base_model)
    assert lora.load_adapter_folder(fresh, str(tmp_path)) == 2 * len(names)
    x = _tokens(model)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)
    other_rank, _ = _lora_model(base_model, rank=4)
    with pytest.raises(ValueError, match="shapes differ"):
        lora.load_adapter_folder(other_rank, str(tmp_path))


# ---- engine side ----------------------------------------------------------------------------------------------
def test_engine_merge_equals_the_lora_forward(base_model):
    model, _ = _lora_model(base_model)
    _trained(model)
    engine_model = copy.deepcopy(base_model)
    merged = MergedAdapter(engine_model)
    named = [(lora_adapter.PEFT_PREFIX + n, t) for n, t in model.state_dict().items() if is_adapter_name(n)]
    config = {"r": 8, "lora_alpha": 16}
    x = _tokens(model)
    with torch.no_grad():
        want = model(x).logits
        merged.load("a", named, config, "test")
        assert torch.allclose(engine_model(x).logits, want, atol=1e-5)
        merged.load("a", named, config, "test")  # a second push recomputes from the base: no accumulation
        assert torch.allclose(engine_model(x).logits, want, atol=1e-5)
        assert merged.summary()["tensors"] == len(named)
        merged.restore()
        assert torch.equal(engine_model(x).logits, base_model(x).logits)


def test_engine_with_a_host_base_restores_it_on_resume(base_model):
    """base_backup (a colocated LoRA engine): one host copy of the base, taken at the first adapter load; a release
    copies nothing more, a resume brings the base back and merges the adapter again; a second push and an unload
    equal the device-copy path's, bit for bit, with no device copy of the base kept."""
    from slime.backends.hf_engine.release import WeightMemory

    model, _ = _lora_model(base_model)
    _trained(model)
    named = [(lora_adapter.PEFT_PREFIX + n, t) for n, t in model.state_dict().items() if is_adapter_name(n)]
    other = [(n, t * 2 if n.endswith("lora_B.weight") else t) for n, t in named]
    config = {"r": 8, "lora_alpha": 16}
    x = _tokens(model)
    reference = copy.deepcopy(base_model)  # the device-copy path
    by_device = MergedAdapter(reference)
    engine_model = copy.deepcopy(base_model)
    weights = WeightMemory(engine_model, "base_backup")
    merged = MergedAdapter(engine_model, weights)
    with torch.no_grad():
        merged.load("a", named, config, "test")
        by_device.load("a", named, config, "test")
        want = reference(x).logits
        assert torch.equal(engine_model(x).logits, want) and weights.host_copies == 1 and merged.base == {}
        for _ in range(2):
            weights.release()
            assert all(p.numel() == 0 for p in engine_model.parameters())
            weights.resume()
            merged.reapply()
            assert torch.equal(engine_model(x).logits, want)  # the base back, the adapter merged again
        merged.load("a", other, config, "test")  # the next push: from the host base, not on top of the last
        by_device.load("a", other, config, "test")
        assert torch.equal(engine_model(x).logits, reference(x).logits)
        merged.restore()
        for (n, p), q in zip(engine_model.named_parameters(), base_model.parameters()):
            assert torch.equal(p, q), n
        assert weights.host_copies == 1  # taken once: the base is frozen
        merged.forget_base()  # a full-weight load: the next snapshot takes the new base
        weights.release()
        assert weights.host_copies == 2


def test_engine_refuses_a_bad_adapter_and_changes_nothing(base_model):
    engine_model = copy.deepcopy(base_model)
    merged = MergedAdapter(engine_model)
    a = torch.zeros(8, engine_model.config.hidden_size)
    b = torch.ones(engine_model.config.hidden_size, 8)
    good = ("model.layers.0.self_attn.q_proj.lora_A.weight", a)
    with pytest.raises(ValueError, match="only lora_A"):
        merged.load("a", [good], {"r": 8, "lora_alpha": 16}, "t")
    with pytest.raises(ValueError, match="expected"):
        merged.load("a", [good, ("model.layers.0.self_attn.q_proj.lora_B.weight", b[:, :4])], {"r": 8,
                                                                                                "lora_alpha": 16}, "t")
    with pytest.raises(ValueError, match="no module"):
        merged.load("a", [("model.layers.99.q_proj.lora_A.weight", a)], {"r": 8, "lora_alpha": 16}, "t")
    with pytest.raises(ValueError, match="'r'"):
        merged.load("a", [good], {"lora_alpha": 16}, "t")
    assert merged.name is None
    for (n, p), q in zip(engine_model.named_parameters(), base_model.parameters()):
        assert torch.equal(p, q), n
    assert module_of("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight") == ("model.layers.0.mlp.up_proj",
                                                                                       "B")


# ---- a vision-language model (the tiny Qwen2.5-VL) --------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("vlm") / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _peft_selects(model, target_modules: list[str]) -> list[str]:
    """The modules PEFT's LoRA matches for a list `target_modules` (peft.tuners.tuners_utils.check_target_module_
    exists: the full name listed, or a name ending with '.' + an entry)."""
    return [name for name, _ in model.named_modules() if name and
            (name in target_modules or any(name.endswith("." + t) for t in target_modules))]


def test_vlm_all_linear_adapts_the_tower_and_the_peft_config_names_exactly_those(vlm):
    """fsdp's all-linear on a VLM: every linear but the LM head, the vision tower's and merger's too; the PEFT
    config's target_modules select exactly the adapted modules (bare last parts would also select the decoder
    layers `layers.0` / `layers.2` through the merger's `mlp.0` / `mlp.2`, and the patch embedding's `proj`)."""
    names = lora.target_names(vlm, "all-linear")
    tower = lora.outside_decoder(vlm, names)
    assert len(names) == 40 and len(tower) == 12 and all(n.startswith("model.visual.") for n in tower)
    targets = lora.peft_target_modules(vlm, names)
    assert sorted(_peft_selects(vlm, targets)) == sorted(names)
    bare = sorted({n.rsplit(".", 1)[-1] for n in names})
    assert "model.language_model.layers.0" in _peft_selects(vlm, bare)
    attention = lora.target_names(vlm, "q_proj,k_proj,v_proj,o_proj")  # names the tower does not use
    assert lora.outside_decoder(vlm, attention) == []
    assert lora.peft_target_modules(vlm, attention) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_vlm_tower_adapters_refused_unless_the_hf_engine_serves_them(vlm):
    names = lora.target_names(vlm, "all-linear")
    tower = lora.outside_decoder(vlm, names)
    lora.check_engine_adapts(names, tower, make_args(*LORA, "--rollout-backend", "hf"))
    sglang = make_args(*LORA, "--rollout-backend", "sglang")
    with pytest.raises(ValueError, match="12 modules of the vision tower.*--target-modules k_proj,o_proj,q_proj,"
                                         "v_proj.*--train-backend megatron.*--rollout-backend hf"):
        lora.check_engine_adapts(names, tower, sglang)
    attention = lora.target_names(vlm, "q_proj,k_proj,v_proj,o_proj")
    lora.check_engine_adapts(attention, lora.outside_decoder(vlm, attention), sglang)


def test_engine_merges_an_adapter_named_as_the_checkpoint(vlm):
    """The Megatron trainer names a Qwen2.5-VL adapter as the checkpoint does (`model.layers.*`); the hf engine
    maps it to transformers' `model.language_model.layers.*` as it maps a full push, and merges a tower adapter
    (fsdp's names) the same way as any linear."""
    from slime.backends.hf_engine.checkpoint_names import checkpoint_name_mapper

    torch.manual_seed(0)
    hidden = vlm.config.get_text_config().hidden_size
    a, b = torch.randn(4, hidden), torch.randn(hidden, 4)
    config = {"r": 4, "lora_alpha": 8}
    merged = []
    for module in ("model.layers.1.self_attn.o_proj", "model.language_model.layers.1.self_attn.o_proj"):
        model = copy.deepcopy(vlm)
        adapter = MergedAdapter(model, None, checkpoint_name_mapper(model, {n for n, _ in model.named_parameters()}))
        adapter.load("a", [(f"{lora_adapter.PEFT_PREFIX}{module}.lora_A.weight", a),
                           (f"{module}.lora_B.weight", b)], config, "test")
        merged.append(model.get_submodule("model.language_model.layers.1.self_attn.o_proj").weight.detach().clone())
    base = vlm.get_submodule("model.language_model.layers.1.self_attn.o_proj").weight
    assert torch.allclose(merged[0], base + 2 * b @ a, atol=1e-6) and torch.equal(merged[0], merged[1])
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj is no module"):
        MergedAdapter(copy.deepcopy(vlm)).load("a", [("model.layers.1.self_attn.o_proj.lora_A.weight", a),
                                                     ("model.layers.1.self_attn.o_proj.lora_B.weight", b)],
                                               config, "test")  # without the mapping (what main did)
    model = copy.deepcopy(vlm)
    qkv = model.get_submodule("model.visual.blocks.0.attn.qkv")
    adapter = MergedAdapter(model, None, checkpoint_name_mapper(model, {n for n, _ in model.named_parameters()}))
    ta, tb = torch.randn(4, qkv.in_features), torch.randn(qkv.out_features, 4)
    adapter.load("a", [("model.visual.blocks.0.attn.qkv.lora_A.weight", ta),
                       ("model.visual.blocks.0.attn.qkv.lora_B.weight", tb)], config, "test")
    want = vlm.get_submodule("model.visual.blocks.0.attn.qkv").weight + 2 * tb @ ta
    assert torch.allclose(qkv.weight, want, atol=1e-6)
