"""Weights really arrive: after a push, the engine's log-probs of a fixed sequence equal the trainer's. A MoE model
too: the fsdp trainer splits its fused experts into the checkpoint's per-expert tensors and the engine writes them back
into its fused ones."""

from __future__ import annotations

import httpx
import pytest
import ray

from slime.ray.launcher import Run
from slime.config.arguments import parse_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.rewards import ALTERNATING


def _engine_log_probs(url: str, tokens: list[int], response_length: int) -> tuple[list[float], str]:
    r = httpx.post(f"{url}/generate", json={
        "input_ids": tokens, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True, "logprob_start_len": 0,
    }, timeout=60)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    input_lp = [entry[0] for entry in meta["input_token_logprobs"]]
    return input_lp[len(tokens) - response_length:], meta["weight_version"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_pushed_weights_reach_the_engine(tiny_model_dir, toy_data_path, monkeypatch, tmp_path, arch):
    from tools.make_tiny_model import make_tiny_model

    model_dir = tiny_model_dir if arch == "qwen3" else make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny")
    monkeypatch.setenv("SLIME_TRAIN_NUM_THREADS", "1")
    monkeypatch.setenv("SLIME_ENGINE_NUM_THREADS", "1")
    args = parse_args([
        "--hf-checkpoint", model_dir, "--prompt-data", toy_data_path, "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", ALTERNATING,
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--rollout-max-response-len", "4", "--lr", "1e-2", "--micro-batch-size", "16", "--num-rollout", "1",
    ])
    before = run_processes()
    with Run(args) as run:
        run.actor.init(with_ref=False, num_rollout=1)
        engines = ray.get(run.rollout_manager.get_engines.remote())
        url = ray.get(run.rollout_manager.get_engine_urls.remote())[0]
        batch, _ = ray.get(run.rollout_manager.generate.remote(0))
        run.actor.train(0, ray.put(batch))  # trainer weights now differ from the engine's

        tokens, response_length = batch.tokens[0], batch.response_lengths[0]
        trainer_lp = run.actor.compute_log_probs([tokens], [response_length])[0]
        stale_lp, _ = _engine_log_probs(url, tokens, response_length)
        assert max(abs(a - b) for a, b in zip(trainer_lp, stale_lp)) > 1e-3, "training did not change the weights"

        run.actor.update_weights(engines, 7)
        fresh_lp, version = _engine_log_probs(url, tokens, response_length)
        assert version == "7"
        assert len(fresh_lp) == response_length
        assert max(abs(a - b) for a, b in zip(trainer_lp, fresh_lp)) < 1e-4
    assert wait_for_no_new_processes(before) == {}
