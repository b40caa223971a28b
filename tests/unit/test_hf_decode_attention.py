"""The slot cache's Triton decode attention (slime/backends/hf_engine/decode_attention.py, `--decode-attention
triton`) run by Triton's interpreter on CPU (`TRITON_INTERPRET=1`, set before the kernel is defined, so in a process
of its own): the kernel against fp64 attention on the slot cache's shapes (grouped heads, prefix masks over a column
bucket, strided views of a larger cache), a model's decode through the slot cache with it against SDPA, and the calls
it leaves to SDPA. Its speed is a GPU matter (`benchmarks/decode_speed.py --kv-cache slots,slots:triton`)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def _reference(query, key, value, mask, scale):
    """fp64 attention of each query head over its KV head's columns where the mask is true -> [B, 1, H, D]."""
    b, h, _, d = query.shape
    groups = h // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    s = (query.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def _case(rows, heads, kv_heads, dim, lens, columns, allocated, dtype, seed):
    """query [rows, heads, 1, dim]; key / value views [rows, kv_heads, columns, dim] of a cache of `allocated`
    columns and rows + 2 slots (as the slot cache hands them out); prefix masks of `lens` + 1 columns."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, 1, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # transformers' layout
    cache_k = torch.randn(rows + 2, kv_heads, allocated, dim, generator=gen).to(dtype)
    cache_v = torch.randn(rows + 2, kv_heads, allocated, dim, generator=gen).to(dtype)
    key, value = cache_k[:rows, :, :columns], cache_v[:rows, :, :columns]
    mask = (torch.arange(columns) <= torch.tensor(lens).unsqueeze(1))[:, None, None, :]
    return query, key, value, mask


def _kernel_against_fp64() -> None:
    from slime.backends.hf_engine import decode_attention as da

    assert da.INTERPRETED
    cases = [  # (rows, heads, kv heads, dim, lens, columns, allocated, dtype)
        (3, 16, 8, 128, [0, 70, 127], 128, 256, torch.float32),  # Qwen3-0.6B's heads; one row of one column
        (2, 14, 2, 64, [200, 5], 256, 256, torch.float32),  # 7 query heads per KV head (padded to 16)
        (4, 8, 8, 32, [1, 64, 63, 130], 192, 320, torch.float32),  # no grouping; blocks cut at 64
        (3, 16, 8, 128, [10, 100, 255], 256, 384, torch.bfloat16),
    ]
    for i, (rows, heads, kv_heads, dim, lens, columns, allocated, dtype) in enumerate(cases):
        query, key, value, mask = _case(rows, heads, kv_heads, dim, lens, columns, allocated, dtype, seed=i)
        assert da.covered(query, key, value, mask)
        scale = dim ** -0.5
        got = da.triton_decode_attention(query, key, value, mask, scale)
        want = _reference(query, key, value, mask, scale)
        assert got.shape == (rows, 1, heads, dim) and got.dtype == dtype and got.is_contiguous()
        tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # bf16: the rounded probabilities
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (i, err)


def _kernel_writes_the_new_kv() -> None:
    """With `write` the kernel stores each row's new key / value at its column of the cache (the column the mask's
    prefix ends at; columns of other rows and slots untouched) and attends as if the indexed writes had come first."""
    from slime.backends.hf_engine import decode_attention as da

    for i, (dtype, lens) in enumerate([(torch.float32, [0, 70, 127]), (torch.bfloat16, [5, 127, 64])]):
        query, key, value, mask = _case(3, 16, 8, 128, lens, 128, 256, dtype, seed=10 + i)
        gen = torch.Generator().manual_seed(20 + i)
        new_k = torch.randn(3, 1, 8, 128, generator=gen).to(dtype).transpose(1, 2)  # [B, KVH, 1, D], strided
        new_v = torch.randn(3, 1, 8, 128, generator=gen).to(dtype).transpose(1, 2)
        columns = torch.tensor(lens)
        assert da.covers_write(key, new_k, new_v, columns)
        cache_k, cache_v = key._base.clone(), value._base.clone()
        written_k, written_v = cache_k[:3, :, :128], cache_v[:3, :, :128]
        rows = torch.arange(3)
        written_k[rows, :, columns] = new_k[:, :, 0]
        written_v[rows, :, columns] = new_v[:, :, 0]
        scale = 128 ** -0.5
        got = da.triton_decode_attention(query, key, value, mask, scale, (new_k, new_v, columns))
        assert torch.equal(key._base, cache_k) and torch.equal(value._base, cache_v)  # stored, nothing else moved
        want = _reference(query, written_k, written_v, mask, scale)
        tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (i, err)
    assert not da.covers_write(key, new_k[:, :, :, :64], new_v, columns)  # another head dim
    assert not da.covers_write(key, new_k.float(), new_v, columns)  # another dtype than the cache
    assert not da.covers_write(key, new_k, new_v, columns.float())


def _decode_matches_sdpa() -> None:
    """A tiny Qwen3's decode through the slot cache, SDPA against the kernel: the same tokens, log-probs within
    1e-4 (fp32), over merges, finishes and a column bucket's growth."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler
    from tools.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as root:
        path = make_tiny_model(os.path.join(root, "m"), size="tiny", seed=0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)

    def serve(attention: str, fused_kv_write: bool | None = None) -> list[Request]:
        sched = Scheduler(model, tok, kv_cache="slots", max_running_requests=4, cuda_graphs=False,
                          decode_attention=attention, fused_kv_write=fused_kv_write)
        gen = torch.Generator().manual_seed(0)
        reqs = []
        for i in range(6):  # the last one's prompt and tokens pass a column bucket (128)
            prompt = torch.randint(3, 150, (int(torch.randint(20, 30, (1,), generator=gen)),), generator=gen).tolist()
            params = SamplingParams(temperature=0.0 if i % 2 else 1.0, sampling_seed=100 + i,
                                    max_new_tokens=110 if i == 5 else 10 + 8 * i, ignore_eos=True)
            reqs.append(Request(rid=str(i), input_ids=prompt, params=params, return_logprob=True))
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return reqs

    from slime.backends.hf_engine import slots

    calls = []
    kernel_call = slots.triton_decode_attention
    slots.triton_decode_attention = lambda *a: calls.append(1) or kernel_call(*a)
    sdpa = serve("sdpa")
    assert not calls
    kernel = serve("triton", fused_kv_write=False)  # --disable-fused-kv-write: the step's KV written apart
    assert len(calls) > 100  # every layer of every decode step went through the kernel
    writes = []
    slots.triton_decode_attention = lambda *a: writes.append(a[5] is not None) or kernel_call(*a)
    fused = serve("triton")  # the default with the kernel: it stores each step's KV
    assert len(writes) > 100 and all(writes)
    for a, b, c in zip(sdpa, kernel, fused):
        assert a.output_ids == b.output_ids == c.output_ids, a.rid
        assert max(abs(p - q) for p, q in zip(a.output_logprobs, b.output_logprobs)) < 1e-4, a.rid
        assert max(abs(p - q) for p, q in zip(b.output_logprobs, c.output_logprobs)) < 1e-4, a.rid


def _left_to_sdpa() -> None:
    from slime.backends.hf_engine import decode_attention as da

    query, key, value, mask = _case(2, 16, 8, 128, [3, 9], 128, 128, torch.float32, seed=0)
    assert da.covered(query, key, value, mask)
    assert not da.covered(query.expand(2, 16, 2, 128), key, value, mask)  # two query positions
    assert not da.covered(query, key, value, mask.float())  # an additive mask
    assert not da.covered(query, key, value, mask[:, :, :, :64])  # a mask of other columns
    assert not da.covered(query[..., :96], key[..., :96], value[..., :96], mask)  # head dim not a power of two
    assert not da.covered(query.double(), key.double(), value.double(), mask)


@pytest.mark.parametrize("case", ["_kernel_against_fp64", "_kernel_writes_the_new_kv", "_decode_matches_sdpa",
                                  "_left_to_sdpa"])
def test_decode_attention_in_the_interpreter(case):
    run_interpreted(f"from tests.unit.test_hf_decode_attention import {case}; {case}()")


def test_off_cuda_without_the_interpreter_sdpa_serves():
    from slime.backends.hf_engine import decode_attention as da
    from slime.backends.hf_engine.slots import SlotCache

    if da.INTERPRETED:
        pytest.skip("this process runs Triton's interpreter")
    query, key, value, mask = _case(2, 16, 8, 128, [3, 9], 128, 128, torch.float32, seed=0)
    assert not da.covered(query, key, value, mask)
    with pytest.raises(ValueError, match="--decode-attention 'flash'"):
        SlotCache(torch.nn.Linear(2, 2), 4, False, "flash")
    # the default (auto) takes the kernel on CUDA only: a CPU slot cache attends with SDPA, and writes its KV apart
    cpu = SlotCache(torch.nn.Linear(2, 2), 4, False)
    assert cpu.attention == "sdpa" and not cpu.fused_kv_write
    with pytest.raises(ValueError, match="fused KV writes go into the Triton decode attention"):
        SlotCache(torch.nn.Linear(2, 2), 4, False, "sdpa", fused_kv_write=True)


def test_the_engine_refuses_the_kernel_where_it_would_not_run(capsys):
    from slime.backends.hf_engine.server import parse_args

    for flags in (["--device", "cpu"], ["--device", "cuda", "--kv-cache", "dynamic"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "m", "--decode-attention", "triton", *flags])
        assert "--decode-attention triton is for the slot cache on CUDA" in capsys.readouterr().err
    assert parse_args(["--model-path", "m", "--decode-attention", "triton", "--device", "cuda"]).decode_attention == \
        "triton"
    assert parse_args(["--model-path", "m", "--device", "cpu"]).decode_attention == "auto"  # auto is never refused
    # the fused KV writes are the kernel's default; turning them off is never refused (nothing to write apart on CPU)
    assert parse_args(["--model-path", "m", "--device", "cpu", "--disable-fused-kv-write"]).disable_fused_kv_write
    assert not parse_args(["--model-path", "m", "--device", "cuda"]).disable_fused_kv_write
