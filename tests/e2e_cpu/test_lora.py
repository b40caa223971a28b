"""LoRA end to end on CPU (docs/lora.md): real Ray, the hf engine process, fsdp training with adapters. A push sends
only the adapter (the engine reports its bytes), after it the engine's log-probs equal the trainer's, and training
moves the policy; a save writes the base HF folder and a PEFT adapter folder, and a resume continues from them."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError
from slime.config.arguments import parse_args
from slime.ray.launcher import Run
from slime.utils import lora_adapter
from tests.args import make_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.rewards import ALTERNATING

RANK = 8


def _engine_log_probs(url: str, tokens: list[int], response_length: int) -> tuple[list[float], str]:
    r = httpx.post(f"{url}/generate", json={
        "input_ids": tokens, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True, "logprob_start_len": 0,
    }, timeout=60)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    input_lp = [entry[0] for entry in meta["input_token_logprobs"]]
    return input_lp[len(tokens) - response_length:], meta["weight_version"]


def _adapter_bytes(model_dir: str) -> tuple[int, int]:
    """(adapter bytes with all-linear at RANK, full fp32 weight bytes) of the model, from its config and weights."""
    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, ffn = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size, c.intermediate_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, ffn), (h, ffn), (ffn, h)]
    adapter = c.num_hidden_layers * sum(RANK * (i + o) for i, o in shapes) * 4
    full = sum(t.numel() * 4 for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    return adapter, full


def _args(model_dir, data_path, *extra):
    return parse_args([
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", ALTERNATING,  # non-zero advantages
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--rollout-max-response-len", "4", "--lr", "1e-2", "--micro-batch-size", "16",
        "--train-backend", "fsdp", "--lora-rank", str(RANK), "--lora-alpha", "16", "--target-modules", "all-linear",
        *extra,
    ])


@pytest.mark.timeout(500)
def test_lora_push_sends_only_the_adapter_and_log_probs_agree(tiny_model_dir, toy_data_path, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIME_TRAIN_NUM_THREADS", "1")
    monkeypatch.setenv("SLIME_ENGINE_NUM_THREADS", "1")
    save = str(tmp_path / "ckpt")
    hf_out = str(tmp_path / "hf_{rollout_id}")
    args = _args(tiny_model_dir, toy_data_path, "--num-rollout", "2", "--save", save, "--save-hf", hf_out)
    adapter_bytes, full_bytes = _adapter_bytes(tiny_model_dir)
    before = run_processes()
    with Run(args) as run:
        run.actor.init(with_ref=False, num_rollout=2)
        engines = ray.get(run.rollout_manager.get_engines.remote())
        url = ray.get(run.rollout_manager.get_engine_urls.remote())[0]
        batch, _ = ray.get(run.rollout_manager.generate.remote(0))
        tokens, response_length = batch.tokens[0], batch.response_lengths[0]
        base_lp = run.actor.compute_log_probs([tokens], [response_length])[0]
        engine_lp, _ = _engine_log_probs(url, tokens, response_length)
        assert max(abs(a - b) for a, b in zip(base_lp, engine_lp)) < 1e-4, "B = 0: step 0 is the base model"

        metrics = run.actor.train(0, ray.put(batch))
        assert metrics["train/grad_norm"] > 0
        trainer_lp = run.actor.compute_log_probs([tokens], [response_length])[0]
        assert max(abs(a - b) for a, b in zip(trainer_lp, base_lp)) > 1e-3, "training did not move the adapter"
        stale_lp, _ = _engine_log_probs(url, tokens, response_length)
        assert max(abs(a - b) for a, b in zip(trainer_lp, stale_lp)) > 1e-3

        run.actor.update_weights(engines, 7)
        info = httpx.get(f"{url}/server_info", timeout=30).json()["lora_adapter"]
        assert info["bytes"] == adapter_bytes, (info, adapter_bytes)
        assert info["bytes"] < full_bytes / 4, (info["bytes"], full_bytes)
        fresh_lp, version = _engine_log_probs(url, tokens, response_length)
        assert version == "7"
        assert max(abs(a - b) for a, b in zip(trainer_lp, fresh_lp)) < 1e-4

        run.actor.save(0)
        resumed_batch, _ = ray.get(run.rollout_manager.generate.remote(1))
        next_metrics = run.actor.train(1, ray.put(resumed_batch))
    assert wait_for_no_new_processes(before) == {}

    folder = os.path.join(save, "iter_0000000")
    assert not any(".lora_" in k for k in load_file(os.path.join(folder, "model.safetensors")))
    with open(os.path.join(folder, "adapter", "adapter_config.json")) as f:
        assert json.load(f)["r"] == RANK
    adapter = load_file(os.path.join(folder, "adapter", "adapter_model.safetensors"))
    assert sum(t.numel() * t.element_size() for t in adapter.values()) == adapter_bytes

    # --save-hf: the base with the adapter merged in, i.e. the policy the engine served after the push
    merged = AutoModelForCausalLM.from_pretrained(hf_out.format(rollout_id=0), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = merged(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(lp[-response_length:].tolist(), trainer_lp)) < 1e-4
    assert os.path.isfile(os.path.join(hf_out.format(rollout_id=0), "adapter", "adapter_model.safetensors"))

    # Resume from the save: the same next rollout's loss as the run that went on.
    args = _args(tiny_model_dir, toy_data_path, "--num-rollout", "2", "--load", save, "--save", save)
    with Run(args) as run:
        assert run.actor.init(with_ref=False, num_rollout=2) == 1
        again = run.actor.train(1, ray.put(resumed_batch))
    assert wait_for_no_new_processes(before) == {}
    assert again["train/loss"] == pytest.approx(next_metrics["train/loss"], rel=1e-5, abs=1e-7)
    assert again["train/grad_norm"] == pytest.approx(next_metrics["train/grad_norm"], rel=1e-4)

    # The checkpoint's weights are only the base: loading it without LoRA stops, naming the fix.
    args = parse_args(["--hf-checkpoint", tiny_model_dir, "--prompt-data", toy_data_path, "--input-key", "prompt",
                       "--label-key", "label", "--rm-type", "random", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                       "--global-batch-size", "16", "--num-rollout", "2", "--train-backend", "fsdp", "--load", save])
    with Run(args) as run, pytest.raises(Exception, match="was saved with LoRA.*pass the run's --lora-rank"):
        run.actor.init(with_ref=False, num_rollout=2)
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.timeout(300)
def test_engine_loads_and_unloads_a_peft_folder(tiny_model_dir, tmp_path, monkeypatch):
    """SGLang's /load_lora_adapter and /unload_lora_adapter on the hf engine process: the served log-probs are those
    of the merged model, then the base's again; bad requests answer 400 and change nothing."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    names = lora.apply_lora(model, RANK, 16, "q_proj,v_proj,down_proj")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".lora_B.weight"):
                p.normal_(0, 0.1)
    folder = str(tmp_path / "adapters" / "a1")
    lora_adapter.write_adapter_folder(model.state_dict(), {"r": RANK, "lora_alpha": 16, "target_modules": names}, folder)
    monkeypatch.setenv("SLIME_ENGINE_WEIGHT_DIRS", str(tmp_path / "adapters"))
    monkeypatch.setenv("SLIME_ENGINE_NUM_THREADS", "1")
    tokens = [56, 62, 137, 92, 11, 40, 7]

    def local(m):
        with torch.no_grad():
            logits = m(torch.tensor([tokens])).logits[0]
        return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()

    before = run_processes()
    eng = HFEngine(make_args(hf_checkpoint=tiny_model_dir, sglang_server_concurrency=4), 0)
    try:
        url = eng.init()
        out = eng.load_lora_adapter("a1", folder)
        assert out["success"] and out["loaded_adapters"] == {"a1": folder}
        served, _ = _engine_log_probs(url, tokens, len(tokens) - 1)
        assert max(abs(a - b) for a, b in zip(served, local(model))) < 1e-4
        assert max(abs(a - b) for a, b in zip(served, local(base))) > 1e-3
        with pytest.raises(EngineHTTPError, match="no adapter named 'other'"):
            eng.unload_lora_adapter("other")
        with pytest.raises(EngineHTTPError, match="outside the folders"):
            eng.load_lora_adapter("a2", str(tmp_path))
        with pytest.raises(EngineHTTPError, match="no adapter_config.json"):
            eng.load_lora_adapter("a2", str(tmp_path / "adapters"))
        assert httpx.get(f"{url}/server_info", timeout=30).json()["lora_adapter"]["name"] == "a1"
        assert eng.unload_lora_adapter("a1")["loaded_adapters"] == {}
        served, _ = _engine_log_probs(url, tokens, len(tokens) - 1)
        assert max(abs(a - b) for a, b in zip(served, local(base))) < 1e-5
    finally:
        eng.shutdown()
    assert wait_for_no_new_processes(before) == {}
