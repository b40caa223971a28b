"""The hf engine's decode speed against the memory-bandwidth bound (GPU).

    python benchmarks/decode_speed.py [--shape qwen3-0.6b] [--batch 64,256] [--prompt-len 64] [--new-tokens 256]
                                      [--bandwidth-tb-s 4.3]

A random-init model of the shape (benchmarks/weight_sync.py's helper, bf16 on the GPU) served by the engine's
scheduler in this process (no HTTP), once per `--kv-cache` mode (`dynamic`: a transformers DynamicCache;
`slots`: the preallocated slot cache with CUDA-graph decode, slime/backends/hf_engine/slots.py): `--batch` requests of `--prompt-len` random tokens arrive together, each
generates exactly `--new-tokens` tokens (EOS ignored) at temperature 1 with log-probs, twice on the same
scheduler; the second round is measured (the first captures the CUDA graphs of each shape bucket). Prefill and decode
forward steps are timed apart (every step ends in a host sync, so wall time per step is device time plus the
host's share). The bound of one decode step is the bytes it must read, the weights once plus every live
row's KV cache (2 x layers x KV heads x head dim x 2 bytes per token of context), over `--bandwidth-tb-s`
(device copy bandwidth measured on the H200); efficiency = bound / measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)


def kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16


def bench(model, tokenizer, kv_cache: str, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> dict:
    import torch

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler

    sched = Scheduler(model, tokenizer, max_running_requests=batch, random_seed=0, kv_cache=kv_cache)
    timings = {"prefill": [], "decode": []}

    def timed(kind, fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            timings[kind].append(time.perf_counter() - start)
            return out
        return wrapper

    sched._prefill = timed("prefill", sched._prefill)
    sched._decode = timed("decode", sched._decode)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    for _ in range(2):  # the first round warms up (CUDA graph captures, allocator); the second is measured
        timings["prefill"].clear()
        timings["decode"].clear()
        reqs = [Request(rid=str(i), input_ids=torch.randint(1, vocab - 1, (prompt_len,), generator=gen).tolist(),
                        params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True),
                        return_logprob=True) for i in range(batch)]
        for r in reqs:
            sched.submit(r)
        start = time.perf_counter()
        sched.run_until_idle()
        wall = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in reqs), "a request stopped early"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model.config)
    # decode step k (k = 1 .. new_tokens - 1) feeds token k of every row, attending to prompt + k tokens
    bounds = [(weight_bytes + batch * (prompt_len + k) * per_token) / bandwidth for k in range(1, new_tokens)]
    decode = timings["decode"]
    return {"kv cache": kv_cache, "batch": batch, "wall s": wall, "prefill s": sum(timings["prefill"]),
            "decode steps": len(decode),
            "ms / decode step": 1e3 * statistics.fmean(decode), "bound ms / step": 1e3 * statistics.fmean(bounds),
            "efficiency": statistics.fmean(bounds) / statistics.fmean(decode),
            "decode tok/s": batch * len(decode) / sum(decode)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", default="64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--bandwidth-tb-s", type=float, default=4.3)
    p.add_argument("--kv-cache", default="dynamic,slots", help="scheduler KV cache modes to compare")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_speed.py needs CUDA")
    from transformers import AutoTokenizer

    from weight_sync import make_model_dir

    with tempfile.TemporaryDirectory() as root:
        path, model = make_model_dir(args.shape, root)
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    print(f"{args.shape}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, bf16, "
          f"{torch.cuda.get_device_name()}, bound at {args.bandwidth_tb_s} TB/s")
    header = False
    for mode in args.kv_cache.split(","):
        bench(model, tokenizer, mode, 8, args.prompt_len, 8, args.bandwidth_tb_s * 1e12)  # warm-up (kernels)
        for b in args.batch.split(","):
            row = bench(model, tokenizer, mode, int(b), args.prompt_len, args.new_tokens, args.bandwidth_tb_s * 1e12)
            if not header:  # rows are printed as they finish, so a run cut short keeps what it measured
                print("| " + " | ".join(row) + " |")
                print("|" + " ---: |" * len(row))
                header = True
            print("| " + " | ".join(f"{v:.1%}" if k == "efficiency" else (f"{v:,.2f}" if isinstance(v, float) else str(v))
                                    for k, v in row.items()) + " |", flush=True)


if __name__ == "__main__":
    main()
