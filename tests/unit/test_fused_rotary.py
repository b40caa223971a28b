"""The hf engine's fused rotary embedding (slime/backends/hf_engine/fused_rotary.py) against transformers' own
`apply_rotary_pos_emb`, run by Triton's interpreter on CPU (`TRITON_INTERPRET=1`, set before the kernel is
defined, so in a process of its own): the kernel against an fp64 rotation on odd shapes, whole Qwen3 / Llama
forwards with and without it, the cases it leaves to transformers, and a rotation of another kind kept as it is.
The kernel's speed is a GPU matter (`benchmarks/decode_speed.py --rotary op,fused`)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def _reference(x, cos, sin):
    """transformers' rotation in fp64: x * cos + rotate_half(x) * sin, cos / sin [B, S, D] over x [B, H, S, D]."""
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _angles(batch, seq, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(batch, seq, dim // 2, generator=gen) * 50
    a = torch.cat([a, a], dim=-1)
    return a.cos().to(dtype), a.sin().to(dtype)


def _kernel_against_fp64() -> None:
    from slime.backends.hf_engine import fused_rotary

    assert fused_rotary.INTERPRETED
    gen = torch.Generator().manual_seed(1)
    # heads that are no power of two, several positions, a head dimension of 24 (blocks of 16 with a mask), and
    # cos / sin shared by the batch (shape[0] == 1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        for batch, heads, seq, dim, shared in ((2, 6, 3, 24, False), (3, 5, 1, 128, True), (1, 2, 7, 64, False)):
            x = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # attention's view
            cos, sin = _angles(1 if shared else batch, seq, dim, dtype)
            got = fused_rotary._rotate(x, cos, sin)
            assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
            err = (got.double() - _reference(x, cos, sin)).abs().max().item()
            assert err <= tol * 4, (dtype, batch, heads, seq, dim, err)


def _tiny(kind: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.to(dtype).eval()


def _models_with_and_without() -> None:
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    from slime.backends.hf_engine.fused_rotary import fuse_rotary, restore_rotary

    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(2))
    for kind, module in (("qwen3", qwen3), ("llama", llama)):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
            model = _tiny(kind, dtype)
            own = module.apply_rotary_pos_emb
            with torch.no_grad():
                want = model(ids).logits.float()
                assert fuse_rotary(model) == 1 and module.apply_rotary_pos_emb.own is own
                assert fuse_rotary(model) == 1 and module.apply_rotary_pos_emb.own is own  # not fused twice
                got = model(ids).logits.float()
            restore_rotary(model)
            assert module.apply_rotary_pos_emb is own
            err = (got - want).abs().max().item()
            assert err < tol, (kind, dtype, err)


def _left_to_transformers() -> None:
    from transformers.models.glm import modeling_glm
    from transformers.models.qwen3 import modeling_qwen3

    from slime.backends.hf_engine import fused_rotary

    own = modeling_qwen3.apply_rotary_pos_emb
    fused = fused_rotary._fused(own)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, 32, generator=gen)
    k = torch.randn(2, 2, 3, 32, generator=gen)
    cos, sin = _angles(2, 3, 32, torch.float32)
    calls = []
    fused_rotary_rotate = fused_rotary._rotate
    fused_rotary._rotate = lambda *a: calls.append(a) or fused_rotary_rotate(*a)
    try:
        for args, kwargs in (((q, k, cos, sin), {}), ((q, k, cos, sin), {"unsqueeze_dim": 1})):
            fused(*args, **kwargs)
        assert len(calls) == 4  # q and k of both calls
        # [B, S, H, D] inputs with unsqueeze_dim=2, another dtype, cos narrower than the head: transformers' own
        # function, with its result or its error
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        for args, kwargs in (((qt, kt, cos, sin), {"unsqueeze_dim": 2}), ((q.double(), k.double(), cos, sin), {})):
            got, want = fused(*args, **kwargs), own(*args, **kwargs)
            assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
        with pytest.raises(RuntimeError, match="size of tensor"):
            fused(q, k, cos[..., :16], sin[..., :16])
        assert len(calls) == 4
    finally:
        fused_rotary._rotate = fused_rotary_rotate
    # GLM rotates interleaved pairs: the check on random inputs keeps its own function
    glm = modeling_glm.apply_rotary_pos_emb
    assert not fused_rotary._agrees(glm, fused_rotary._fused(glm), (4, 2, 32), torch.device("cpu"), torch.float32)
    assert fused_rotary._agrees(own, fused, (6, 2, 32), torch.device("cpu"), torch.bfloat16)
    # a kernel that fails (here: to launch) leaves transformers' form, with a warning
    fused_rotary._rotate = lambda *a: (_ for _ in ()).throw(KeyError("no kernel"))
    try:
        assert not fused_rotary._agrees(own, fused, (6, 2, 32), torch.device("cpu"), torch.float32)
    finally:
        fused_rotary._rotate = fused_rotary_rotate


@pytest.mark.parametrize("case", ["_kernel_against_fp64", "_models_with_and_without", "_left_to_transformers"])
def test_fused_rotary_in_the_interpreter(case):
    run_interpreted(f"from tests.unit.test_fused_rotary import {case}; {case}()")


def test_nothing_is_fused_off_cuda_without_the_interpreter():
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    from slime.backends.hf_engine import fused_rotary

    if fused_rotary.INTERPRETED:
        pytest.skip("this process runs Triton's interpreter")
    own = qwen3.apply_rotary_pos_emb
    assert fused_rotary.fuse_rotary(_tiny("qwen3", torch.float32)) == 0
    assert qwen3.apply_rotary_pos_emb is own
