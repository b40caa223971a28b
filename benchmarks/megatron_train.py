"""Training throughput and MFU of the Megatron backend on one GPU, packed (thd) against padded (bshd).

    python benchmarks/megatron_train.py [--shape qwen3-4b] [--num-layers N] [--seq-len 4096] [--min-len 4096]
                                        [--samples 16] [--max-tokens-per-gpu 8192] [--layouts thd,bshd] [--steps 3]
                                        [--push N]
    python benchmarks/megatron_train.py --layouts thd,thd:torch      # slime's kernels against --log-probs-kernel torch
    python benchmarks/megatron_train.py --layouts thd,thd+nogaf,thd:torch+torchrope+nogaf   # each fused kernel off
    python benchmarks/megatron_train.py --layouts thd,thd+cudnn,bshd,bshd+cudnn   # --attention-kernel flash vs cudnn
    python benchmarks/megatron_train.py --profile 30 --profile-syncs   # a profiled step, and where the host waits
    python benchmarks/megatron_train.py --max-tokens-per-gpu 4096 --layouts thd+sgd,thd+cudnn+sgd
        # the whole 4B on an 80 GB card: SGD without momentum keeps no optimizer state beyond the fp32 master
        # weights (Adam's 32 GB more do not fit); the step then is forward + backward + a cheap update

A random-init model of a published Qwen3 shape (benchmarks/weight_sync.py's helper) is written as an HF folder
and loaded by `MegatronTrainRayActor` (driven directly, no Ray: one rank, bf16 parameters, fp32 master weights
in the distributed optimizer, `--use-dynamic-batch-size` micro-batches of at most `--max-tokens-per-gpu`
tokens, SDPA attention without TransformerEngine: cuDNN or varlen flash by --attention-kernel). The batch:
`--samples` sequences with lengths drawn uniformly from [--min-len, --seq-len] (default: all exactly --seq-len), the
last 3/4 of each the "response", random tokens, group-normalised random rewards, one optimizer step per batch.

Per layout it times, after one warm-up step:
- `forward`: `compute_log_probs` over the batch (what the old-policy / reference log-probs cost);
- `train`: `train()` with `--use-rollout-logprobs` (forward + backward + optimizer step, no extra forward);
and reports tokens/s and MFU = model FLOPs / time / --peak-tflops (790: the H200's measured bf16 matmul
rate, ../shared/gpu/README.md). With `--push N` it then starts an `hf` engine on the same GPU and times N
colocated weight pushes (`update_weights`: HF export of the Megatron weights, buckets, CUDA IPC). Model FLOPs per token: 2 x (matmul parameters, lm head included) for a
forward, plus causal attention 2 x layers x heads x head_dim x (context length) per token; a training pass
counts 3 forwards. Padding is not counted as useful work, so bshd pays for its pad tokens. Needs CUDA and
megatron-core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_step import MODEL_SCRIPTS, model_args  # noqa: E402
from weight_sync import SHAPES, make_model_dir  # noqa: E402

from tests.args import make_args  # noqa: E402


# a layout's `+option`s: the flags each adds
LAYOUT_OPTIONS = {"rope": ["--rope-kernel", "triton"], "torchrope": ["--rope-kernel", "torch"],
                  "nogaf": ["--no-gradient-accumulation-fusion"], "cudnn": ["--attention-kernel", "cudnn"],
                  "unfusedadam": ["--adam-kernel", "unfused"],
                  # no optimizer state beyond the fp32 master weights: the whole 4B's forward + backward fits 80 GB
                  "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0", "--no-use-distributed-optimizer"]}


def slime_args(cli, model_dir: str, workdir: str, layout: str) -> argparse.Namespace:
    """`layout`: a --qkv-format, optionally suffixed `:<--log-probs-kernel>` (slime's default, auto, when absent),
    then `+option`s of LAYOUT_OPTIONS (e.g. thd:torch+torchrope+nogaf: the trainer before its fused kernels)."""
    from slime.config.arguments import parse_args

    head, *options = layout.split("+")
    qkv_format, _, kernel = head.partition(":")
    extra = []
    for option in options:
        if option not in LAYOUT_OPTIONS:
            raise SystemExit(f"--layouts {layout}: unknown option +{option}; choose from {sorted(LAYOUT_OPTIONS)}")
        extra += LAYOUT_OPTIONS[option]

    data = os.path.join(workdir, "prompts.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "x", "label": "y"}\n')
    return parse_args([
        *shape_args(cli), "--train-backend", "megatron", "--hf-checkpoint", model_dir, "--bf16",
        "--prompt-data", data, "--rollout-batch-size", str(cli.samples), "--n-samples-per-prompt", "1",
        "--global-batch-size", str(cli.samples), "--num-rollout", str(cli.steps + 1),
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(cli.max_tokens_per_gpu),
        "--qkv-format", qkv_format, "--log-probs-kernel", kernel or "auto",
        "--use-distributed-optimizer", "--use-rollout-logprobs", *extra,
        "--lr", "1e-6", "--clip-grad", "1.0", "--advantage-estimator", "grpo", "--seed", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--colocate",
    ])  # fmt: skip


def shape(cli) -> dict:
    """The HF shape trained: --shape's, with --num-layers decoder layers when given."""
    return dict(SHAPES[cli.shape], **({"num_hidden_layers": cli.num_layers} if cli.num_layers else {}))


def shape_args(cli) -> list[str]:
    """--shape's Megatron flags (scripts/models), --num-layers replaced when given."""
    flags = model_args(cli.shape)
    if cli.num_layers:
        flags[flags.index("--num-layers") + 1] = str(cli.num_layers)
    return flags


def make_batch(cli, vocab_size: int):
    from slime.utils.types import TrainBatch

    rng = random.Random(0)
    lengths = [rng.randint(cli.min_len, cli.seq_len) for _ in range(cli.samples)]
    tokens = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]
    responses = [n - n // 4 for n in lengths]
    rewards = [rng.choice([-1.0, 1.0]) for _ in lengths]
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=[[1] * r for r in responses],
                      rewards=rewards, raw_rewards=rewards, truncated=[False] * len(lengths),
                      group_indices=list(range(len(lengths))))


def matmul_params(shape: dict) -> int:
    """Parameters of the matmuls of a forward: attention and MLP projections, and the lm head."""
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * ffn) + h * shape["vocab_size"]


def model_params(shape: dict) -> int:
    """All parameters (tied embeddings counted once; norms included)."""
    h, layers, d = shape["hidden_size"], shape["num_hidden_layers"], shape["head_dim"]
    norms = layers * (2 * h + 2 * d) + h
    untied = 0 if shape.get("tie_word_embeddings", True) else h * shape["vocab_size"]
    return matmul_params(shape) + norms + untied


def forward_flops(shape: dict, lengths: list[int]) -> float:
    """Model FLOPs of one forward over sequences of `lengths` (causal attention, lm head included)."""
    q = shape["num_attention_heads"] * shape["head_dim"]
    attention = sum(2 * shape["num_hidden_layers"] * q * n * n for n in lengths)  # QK^T, AV; causal half
    return 2 * matmul_params(shape) * sum(lengths) + attention


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_layout(cli, model_dir: str, workdir: str, layout: str) -> dict:
    """One process per layout (megatron-core's global state is per process): results as JSON on stdout."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    args = slime_args(cli, model_dir, workdir, layout)
    batch = make_batch(cli, SHAPES[cli.shape]["vocab_size"])
    actor = MegatronTrainRayActor(1, 0, "127.0.0.1", 29500 + random.randrange(1000))
    try:
        actor.init(args, "actor", with_ref=False)
        batch.rollout_log_probs = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        torch.cuda.reset_peak_memory_stats()
        forward = [timed(lambda: actor.compute_log_probs(batch.tokens, batch.response_lengths))
                   for _ in range(2)]
        train = [timed(lambda i=i: actor.train(i, batch)) for i in range(cli.steps + 1)]
        peak = torch.cuda.max_memory_allocated() / 1e9
        if cli.profile:
            profile_step(cli, actor, batch, layout)
        push = time_push(cli, actor, model_dir) if cli.push else []
    finally:
        actor.shutdown()
    lengths = [len(t) for t in batch.tokens]
    return {"layout": layout, "tokens": sum(lengths), "fwd_flops": forward_flops(shape(cli), lengths),
            "forward_s": min(forward), "train_s": sum(train[1:]) / cli.steps, "peak_gb": peak, "push_s": push}


def profile_step(cli, actor, batch, layout: str) -> None:
    """--profile: one more train step under torch.profiler; prints (to stderr) wall time against GPU kernel time
    and the top kernels and host operators, so a launch-bound step (host time above kernel time) shows."""
    from torch.profiler import ProfilerActivity, profile

    from tests.gpu.timing import kernel_seconds

    torch.cuda.synchronize()
    # the Python frames of each event need the verbose experimental config on recent torch (else `stack` is empty)
    stacks = {"with_stack": True, "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 **(stacks if cli.profile_syncs else {})) as prof:
        wall = timed(lambda: actor.train(cli.steps + 1, batch))
    events = prof.key_averages()
    kernel_s = kernel_seconds(events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"\n[{layout}] profiled train step: wall {wall:.2f} s, GPU kernel time {kernel_s:.2f} s "
          f"({kernel_s / wall:.0%} busy), kernel launches {launches}", file=sys.stderr)
    print(events.table(sort_by="self_device_time_total", row_limit=cli.profile), file=sys.stderr)
    print(events.table(sort_by="self_cpu_time_total", row_limit=cli.profile), file=sys.stderr)
    if cli.profile_syncs:
        print_sync_sites(prof, cli.profile)


# the runtime's waits, and the operators that make the host wait for a value on the GPU (`.item()`, `.tolist()`,
# `int(t)`, `nonzero`, `unique`, a boolean mask's select); the runtime events may carry no Python frames of their own
HOST_WAITS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::masked_select")


def print_sync_sites(prof, limit: int) -> None:
    """--profile-syncs: where the host waits for the GPU (a sync, a copy to or from pageable memory), grouped by the
    Python frames that asked for it, most total time first."""
    sites = [e for e in prof.key_averages(group_by_stack_n=6) if e.key in HOST_WAITS]
    sites.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\nhost waits by call site (top {limit}):", file=sys.stderr)
    for e in sites[:limit]:
        frames = " <- ".join(f for f in e.stack if "site-packages/torch" not in f)[:600]
        print(f"{e.key} x{e.count}, {e.self_cpu_time_total / 1e3:.1f} ms: {frames}", file=sys.stderr)


def time_push(cli, actor, model_dir: str) -> list[float]:
    """--push N: an `hf` engine on the same GPU, then N timed colocated pushes (`update_weights`: the HF
    export of the Megatron weights, buckets, CUDA IPC hand-over), after one warm-up push."""
    from slime.backends.hf_engine.engine import HFEngine

    engine = HFEngine(make_args(hf_checkpoint=model_dir, rollout_seed=0, sglang_server_concurrency=8), 0)
    engine.init()
    try:
        seconds = [timed(lambda v=v: actor.update_weights([engine], weight_version=v)) for v in range(cli.push + 1)]
        if engine.get_weight_version() != str(cli.push):
            raise RuntimeError(f"engine reports weight version {engine.get_weight_version()}, pushed {cli.push}")
        return seconds[1:]
    finally:
        engine.shutdown()


def report(cli, results: list[dict]) -> str:
    peak = cli.peak_tflops * 1e12
    lines = [
        f"{cli.shape}{f' ({cli.num_layers} layers)' if cli.num_layers else ''}, "
        f"{cli.samples} sequences of {cli.min_len}-{cli.seq_len} tokens, "
        f"--max-tokens-per-gpu {cli.max_tokens_per_gpu}, peak {cli.peak_tflops:.0f} TFLOP/s",
        "| layout | tokens | forward s | forward tok/s | forward MFU | train s | train tok/s | train MFU | peak GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        fwd_mfu = r["fwd_flops"] / r["forward_s"] / peak
        train_mfu = 3 * r["fwd_flops"] / r["train_s"] / peak
        lines.append(f"| {r['layout']} | {r['tokens']} | {r['forward_s']:.2f} | {r['tokens'] / r['forward_s']:,.0f} | "
                     f"{fwd_mfu:.1%} | {r['train_s']:.2f} | {r['tokens'] / r['train_s']:,.0f} | {train_mfu:.1%} | "
                     f"{r['peak_gb']:.1f} |")
    for r in results:
        if r["push_s"]:
            gb = 2 * model_params(shape(cli)) / 1e9
            best = min(r["push_s"])
            lines.append(f"{r['layout']}: colocated weight push of {gb:.2f} GB (bf16): best {best:.3f} s, mean "
                         f"{sum(r['push_s']) / len(r['push_s']):.3f} s, {gb / best:.1f} GB/s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(MODEL_SCRIPTS))
    p.add_argument("--num-layers", type=int, default=None,
                   help="train the shape with this many decoder layers (a per-layer profile of a shape whose "
                        "optimizer state does not fit the card)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence (default: --seq-len)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--layouts", default="thd,bshd",
                   help="qkv formats, comma-separated, each run with slime's default kernels; :torch / :triton "
                        "picks --log-probs-kernel, +torchrope / +rope the --rope-kernel, +nogaf adds "
                        "--no-gradient-accumulation-fusion (e.g. thd,thd:torch+torchrope+nogaf)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--push", type=int, default=0, help="also time N colocated weight pushes to an hf engine")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile one more train step; print the top N kernels and host operators")
    p.add_argument("--profile-syncs", action="store_true",
                   help="with --profile: also record Python stacks and print where the host waits for the GPU")
    p.add_argument("--model-dir", help="reuse this HF folder (made by an earlier run)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    cli = p.parse_args()
    cli.min_len = cli.min_len or cli.seq_len
    if not torch.cuda.is_available():
        sys.exit("benchmarks/megatron_train.py needs CUDA (megatron-core trains on GPUs only)")
    if cli.worker:
        workdir = os.path.dirname(cli.model_dir)
        print("RESULT " + json.dumps(run_layout(cli, cli.model_dir, workdir, cli.worker)), flush=True)
        return
    with tempfile.TemporaryDirectory() as root:
        model_dir = cli.model_dir
        if model_dir is None:
            model_dir, model = make_model_dir(cli.shape, root, cli.num_layers)
            del model
            torch.cuda.empty_cache()
        results = []
        for layout in cli.layouts.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--model-dir", model_dir,
                   "--worker", layout]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not found:
                print(f"{layout}: worker failed with exit code {done.returncode}", flush=True)
                continue
            results.append(json.loads(found[-1][len("RESULT "):]))
            print(report(cli, results[-1:]), flush=True)
        print("\n" + report(cli, results), flush=True)


if __name__ == "__main__":
    main()
