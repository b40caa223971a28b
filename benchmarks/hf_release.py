"""The hf engine's memory release and resume, alone (no trainer): seconds per call, and what the next generation pays.

    python benchmarks/hf_release.py [--shape qwen3-4b|qwen3-0.6b|tiny|small] [--modes free,cpu_backup]
        [--cycles 3] [--requests 64] [--prompt-len 64] [--new-tokens 128]

Per mode one hf engine server, started as slime starts it (`HFEngine`; `cpu_backup`: with
`--sglang-enable-weights-cpu-backup`). Each cycle runs slime's colocated order with the trainer left out: release
everything, resume the weights, load them (`free`: from the model folder, `update_weights_from_disk`, standing in
for the trainer's push, which the colocated run times; `cpu_backup` needs none), resume the KV cache and CUDA
graphs, then generate one batch (`--requests` greedy requests of `--prompt-len` random tokens and `--new-tokens`
new ones) twice: the first after the resume pays for the KV slots and the CUDA graphs again, the second is the
steady state. Seconds are the client's (one HTTP call each); the table also shows the engine's own seconds for the
release and the weights' resume (its log lines) and the CUDA graphs captured during the first generation.

On CUDA the shapes are benchmarks/weight_sync.py's random-init Qwen3 ones in bf16. Without CUDA the `tiny` /
`small` shapes of tools/make_tiny_model.py run on CPU with `SLIME_ENGINE_RELEASE_MEMORY_ON_CPU=1` (the engine frees
its weights as on CUDA): the same calls, timings that say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH_DIR)

import httpx  # noqa: E402

from colocate_memory import engine_memory_calls  # noqa: E402 (benchmarks/ on the path first)

MODES = {"free": [], "cpu_backup": ["--sglang-enable-weights-cpu-backup"]}
CPU_SHAPES = ("tiny", "small")


def make_model(shape: str, workdir: str) -> tuple[str, int]:
    """The model folder of `shape` and its vocabulary size."""
    import json

    if shape in CPU_SHAPES:
        from tools.make_tiny_model import make_tiny_model

        path = make_tiny_model(os.path.join(workdir, shape), size=shape, seed=0)
    else:
        import torch

        from weight_sync import make_model_dir

        path, model = make_model_dir(shape, workdir)
        del model
        torch.cuda.empty_cache()
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)["vocab_size"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generate_batch(url: str, prompts: list[list[int]], new_tokens: int) -> None:
    body = {"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                      "ignore_eos": True}}
    resp = httpx.post(url + "/generate", json=body, timeout=3600, trust_env=False)
    if resp.status_code != 200:
        raise SystemExit(f"/generate answered {resp.status_code}: {resp.text[:2000]}")


def run_mode(args, mode: str, model_dir: str, prompts: list[list[int]]) -> list[dict]:
    from slime.backends.hf_engine.engine import HFEngine
    from tests.args import make_args

    engine = HFEngine(make_args(*MODES[mode], hf_checkpoint=model_dir, rollout_seed=0,
                                sglang_server_concurrency=max(args.requests, 1)), rank=0)
    rows = []
    try:
        url = engine.init()
        generate_batch(url, prompts, args.new_tokens)  # warm: KV slots allocated, CUDA graphs captured
        for cycle in range(args.cycles):
            row = {"mode": mode, "cycle": cycle}
            row["release"] = timed(engine.release_memory_occupation)
            row["resume_weights"] = timed(lambda: engine.resume_memory_occupation(["weights"]))
            row["load"] = (timed(lambda: engine.update_weights_from_disk(model_dir, weight_version=str(cycle)))
                           if mode == "free" else 0.0)
            row["resume_kv"] = timed(lambda: engine.resume_memory_occupation(["kv_cache", "cuda_graph"]))
            graphs = engine.get_server_info().get("num_cuda_graphs", 0)
            row["first_generate"] = timed(lambda: generate_batch(url, prompts, args.new_tokens))
            row["graphs"] = engine.get_server_info().get("num_cuda_graphs", 0) - graphs
            row["steady_generate"] = timed(lambda: generate_batch(url, prompts, args.new_tokens))
            rows.append(row)
        own = engine_memory_calls([engine.log_path])
        releases = [c for c in own if c["call"] == "released"][-args.cycles:]
        resumes = [c for c in own if c["call"] == "resumed" and c["tags"] == ["weights"]][-args.cycles:]
        for row, rel, res in zip(rows, releases, resumes):
            row.update(engine_release=rel["seconds"], engine_resume_weights=res["seconds"], gb=rel["gb"])
    finally:
        engine.shutdown()
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| mode | cycle | release s (engine's) | resume weights s (engine's) | load from disk s | resume kv s | "
             "first generate s | steady generate s | re-capture + re-allocation s | graphs captured | GB freed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['cycle']} | {r['release']:.3f} ({r.get('engine_release', float('nan')):.3f}) "
                     f"| {r['resume_weights']:.3f} ({r.get('engine_resume_weights', float('nan')):.3f}) | "
                     f"{r['load']:.2f} | {r['resume_kv']:.3f} | {r['first_generate']:.2f} | "
                     f"{r['steady_generate']:.2f} | {r['first_generate'] - r['steady_generate']:.2f} | {r['graphs']} | "
                     f"{r.get('gb', float('nan')):.3f} |")
    return "\n".join(lines)


def main() -> None:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b" if cuda else "tiny")
    p.add_argument("--modes", default="free,cpu_backup")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if not cuda and args.shape not in CPU_SHAPES:
        sys.exit(f"--shape {args.shape} needs CUDA; without it choose one of {', '.join(CPU_SHAPES)}")
    if not cuda:
        os.environ["SLIME_ENGINE_RELEASE_MEMORY_ON_CPU"] = "1"
        os.environ.setdefault("SLIME_ENGINE_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as workdir:
        os.environ.setdefault("SLIME_ENGINE_LOG_DIR", os.path.join(workdir, "engine_logs"))
        model_dir, vocab = make_model(args.shape, workdir)
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        rows = [row for mode in modes for row in run_mode(args, mode, model_dir, prompts)]
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{args.shape} on {device}: hf engine release / resume, {args.requests} requests x {args.prompt_len} + "
          f"{args.new_tokens} tokens per generation")
    print(report(rows))


if __name__ == "__main__":
    main()
