"""`--adam-kernel` on a real GPU (run on the H100 / H200; skipped without CUDA): the workers of tests/e2e_cpu/
test_megatron_adam_kernel.py (megatron-core's optimizer) and test_fsdp_adam_kernel.py (the fsdp trainer's AdamW over
FSDP2's DTensor parameters) with nccl and CUDA parameters, where the fused kernel keeps each step counter on the GPU
and torch's default keeps it on the host, across a checkpoint of the other kernel."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.e2e_cpu.test_fsdp_adam_kernel import fsdp_adam_kernels
from tests.e2e_cpu.test_megatron_adam_kernel import adam_kernels, check_adam_kernels
from tests.forkserver import spawned_result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.timeout(300)
def test_fused_and_unfused_adam_on_the_gpu(tmp_path):
    check_adam_kernels(spawned_result(adam_kernels, str(tmp_path)), "cuda")


@pytest.mark.timeout(300)
def test_fsdp_fused_and_unfused_adam_on_the_gpu(tiny_model_dir, tmp_path):
    check_adam_kernels(spawned_result(fsdp_adam_kernels, tiny_model_dir, str(tmp_path)), "cuda", tolerance=1e-5)
