"""A GRPO batch's prefill in the hf engine, with its groups' prompts shared and without (CPU or GPU).

    python benchmarks/group_prefill.py [--shape small] [--prompts 32] [--samples 8] [--prompt-len 64]
                                       [--repeats 3] [--device cpu|cuda]

`--prompts` distinct prompts of `--prompt-len` random tokens, `--samples` requests each (a GRPO group's n
samples), all submitted at once to the engine's scheduler in this process (no HTTP), each asking for one new
token, so the run is its prefill (admitted in forwards of at most the scheduler's 16384 padded tokens). Twice
side by side: `shared` (the default: one forward row per distinct prompt, its KV cache and logits copied to the
group's requests) and `alone` (`--disable-shared-prefill`: every request's prompt forwarded itself). Prints the
median wall seconds of `--repeats` rounds after one warm-up round, the rows forwarded, and the ratio; the
sampled tokens of both must agree (the same per-request generators see the same logits).

`--shape`: `tiny` / `small` (tools/make_tiny_model.py, random init, fp32 on CPU) or a published Qwen3 shape of
benchmarks/weight_sync.py (`qwen3-0.6b`, `qwen3-4b`: bf16, GPU).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)


def load_model(shape: str, device: str, workdir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if shape in ("tiny", "small"):
        from tools.make_tiny_model import make_tiny_model

        path = make_tiny_model(os.path.join(workdir, shape), size=shape, seed=0)
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(path)
    from weight_sync import make_model_dir

    path, model = make_model_dir(shape, workdir)  # bf16 on CUDA
    return model.eval(), AutoTokenizer.from_pretrained(path)


def prefill_round(model, tokenizer, prompts: list[list[int]], samples: int, shared: bool, seed: int):
    import torch

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler

    sched = Scheduler(model, tokenizer, max_running_requests=len(prompts) * samples, random_seed=0,
                      shared_prefill=shared)
    reqs = [Request(rid=f"{g}-{k}", input_ids=list(p), return_logprob=True,
                    params=SamplingParams.from_dict({"temperature": 1.0, "max_new_tokens": 1, "ignore_eos": True,
                                                     "sampling_seed": seed + samples * g + k}))
            for g, p in enumerate(prompts) for k in range(samples)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, sched.stats, [r.output_ids for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = p.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as workdir, torch.no_grad():
        model, tokenizer = load_model(args.shape, device, workdir)
        vocab = model.get_output_embeddings().weight.shape[0]
        rng = random.Random(0)
        rows = {}
        for mode, shared in (("shared", True), ("alone", False)):
            seconds, outputs = [], None
            for i in range(args.repeats + 1):  # round 0 warms up (allocator, kernels)
                prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
                if mode == "alone":
                    prompts = rows["shared"]["prompts"][i]  # the same prompts as the shared rounds
                took, stats, out = prefill_round(model, tokenizer, prompts, args.samples, shared, seed=i)
                seconds.append(took)
                outputs = (outputs or []) + [out]
                rows.setdefault(mode, {"prompts": []})["prompts"].append(prompts)
            rows[mode].update(seconds=statistics.median(seconds[1:]), stats=stats, outputs=outputs)
        same = rows["shared"]["outputs"] == rows["alone"]["outputs"]
    n = args.prompts * args.samples
    print(f"{args.shape} on {device}: {args.prompts} prompts x {args.samples} samples x {args.prompt_len} tokens "
          f"({n} requests), median of {args.repeats} rounds")
    print("| prefill | rows forwarded | forwards | seconds | vs alone |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in ("shared", "alone"):
        r = rows[mode]
        print(f"| {mode} | {r['stats']['num_prefill_rows']} | {r['stats']['num_prefill_steps']} | "
              f"{r['seconds']:.3f} | {rows['alone']['seconds'] / r['seconds']:.2f}x |")
    print(f"sampled tokens identical in both modes: {same}")
    if not same:
        sys.exit("the shared prefill changed the sampled tokens")


if __name__ == "__main__":
    main()
