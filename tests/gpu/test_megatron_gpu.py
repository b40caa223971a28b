"""The Megatron backend on a real GPU (run on the H200 machine; skipped without CUDA / megatron-core / ray).

(a) HF vs Megatron logits of a tiny Qwen3 and a tiny Qwen3-MoE after loading the same weights: fp32 to
    1e-4 relative; bf16 within twice transformers' own bf16 error against fp32 (relative to max |logit|);
(b) the actor on one GPU: bf16 training step, HF export and a CUDA-IPC weight push to an `hf` engine
    whose log-probs then match the trainer's;
(c) `train.py --train-backend megatron --colocate` with the `hf` engine: GRPO steps on the toy task, the
    engine/trainer log-prob gap reported, the trainer's state off the GPU after each offload (its figures per
    rollout, `perf/actor_<move>_*`), then SIGTERM after a checkpoint and `--load` resumes at the next rollout id.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.autograd_graph import node_names
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.ranks import run_ranks
from tests.e2e_cpu.test_megatron_actor import WORKER, hf_logits, max_abs_diff, run_logits_worker

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_logits_match_hf(arch, dtype, tmp_path):
    """fp32: Megatron == HF to 1e-4 relative. bf16: both run in bf16 with different kernels, so each is
    compared with the fp32 HF logits; Megatron's mean bf16 error may be at most twice HF's own, and for
    the dense model its worst logit too (floor 1e-2 relative). The MoE model routes in fp32
    (`--moe-router-dtype fp32`, as slime's MoE scripts do)."""
    extra = "--moe-router-dtype fp32" if arch == "qwen3_moe" else ""
    saved = run_logits_worker(arch, str(tmp_path), dtype, extra)
    exact = hf_logits(saved, torch.float32, "cuda")
    scale = float(exact.abs().max())
    ours = float((saved["logits"] - exact).abs().max()) / scale
    agree = float((saved["logits"].argmax(-1) == exact.argmax(-1)).float().mean())
    if dtype == "float32":
        print(f"\n[logits] {arch} fp32: Megatron vs HF max rel {ours:.3e}, argmax agree {agree:.3f}")
        assert ours <= 1e-4
        return
    hf_bf16 = hf_logits(saved, torch.bfloat16, "cuda")
    theirs = float((hf_bf16 - exact).abs().max()) / scale
    ours_mean = float((saved["logits"] - exact).abs().mean() / exact.abs().mean())
    theirs_mean = float((hf_bf16 - exact).abs().mean() / exact.abs().mean())
    print(f"\n[logits] {arch} bf16 vs HF fp32: Megatron max rel {ours:.3e} / mean rel {ours_mean:.3e}; HF-bf16 max rel "
          f"{theirs:.3e} / mean rel {theirs_mean:.3e}; argmax agree {agree:.3f}")
    assert ours_mean <= 2 * theirs_mean
    if arch == "qwen3_moe":
        # A near-tied expert choice that bf16 rounding flips changes that token's logits wholesale, so the
        # worst token is not a precision measure for MoE; the mean and the argmax agreement are.
        assert agree >= 0.95
    else:
        assert ours <= max(2 * theirs, 1e-2)


def test_actor_bf16_step_export_and_cuda_ipc_push(tiny_model_dir, tmp_path):
    r = run_ranks(WORKER, 1, str(tmp_path), ["--model", tiny_model_dir, "--bf16", "--engine"], timeout_s=400)
    gap = max_abs_diff(r["engine_lp_after_push"], r["lp_after"])
    print(f"\n[actor] bf16 export max |Δ| vs fp32 file {r['export_max_abs_diff']:.3e}; engine vs trainer log-prob "
          f"max |Δ| after push {gap:.3e}; metrics {r['metrics']}")
    assert r["export_names_missing"] == [] and r["export_names_extra"] == []
    assert r["export_max_abs_diff"] < 1e-2  # bf16 rounding of fp32 weights
    assert r["engine_weight_version"] == "1"
    assert max_abs_diff(r["lp_before"], r["lp_after"]) > 1e-2  # the step moved the policy
    assert gap < 0.1  # bf16 engine vs bf16 trainer on the pushed weights


def _train_cmd(model_dir, data_path, out, *extra):
    return [
        sys.executable, os.path.join(REPO_ROOT, "train.py"), *model_args("tiny-qwen3"),
        "--train-backend", "megatron", "--rollout-backend", "hf", "--colocate", "--actor-num-gpus-per-node", "1",
        "--bf16",
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "toy", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--global-batch-size", "128", "--micro-batch-size", "32", "--rollout-max-response-len", "4",
        "--lr", "7e-4", "--use-kl-loss", "--kl-loss-coef", "0.001", "--entropy-coef", "0.01",
        "--save", os.path.join(out, "ckpt"), "--save-interval", "2",
        "--use-tensorboard", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(900)
def test_train_py_megatron_colocate_then_resume(tiny_model_dir, toy_data_path, tmp_path):
    out = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    latest = os.path.join(out, "ckpt", "latest_checkpointed_iteration.txt")
    tb1 = os.path.join(out, "tb1")
    with open(os.path.join(out, "run1.log"), "w") as log:
        proc = subprocess.Popen(_train_cmd(tiny_model_dir, toy_data_path, out, "--num-rollout", "40",
                                           "--tensorboard-dir", tb1),
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.isfile(latest) and int(open(latest).read().strip() or -1) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, open(os.path.join(out, "run1.log")).read()[-4000:]
    proc.send_signal(signal.SIGTERM)  # like a preempted job
    proc.wait(timeout=120)
    diffs = read_scalars(tb1, "train/train_rollout_logprob_abs_diff")
    rewards = read_scalars(tb1, "rollout/raw_reward")
    print(f"\n[train.py] run 1 killed after rollout {max(rewards)}; engine/trainer |Δ log-prob| per rollout: "
          f"{[round(diffs[k], 4) for k in sorted(diffs)]}; "
          f"raw reward: {[round(rewards[k], 3) for k in sorted(rewards)]}")
    assert max(diffs.values()) < 0.05  # bf16 hf engine vs bf16 Megatron on the same pushed weights
    figures, logged = _handoff_figures(tb1)
    _check_state_left_the_gpu(figures, logged, _parameter_count(tiny_model_dir))
    saved = int(open(latest).read().strip())

    tb2 = os.path.join(out, "tb2")
    done = subprocess.run(_train_cmd(tiny_model_dir, toy_data_path, out, "--num-rollout", str(saved + 3),
                                     "--load", os.path.join(out, "ckpt"), "--tensorboard-dir", tb2),
                          capture_output=True, text=True, env=env, cwd=out, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = sorted(read_scalars(tb2, "rollout/raw_reward"))
    print(f"[train.py] run 2 resumed from checkpoint {saved}: rollouts {steps}")
    assert steps == [saved + 1, saved + 2]
    # the process's memory as nvidia-smi reports it (absent where it does not list the process: a PID namespace)
    # holds at least what torch reserved
    for move in MOVES:
        process = figures[move, "process_gb"]
        print(f"[train.py] actor GB after {move}, nvidia-smi: {[round(process[k], 3) for k in sorted(process)]}")
        assert all(process[k] >= figures[move, "reserved_gb"][k] for k in process)


MOVES = ("onload", "offload_state", "offload")  # slime/ray/handoff.py's moves of the trainer, in a step's order


def _handoff_figures(tb: str) -> tuple[dict, list[int]]:
    """{(move, figure): {rollout: value}} of the trainer's moves, and the rollouts that logged all of them (the run
    was killed mid-step: `perf/step_time`, written after them, marks a step whose figures are complete)."""
    figures = {(m, f): read_scalars(tb, f"perf/actor_{m}_{f}")
               for m in MOVES for f in ("moved_gb", "allocated_gb", "reserved_gb", "process_gb")}
    logged = sorted(read_scalars(tb, "perf/step_time"))
    for (move, figure), values in figures.items():
        if figure != "process_gb":
            assert set(logged) <= set(values), (move, figure, sorted(values), logged)
    return figures, logged


def _parameter_count(model_dir: str) -> int:
    from safetensors import safe_open

    count = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            count += math.prod(f.get_slice(name).get_shape())
    return count


def _check_state_left_the_gpu(f: dict, logged: list[int], n: int) -> None:
    """--colocate moves the trainer's state to host memory around each push: before it the optimizer state, the
    gradients and the reference model (`offload_state`), after it the weights (`offload`); `onload` brings all back
    for training. In bytes per parameter of the tiny model (n of them; megatron-core pads the vocabulary): bf16
    weights 2 (in megatron-core's parameter buffer: the distributed optimizer is the default, as in slime),
    bf16 gradients 2, fp32 master weights 4, Adam's two fp32 moments 8 (made by rollout 0's first step), the bf16
    reference model 2. What stays on the device is the allocator's fixed overhead, which rollout 0's training makes
    (cuBLAS workspaces, ~70 MB on the H200, more than the tiny state): so the state's departure is measured against
    what the onload brought back, from rollout 1 on."""
    weights, state = 2 * n / 1e9, 14 * n / 1e9  # state: weights, master weights, Adam (gradients, reference on top)
    print(f"[train.py] rollouts logged {logged}; actor GB at rollout 1: allocated after onload "
          f"{f['onload', 'allocated_gb'][1]:.4f}, before the push {f['offload_state', 'allocated_gb'][1]:.4f}, after "
          f"the offload {f['offload', 'allocated_gb'][1]:.4f}; moved {f['onload', 'moved_gb'][1]:.4f} back, "
          f"{f['offload_state', 'moved_gb'][1]:.4f} + {f['offload', 'moved_gb'][1]:.4f} out ({n} parameters)")
    assert logged[:3] == [0, 1, 2]
    assert f["onload", "moved_gb"][0] >= 0.9 * 8 * n / 1e9  # rollout 0: weights, gradients, master weights back
    for k in logged:
        # during the push the weights, and only they, are on the device beside the fixed overhead
        held = f["offload_state", "allocated_gb"][k] - f["offload", "allocated_gb"][k]
        assert 0.9 * weights <= held <= 1.25 * weights, (k, held, weights)
        assert f["offload", "moved_gb"][k] >= 0.9 * weights, k  # and they leave after it
    for k in logged[1:]:
        back = f["onload", "moved_gb"][k]
        assert back >= 0.9 * state, (k, back, state)
        # all that came back left again: after the offload the allocator holds what it held before the onload
        assert f["onload", "allocated_gb"][k] - f["offload", "allocated_gb"][k] >= 0.9 * back, k


@pytest.mark.parametrize("kernel,lengths", [("flash", [5, 300, 1024, 77]), ("cudnn", [5, 300, 1024, 77]),
                                            ("cudnn", [900, 1000, 1088, 1024]), ("cudnn", [1088] * 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdp_attention_packed_equals_each_sequence_alone(dtype, kernel, lengths):
    """SDPAttention on packed (THD) input: torch's varlen flash kernel in bf16, one SDPA call per sequence in
    fp32, or with --attention-kernel cudnn and little padding (the lengths 900-1088) SDPA with cuDNN first on the
    sequences right-padded (with much padding, 5-1024, it stays varlen flash), or on one length viewed as padded rows
    without a copy; each equals each sequence attended alone (fp32 math), forward and gradients; GQA 4 query heads
    per key/value head."""
    import types

    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    from slime.backends.megatron_utils import sdpa_attention
    from slime.backends.megatron_utils.forward import packed_seq_params

    torch.manual_seed(0)
    config = types.SimpleNamespace(attention_dropout=0.0, kv_channels=128, window_size=None, softmax_type="vanilla")
    attention = sdpa_attention.SDPAttention(config, 1, AttnMaskType.causal, "self")
    sdpa_attention.install(kernel)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    params = packed_seq_params(bounds, "cuda")
    sdpa_attention.install("flash")
    cu = params.cu_seqlens_q
    padded = kernel == "cudnn" and lengths[0] > 5
    assert (params.padded_rows is not None) == padded
    total = sum(lengths)
    q = torch.randn(total, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(total, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(total, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, 16 * 128)
    if padded and dtype == torch.bfloat16:  # cuDNN's kernel is what ran (its backward node is in the graph)
        nodes = node_names(out)
        assert "Cudnn" in " ".join(nodes), nodes
        if len(set(lengths)) == 1:  # viewed, not scattered: and cuDNN wrote its output in the query's layout
            assert params.padded_rows.viewed
            assert not any(x in n for n in nodes for x in ("Copy", "Clone", "Index", "Relayout")), nodes
    out.float().square().sum().backward()

    refs = []
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (qf, kf, vf))
        refs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    .squeeze(0).transpose(0, 1).reshape(end - start, -1))
    ref = torch.cat(refs)
    ref.square().sum().backward()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max() / ref.abs().max() < tol
    for ours, exact in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert (ours.float() - exact).abs().max() / exact.abs().max() < tol


def test_grouped_flash_varlen_equals_the_kernel_on_repeated_heads():
    """Packed GQA attention straight through the flash kernels (what a torch whose varlen_attn lacks enable_gqa
    runs): the same output and gradients as the kernel on key/value heads repeated per group (the sums of the
    repeated heads' gradients), and no copies of them: its forward allocates less. Prints both ways' ms."""
    from slime.backends.megatron_utils.sdpa_attention import _GroupedFlashVarlen, _varlen_attn
    from tests.gpu.timing import cuda_ms

    assert _varlen_attn() is not None, "this torch has no torch.nn.attention.varlen"
    varlen, keywords = _varlen_attn()
    torch.manual_seed(0)
    lengths = [1088] * 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, scale = sum(lengths), 128 ** -0.5
    q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16)

    def grouped():
        return _GroupedFlashVarlen.apply(q, k, v, cu, 1088, scale)

    def repeated():
        kwargs = {"scale": scale} if "scale" in keywords else {}
        kwargs.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
        return varlen(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), cu, cu, 1088, 1088, **kwargs)

    results = []
    for fn in (grouped, repeated):
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        held = torch.cuda.max_memory_allocated() - before
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad, v.grad, held))
    for a, b in zip(results[0][:4], results[1][:4]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert results[0][4] < results[1][4], (results[0][4], results[1][4])

    def step(fn):
        return lambda: fn().backward(grad)

    grouped_ms, repeated_ms = cuda_ms(step(grouped)), cuda_ms(step(repeated))
    print(f"[grouped flash] 4 x 1088 tokens, 32/8 heads: forward + backward {grouped_ms:.3f} ms grouped, "
          f"{repeated_ms:.3f} ms with key/value repeated; forward allocated {results[0][4] / 2**20:.1f} / "
          f"{results[1][4] / 2**20:.1f} MiB")
    assert grouped_ms <= repeated_ms * 1.1
