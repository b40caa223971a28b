"""Context parallelism of the Megatron backend (slime/backends/megatron_utils/cp_layout.py) on real gloo ranks
through the test-only CPU shim, in fp32: a run with `--context-parallel-size 2` against the same layout without
CP, on the same packed micro-batches (one rank vs two; DP2, TP2 and PP2 against each × CP2 on four ranks).

Compared: the log-probs and entropies of every response token, the step's loss and metrics, every parameter's
gradient as the optimizer used it (after megatron-core's DDP reduction over the data-parallel-with-CP group), and
the log-probs after the step.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_cp_worker.py")
# an entropy bonus and the rollout's (shifted) log-probs as the old policy: a loss with every term non-zero; a clip
# norm no gradient reaches, so that the gradients compared are the reduced ones, not rescaled to a common norm; no
# distributed optimizer, whose reduce-scatter leaves each rank only its shard of the gradients rank 0's are read from
FLAGS = ("--entropy-coef 0.01 --use-rollout-logprobs --transformer-impl local --clip-grad 1e9 "
         "--no-use-distributed-optimizer")
# name: (world size, flags); each CP layout is compared with the one before it
LAYOUTS = {
    "cp1": (1, FLAGS),
    "cp2": (2, FLAGS + " --context-parallel-size 2"),
    "dp2": (2, FLAGS),
    "dp2_cp2": (4, FLAGS + " --context-parallel-size 2"),
    # vocab-parallel log-probs and split heads with CP; gradients compared shard by shard (rank 0's)
    "tp2": (2, FLAGS + " --tensor-model-parallel-size 2"),
    "tp2_cp2": (4, FLAGS + " --tensor-model-parallel-size 2 --context-parallel-size 2"),
    # two pipeline stages exchange each CP rank's share of the row; rank 0's are the first stage's gradients
    "pp2": (2, FLAGS + " --pipeline-model-parallel-size 2"),
    "pp2_cp2": (4, FLAGS + " --pipeline-model-parallel-size 2 --context-parallel-size 2"),
}
PAIRS = [("cp1", "cp2"), ("dp2", "dp2_cp2"), ("tp2", "tp2_cp2"), ("pp2", "pp2_cp2")]


def max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_cp")
    out = {}
    for name, (world, flags) in LAYOUTS.items():
        result = run_ranks(WORKER, world, str(root / name), ["--model", tiny_model_dir, f"--extra={flags}"],
                           timeout_s=400)
        result["grads"] = torch.load(str(root / name / "grads.pt"))
        out[name] = result
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("base,cp", PAIRS)
def test_context_parallel_matches_no_context_parallel(runs, base, cp):
    one, two = runs[base], runs[cp]
    # the CP run really split the sequences: every attention call ran across the CP group, over half the tokens
    assert (one["cp_size"], two["cp_size"]) == (1, 2) and one["dp_size"] == two["dp_size"]
    assert one["cp_attention_calls"] == 0 and two["cp_attention_calls"] > 0 and two["packed_tokens"] > 0
    assert two["cp_query_tokens"] == two["packed_tokens"] < one["packed_tokens"]
    # (a) the log-prob and entropy of every response token
    assert max_abs_diff(one["lp_before"], two["lp_before"]) < 2e-6
    assert max_abs_diff(one["entropy"], two["entropy"]) < 5e-6
    # (b) the loss and every metric of the step
    assert set(one["metrics"]) == set(two["metrics"])
    assert one["metrics"]["train/loss"] != 0.0 and one["metrics"]["train/entropy_loss"] > 0.0
    for name, value in one["metrics"].items():
        assert two["metrics"][name] == pytest.approx(value, rel=1e-5, abs=5e-7), name
    # (c) every parameter's gradient after the reduction over the data-parallel-with-CP group
    assert set(one["grads"]) == set(two["grads"]) and len(one["grads"]) > 10
    for name, grad in one["grads"].items():
        assert grad.abs().max() > 0, name
        diff = (grad - two["grads"][name]).abs().max().item()
        assert diff <= 5e-6 * grad.abs().max().item() + 1e-9, (name, diff, grad.abs().max().item())
    # and the weights the step produced
    assert max_abs_diff(one["lp_after"], two["lp_after"]) < 1e-5
