"""`sdpa_attention.varlen_causal`: the packed causal call onto torch's `varlen_attn` with the keywords the installed
torch version takes (the CUDA path; here with a recording stand-in for the kernel, since varlen_attn is CUDA-only),
and grouped-query heads sent to torch's flash kernels directly where `varlen_attn` has no `enable_gqa`."""

from __future__ import annotations

import torch

from slime.backends.megatron_utils import sdpa_attention
from slime.backends.megatron_utils.sdpa_attention import _varlen_attn, varlen_causal


def _inputs(kv_heads: int):
    q = torch.randn(10, 4, 8)
    k, v = torch.randn(10, kv_heads, 8), torch.randn(10, kv_heads, 8)
    return q, k, v, torch.tensor([0, 3, 10], dtype=torch.int64)


def _recording():
    calls = []

    def fn(*args, **kwargs):
        calls.append((args, kwargs))
        return args[0]
    return fn, calls


def test_this_torchs_keywords_causal_by_window_with_the_scale_and_grouped_heads():
    keywords = _varlen_attn()[1]  # torch 2.13's varlen_attn: window_size, scale, enable_gqa
    fn, calls = _recording()
    q, k, v, cu = _inputs(kv_heads=2)
    assert varlen_causal(fn, keywords, q, k, v, cu, 7, 0.25) is q
    (args, kwargs), = calls
    assert kwargs == {"enable_gqa": True, "scale": 0.25, "window_size": (-1, 0)}
    assert args[3] is args[4] and args[3].dtype == torch.int32 and args[3].tolist() == [0, 3, 10]
    assert args[5:] == (7, 7)


def test_an_older_varlen_attn_gets_is_causal_and_no_grouped_keyword_for_equal_heads():
    fn, calls = _recording()
    q, k, v, cu = _inputs(kv_heads=4)
    varlen_causal(fn, {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal"},
                  q, k, v, cu, 7, 0.25)
    assert calls[0][1] == {"is_causal": True}


def test_grouped_heads_without_enable_gqa_take_the_flash_kernels_directly(monkeypatch):
    fn, calls = _recording()
    taken = []
    monkeypatch.setattr(sdpa_attention._GroupedFlashVarlen, "apply", lambda *a: taken.append(a) or a[0])
    q, k, v, cu = _inputs(kv_heads=2)
    out = varlen_causal(fn, {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
                             "scale"}, q, k, v, cu, 7, 0.25)
    assert out is q and not calls
    (q_, k_, v_, cu_, max_len, scale), = taken
    assert q_ is q and k_ is k and v_ is v and cu_.dtype == torch.int32 and (max_len, scale) == (7, 0.25)
