"""The update_weights_from_tensor payload with CUDA tensors: another process opens the CUDA IPC handle
through the restricted reader and sees the same values (run on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_bucket_opens_in_another_process():
    gen = torch.Generator(device="cuda").manual_seed(0)
    named = [("w", torch.randn(64, 32, device="cuda", generator=gen).bfloat16()),
             ("b", torch.randn(7, device="cuda", generator=gen)),
             ("i", torch.arange(5, device="cuda"))]
    flat = flatten_bucket(named)
    assert flat.flattened_tensor.is_cuda
    code = textwrap.dedent("""
        import sys, torch
        from slime.weight_sync.tensor_payload import deserialize_bucket
        for name, t in deserialize_bucket(sys.stdin.read()).unflatten():
            assert t.is_cuda, name
            print(name, t.dtype, float(t.double().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], input=serialize_bucket(flat), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = {line.split()[0]: (line.split()[1], float(line.split()[2])) for line in out.stdout.strip().splitlines()}
    for name, t in named:
        assert got[name][0] == str(t.dtype) and got[name][1] == pytest.approx(float(t.double().sum()), rel=1e-12)
    del flat
