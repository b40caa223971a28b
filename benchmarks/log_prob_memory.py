"""Memory of the training log-prob / entropy computation: the plain autograd formula against the kernel both
trainers use, `slime.algorithm.log_probs.log_probs_and_entropy` (chunked, recomputing softmax in backward), called
as the fsdp trainer calls it (the whole `[T, V]` block) and as the Megatron trainer does (the rows it reads,
picked by index), side by side.

    python benchmarks/log_prob_memory.py [--tokens 2048] [--vocab 151936] [--dtype bfloat16]

Each (implementation, entropy on/off) runs in a fresh process: random logits [T, V] in --dtype as the model
would output them, forward to per-token log-probs (and entropy), a loss, backward. Reported: the peak memory
above the logits themselves in bytes per logit (CUDA: torch's peak allocation; CPU: peak RSS), and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def plain(logits, targets, with_entropy):
    import torch

    log_p = torch.log_softmax(logits.float(), dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, (-(log_p.exp() * log_p).sum(-1) if with_entropy else None)


def measure(impl: str, tokens: int, vocab: int, dtype: str, with_entropy: bool) -> dict:
    import resource

    import torch

    from slime.algorithm.log_probs import log_probs_and_entropy

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=getattr(torch, dtype), device=device).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    rows = torch.arange(tokens, device=device)  # the Megatron trainer's call: the rows it reads, by index
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    fn = {"plain": plain, "kernel": lambda x, t, e: log_probs_and_entropy(x, t, with_entropy=e),
          "kernel by rows": lambda x, t, e: log_probs_and_entropy(x, t, with_entropy=e, rows=rows,
                                                                  vocab_size=vocab)}[impl]
    lp, ent = fn(logits, targets, with_entropy)
    loss = -lp.sum() + (0.01 * ent.sum() if with_entropy else 0.0)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"bytes_per_logit": (peak - base) / (tokens * vocab), "seconds": time.perf_counter() - start,
            "device": device}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: impl,entropy for the child process
    args = p.parse_args()
    if args.one:
        impl, entropy = args.one.split(",")
        print(json.dumps(measure(impl, args.tokens, args.vocab, args.dtype, entropy == "1")))
        return
    rows = []
    for entropy in ("0", "1"):
        for impl in ("plain", "kernel", "kernel by rows"):
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                  "--dtype", args.dtype, "--one", f"{impl},{entropy}"],
                                 capture_output=True, text=True, check=True)
            rows.append((impl, entropy == "1", json.loads(out.stdout.strip().splitlines()[-1])))
    device = rows[0][2]["device"]
    print(f"T={args.tokens} tokens × V={args.vocab}, {args.dtype} logits, {device}; peak above the logits:")
    print("| implementation | entropy | bytes per logit | GB at this T×V | seconds | memory vs plain |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for impl, entropy, r in rows:
        base = next(x for i, e, x in rows if i == "plain" and e == entropy)["bytes_per_logit"]
        print(f"| {impl} | {'on' if entropy else 'off'} | {r['bytes_per_logit']:.1f} "
              f"| {r['bytes_per_logit'] * args.tokens * args.vocab / 1e9:.2f} | {r['seconds']:.2f} "
              f"| {r['bytes_per_logit'] / base:.2f} |")


if __name__ == "__main__":
    main()
