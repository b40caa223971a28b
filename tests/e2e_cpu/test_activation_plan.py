"""The dry-run plan's activation term against what a Megatron decoder layer keeps for its backward.

`layer_activation_elements` (slime/config/plan/memory.py) is a formula over the model's shape;
tests/e2e_cpu/megatron_activation_worker.py tallies, on CPU, the bf16 storages autograd keeps in each decoder layer of
a tiny model built by slime's model provider (norms, flash attention and the rotary embedding as their CUDA kernels
keep them; under --attention-kernel cudnn the packed micro-batch through the padded route, scattered and gathered or,
sequences of one length, viewed, whose SDPA on the CPU runs torch's CPU flash kernel, keeping what cuDNN's does). The
two must agree to the byte for a dense layer with q/k norms (qwen3) and without (llama), a layer with sandwich norms
(glm4) and an MoE layer (qwen3-moe), on each route. What the formula leaves out, fp32 statistics (an RMSNorm's inverse
RMS per row, the log-sum-exp per head) and the router's fp32 scores and indices, is checked to be only that.
"""

from __future__ import annotations

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from slime.config.plan.memory import layer_activation_elements
from slime.config.plan.model_size import load_model_shape
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import free_port, run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_activation_worker.py")
ARCHS = ("qwen3", "llama", "glm4", "qwen3_moe")


ROUTES = ("flash", "padded", "one-length")  # megatron_activation_worker.py's --route


def tally(arch: str, route: str, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "worker.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    rc = run_script(WORKER, WORKER, ["--arch", arch, "--route", route, "--out", out, "--port",
                                     str(free_port())], log, env, timeout_s=300)
    assert rc == 0, open(log, errors="replace").read()[-4000:]
    with open(os.path.join(out, "activations.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[tuple[str, str], dict]:
    root = tmp_path_factory.mktemp("activations")
    with ThreadPoolExecutor(2) as pool:  # one thread each: two fill CI's two cores
        futures = {(arch, route): pool.submit(tally, arch, route, str(root / f"{arch}-{route}"))
                   for arch in ARCHS for route in ROUTES}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_plan_counts_what_each_layer_keeps(measured, arch, route):
    result = measured[arch, route]
    shape = load_model_shape(result["model_dir"])
    planned = [2 * layer_activation_elements(shape, i, padded_attention=route == "padded")  # bf16
               for i in range(shape.num_layers)]
    assert result["layers"] == planned, (arch, route, result["layers"], planned)

    norm_rows = shape.norms_per_layer + (shape.num_heads + shape.num_kv_heads if shape.qk_norm else 0)
    statistics = 4 * (norm_rows + shape.num_heads)  # fp32 inverse RMS per norm row, log-sum-exp per head
    for layer, other in enumerate(result["other"]):
        if shape.moe_layers[layer]:  # + the router's fp32 scores and int64 indices, per expert or choice
            assert statistics <= other <= statistics + 8 * (shape.num_experts + shape.experts_per_token), other
        else:
            assert other == statistics, (arch, route, layer, other, statistics)
