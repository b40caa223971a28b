"""slime/backends/hf_engine/release.py: the hf engine's weights released and taken back, on CPU.

The same code runs on CUDA (tests/gpu/test_hf_engine_release.py measures the device memory there); here the
storages' weak references show that nothing keeps released memory alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from slime.backends.hf_engine import release
from slime.backends.hf_engine.release import WeightMemory

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 61, 12]])


def tiny_qwen3(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(config).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def state(model) -> dict[str, torch.Tensor]:
    """What a push sends: every parameter by name, a tied one once (as named_parameters gives them)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load(model, named: dict[str, torch.Tensor], memory: WeightMemory) -> None:
    """The engine's loader: copy by name into the model's own parameter objects."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in named.items():
            params[name].copy_(t)
    memory.mark_loaded(params[name] for name in named)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_free_drops_the_storage_and_a_full_load_restores_the_logits(tied):
    model = tiny_qwen3(tied)
    before, weights = logits(model), state(model)
    buffers = {n: (b.data_ptr(), b.clone()) for n, b in model.named_buffers()}
    table = dict(model.named_parameters(remove_duplicate=False))  # the engine's name table, made at start-up
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # distinct parameters: a tied one once
    alive = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    memory = WeightMemory(model, "free")
    assert memory.nbytes == held

    assert memory.release() == held and memory.freed
    gc.collect()
    assert not any(ref() is not None for ref in alive), "released storage is still referenced"
    assert all(p.numel() == 0 for p in table.values())
    assert {n: (b.data_ptr(), b) for n, b in model.named_buffers()}.keys() == buffers.keys()
    for name, b in model.named_buffers():
        assert b.data_ptr() == buffers[name][0] and torch.equal(b, buffers[name][1])  # buffers stay resident
    assert memory.release() == 0  # a second release frees nothing more

    assert memory.resume() == held and not memory.freed
    assert memory.unloaded == sorted(weights)  # uninitialised until loaded
    assert all(table[n] is p for n, p in model.named_parameters(remove_duplicate=False))  # the same objects
    assert all(tuple(table[n].shape) == tuple(t.shape) and table[n].dtype == t.dtype for n, t in weights.items())
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in weights  # pushed once, under the embedding's name
    load(model, weights, memory)
    assert memory.unloaded == []
    assert torch.equal(logits(model), before)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name][1])


def test_a_partial_load_leaves_the_rest_named():
    model = tiny_qwen3(tied=True)
    weights = state(model)
    memory = WeightMemory(model, "free")
    memory.release()
    memory.resume()
    first = dict(list(weights.items())[:3])
    load(model, first, memory)
    assert memory.unloaded == sorted(set(weights) - set(first))
    memory.mark_loaded([torch.zeros(3)])  # a tensor that is none of the model's changes nothing
    assert memory.unloaded == sorted(set(weights) - set(first))
    load(model, {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}, memory)
    assert "lm_head.weight" not in memory.unloaded  # tied: loading the embedding loads the head


def test_views_of_one_storage_stay_views_of_one_storage():
    base = torch.arange(12, dtype=torch.float32)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(base[:4])
    module.b = torch.nn.Parameter(base[4:].view(2, 4))
    memory = WeightMemory(module, "free")
    assert memory.nbytes == 12 * 4  # one storage
    memory.release()
    memory.resume()
    assert module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    assert module.b.data_ptr() - module.a.data_ptr() == 4 * 4 and module.b.shape == (2, 4)
    with torch.no_grad():
        module.b.view(-1).copy_(torch.arange(4, 12, dtype=torch.float32))
        module.a.copy_(torch.arange(4, dtype=torch.float32))
    whole = torch.empty(0).set_(module.a.untyped_storage())
    assert torch.equal(whole, torch.arange(12, dtype=torch.float32))


def test_a_parameter_sharing_a_buffers_storage_stays_resident():
    base = torch.arange(8, dtype=torch.float32)
    module = torch.nn.Module()
    module.register_buffer("table", base[:4])
    module.w = torch.nn.Parameter(base[4:])
    module.v = torch.nn.Parameter(torch.ones(3))
    memory = WeightMemory(module, "free")
    assert memory.resident == ["w"] and memory.nbytes == 3 * 4
    memory.release()
    assert module.w.numel() == 4 and module.v.numel() == 0
    memory.resume()
    assert memory.unloaded == ["v"]


@pytest.mark.parametrize("chunk", [release.HOST_CHUNK_BYTES, 1000], ids=["one-chunk", "split-over-chunks"])
def test_cpu_backup_brings_the_values_back_and_reuses_its_host_copy(chunk, monkeypatch):
    monkeypatch.setattr(release, "HOST_CHUNK_BYTES", chunk)
    model = tiny_qwen3(tied=True)
    before, weights = logits(model), state(model)
    memory = WeightMemory(model, "cpu_backup")
    assert memory.release() == memory.nbytes and all(p.numel() == 0 for p in model.parameters())
    host = [t.data_ptr() for t in memory._host]
    assert sum(t.numel() for t in memory._host) == memory.nbytes  # no more host memory than the weights
    assert len(host) == -(-memory.nbytes // chunk)
    memory.resume()
    assert memory.unloaded == []  # whole again: nothing to push
    assert torch.equal(logits(model), before)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name])
    with torch.no_grad():
        model.model.norm.weight.mul_(2)  # a change made after the resume is what the next release keeps
    changed = logits(model)
    memory.release()
    assert [t.data_ptr() for t in memory._host] == host  # the host copy is reused
    memory.resume()
    assert torch.equal(logits(model), changed)


@pytest.mark.parametrize("chunk", [release.HOST_CHUNK_BYTES, 1000], ids=["one-chunk", "split-over-chunks"])
def test_base_backup_copies_the_base_once_and_restores_parameters_from_it(chunk, monkeypatch):
    """base_backup: the host copy is taken once (the base is frozen); releases copy nothing, each resume brings
    the base back whatever was written since; `restore_params` puts single parameters back (a range split over
    host chunks too); `changed` (a full load) makes the next release take a new copy."""
    monkeypatch.setattr(release, "HOST_CHUNK_BYTES", chunk)
    model = tiny_qwen3(tied=True)
    base = state(model)
    memory = WeightMemory(model, "base_backup")
    with pytest.raises(ValueError, match="no host copy"):
        memory.restore_params([model.model.norm.weight])

    def same(want):
        return all(torch.equal(p, want[n]) for n, p in model.named_parameters())

    assert memory.release() == memory.nbytes and all(p.numel() == 0 for p in model.parameters())
    memory.resume()
    assert memory.host_copies == 1 and memory.unloaded == [] and same(base)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1)  # an adapter merged in: not the base
    memory.release()
    memory.resume()
    assert memory.host_copies == 1 and same(base)  # no copy at this release; the base came back

    with torch.no_grad():
        model.model.norm.weight.mul_(2)  # a full-weight load
    memory.changed()
    new = state(model)
    memory.release()
    memory.resume()
    assert memory.host_copies == 2 and same(new)

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    memory.restore_params([model.model.layers[1].self_attn.q_proj.weight, model.model.embed_tokens.weight])
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, new["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, new["model.embed_tokens.weight"])
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                           new["model.layers.0.self_attn.q_proj.weight"])  # only the ones named
    with pytest.raises(ValueError, match="only base_backup"):
        WeightMemory(model, "cpu_backup").snapshot()


def test_keep_frees_nothing():
    model = tiny_qwen3(tied=False)
    before = logits(model)
    memory = WeightMemory(model, "keep")
    assert memory.release() == 0 and memory.released and not memory.freed
    assert all(p.numel() for p in model.parameters())
    assert memory.resume() == 0 and memory.unloaded == []
    assert torch.equal(logits(model), before)


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError, match="'swap'.*free"):
        WeightMemory(torch.nn.Linear(2, 2), "swap")


def test_hf_engine_launch_flags(monkeypatch):
    """`--sglang-enable-weights-cpu-backup` reaches the hf engine's flag of that name; the test-only environment
    switch adds `--release-memory-on-cpu` on CPU, and a value that is no boolean names the variable."""
    from slime.backends.hf_engine.engine import HFEngine
    from tests.args import make_args

    def command(*flags):
        args = make_args(*flags, validate=False, hf_checkpoint="/models/tiny", rollout_seed=0,
                         sglang_server_concurrency=8, use_cuda=torch.cuda.is_available())  # as validation sets it
        return HFEngine(args, rank=0).launch_command("127.0.0.1", 1)

    monkeypatch.delenv("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU", raising=False)
    assert "--enable-weights-cpu-backup" in command("--sglang-enable-weights-cpu-backup")
    assert "--enable-weights-cpu-backup" in command("--sglang-enable-weights-cpu-backup", "true")
    assert "--enable-weights-cpu-backup" not in command("--sglang-enable-weights-cpu-backup", "false")
    assert "--enable-weights-cpu-backup" not in command() and "--release-memory-on-cpu" not in command()
    lora = ("--lora-rank", "8", "--target-modules", "all-linear")
    # unvalidated args: --offload-rollout as --colocate resolves it; the adapter push leaves the base to the engine
    assert "--lora-base-cpu-backup" in command(*lora, "--offload-rollout")
    assert "--lora-base-cpu-backup" not in command(*lora) and "--lora-base-cpu-backup" not in command(
        "--offload-rollout")
    monkeypatch.setenv("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU", "1")
    assert ("--release-memory-on-cpu" in command()) == (not torch.cuda.is_available())
    monkeypatch.setenv("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU", "0")
    assert "--release-memory-on-cpu" not in command()
    monkeypatch.setenv("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU", "sometimes")
    with pytest.raises(ValueError, match="SLIME_ENGINE_RELEASE_MEMORY_ON_CPU.*sometimes"):
        command()


def test_server_flags_choose_the_release_mode(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.backends.hf_engine.scheduler import Scheduler
    from slime.backends.hf_engine.server import EngineState, parse_args

    args = parse_args(["--model-path", "m", "--device", "cpu", "--enable-weights-cpu-backup",
                       "--release-memory-on-cpu"])
    assert args.enable_weights_cpu_backup and args.release_memory_on_cpu
    defaults = parse_args(["--model-path", "m", "--device", "cpu"])
    assert not defaults.enable_weights_cpu_backup and not defaults.release_memory_on_cpu
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert parse_args(["--model-path", "m", "--lora-base-cpu-backup"]).lora_base_cpu_backup
    for frees, backup, lora_base, mode in ((False, False, False, "keep"), (False, True, False, "keep"),
                                           (True, False, False, "free"), (True, True, False, "cpu_backup"),
                                           (True, False, True, "base_backup"), (True, True, True, "base_backup"),
                                           (False, False, True, "keep")):
        state = EngineState(model, tokenizer, Scheduler(model, tokenizer), model_path=tiny_model_dir, device="cpu",
                            dtype="float32", frees_memory=frees, weights_cpu_backup=backup,
                            lora_base_cpu_backup=lora_base)
        assert state.weights.mode == mode
        assert (state.adapter.weights is not None) == (mode == "base_backup")


def test_a_fused_parameter_is_loaded_once_every_part_of_it_is(tmp_path):
    """A MoE's per-expert checkpoint keys are parts of one fused parameter (checkpoint_names.py): after a resume it
    counts as loaded only once every part has been written since, and a part written before the release does not
    count."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.backends.hf_engine.scheduler import Scheduler
    from slime.backends.hf_engine.server import EngineState
    from tools.make_tiny_model import make_tiny_model

    path0 = make_tiny_model(str(tmp_path / "seed0"), arch="qwen3_moe", size="tiny", seed=0)
    path1 = make_tiny_model(str(tmp_path / "seed1"), arch="qwen3_moe", size="tiny", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path0, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path0)
    state = EngineState(model, tokenizer, Scheduler(model, tokenizer), model_path=path0, device="cpu",
                        dtype="float32", frees_memory=True)
    assert state.weights.mode == "free"
    with safe_open(f"{path1}/model.safetensors", "pt") as f:
        push = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118 (safe_open is not a dict)
    missing, fused = "model.layers.2.mlp.experts.3.up_proj.weight", "model.layers.2.mlp.experts.gate_up_proj"
    parts = {key for key, part in state.slices.items() if part.param == fused}
    assert missing in parts and len(parts) == state.slice_counts[fused] == 8  # 4 experts' gate and up
    want = AutoModelForCausalLM.from_pretrained(path1, dtype=torch.float32).state_dict()

    state.weights.release()
    state.weights.resume()
    state.load_named_tensors([(k, t) for k, t in push if k != missing], "push")
    assert not state.weights.complete and state.weights.unloaded == [fused] and fused in state.unavailable()

    state.weights.release()  # the parts written before this release do not count after the resume
    state.weights.resume()
    state.load_named_tensors([(k, t) for k, t in push if k not in parts or k == missing], "push")
    assert state.weights.unloaded == [fused]
    state.load_named_tensors([(k, t) for k, t in push if k in parts and k != missing], "push")
    assert state.weights.complete and state.unavailable() is None
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())

    state.weights.release()
    state.weights.resume()
    state.load_named_tensors([(k, t) for k, t in push if k not in parts] + [(fused, want[fused])], "push")
    assert state.weights.complete  # the fused parameter by its own name is loaded whole
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())
