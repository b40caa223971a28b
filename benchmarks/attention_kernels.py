"""Causal attention kernels at a packed micro-batch's shape (GPU): forward + backward ms and TFLOP/s.

    python benchmarks/attention_kernels.py [--lengths 1088,1000,900,1088] [--heads 32] [--kv-heads 8] [--head-dim 128]

The default batch is the 4B job's micro-batch (4 sequences of up to 1088 tokens, Qwen3-4B's 32 query and 8 key/value
heads of 128). Every row's output and gradients (of the real tokens) are checked against per-sequence SDPA in fp32
(max |difference| / max |reference|). Rows:
- `packed, slime flash`: what the Megatron trainer runs for packed (THD) micro-batches with --attention-kernel flash,
  `sdpa_attention.varlen_causal` (torch's variable-length flash attention; on a torch whose `varlen_attn` has no
  `enable_gqa`, the grouped flash kernels without repeated key/value heads).
- `packed, slime cudnn`: what it runs with --attention-kernel cudnn (opt-in), `sdpa_attention.
  padded_causal`: the packed tokens scattered to right-padded rows, cuDNN's kernel, gathered back, all in the time;
  sequences of one length are the padded layout as they are (viewed, no scatter), and a second row times the
  scatter and gather on them all the same.
- `padded, <backend>`: `scaled_dot_product_attention(is_causal=True)` on the sequences right-padded to the longest,
  [batch, heads, length, dim], under one SDPA backend, with the key/value heads as they are (`enable_gqa`) or repeated.
  Right padding leaves every real token's causal output and gradients as they are; the pad tokens' work is counted
  in the time but not in the TFLOP/s (nor is it in the `packed, slime cudnn` row's).
- `packed, cuDNN`: torch's cuDNN attention over the cumulative lengths (`aten._cudnn_attention_forward` and its
  autograd backward), key/value heads repeated, its output compared with slime's; a failure is the row's note.

Times: back to back (CUDA events), and the GPU kernels' own time per step (torch.profiler), which is what a step costs
inside a training step whose host runs ahead of the GPU. FLOPs: causal attention, 2 × 2 × heads × head_dim × L²/2 per
sequence for a forward, 2.5 × that for the backward.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu.timing import cuda_ms, kernel_ms  # noqa: E402


def forward_backward(fn, inputs, grad):
    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad())
    return step


def timed(step) -> tuple[float, float]:
    """(back-to-back ms, GPU kernels' ms) of one `step()`."""
    return cuda_ms(step), kernel_ms(step)


def per_sequence_reference(q, k, v, bounds, scale):
    """fp32 causal SDPA one sequence at a time, key/value heads repeated: output and the inputs' gradients."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = qf[a:b].transpose(0, 1)
        ks, vs = (x[a:b].repeat_interleave(group, 1).transpose(0, 1) for x in (kf, vf))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs), (qf, kf, vf)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1088,1000,900,1088")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py measures CUDA kernels: run it on a GPU machine")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from slime.backends.megatron_utils.sdpa_attention import (PaddedRows, _varlen_attn, pad_rows, padded_causal,
                                                              padded_rows, unpad_rows, varlen_causal)

    lengths = [int(x) for x in args.lengths.split(",")]
    heads, kv_heads, dim, group = args.heads, args.kv_heads, args.head_dim, args.heads // args.kv_heads
    scale, total, longest = 1 / math.sqrt(dim), sum(lengths), max(lengths)
    flops = sum(2 * 2 * heads * dim * n * n / 2 for n in lengths) * 3.5
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad_out = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}; "
          f"lengths {lengths}, heads {heads}/{kv_heads} x {dim}", flush=True)

    rows = []  # (kernel, ms or None, note)
    ref, (qf, kf, vf) = per_sequence_reference(q, k, v, bounds, scale)
    ref.backward(grad_out.float())

    def against_reference(out, dq, dk, dv) -> str:
        errors = [((a.float() - b).abs().max() / b.abs().max()).item()
                  for a, b in ((out, ref.detach()), (dq, qf.grad), (dk, kf.grad), (dv, vf.grad))]
        return "vs fp32: out {:.1e}, dq {:.1e}, dk {:.1e}, dv {:.1e}".format(*errors)

    def slime_row(label, fn):
        for x in (q, k, v):
            x.grad = None
        out = fn()
        out.backward(grad_out)
        rows.append((label, timed(forward_backward(fn, (q, k, v), lambda: grad_out)),
                     against_reference(out.detach(), q.grad, k.grad, v.grad)))

    varlen = _varlen_attn()
    if varlen is None:
        rows.append(("packed, slime flash", None, "this torch has no torch.nn.attention.varlen"))
    else:
        slime_row("packed, slime flash (varlen_causal)",
                  lambda: varlen_causal(varlen[0], varlen[1], q, k, v, cu, longest, scale))
    layout = padded_rows(bounds)
    if layout is None:
        rows.append(("packed, slime cudnn", None, "padding adds over half the FLOPs: it stays varlen flash"))
    elif layout.viewed:
        slime_row("packed, slime cudnn (padded_causal: one length, viewed as padded rows)",
                  lambda: padded_causal(q, k, v, layout, scale))
        scattered = PaddedRows(layout.lengths, viewed=False)
        slime_row("packed, slime cudnn, scattered and gathered all the same",
                  lambda: padded_causal(q, k, v, scattered, scale))
    else:
        slime_row("packed, slime cudnn (padded_causal: pad, cuDNN, gather)",
                  lambda: padded_causal(q, k, v, layout, scale))

    batch, full = len(lengths), PaddedRows(tuple(lengths), viewed=False)

    def pad(x):  # packed [tokens, heads, dim] -> right-padded [batch, heads, longest, dim]
        return pad_rows(x, full).view(batch, longest, *x.shape[1:]).transpose(1, 2)

    def unpad(x):  # and back, the real tokens only
        return unpad_rows(x.transpose(1, 2).flatten(0, 1), full)

    qp, kp, vp = (pad(x.detach()).requires_grad_() for x in (q, k, v))
    kr, vr = (x.detach().repeat_interleave(group, 1).requires_grad_() for x in (kp, vp))
    padded_grad = pad(grad_out)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for grouped in (True, False):
            key, value = (kp, vp) if grouped else (kr, vr)

            def padded():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qp, key, value, is_causal=True, enable_gqa=grouped)

            label = f"padded, {name}, key/value heads {'as they are' if grouped else 'repeated'}"
            try:
                out = padded()
                for x in (qp, key, value):
                    x.grad = None
                out.backward(padded_grad)
                dk, dv = key.grad, value.grad  # real tokens against the fp32 reference (repeated heads' summed)
                if not grouped:
                    dk, dv = (g.unflatten(1, (kv_heads, group)).sum(2) for g in (dk, dv))
                note = against_reference(*(unpad(x) for x in (out.detach(), qp.grad, dk, dv)))
                rows.append((label, timed(forward_backward(padded, (qp, key, value), lambda: padded_grad)), note))
            except RuntimeError as e:
                rows.append((label, None, str(e).splitlines()[0][:80]))

    kr3, vr3 = (x.detach().repeat_interleave(group, 1).requires_grad_() for x in (k, v))

    def cudnn_packed():
        return torch.ops.aten._cudnn_attention_forward(q, kr3, vr3, None, cu, cu, longest, longest, True, 0.0, True,
                                                       False, scale=scale)[0]

    label = "packed, cuDNN, key/value heads repeated"
    try:
        with torch.no_grad():
            reference = varlen_causal(varlen[0], varlen[1], q, k, v, cu, longest, scale) if varlen else None
            error = (cudnn_packed().float() - reference.float()).abs().max().item() if varlen else float("nan")
        rows.append((label, timed(forward_backward(cudnn_packed, (q, kr3, vr3), lambda: grad_out)),
                     f"output vs slime's: max |difference| {error:.2e}"))
    except (RuntimeError, IndexError) as e:
        rows.append((label, None, f"{type(e).__name__}: {str(e)[:80]}"))

    print("\n| kernel | fwd + bwd ms | of which GPU kernels | TFLOP/s | note |\n| --- | ---: | ---: | ---: | --- |")
    for label, ms, note in rows:
        shown = ("-",) * 3 if ms is None else (f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{flops / ms[0] / 1e9:.1f}")
        print(f"| {label} | {' | '.join(shown)} | {note} |")


if __name__ == "__main__":
    main()
