"""The Megatron backend on real gloo ranks through the test-only CPU shim (tests/megatron_cpu_shim.py).

megatron-core's own TP / PP / DP code paths run (vocab-parallel logits, 1F1B pipeline schedule, DDP
gradient reduction, distributed optimizer, dist_checkpointing); only its hard-coded CUDA calls are
redirected. Checked against a one-rank run and against transformers on the same weights, in fp32:
log-probs, one training step, the exported HF weights, torch_dist save/load across layouts, and a weight
push to an `hf` engine server.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.ranks import free_port, run_ranks, run_script
from tests.e2e_cpu.together import result_of, run_together
from tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_worker.py")
LOGITS_WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "megatron_logits_worker.py")
# name: (world size, TP, PP, extra worker flags); "dp2" also with the distributed optimizer and a push by
# broadcast, "dynamic": --use-dynamic-batch-size micro-batches; "tp2" also computes the log-prob passes' entropies
LAYOUTS = {
    "tp2": (2, 2, 1, ["--extra=--use-rollout-entropy"]),
    "pp2": (2, 1, 2, ["--engine"]),
    "dp2": (2, 1, 1, ["--engine", "--broadcast", "--extra=--use-distributed-optimizer"]),
    "dynamic": (1, 1, 1, ["--dynamic"]),
    "bshd": (1, 1, 1, ["--extra=--qkv-format bshd"]),  # right-padded micro-batches against packed ("one")
}


def max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def hf_log_probs(model_dir: str, batch: dict) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.data import forward_response_log_probs
    from slime.backends.training.batching import make_micro_batch, unpad_per_token

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mb = make_micro_batch(batch["tokens"], batch["response_lengths"])
    with torch.no_grad():
        lp, _ = forward_response_log_probs(model, mb, 1.0)
    return unpad_per_token(lp, batch["response_lengths"])


def hf_entropy_token_mean(model_dir: str, batch: dict) -> float:
    """The mean entropy over every response token of the batch, from transformers' logits (temperature 1)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.data import forward_response_log_probs
    from slime.backends.training.batching import make_micro_batch, unpad_per_token

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mb = make_micro_batch(batch["tokens"], batch["response_lengths"])
    with torch.no_grad():
        _, entropy = forward_response_log_probs(model, mb, 1.0, with_entropy=True)
    values = [x for row in unpad_per_token(entropy, batch["response_lengths"]) for x in row]
    return sum(values) / len(values)


def hf_logits(saved: dict, dtype=torch.float32, device="cpu") -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved["model_dir"], dtype=dtype).to(device).eval()
    with torch.no_grad():
        return model(input_ids=saved["ids"].to(device)).logits.float().cpu()


def run_logits_worker(arch: str, out: str, dtype: str = "float32", extra: str = "") -> dict:
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "worker.log")
    rc = run_script(LOGITS_WORKER, LOGITS_WORKER, ["--arch", arch, "--out", out, "--dtype", dtype, f"--extra={extra}",
                                                   "--port", str(free_port())],
                    log, dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"), timeout_s=300)
    assert rc == 0, open(log, errors="replace").read()[-4000:]
    return torch.load(os.path.join(out, "logits.pt"))


def run_layouts(root, tiny_model_dir: str) -> dict:
    """One rank, every LAYOUTS entry, a TP2 checkpoint loaded at TP1, and a tiny MoE at EP1 / EP2: rank 0's
    results by name (also used on two GPUs by tests/gpu/test_megatron_multi_gpu.py).

    The one-rank runs are independent of each other, so they go two at a time (each rank process is held to
    one thread: two of them fill the two cores of a CI machine as one two-rank run does)."""
    model = ["--model", tiny_model_dir]

    def run(name, world, flags):
        return run_ranks(WORKER, world, str(root / name), flags, timeout_s=300)

    def together(*jobs):  # (name, world, flags) each, two at a time
        with ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(run, name, world, flags) for name, world, flags in jobs}
            return {name: f.result() for name, f in futures.items()}

    one_rank = {name: layout for name, layout in LAYOUTS.items() if layout[0] == 1}
    out = together(("one", 1, model), *((name, 1, model + ["--tp", str(tp), "--pp", str(pp), *flags])
                                        for name, (_, tp, pp, flags) in one_rank.items()))
    for name, (world, tp, pp, flags) in LAYOUTS.items():
        if name not in one_rank:
            out[name] = run(name, world, model + ["--tp", str(tp), "--pp", str(pp), *flags])
    # A checkpoint written at TP2 loads at TP1 (dist_checkpointing re-shards) and resumes at the next rollout.
    # MoE: experts split over two expert-parallel ranks (dynamic micro-batches, as many on each rank) against
    # one rank holding all four.
    moe = make_tiny_model(str(root / "tiny-qwen3-moe"), arch="qwen3_moe", size="tiny", seed=0)
    moe_flags = ["--model", moe, "--arch", "qwen3_moe"]
    out.update(together(("loaded", 1, model + ["--load", str(root / "tp2" / "ckpt")]), ("moe_one", 1, moe_flags)))
    # ep2 also pushes to an engine: the checkpoint's per-expert names, which the hf engine writes into its fused experts
    ep2 = ["--dynamic", "--engine", "--extra=--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"]
    out["moe_ep2"] = run("moe_ep2", 2, moe_flags + ep2)
    out["root"] = str(root)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("megatron_actor"), tiny_model_dir)


@pytest.mark.timeout(900)
def test_one_rank_log_probs_equal_transformers(runs, tiny_model_dir):
    one = runs["one"]
    assert max_abs_diff(one["lp_before"], hf_log_probs(tiny_model_dir, one["batch"])) < 1e-5
    # The reference model starts as the policy (copied from it, not read again): no KL at the first step.
    assert one["metrics"]["train/kl_loss"] == 0.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_rank(runs, layout):
    one, other = runs["one"], runs[layout]
    assert max_abs_diff(one["lp_before"], other["lp_before"]) < 1e-5
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/kl_loss", "train/grad_norm",
                "train/train_rollout_logprob_abs_diff"):
        assert other["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    # One optimizer step later the policies still agree, and it really moved.
    assert max_abs_diff(one["lp_after"], other["lp_after"]) < 1e-4
    assert max_abs_diff(one["lp_before"], one["lp_after"]) > 1e-2


@pytest.mark.timeout(900)
def test_rollout_entropy_over_a_tensor_parallel_vocabulary(runs, tiny_model_dir):
    """--use-rollout-entropy at TP2 (each rank holds half the vocabulary): the old-policy and reference passes'
    entropies, logged as their token means, are transformers' at the first step (the reference is the policy)."""
    tp2 = runs["tp2"]["metrics"]
    want = hf_entropy_token_mean(tiny_model_dir, runs["tp2"]["batch"])
    assert tp2["rollout/entropy"] == pytest.approx(want, rel=1e-5)
    assert tp2["rollout/ref_entropy"] == pytest.approx(want, rel=1e-5)
    assert "rollout/entropy" not in runs["one"]["metrics"]  # off by default


@pytest.mark.timeout(900)
def test_moe_expert_parallel_matches_one_rank(runs):
    one, ep2 = runs["moe_one"], runs["moe_ep2"]
    assert max_abs_diff(one["lp_before"], ep2["lp_before"]) < 1e-5
    for key in ("train/loss", "train/entropy_loss", "train/grad_norm"):
        assert ep2["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    assert max_abs_diff(one["lp_after"], ep2["lp_after"]) < 1e-4


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["one", *LAYOUTS, "moe_one", "moe_ep2"])
def test_exported_hf_weights_equal_the_checkpoint(runs, layout):
    r = runs[layout]
    assert r["export_names_missing"] == [] and r["export_names_extra"] == []
    assert r["export_max_abs_diff"] == 0.0


@pytest.mark.timeout(900)
def test_torch_dist_checkpoint_reshards_and_resumes(runs):
    loaded = runs["loaded"]
    assert loaded["start"] == 1
    assert max_abs_diff(loaded["lp_before"], runs["tp2"]["lp_after"]) < 1e-5


def run_tool(tool: str, *argv: str, log: str) -> None:
    """A tools/ converter under the CPU shim (the tools need CUDA otherwise), its output in `log`. Forked from the
    logits worker's zygote (tests/e2e_cpu/ranks.py): its top level is the shim's install, which the shim's
    `__main__` does first."""
    shim = os.path.join(REPO_ROOT, "tests", "megatron_cpu_shim.py")
    rc = run_script(LOGITS_WORKER, shim, [os.path.join(REPO_ROOT, "tools", tool), *argv], log,
                    dict(os.environ, OMP_NUM_THREADS="1"), timeout_s=300)  # one process: an in-process store
    assert rc == 0, open(log, errors="replace").read()[-6000:]


@pytest.mark.timeout(900)
def test_trained_torch_dist_checkpoint_converts_to_hf(runs, tiny_model_dir, tmp_path):
    """tools/convert_torch_dist_to_hf.py on the TP2 run's checkpoint (architecture from the flags stored
    with it): transformers loads the folder with no missing or unexpected keys and computes the
    trained policy's log-probs."""
    from transformers import AutoModelForCausalLM

    ckpt = os.path.join(runs["root"], "tp2", "ckpt")
    out = str(tmp_path / "hf")
    run_tool("convert_torch_dist_to_hf.py", "--input-dir", ckpt, "--output-dir", out, "--origin-hf-dir", tiny_model_dir,
             log=str(tmp_path / "convert.log"))
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert max_abs_diff(hf_log_probs(out, runs["tp2"]["batch"]), runs["tp2"]["lp_after"]) < 1e-5


CONVERTED_ARCHS = ["qwen3", "qwen3_moe", "glm4"]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """Each architecture's tiny model converted HF -> torch_dist (release) -> HF by the tools/ scripts."""
    root = tmp_path_factory.mktemp("round_trips")
    models = {arch: make_tiny_model(str(root / arch / arch), arch=arch, size="tiny", seed=0) for arch in CONVERTED_ARCHS}

    def round_trip(arch):
        tiny_model_dir = models[arch]
        release = str(root / arch / "torch_dist")
        run_tool("convert_hf_to_torch_dist.py", *model_args(f"tiny-{arch.replace('_', '-')}"),
                 "--hf-checkpoint", tiny_model_dir, "--save", release, log=str(root / arch / "to_torch_dist.log"))
        latest = open(os.path.join(release, "latest_checkpointed_iteration.txt")).read()
        back = str(root / arch / "hf")
        run_tool("convert_torch_dist_to_hf.py", "--input-dir", release, "--output-dir", back,
                 "--origin-hf-dir", tiny_model_dir, log=str(root / arch / "to_hf.log"))
        return tiny_model_dir, latest, back

    return run_together(round_trip, CONVERTED_ARCHS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", CONVERTED_ARCHS)
def test_hf_to_torch_dist_and_back_is_exact(arch, round_trips):
    from safetensors.torch import load_file

    tiny_model_dir, latest, back = result_of(round_trips, arch)
    assert latest == "release"
    original, converted = load_file(os.path.join(tiny_model_dir, "model.safetensors")), load_file(
        os.path.join(back, "model.safetensors"))
    assert sorted(original) == sorted(converted)
    assert all(torch.equal(original[k], converted[k]) for k in original)


def test_conversion_tool_names_a_missing_flag(tiny_model_dir, tmp_path):
    shim = os.path.join(REPO_ROOT, "tests", "megatron_cpu_shim.py")
    done = subprocess.run([sys.executable, shim, os.path.join(REPO_ROOT, "tools", "convert_hf_to_torch_dist.py"),
                           "--hf-checkpoint", tiny_model_dir, "--save", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode != 0
    assert "--num-layers" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["pp2", "dp2", "moe_ep2"])
def test_weight_push_reaches_the_engine(runs, layout):
    """pp2: colocated (handles to the buffers), from two pipeline stages; dp2: a separate engine, by
    broadcast over a process group formed with it; moe_ep2: a MoE's experts from two expert-parallel ranks, pushed
    as the checkpoint's per-expert tensors into the engine's fused ones."""
    r = runs[layout]
    assert r["engine_weight_version"] == "1"
    assert max_abs_diff(r["engine_lp_after_push"], r["lp_after"]) < 1e-4


LOGITS_ARCHS = ["qwen3_moe", "llama", "qwen2", "glm4", "glm4_moe"]


@pytest.fixture(scope="module")
def family_logits(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_logits")
    return run_together(lambda arch: run_logits_worker(arch, str(root / arch)), LOGITS_ARCHS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", LOGITS_ARCHS)
def test_logits_equal_transformers_per_family(arch, family_logits):
    saved = result_of(family_logits, arch)
    assert float((saved["logits"] - hf_logits(saved)).abs().max()) < 1e-4
