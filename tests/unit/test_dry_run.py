"""--dry-run: train.py / train_async.py validate, print the plan and exit 0 without starting Ray or any process;
the plan's parameter counts, memory estimates, layout and warnings checked against hand-computed numbers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from slime.config.arguments import SlimeArgumentError, parse_args
from slime.config.plan import format_plan
from slime.config.plan.layout import compute_layout, describe_bundles
from slime.config.plan.memory import GiB, engine_memory, fmt_bytes, kv_bytes_per_token, training_memory
from slime.config.plan.model_size import count_params, load_model_shape, shape_from_hf_config
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.together import result_of, run_together

# Published config.json values of Qwen/Qwen3-4B and deepseek-ai/DeepSeek-V3 (the fields the plan reads).
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
    "vocab_size": 151936, "tie_word_embeddings": True, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "max_position_embeddings": 40960, "attention_bias": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "norm_topk_prob": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16",
}  # fmt: skip

TAG = "SLIME_DRY_RUN_TEST_TAG"


def write_config(folder, cfg: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def base(*extra: str) -> list[str]:
    """A 32 × 8 rollout on the `files` fixture's fake model folder and prompt file."""
    return ["--hf-checkpoint", "model", "--prompt-data", "train.jsonl", "--input-key", "prompt",
            "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "3", *extra]  # fmt: skip


def tagged_processes(tag: str) -> list[str]:
    """Live processes whose environment carries our tag (what the dry run might have left behind)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(TAG) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(p.info["cmdline"] or []))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


# ---- the command line, end to end ----------------------------------------------------------------------------


DRY_RUN_ENTRIES = ["train.py", "train_async.py"]


def _dry_run(entry: str, model_dir: str, data_path: str, cwd: str) -> tuple[subprocess.CompletedProcess, float, list]:
    """One dry run of `entry` in `cwd`: its result, its wall time, and the processes of its tag alive as it
    returned."""
    tag = uuid.uuid4().hex
    # A Ray address that refuses connections: any ray.init would fail the run instead of starting a cluster.
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, RAY_ADDRESS="127.0.0.1:9", **{TAG: tag})
    cmd = [
        sys.executable, os.path.join(REPO_ROOT, entry),
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--lr", "1e-3", "--micro-batch-size", "4", "--rm-type", "toy",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--global-batch-size", "16",
        "--num-rollout", "3", "--dry-run",
    ]  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=cwd)
    return out, time.monotonic() - start, tagged_processes(tag)


@pytest.fixture(scope="module")
def dry_runs(tiny_model_dir, toy_data_path, tmp_path_factory) -> dict:
    """Both entries' dry runs, at once (tests/e2e_cpu/together.py: each is a single-threaded process, and each
    test checks its own run, in a working folder of its own)."""
    folders = {entry: tmp_path_factory.mktemp(entry.replace(".", "_")) for entry in DRY_RUN_ENTRIES}
    runs = run_together(lambda e: _dry_run(e, tiny_model_dir, toy_data_path, str(folders[e])), DRY_RUN_ENTRIES)
    return {"runs": runs, "folders": folders}


@pytest.mark.parametrize("entry", DRY_RUN_ENTRIES)
def test_tiny_cpu_dry_run_prints_the_plan_and_starts_nothing(entry, tiny_model_dir, dry_runs):
    from transformers import AutoModelForCausalLM

    out, elapsed, left = result_of(dry_runs["runs"], entry)
    tmp_path = dry_runs["folders"][entry]
    assert out.returncode == 0, out.stderr[-3000:]
    assert elapsed < 60, f"a dry run should take seconds, took {elapsed:.1f}s"
    assert left == []
    assert not (tmp_path / "outputs").exists()  # no tracker, no checkpoint folder
    plan = out.stdout
    assert plan.startswith(f"slime dry run: {entry}: arguments are valid; nothing was started")
    assert ("asynchronous (train_async.py)" if entry == "train_async.py" else "synchronous (train.py)") in plan
    assert "CPU (no CUDA): bundles are {CPU: 1}" in plan
    assert re.search(r"actor\s+0-1\s+node 0: CPU slot 0-1\s+FSDP over 2 rank\(s\)", plan), plan
    assert re.search(r"engine 1\s+3\s+node 0: CPU slot 3\s+hf engine", plan), plan
    assert re.search(r"samples per rollout\s+16 = --rollout-batch-size 4 × --n-samples-per-prompt 4", plan)
    assert re.search(r"optimizer steps\s+1 per rollout of --global-batch-size 16 samples; 3 in the run", plan)
    assert re.search(r"data-parallel size\s+2 ", plan)
    assert re.search(r"micro-batches\s+2 per step per DP rank = 8 ÷ --micro-batch-size 4", plan)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert f"({n_params:,})" in plan
    assert "no limit checked" in plan
    assert "== Warnings ==\n  none\n" in plan


# ---- parameter counts --------------------------------------------------------------------------------------


def test_param_count_of_the_tiny_model_folder_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert count_params(load_model_shape(tiny_model_dir)).total == sum(p.numel() for p in model.parameters())


def test_param_count_matches_transformers_for_every_family(tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_tiny_model import ARCHS, build_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for arch in ARCHS:  # dense, GQA bias, q/k norms, GLM's extra norms, MoE with and without shared experts, MLA
        config = build_config(arch, "tiny", 192, tokenizer)
        model = AutoModelForCausalLM.from_config(config)
        counted = count_params(shape_from_hf_config(config.to_dict()))
        assert counted.total == sum(p.numel() for p in model.parameters()), arch


def test_qwen3_4b_has_4_0e9_parameters():
    h, layers, heads, kv, d, ffn, vocab = 2560, 36, 32, 8, 128, 9728, 151936
    per_layer = 2 * h + h * heads * d * 2 + h * kv * d * 2 + 2 * d + 3 * h * ffn  # norms, q+o, k+v, q/k norm, MLP
    expected = layers * per_layer + vocab * h + h  # tied embedding, final norm
    counts = count_params(shape_from_hf_config(QWEN3_4B))
    assert counts.total == expected == 4_022_468_096
    assert counts.output == 0 and counts.active == counts.total


def test_deepseek_v3_has_671b_parameters_37b_active():
    counts = count_params(shape_from_hf_config(DEEPSEEK_V3))
    assert abs(counts.total / 671e9 - 1) < 0.002, counts.total
    assert abs(counts.active / 37e9 - 1) < 0.02, counts.active
    assert counts.layers_expert == 58 * 256 * 3 * 7168 * 2048


# ---- memory estimates --------------------------------------------------------------------------------------


def test_megatron_and_engine_memory_of_qwen3_4b_closed_form(files):
    write_config(files / "model", QWEN3_4B)
    argv = base(
        *model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8", "--colocate",
        "--tensor-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer", "--micro-batch-size", "1",
        "--rollout-max-context-len", "4096", "--rollout-num-gpus-per-engine", "2",
        "--sglang-mem-fraction-static", "0.7",
    )  # fmt: skip
    args = parse_args(argv)
    assert (args.use_cuda, args.train_backend, args.rollout_backend) == (True, "megatron", "sglang")
    shape = load_model_shape("model")
    est = training_memory(args, shape, tokens=4096, micro_batches=64, with_ref=False)
    padded_vocab = 152064  # 151936 up to a multiple of 128 × TP 2
    per_gpu = (4_022_468_096 + (padded_vocab - 151936) * 2560) / 2
    assert est.get("weights") == per_gpu * 2
    assert args.accumulate_allreduce_grads_in_fp32  # --bf16: fp32 gradient buffers, as Megatron-LM
    assert est.get("gradients") == per_gpu * 4
    assert est.get("optimizer") == per_gpu * 12 / 4  # distributed over DP 4
    for momentum, held in (("0.9", 8), ("0", 4)):  # fp32 master (+ momentum) of SGD
        sgd = parse_args([*argv, "--optimizer", "sgd", "--sgd-momentum", momentum, "--no-use-distributed-optimizer"])
        assert training_memory(sgd, shape, tokens=4096, micro_batches=64, with_ref=False).get("optimizer") == \
            per_gpu * held  # megatron-core's distributed optimizer takes Adam only
    # per token and layer, no sequence parallel (the 4h of norm and projection inputs whole on each TP rank), bf16:
    # 4h + fused qkv (q + 2kv) + q's copy for its norm + query, key, output (q + kv + q) + 3·ffn, the rest ÷ TP 2
    q, kv, ffn = 32 * 128 / 2, 8 * 128 / 2, 9728 / 2
    assert est.get("activations") == 36 * 4096 * 2 * (4 * 2560 + 4 * q + 3 * kv + 3 * ffn)
    # --attention-kernel cudnn: the padded query, key, value, output (2q + 2kv) and the gathered output (q) in place
    # of flash attention's query, key and output
    cudnn = training_memory(parse_args([*argv, "--attention-kernel", "cudnn"]), shape, tokens=4096, micro_batches=64,
                            with_ref=False)
    assert cudnn.get("activations") == 36 * 4096 * 2 * (4 * 2560 + 5 * q + 4 * kv + 3 * ffn)
    # without q/k norms (Llama's layer) the padded route keeps kv less than flash: the plan counts flash's, which
    # micro-batches of sequences of one length (viewed, not copied) and too uneven ones keep under cudnn as well
    llama = shape_from_hf_config(dict(QWEN3_4B, architectures=["LlamaForCausalLM"], model_type="llama"))
    assert not llama.qk_norm
    for kernel_args in ([], ["--attention-kernel", "cudnn"]):
        plan = training_memory(parse_args([*argv, *kernel_args]), llama, tokens=4096, micro_batches=64,
                               with_ref=False)
        assert plan.get("activations") == 36 * 4096 * 2 * (4 * 2560 + 3 * q + 3 * kv + 3 * ffn)
    assert est.get("logits") == 4096 * padded_vocab / 2 * 8

    mem, _ = engine_memory(args, shape, 80 * GiB)
    assert mem.weights == 4_022_468_096 * 2 / 2
    assert mem.kv_bytes_per_token == 2 * 36 * (8 // 2) * 128 * 2
    assert mem.kv_tokens == int((0.7 * 80 * GiB - mem.weights) // mem.kv_bytes_per_token)

    plan = format_plan(args)
    assert "GPU (planned as a GPU run: --dry-run-cuda, or GPU-only flags; this machine has no CUDA)" in plan or "GPU (CUDA)" in plan
    assert re.search(r"engine 3\s+6-7\s+node 0: GPU 6-7\s+TP 2", plan), plan
    assert re.search(r"rollout\s+0-7\s+node 0: GPU 0-7\s+shared with actor \(--colocate\)", plan)
    assert "colocated, generating" in plan
    # the phases as the loop's memory handoff runs them (--colocate turns both offloads on)
    assert "training state to host memory while the engines generate" in plan
    assert "engines released (--offload-rollout)" in plan and "state in host memory (--offload-train)" in plan
    assert "colocated, pushing weights" in plan


def test_fixed_micro_batches_far_below_the_gpu_get_a_token_budget_hint(files):
    """Micro-batches of a few samples on a GPU with room: the plan names the --max-tokens-per-gpu that its own
    estimate fits in 80% of the GPU (the largest doubling of the micro-batch), and says nothing when the run already
    packs by tokens, plans for CPU, or shares the training phase with resident engines."""
    write_config(files / "model", QWEN3_4B)
    flags = (*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--dry-run-gpu-gb", "141", "--bf16",
             "--use-distributed-optimizer", "--rollout-max-context-len", "1024", "--global-batch-size", "256",
             "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    args = parse_args(base(*flags, "--micro-batch-size", "2"))
    plan = format_plan(args)
    hinted = re.search(r"hint: micro-batches of --micro-batch-size 2 \(2048 tokens\) leave room: "
                       r"--use-dynamic-batch-size --max-tokens-per-gpu (\d+) packs up to (\d+) full-length", plan)
    assert hinted, plan
    budget = int(hinted.group(1))
    assert budget % 1024 == 0 and int(hinted.group(2)) == budget // 1024 and budget >= 4 * 1024
    shape = load_model_shape("model")

    def total(tokens: int) -> float:
        packed = parse_args(base(*flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(tokens)))
        return training_memory(packed, shape, tokens, None, with_ref=False).total

    assert total(budget) <= 0.8 * 141 * GiB < total(2 * budget)  # the largest doubling the estimate fits
    for other in (base(*flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"),
                  base(*flags, "--micro-batch-size", "2", "--colocate", "--no-offload-rollout"),
                  [f for f in base(*flags, "--micro-batch-size", "2") if f != "--dry-run-cuda"]):
        assert "hint: micro-batches" not in format_plan(parse_args(other))


def test_colocated_plan_follows_the_offload_flags(files):
    write_config(files / "model", QWEN3_4B)
    common = (*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8", "--colocate",
              "--tensor-model-parallel-size", "2", "--bf16", "--micro-batch-size", "1", "--rollout-max-context-len",
              "4096", "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7")
    resident = format_plan(parse_args(base(*common, "--no-offload-rollout", "--no-offload-train")))
    assert "none: training state and engines stay resident" in resident
    assert re.search(r"colocated, training\s+\S+ GB = training \S+ GB \+ engines static pool", resident), resident
    assert "pushing weights" not in resident
    # resident together, the 0.7 pool does not leave room for the training state: the fix is named
    assert "drop --no-offload-rollout, or lower --sglang-mem-fraction-static" in resident
    handed = format_plan(parse_args(base(*common)))
    assert "drop --no-offload-rollout" not in handed
    # the push holds the trainer's weights only (the rest is offloaded first) beside the engines' weights
    assert re.search(r"colocated, pushing weights\s+\S+ GB = training weights \S+ GB \(the rest offloaded\)",
                     handed), handed
    kept = format_plan(parse_args(base(*common, "--no-offload-train")))
    assert re.search(r"colocated, pushing weights\s+\S+ GB = training state", kept), kept


def test_fsdp_memory_closed_form(tiny_model_dir, toy_data_path):
    args = parse_args(["--hf-checkpoint", tiny_model_dir, "--prompt-data", toy_data_path, "--rollout-batch-size", "4",
                       "--num-rollout", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--dry-run"])
    if args.use_cuda:
        pytest.skip("checks the CPU (fp32) numbers")
    shape = load_model_shape(tiny_model_dir)
    p = count_params(shape).total
    est = training_memory(args, shape, tokens=100, micro_batches=None, with_ref=True)
    assert est.get("weights") == est.get("gradients") == est.get("reference model") == 4 * p / 2
    assert est.get("optimizer") == 8 * p / 2
    assert est.get("activations") == shape.num_layers * 100 * shape.hidden_size * 34 * 2  # fp32 doubles 34·T·h


def test_the_opd_teachers_memory_is_counted(tiny_model_dir, toy_data_path, tmp_path, files):
    """--use-opd --opd-type megatron: the trainer holds a frozen teacher; the plan counts it (its own size on fsdp,
    read from its config.json; the student's layout on megatron)."""
    from tools.make_tiny_model import make_tiny_model

    teacher = make_tiny_model(str(tmp_path / "teacher"), size="small", seed=1)
    opd = ("--use-opd", "--opd-type", "megatron", "--opd-kl-coef", "1.0", "--opd-teacher-load", teacher)
    args = parse_args(["--hf-checkpoint", tiny_model_dir, "--prompt-data", toy_data_path, "--rollout-batch-size", "4",
                       "--num-rollout", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--dry-run",
                       *opd])
    shape = load_model_shape(tiny_model_dir)
    est = training_memory(args, shape, tokens=100, micro_batches=None, with_ref=False)
    assert est.get("teacher model") == 4 * count_params(load_model_shape(teacher)).total / 2
    assert est.get("teacher model") > 4 * est.get("weights")  # the small teacher, not the tiny student

    write_config(files / "model", QWEN3_4B)
    common = (*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8",
              "--colocate", "--tensor-model-parallel-size", "2", "--bf16", "--micro-batch-size", "1")
    megatron = training_memory(parse_args(base(*common, *opd)), load_model_shape("model"), tokens=4096,
                               micro_batches=1, with_ref=False)
    assert megatron.get("teacher model") == megatron.get("weights")
    without = training_memory(parse_args(base(*common)), load_model_shape("model"), tokens=4096, micro_batches=1,
                              with_ref=False)
    assert without.get("teacher model") == 0 and megatron.total == without.total + megatron.get("weights")


def test_mla_kv_cache_is_the_latent_per_layer():
    shape = shape_from_hf_config(DEEPSEEK_V3)
    assert kv_bytes_per_token(shape, tp=16, kv_bytes=2)[0] == 61 * (512 + 64) * 2


# ---- layout and warnings -----------------------------------------------------------------------------------


def test_deepseek_v3_on_128_gpus_disaggregated(files):
    write_config(files / "model", DEEPSEEK_V3)
    args = parse_args(base(
        *model_args("deepseek-v3"), "--dry-run", "--dry-run-cuda", "--actor-num-nodes", "8",
        "--rollout-num-gpus", "64", "--rollout-num-gpus-per-engine", "16", "--tensor-model-parallel-size", "8",
        "--sequence-parallel", "--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "16",
        "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1", "--bf16",
        "--use-distributed-optimizer", "--rollout-max-context-len", "16384", "--global-batch-size", "256",
    ))  # fmt: skip
    layout = compute_layout(args)
    assert layout.actor == list(range(64)) and layout.rollout == list(range(64, 128))
    assert [e.bundles[0] for e in layout.engines] == [64, 80, 96, 112]
    assert layout.engines[0].node_actor_bundles() == [64, 72]
    assert describe_bundles(layout, layout.engines[0].bundles) == "nodes 8-9: GPU 0-7 each"
    assert describe_bundles(layout, layout.actor) == "nodes 0-7: GPU 0-7 each"

    plan = format_plan(args)
    assert "TP 8 × PP 4 × CP 1 × DP 2, EP 16" in plan
    # stage 1: 15 MoE layers' activations with 3 micro-batches in flight outweigh the last stage's 16 layers and logits
    # with 1 (stage 0 has DeepSeek's 3 dense layers among its 15)
    assert "pipeline stage 1 of 4 (layers per stage [15, 15, 15, 16]), the largest" in plan
    # weights, fp32 gradient buffers (--bf16), fp32 master + Adam
    need = math.ceil(count_params(shape_from_hf_config(DEEPSEEK_V3)).total * (2 + 4 + 12) / (80 * GiB))
    assert re.search(r"! estimated training memory [\d.]+ GB > 80.0 GB per GPU: ", plan), plan
    assert f"needs ≥ {need} GPUs of 80.0 GB however it is sharded, and the actor has 64" in plan
    assert "61 layers × (kv_lora_rank 512 + rope 64) × 2 B" in plan


def test_engine_tp_that_does_not_divide_the_heads_is_a_warning_with_the_fix(files):
    write_config(files / "model", QWEN3_4B)
    args = parse_args(base(
        *model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "4",
        "--rollout-num-gpus", "12", "--rollout-num-gpus-per-engine", "6", "--global-batch-size", "64",
    ))  # fmt: skip
    plan = format_plan(args)
    assert ("! --rollout-num-gpus-per-engine 6 (SGLang TP) does not divide the 32 attention heads "
            "(num_attention_heads) of model/config.json: SGLang refuses to start; try 4 or 8") in plan
    # bundles 4-9 cross from node 0 to node 1
    assert "engine 0 straddles nodes 0-1" in plan
    assert "use a --rollout-num-gpus-per-engine that divides --num-gpus-per-node 8" in plan


def test_megatron_tp_that_does_not_divide_the_query_groups_fails_before_the_plan(files, capsys):
    import train

    write_config(files / "model", QWEN3_4B)
    argv = base(*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-nodes", "2",
                "--rollout-num-gpus", "8", "--tensor-model-parallel-size", "16")
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    message = str(info.value.code)
    assert "--tensor-model-parallel-size 16 does not divide --num-query-groups 8" in message
    assert "[1, 2, 4, 8]" in message
    assert "slime dry run" not in capsys.readouterr().out


def test_query_groups_warning_from_config_json_without_model_args(files):
    write_config(files / "model", {**QWEN3_4B, "num_attention_heads": 24, "num_key_value_heads": 12})
    args = parse_args(base(
        "--dry-run", "--dry-run-cuda", "--train-backend", "megatron", "--actor-num-gpus-per-node", "8", "--colocate",
        "--tensor-model-parallel-size", "8", "--rollout-num-gpus-per-engine", "4",
    ))  # fmt: skip
    plan = format_plan(args)
    assert ("! --tensor-model-parallel-size 8 does not divide the 12 query groups (num_key_value_heads) of "
            "model/config.json: try 4") in plan
    assert "--train-backend megatron needs the model architecture; missing --num-layers" in plan


def test_memory_over_the_gpu_names_the_fixes(files):
    write_config(files / "model", QWEN3_4B)
    args = parse_args(base(
        *model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--dry-run-gpu-gb", "80",
        "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8", "--bf16", "--micro-batch-size", "4",
        "--rollout-max-context-len", "8192", "--global-batch-size", "256", "--no-use-distributed-optimizer",
    ))  # fmt: skip
    warning = next(w for w in format_plan(args).splitlines() if "estimated training memory" in w)
    assert "> 80.0 GB per GPU" in warning
    assert "drop --no-use-distributed-optimizer (→ " in warning
    assert "add --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 (→ " in warning
    assert "raise --tensor-model-parallel-size to 2 (→ " in warning


def test_dry_run_flags_need_dry_run(files):
    for flag in (["--dry-run-gpu-gb", "141"], ["--dry-run-cuda"]):
        with pytest.raises(SlimeArgumentError, match=f"{flag[0]} only applies to a dry run; add --dry-run"):
            parse_args(base("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", *flag))
    with pytest.raises(SlimeArgumentError, match="--dry-run-gpu-gb 0.0: must be a positive number"):
        parse_args(base("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--dry-run",
                        "--dry-run-gpu-gb", "0"))


def test_a_gpu_command_line_is_planned_as_a_gpu_run_without_dry_run_cuda(files, monkeypatch):
    """What --dry-run is for: planning slime's GPU job from a machine without GPUs. A command line naming a
    GPU-only piece (SGLang engines, megatron, nccl) is planned as the GPU run; one naming a CPU-only piece, or
    none, is planned as what this machine would run."""
    monkeypatch.setattr("slime.config.arguments._cuda_available", lambda: False)
    write_config(files / "model", QWEN3_4B)
    gpu = base(*model_args("qwen3-4B"), "--dry-run", "--colocate", "--tensor-model-parallel-size", "2")
    for extra in (["--rollout-backend", "sglang"], ["--sglang-mem-fraction-static", "0.7"],
                  ["--train-backend", "megatron"]):  # fmt: skip
        args = parse_args(gpu + extra)
        assert (args.use_cuda, args.dry_run_cuda, args.rollout_backend, args.train_backend) == (
            True, True, "sglang", "megatron"), extra
        assert args.distributed_backend == "nccl"
    cpu = parse_args(gpu + ["--sglang-mem-fraction-static", "0.7", "--rollout-backend", "hf"])
    assert (cpu.use_cuda, cpu.rollout_backend, cpu.train_backend) == (False, "hf", "fsdp")
    plain = parse_args(base("--dry-run", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"))
    assert (plain.use_cuda, plain.rollout_backend) == (False, "hf")
    not_a_dry_run = [t for t in gpu if t != "--dry-run"]
    with pytest.raises(SlimeArgumentError, match="--rollout-backend sglang needs CUDA"):
        parse_args(not_a_dry_run + ["--rollout-backend", "sglang"])  # a real run still needs the GPUs


def test_plan_trains_the_actors_role_args(files):
    """--megatron-config-path: the training sections plan the actor's group with its overrides (here TP 2 over the
    command line's TP 1), and a role's override the layout refuses fails before anything starts."""
    write_config(files / "model", QWEN3_4B)
    (files / "roles.yaml").write_text("megatron:\n  - {role: actor, overrides: {tensor_model_parallel_size: 2}}\n")
    common = (*model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8", "--bf16",
              "--use-distributed-optimizer", "--micro-batch-size", "1", "--rollout-max-context-len", "4096",
              "--rollout-num-gpus", "8")
    args = parse_args(base(*common, "--megatron-config-path", "roles.yaml"))
    assert args.tensor_model_parallel_size == 1
    plan = format_plan(args)
    assert re.search(r"data-parallel size\s+4 \(8 actor ranks .*÷ \(TP 2 × PP 1 × CP 1\)\)", plan), plan
    assert "--megatron-config-path roles.yaml: actor: {'tensor_model_parallel_size': 2}" in plan
    per_gpu = (4_022_468_096 + (152064 - 151936) * 2560) / 2  # the vocabulary padded for TP 2, split over TP 2
    assert re.search(rf"weights\s+{re.escape(fmt_bytes(per_gpu * 2))}", plan), plan
    plain = format_plan(parse_args(base(*common)))
    assert re.search(r"data-parallel size\s+8 ", plain) and "role overrides" not in plain
    (files / "roles.yaml").write_text("megatron:\n  - {role: actor, overrides: {tensor_model_parallel_size: 3}}\n")
    with pytest.raises(SlimeArgumentError, match=r"roles.yaml: with the actor's overrides "
                                                 r"\{'tensor_model_parallel_size': 3\}: --tensor-model-parallel-size 3 "
                                                 r"does not divide --num-attention-heads 32"):
        parse_args(base(*common, "--megatron-config-path", "roles.yaml"))


@pytest.mark.parametrize("rollout_gpus", [4, 12])
def test_colocated_engines_on_a_subset_or_a_superset_of_the_actors_gpus(files, rollout_gpus):
    """--colocate with --rollout-num-gpus other than the actor's 8: max(8, N) bundles, the engines on [0, N)."""
    write_config(files / "model", QWEN3_4B)
    args = parse_args(base(
        *model_args("qwen3-4B"), "--dry-run", "--dry-run-cuda", "--actor-num-gpus-per-node", "8", "--colocate",
        "--rollout-num-gpus", str(rollout_gpus), "--rollout-num-gpus-per-engine", "2", "--bf16", "--micro-batch-size",
        "1", "--rollout-max-context-len", "4096", "--sglang-mem-fraction-static", "0.7",
    ))  # fmt: skip
    layout = compute_layout(args)
    assert layout.total_bundles == max(8, rollout_gpus) and layout.actor == list(range(8))
    assert layout.rollout == list(range(rollout_gpus))
    assert [e.bundles for e in layout.engines] == [[2 * i, 2 * i + 1] for i in range(rollout_gpus // 2)]
    plan = format_plan(args)
    assert f"placement group: {max(8, rollout_gpus)} bundle(s)" in plan
    if rollout_gpus == 4:
        assert re.search(r"rollout\s+0-3\s+node 0: GPU 0-3\s+shared with actor \(--colocate\); actor bundles 4-7 "
                         r"hold no engine", plan), plan
    else:  # bundles 8-11 are a second node's: the engines there hold no training rank
        assert re.search(r"rollout\s+0-11\s+node 0: GPU 0-7, node 1: GPU 0-3\s+0-7 shared with actor \(--colocate\), "
                         r"8-11 engines only", plan), plan
        assert re.search(r"engine 5\s+10-11\s+node 1: GPU 2-3", plan), plan
    assert "colocated, generating" in plan  # the shared GPUs' phases are planned as before
