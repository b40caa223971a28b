"""The hf engine's decode speed against the memory-bandwidth bound (GPU), next to a real SGLang server's.

    python benchmarks/decode_speed.py [--shape qwen3-0.6b] [--batch 64,256] [--prompt-len 64] [--new-tokens 256]
                                      [--bandwidth-tb-s B] [--kv-cache dynamic,slots,slots:sdpa] [--norms op,fused]
                                      [--rotary fused] [--projections fused] [--overlap off,on]
                                      [--sglang triton,flashinfer]

A random-init model of the shape (benchmarks/weight_sync.py's helper, bf16 on the GPU) served by the engine's
scheduler in this process (no HTTP), once per `--kv-cache` mode (`dynamic`: a transformers DynamicCache;
`slots`: the preallocated slot cache with CUDA-graph decode, slime/backends/hf_engine/slots.py, and its default
decode attention, the kernel of slime/backends/hf_engine/decode_attention.py on CUDA; `slots:sdpa` / `slots:triton`:
the same with that attention named): `--batch` requests of `--prompt-len` random tokens arrive together, each
generates exactly `--new-tokens` tokens (EOS ignored) at temperature 1 with log-probs, twice on the same
scheduler; the second round is measured (the first captures the CUDA graphs of each shape bucket). Prefill forward
steps are timed apart (synchronised); the decode time is the round's wall time less the prefills', per token after
the first (`--new-tokens` - 1 steps; the overlap schedule takes one more forward step, for rows already finished):
device time plus the host's share, which the overlap schedule hides behind the next step. The bound of one decode step is the bytes it must read, the weights once plus every live
row's KV cache (2 x layers x KV heads x head dim x 2 bytes per token of context), over `--bandwidth-tb-s`
(default: this GPU's device-to-device copy bandwidth, read + write, measured at the start: 4.3 TB/s on the H200);
efficiency = bound / measured. `--norms`: each KV cache mode with
transformers' RMSNorm modules as they are (`op`: about eight kernels each) and then each as one `F.rms_norm`
kernel (`fused`: what the engine serves with on CUDA, slime/backends/hf_engine/fused_norms.py). `--rotary`: the rotary
embedding as transformers computes it (`op`, about ten kernels a layer) and as one Triton kernel for the query and
one for the key (`fused`, the engine's default on CUDA, slime/backends/hf_engine/fused_rotary.py). `--projections`:
the attention's q/k/v and the MLP's gate/up projections as separate products (`op`) and as one product per group
(`fused`, the engine's default on CUDA, slime/backends/hf_engine/fused_projections.py). `--overlap`: the
slot cache's rows with the plain schedule (`off`, the server's `--disable-overlap-schedule`) and the overlap schedule
(`on`, its default on CUDA: the next decode step is launched before the host reads this one's tokens).

`--sglang BACKENDS` adds one row per batch for a real SGLang server per attention backend, on the same model
folder (bf16, pytorch sampler, CUDA graphs up to the largest batch, radix cache off so nothing is reused), started
by `SLIME_SGLANG_LAUNCHER` when set (docs/sglang_backend.md), else `python -m sglang.launch_server`. SGLang is
timed over HTTP: one `/generate` of the whole batch (its `input_ids` lists) with 1 new token (prefill) and one
with `--new-tokens` (fresh random prompts each time); its decode step is the difference over `--new-tokens - 1`,
so host and HTTP overhead of the second call count against it. The server's start-up seconds (JIT compiles and
CUDA graph capture included) are printed per backend.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)


def kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16


def bench(model, tokenizer, kv_cache: str, batch: int, prompt_len: int, new_tokens: int, bandwidth: float,
          profile: int = 0, overlap: bool = False) -> dict:
    import torch

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler

    cache, _, attention = kv_cache.partition(":")  # slots:sdpa: the slot cache with --decode-attention sdpa
    attention, apart, extra = attention.partition("-")  # slots:triton-kv: and --disable-fused-kv-write
    if apart and extra != "kv":
        raise SystemExit(f"--kv-cache {kv_cache}: the part after '-' can only be 'kv' (--disable-fused-kv-write)")
    sched = Scheduler(model, tokenizer, max_running_requests=batch, random_seed=0, kv_cache=cache, overlap=overlap,
                      decode_attention=attention or "auto", fused_kv_write=False if apart else None)
    prefills, decode_steps = [], [0]
    prefill, decode = sched._prefill, sched._decode

    def timed_prefill(*a, **kw):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = prefill(*a, **kw)
        torch.cuda.synchronize()
        prefills.append(time.perf_counter() - start)
        return out

    def counted_decode(*a, **kw):  # no sync here: the overlap schedule's steps run ahead of the host
        decode_steps[0] += 1
        return decode(*a, **kw)

    sched._prefill, sched._decode = timed_prefill, counted_decode
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    for _ in range(2):  # the first round warms up (CUDA graph captures, allocator); the second is measured
        prefills.clear()
        decode_steps[0] = 0
        reqs = [Request(rid=str(i), input_ids=torch.randint(1, vocab - 1, (prompt_len,), generator=gen).tolist(),
                        params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True),
                        return_logprob=True) for i in range(batch)]
        for r in reqs:
            sched.submit(r)
        torch.cuda.synchronize()
        start = time.perf_counter()
        sched.run_until_idle()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in reqs), "a request stopped early"
    if profile:
        profile_round(sched, vocab, batch, prompt_len, profile, f"{kv_cache}, batch {batch}")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model.config)
    # decode step k (k = 1 .. new_tokens - 1) feeds token k of every row, attending to prompt + k tokens
    bounds = [(weight_bytes + batch * (prompt_len + k) * per_token) / bandwidth for k in range(1, new_tokens)]
    steps, decode_s = decode_steps[0], wall - sum(prefills)
    return {"kv cache": kv_cache, "batch": batch, "wall s": wall, "prefill s": sum(prefills), "decode steps": steps,
            "ms / decode step": 1e3 * decode_s / (new_tokens - 1), "bound ms / step": 1e3 * statistics.fmean(bounds),
            "efficiency": statistics.fmean(bounds) / (decode_s / (new_tokens - 1)),
            "decode tok/s": batch * (new_tokens - 1) / decode_s}


def profile_round(sched, vocab: int, batch: int, prompt_len: int, top: int, label: str) -> None:
    """--profile: one more round of 32 new tokens under torch.profiler (after the measured one, so the timings
    above are not profiled); prints GPU kernel time against wall time and the top kernels and host operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from slime.backends.hf_engine.scheduler import Request, SamplingParams
    from tests.gpu.timing import kernel_seconds

    gen = torch.Generator().manual_seed(batch + 1)
    for i in range(batch):
        sched.submit(Request(rid=f"p{i}", input_ids=torch.randint(1, vocab - 1, (prompt_len,), generator=gen).tolist(),
                             params=SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True),
                             return_logprob=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        sched.run_until_idle()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernel_s = kernel_seconds(events)
    print(f"\n[{label}] profiled round (32 new tokens): wall {wall:.3f} s, GPU kernel time {kernel_s:.3f} s "
          f"({kernel_s / wall:.0%} busy)", file=sys.stderr)
    print(events.table(sort_by="self_device_time_total", row_limit=top), file=sys.stderr)
    print(events.table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr, flush=True)


def sglang_server(model_dir: str, attention_backend: str, max_batch: int, log_path: str):
    """Start SGLang on `model_dir`; returns (process, base URL, start-up seconds). The caller stops it."""
    import httpx

    from slime.utils.net import free_port

    port = free_port("127.0.0.1")
    launcher = shlex.split(os.environ.get("SLIME_SGLANG_LAUNCHER", "")) or [sys.executable, "-m",
                                                                           "sglang.launch_server"]
    cmd = [*launcher, "--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--attention-backend", attention_backend, "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5",
           "--cuda-graph-max-bs", str(max_batch), "--max-running-requests", str(max_batch),
           "--disable-prefill-cuda-graph", "--disable-radix-cache", "--skip-server-warmup", "--random-seed", "0"]
    log = open(log_path, "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            log.close()
            with open(log_path) as f:
                raise SystemExit(f"SGLang ({attention_backend}) exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            if httpx.get(url + "/health_generate", timeout=60, trust_env=False).status_code == 200:
                return proc, url, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        if time.perf_counter() - start > 900:
            stop_server(proc)
            raise SystemExit(f"SGLang ({attention_backend}) did not answer /health_generate in 900 s; see {log_path}")
        time.sleep(1)


def stop_server(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def bench_sglang(url: str, name: str, vocab: int, batch: int, prompt_len: int, new_tokens: int,
                 bound_s: float) -> dict:
    import httpx

    rng = random.Random(batch)

    def timed(max_new: int) -> float:
        body = {"input_ids": [[rng.randrange(1, vocab - 1) for _ in range(prompt_len)] for _ in range(batch)],
                "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True},
                "return_logprob": True}
        start = time.perf_counter()
        answer = httpx.post(url + "/generate", json=body, timeout=600, trust_env=False)
        wall = time.perf_counter() - start
        answer.raise_for_status()
        lengths = {len(a["meta_info"]["output_token_logprobs"]) for a in answer.json()}
        assert lengths == {max_new}, f"SGLang returned {lengths} tokens per request, expected {max_new}"
        return wall

    timed(8)  # warm-up
    prefill, wall = timed(1), timed(new_tokens)
    step = (wall - prefill) / (new_tokens - 1)
    return {"kv cache": f"sglang {name}", "norms": "sglang", "rotary": "sglang", "projections": "sglang",
            "overlap": "sglang", "batch": batch,
            "wall s": wall, "prefill s": prefill,
            "decode steps": new_tokens - 1, "ms / decode step": 1e3 * step, "bound ms / step": 1e3 * bound_s,
            "efficiency": bound_s / step, "decode tok/s": batch / step}


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read + write), the best of 5."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / min(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", default="64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--bandwidth-tb-s", type=float, default=None,
                   help="the bound's memory bandwidth (default: measured here by a device copy)")
    p.add_argument("--kv-cache", default="dynamic,slots", help="scheduler KV cache modes to compare ('' for none); "
                   "slots:sdpa / slots:triton: the slot cache with the hf engine's --decode-attention sdpa / triton (plain slots: "
                   "its default, auto); slots:triton-kv adds --disable-fused-kv-write")
    p.add_argument("--norms", default="op,fused", help="RMSNorm forms to compare: op (transformers' modules), "
                   "fused (F.rms_norm, the engine's default on CUDA); op runs first, fusing is not undone")
    p.add_argument("--rotary", default="fused", help="rotary embedding forms to compare, under each --norms form: op "
                   "(transformers' apply_rotary_pos_emb), fused (one Triton kernel per tensor, the engine's default on "
                   "CUDA)")
    p.add_argument("--projections", default="fused", help="projection forms to compare, under each --rotary form: "
                   "op (q/k/v and gate/up one product each as transformers runs them), fused (one product per group, "
                   "the engine's default on CUDA)")
    p.add_argument("--overlap", default="off,on", help="schedules of the slots rows to compare: off (plain), on "
                   "(the overlap schedule, the engine's default on CUDA)")
    p.add_argument("--sglang", default="", help="attention backends of a real SGLang server to add rows for, "
                   "e.g. triton,flashinfer")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each measured row, profile one more round and print the top N kernels / host ops")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_speed.py needs CUDA")
    from transformers import AutoTokenizer

    from weight_sync import make_model_dir

    from slime.backends.hf_engine.fused_norms import fuse_rms_norms
    from slime.backends.hf_engine.fused_projections import join_projections, restore_projections
    from slime.backends.hf_engine.fused_rotary import fuse_rotary, restore_rotary

    header = []

    def print_row(row: dict) -> None:  # rows are printed as they finish, so a run cut short keeps what it measured
        if not header:
            print("| " + " | ".join(row) + " |")
            print("|" + " ---: |" * len(row))
            header.append(True)
        print("| " + " | ".join(f"{v:.1%}" if k == "efficiency" else (f"{v:,.2f}" if isinstance(v, float) else str(v))
                                for k, v in row.items()) + " |", flush=True)

    batches = [int(b) for b in args.batch.split(",")]
    if args.bandwidth_tb_s is None:
        args.bandwidth_tb_s = round(copy_bandwidth() / 1e12, 2)
    bandwidth = args.bandwidth_tb_s * 1e12
    with tempfile.TemporaryDirectory() as root:
        path, model = make_model_dir(args.shape, root)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model.eval()
        print(f"{args.shape}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, bf16, "
              f"{torch.cuda.get_device_name()}, bound at {args.bandwidth_tb_s} TB/s")
        norms = [n for n in ("op", "fused") if n in args.norms.split(",")]
        rotary = [r for r in ("op", "fused") if r in args.rotary.split(",")]
        projections = [f for f in ("op", "fused") if f in args.projections.split(",")]
        for form in norms:
            if form == "fused":
                fuse_rms_norms(model)
            for rotation in rotary:
                if rotation == "fused" and not fuse_rotary(model):
                    sys.exit("--rotary fused: the model's rotary embedding could not be fused (see the log)")
                if rotation == "op":
                    restore_rotary(model)
                for joining in projections:
                    if joining == "fused" and not join_projections(model):
                        sys.exit("--projections fused: no projections could be joined (see the log)")
                    if joining == "op":
                        restore_projections(model)
                    for mode in filter(None, args.kv_cache.split(",")):
                        bench(model, tokenizer, mode, 8, args.prompt_len, 8, bandwidth)  # warm-up (kernels)
                        overlaps = [o for o in ("off", "on") if o in args.overlap.split(",")]
                        schedules = overlaps if mode.startswith("slots") else ["off"]
                        for overlap in schedules:
                            for b in batches:
                                row = bench(model, tokenizer, mode, b, args.prompt_len, args.new_tokens, bandwidth,
                                            args.profile, overlap=overlap == "on")
                                print_row({"kv cache": row.pop("kv cache"), "norms": form, "rotary": rotation,
                                           "projections": joining, "overlap": overlap, **row})
                    restore_projections(model)
            restore_rotary(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        per_token, vocab = kv_bytes_per_token(model.config), model.config.vocab_size
        del model
        torch.cuda.empty_cache()
        for backend in filter(None, args.sglang.split(",")):
            proc, url, startup = sglang_server(path, backend, max(batches), os.path.join(root, f"sglang-{backend}.log"))
            print(f"SGLang ({backend}): up in {startup:.1f} s (until /health_generate answers)", flush=True)
            try:
                for b in batches:
                    bound = statistics.fmean((weight_bytes + b * (args.prompt_len + k) * per_token) / bandwidth
                                             for k in range(1, args.new_tokens))
                    print_row(bench_sglang(url, backend, vocab, b, args.prompt_len, args.new_tokens, bound))
            finally:
                stop_server(proc)


if __name__ == "__main__":
    main()
