"""slime/backends/megatron_utils/grad_norm.py: megatron-core's gradient norm without its local fallback's host wait
per parameter: the same norm, no `.item()` on the way, installed only where the fallback is in use."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def test_the_norm_of_every_gradient_on_their_device_without_a_host_wait():
    from slime.backends.megatron_utils.grad_norm import foreach_l2_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) * scale for shape, scale in (((7, 5), 1.0), ((3,), 1e-3), ((4, 4, 2), 30))]
    flag = torch.zeros(1, dtype=torch.int)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm, per_tensor = foreach_l2_norm(2048 * 32, flag, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    want = torch.linalg.vector_norm(torch.cat([t.flatten().double() for t in grads]))
    assert abs(norm.item() - want.item()) <= 1e-6 * want.item()
    waits = [e for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item")]
    assert not waits, [e.name for e in waits]  # megatron-core's fallback makes one per gradient
    assert foreach_l2_norm(2048 * 32, flag, [[]], False)[0].tolist() == [0.0]


def test_installed_only_in_place_of_megatron_cores_local_fallback(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from slime.backends.megatron_utils import grad_norm

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)  # no TE, no Apex (here)
    assert grad_norm.install() and clip_grads.l2_norm_impl is grad_norm.foreach_l2_norm
    assert grad_norm.install() and clip_grads.l2_norm_impl is grad_norm.foreach_l2_norm  # once

    def apex_kernel(*args):
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_kernel)
    assert not grad_norm.install() and clip_grads.l2_norm_impl is apex_kernel
