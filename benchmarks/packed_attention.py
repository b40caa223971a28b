"""The Megatron trainer's packed (thd) causal attention, kernel by kernel, forward + backward (GPU).

    python benchmarks/packed_attention.py [--shape qwen3-4b] [--seq-len 1088] [--sequences 4] [--repeats 20]

One layer's attention at a published shape's heads (Qwen3-4B: 32 query heads, 8 key/value heads, head_dim 128) on
`--sequences` packed sequences of `--seq-len` tokens, bf16, each way torch offers here:
- `flash, repeated`: `varlen_attn` on key/value heads repeated per group (what SDPAttention ran on a torch whose
  varlen_attn lacks enable_gqa, before 2026-12-06);
- `flash, grouped`: torch's flash kernels on the key/value heads as they are (`_GroupedFlashVarlen`, what it runs now);
- `cudnn`: torch's cuDNN attention over the same cumulative lengths (`aten._cudnn_attention_forward`), with
  the key/value heads as they are and repeated, where this torch and cuDNN take them.
Per way: milliseconds of forward + backward (CUDA events, mean of `--repeats` after a warm-up), the bytes its
forward allocates, and the largest difference of its output and gradients from an fp32 SDPA reference per sequence
(relative to the reference's largest value). A way this machine cannot run shows its error instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weight_sync import SHAPES  # noqa: E402

from slime.backends.megatron_utils.sdpa_attention import _GroupedFlashVarlen, _varlen_attn  # noqa: E402
from tests.gpu.timing import cuda_ms  # noqa: E402


def repeated(q, k, v, cu, max_len, scale):
    fn, keywords = _varlen_attn()
    groups = q.shape[1] // k.shape[1]
    kwargs = {"scale": scale} if "scale" in keywords else {}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
    return fn(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, cu, max_len, max_len,
              **kwargs)


def grouped(q, k, v, cu, max_len, scale):
    return _GroupedFlashVarlen.apply(q, k, v, cu, max_len, scale)


class _Cudnn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device), cu, cu,
            ctx.max_len, ctx.max_len, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def cudnn_grouped(q, k, v, cu, max_len, scale):
    return _Cudnn.apply(q, k, v, cu, max_len, scale)


def cudnn_repeated(q, k, v, cu, max_len, scale):
    groups = q.shape[1] // k.shape[1]
    return _Cudnn.apply(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, max_len,
                        scale)


WAYS = {"flash, repeated": repeated, "flash, grouped": grouped, "cudnn, grouped": cudnn_grouped,
        "cudnn, repeated": cudnn_repeated}


def reference(q, k, v, cu, grad):
    """fp32 SDPA per sequence: output and the three gradients."""
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (qf, kf, vf))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    .squeeze(0).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), qf.grad, kf.grad, vf.grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=1088)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/packed_attention.py needs CUDA")
    shape = SHAPES[args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    torch.manual_seed(0)
    total, scale = args.seq_len * args.sequences, head_dim ** -0.5
    cu = torch.arange(0, total + 1, args.seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    exact = reference(q, k, v, cu, grad)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
          f"{args.shape}: {heads} query / {kv_heads} key-value heads of {head_dim}; {args.sequences} x "
          f"{args.seq_len} tokens, bf16", flush=True)
    print("| way | fwd + bwd ms | forward allocates MiB | max rel. error (out, dq, dk, dv) |")
    print("| --- | ---: | ---: | --- |")
    for name, fn in WAYS.items():
        try:
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = fn(q, k, v, cu, args.seq_len, scale)
            held = (torch.cuda.max_memory_allocated() - before) / 2**20
            out.backward(grad)
            errors = [((a.float() - b).abs().max() / b.abs().max()).item()
                      for a, b in zip((out.detach(), q.grad, k.grad, v.grad), exact)]
            ms = cuda_ms(lambda: fn(q, k, v, cu, args.seq_len, scale).backward(grad), args.repeats)
        except Exception as e:  # noqa: BLE001 (a way this torch / cuDNN cannot run is a row, not the end)
            print(f"| {name} | - | - | {type(e).__name__}: {str(e).splitlines()[0][:150]} |", flush=True)
            continue
        print(f"| {name} | {ms:.3f} | {held:.1f} | {', '.join(f'{e:.1e}' for e in errors)} |", flush=True)


if __name__ == "__main__":
    main()
