"""The hf engine's release / resume of its weights as on CUDA, on a real server process on CPU.

`SLIME_ENGINE_RELEASE_MEMORY_ON_CPU=1` makes `HFEngine` start the server with `--release-memory-on-cpu`: a release
frees the weights (release.py) and a resume gives them back uninitialised, as SGLang's memory saver does, so
generation waits for a complete push; with `--sglang-enable-weights-cpu-backup` they come back with their values.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import httpx
import pytest
import torch

from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError
from slime.weight_sync.buckets import buckets
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket
from tests.args import make_args

SEQ = [56, 62, 137, 92, 138, 20, 21, 22, 23, 24, 25]


@contextmanager
def released_engine(model_dir, *flags):
    old = os.environ.get("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU")
    os.environ["SLIME_ENGINE_RELEASE_MEMORY_ON_CPU"] = "1"
    eng = HFEngine(make_args(*flags, hf_checkpoint=model_dir, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()
        if old is None:
            os.environ.pop("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU")
        else:
            os.environ["SLIME_ENGINE_RELEASE_MEMORY_ON_CPU"] = old


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    """What the trainer pushes: the checkpoint's parameters by name (a tied one once, as named_parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def scores(url):
    resp = httpx.post(url + "/generate", json={"input_ids": SEQ, "sampling_params": {"max_new_tokens": 0},
                                              "return_logprob": True, "logprob_start_len": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    return [lp for lp, _, _ in resp.json()["meta_info"]["input_token_logprobs"][1:]]


def refused(url) -> str:
    resp = httpx.post(url + "/generate", json={"input_ids": SEQ, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert resp.status_code == 503, resp.text
    return resp.json()["error"]["message"]


def push(engine, named, version):
    for bucket in buckets(named, max_bytes=1 << 20):
        flat = flatten_bucket(bucket)  # kept alive until the engine has copied it (shared memory)
        engine.update_weights_from_tensor(serialize_bucket(flat), weight_version=version)


def log_lines(engine, what: str) -> list[str]:
    with open(engine.log_path, errors="replace") as f:
        return [line for line in f if f"memory: {what}" in line]


@pytest.mark.timeout(240)
def test_freed_weights_come_back_uninitialised_and_generation_waits_for_a_complete_push(tiny_model_dir, checkpoint):
    with released_engine(tiny_model_dir) as engine:
        url = engine.get_url()
        loaded = scores(url)
        info = engine.get_server_info()
        assert info["weights_release"] == "free" and info["uninitialised_weights"] == 0
        engine.check_weights("snapshot")

        engine.release_memory_occupation()
        assert "resume_memory_occupation" in refused(url)
        with pytest.raises(EngineHTTPError, match="released.*resume_memory_occupation"):
            push(engine, checkpoint, "too-early")  # nothing to copy into: refused, naming the fix
        with pytest.raises(EngineHTTPError, match="released"):
            engine.check_weights("checksum")
        freed = log_lines(engine, "released")[-1]
        held = sum(t.numel() * t.element_size() for _, t in checkpoint)
        assert float(re.search(r"([\d.]+) GB freed", freed).group(1)) == pytest.approx(held / 1e9, abs=1e-3), freed

        # slime's order: weights back, push, then the KV cache; in between generation is refused, naming what is missing
        engine.resume_memory_occupation(["weights"])
        message = refused(url)
        assert f"{len(checkpoint)} of {len(checkpoint)} parameters have not been loaded" in message, message
        assert "--enable-weights-cpu-backup" in message
        assert engine.health_generate(timeout=10)  # waiting for weights on purpose is not being dead
        assert engine.get_server_info()["uninitialised_weights"] == len(checkpoint)
        left_out = next(n for n, _ in checkpoint if n.endswith("layers.1.mlp.down_proj.weight"))
        push(engine, [(n, t) for n, t in checkpoint if n != left_out], "1")
        message = refused(url)
        assert f"1 of {len(checkpoint)} parameters" in message and left_out in message, message
        push(engine, [(n, t) for n, t in checkpoint if n == left_out], "1")
        engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
        assert scores(url) == loaded
        assert engine.check_weights("compare")["success"] is True  # --check-weight-update-equal's check
        assert engine.get_server_info()["uninitialised_weights"] == 0

        # a resume without a push is never served, also with every tag at once; a load from disk completes it
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        assert "have not been loaded" in refused(url)
        engine.update_weights_from_disk(tiny_model_dir, weight_version="2")
        assert scores(url) == loaded
        assert "uninitialised until loaded" in log_lines(engine, "resumed")[-1]


@pytest.mark.timeout(240)
def test_cpu_backup_keeps_the_released_weights(tiny_model_dir):
    with released_engine(tiny_model_dir, "--sglang-enable-weights-cpu-backup") as engine:
        url = engine.get_url()
        loaded = scores(url)
        assert engine.get_server_info()["weights_release"] == "cpu_backup"
        for _ in range(2):  # the second release reuses the host copy
            engine.release_memory_occupation()
            assert "resume_memory_occupation" in refused(url)
            engine.resume_memory_occupation()
            assert scores(url) == loaded  # no push needed
        assert float(re.search(r"([\d.]+) GB freed", log_lines(engine, "released")[-1]).group(1)) > 0


def local_scores(model) -> list[float]:
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(1, ids[0, 1:, None])[:, 0].tolist()


@pytest.mark.timeout(240)
def test_colocated_lora_engine_gets_its_base_back_from_one_host_copy(tiny_model_dir):
    """A LoRA run whose engines release their weights (--offload-rollout, on with --colocate) starts the hf engine
    with --lora-base-cpu-backup: each release frees the weights (as on CUDA) and copies nothing, each resume brings
    the base back from one host copy and merges the loaded adapter again, so a push of the adapter alone gives
    base + adapter; unloading it gives exactly the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    from slime.weight_sync.adapter import push_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    r, alpha = 4, 8

    def adapter(scale: float):
        named, merged = [], {}
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                a = torch.randn(r, module.in_features, generator=gen) * 0.3
                b = torch.randn(module.out_features, r, generator=gen) * scale
                named += [(f"{name}.lora_A.weight", a), (f"{name}.lora_B.weight", b)]
                merged[name + ".weight"] = module.weight + (alpha / r) * b @ a
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in merged:
                    p.copy_(merged[n])
        return named, local_scores(model)

    config = {"r": r, "lora_alpha": alpha, "target_modules": ["all-linear"]}
    lora = ("--lora-rank", str(r), "--lora-alpha", str(alpha), "--target-modules", "all-linear", "--offload-rollout")
    with released_engine(tiny_model_dir, *lora) as engine:
        url = engine.get_url()
        assert local_scores(base) == pytest.approx(scores(url), abs=1e-5)
        engine.check_weights("snapshot")  # the checkpoint's weights, to compare with after the round trips
        info = engine.get_server_info()
        assert info["weights_release"] == "base_backup" and info["weights_host_copies"] == 0
        engine.release_memory_occupation()  # start-up: released before the first push, as train.py does
        assert "resume_memory_occupation" in refused(url)
        for version in range(3):  # each step: resume the weights, push the adapter, generate, release
            engine.resume_memory_occupation(["weights"])
            named, want = adapter(scale=0.05 * (version + 1))
            push_adapter(named, [engine], config, str(version))
            engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
            got = scores(url)
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (version, got, want)
            assert max(abs(a - b) for a, b in zip(got, local_scores(base))) > 1e-3  # the adapter moves them
            engine.release_memory_occupation()
            engine.resume_memory_occupation()  # without a push: the same adapter merged on the base again
            assert scores(url) == got
            engine.release_memory_occupation()
        info = engine.get_server_info()
        assert info["weights_host_copies"] == 1 and info["uninitialised_weights"] == 0  # taken once, at start-up
        freed = [float(re.search(r"([\d.]+) GB freed", line).group(1)) for line in log_lines(engine, "released")]
        assert len(freed) == 7 and all(gb > 0 for gb in freed), freed
        engine.resume_memory_occupation()
        engine.unload_lora_adapter("slime_lora")
        assert engine.check_weights("compare")["success"] is True  # exactly the checkpoint's weights again
        assert scores(url) == pytest.approx(local_scores(base), abs=1e-5)
