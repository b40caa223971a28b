"""slime's command line: flag families, derived fields, couplings, file and plugin checks (pure CPU)."""

from __future__ import annotations

import logging
import os

import pytest

from slime.config.arg_groups import reward
from slime.rollout.rm_hub import RM_TYPES
from slime.config.arguments import SlimeArgumentError, build_parser, parse_args, split_argv, validate_args
from slime.utils.placement import num_bundles, num_colocated_engines
from tests.args import make_args


def base(*extra: str) -> list[str]:
    """The seed's launch command (32 prompts × 8 samples, one step of 256 per rollout), relative paths."""
    return [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8",
        "--hf-checkpoint", "model", "--prompt-data", "train.jsonl", "--input-key", "prompt",
        "--label-key", "label", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--num-rollout", "3", *extra,
    ]  # fmt: skip


def without(argv: list[str], flag: str) -> list[str]:
    """argv minus `flag` and its one value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def error_of(argv: list[str]) -> str:
    with pytest.raises(SlimeArgumentError) as info:
        parse_args(argv)
    return str(info.value)


# ---- batch identity ------------------------------------------------------------------------------------


def test_seed_example_one_step_of_256(files):
    args = parse_args(base("--global-batch-size", "256"))
    assert (args.global_batch_size, args.num_steps_per_rollout) == (256, 1)
    assert args.over_sampling_batch_size == 32


def test_neither_given_means_one_step_per_rollout(files):
    args = parse_args(base())
    assert (args.global_batch_size, args.num_steps_per_rollout) == (256, 1)


def test_steps_derive_global_batch_size(files):
    args = parse_args(base("--num-steps-per-rollout", "4"))
    assert (args.global_batch_size, args.num_steps_per_rollout) == (64, 4)


def test_global_batch_size_derives_steps(files):
    args = parse_args(base("--global-batch-size", "128"))
    assert args.num_steps_per_rollout == 2


def test_identity_error_names_four_numbers_and_nearest_sizes(files):
    msg = error_of(base("--global-batch-size", "100"))
    assert "--rollout-batch-size 32 × --n-samples-per-prompt 8 = 256 samples per rollout" in msg
    assert "--global-batch-size 100 does not divide" in msg
    assert "num_steps_per_rollout would be 2.56" in msg
    assert "Nearest valid --global-batch-size: 64 (4 steps per rollout) or 128 (2 steps per rollout)" in msg


def test_global_batch_larger_than_rollout_suggests_the_whole_rollout(files):
    msg = error_of(base("--global-batch-size", "512"))
    assert "num_steps_per_rollout would be 0.5" in msg
    assert "Nearest valid --global-batch-size: 256 (1 step per rollout) (" in msg


def test_steps_that_do_not_divide(files):
    msg = error_of(base("--num-steps-per-rollout", "3"))
    assert "--num-steps-per-rollout 3" in msg and "85.33" in msg
    assert "2 (--global-batch-size 128) or 4 (--global-batch-size 64)" in msg


def test_both_given_must_agree(files):
    args = parse_args(base("--global-batch-size", "64", "--num-steps-per-rollout", "4"))
    assert args.global_batch_size == 64
    msg = error_of(base("--global-batch-size", "128", "--num-steps-per-rollout", "4"))
    assert "--global-batch-size 128 × --num-steps-per-rollout 4 = 512" in msg and "256" in msg
    assert "--global-batch-size 128 with --num-steps-per-rollout 2" in msg


def test_global_batch_must_split_over_data_parallel_ranks(files):
    # 3 prompts × 4 samples = 12 per rollout: fine for 4 ranks, not for 8.
    argv = base("--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--rollout-num-gpus", "8")
    msg = error_of(argv + ["--train-backend", "fsdp"])
    assert "--global-batch-size 12 is not divisible by the data-parallel size 8" in msg
    assert "8 actor ranks" in msg
    args = parse_args(argv + ["--actor-num-gpus-per-node", "4", "--train-backend", "fsdp"])
    assert args.global_batch_size == 12


def test_megatron_model_parallel_sizes_shrink_data_parallel(files):
    argv = base("--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--train-backend", "megatron")
    args = parse_args(argv + ["--tensor-model-parallel-size", "2"])  # 8 ranks / TP 2 = DP 4 divides 12
    assert args.megatron_args == ["--tensor-model-parallel-size", "2"]
    msg = error_of(argv + ["--tensor-model-parallel-size", "3"])
    assert "TP 3 × PP 1 × CP 1 = 3 does not divide" in msg


def test_micro_batch_size_counts_unless_dynamic(files):
    msg = error_of(base("--global-batch-size", "64", "--micro-batch-size", "16"))
    assert "data-parallel size 8 × --micro-batch-size 16 = 128" in msg
    assert "Nearest valid --global-batch-size: 128 (2 steps per rollout)." in msg
    args = parse_args(
        base("--global-batch-size", "64", "--micro-batch-size", "16", "--use-dynamic-batch-size",
             "--max-tokens-per-gpu", "4096")
    )  # fmt: skip
    assert args.log_probs_max_tokens_per_gpu == 4096


# ---- backends and derived fields -----------------------------------------------------------------------


def test_backends_follow_cuda(files):
    import torch

    args = parse_args(base())
    cuda = torch.cuda.is_available()
    assert args.use_cuda is cuda
    assert (args.train_backend, args.rollout_backend) == (("megatron", "sglang") if cuda else ("fsdp", "hf"))
    assert args.distributed_backend == ("nccl" if cuda else "gloo")

    parser = build_parser()
    for extra, backend in (([], "fsdp"), (["--num-layers", "2"], "megatron")):  # megatron needs MODEL_ARGS
        ns = parser.parse_args(base())
        ns.sglang_args, ns.router_args, ns.megatron_args, ns.use_cuda = {}, {}, extra, True
        ns.num_layers = 2 if extra else None
        validate_args(ns, parser)
        assert (ns.train_backend, ns.rollout_backend, ns.distributed_backend) == (backend, "sglang", "nccl")


@pytest.mark.parametrize("script", ["train", "train_async"])
@pytest.mark.parametrize("extra, expected", [
    (["--train-backend", "megatron", "--num-layers", "2", "--rm-type", "math"],
     ["missing --hidden-size --num-attention-heads --vocab-size", "${MODEL_ARGS[@]}"]),
    ([], ["no reward function: set --rm-type", "--custom-rm-path", "metadata rm_type"]),
])  # fmt: skip
def test_what_the_ranks_would_refuse_stops_before_ray(files, script, extra, expected, monkeypatch):
    import importlib

    import ray

    entry = importlib.import_module(script)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    with pytest.raises(SystemExit) as info:
        entry.main(base(*extra))
    assert all(text in str(info.value) for text in expected), str(info.value)


def test_rows_with_their_own_rm_type_need_no_flag(files):
    from slime.config.arguments import check_before_start

    (files / "train.jsonl").write_text('{"prompt": "1+1?", "label": "2", "metadata": {"rm_type": "math"}}\n')
    check_before_start(parse_args(base()))  # no error


def test_response_length_defaults_to_the_models_context(files):
    from slime.rollout.sglang_rollout import build_sampling_params

    (files / "model" / "config.json").write_text('{"max_position_embeddings": 4096}')
    args = parse_args(base())
    assert (args.rollout_max_context_len, args.rollout_max_prompt_len) == (4096, 4095)
    assert build_sampling_params(args)["max_new_tokens"] == 4096  # generate() subtracts the prompt
    assert parse_args(base("--sglang-context-length", "1024")).rollout_max_context_len == 1024
    bounded = parse_args(base("--rollout-max-response-len", "8"))
    assert bounded.rollout_max_context_len is None and build_sampling_params(bounded)["max_new_tokens"] == 8


def test_sglang_backend_without_cuda_is_refused(files, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "--rollout-backend sglang needs CUDA" in error_of(base("--rollout-backend", "sglang"))
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")  # a launcher that serves without CUDA
    assert parse_args(base("--rollout-backend", "sglang")).rollout_backend == "sglang"
    assert "--distributed-backend nccl needs CUDA" in error_of(base("--distributed-backend", "nccl"))


def test_tensorboard_dir(files, monkeypatch):
    args = parse_args(base("--tb-project-name", "proj", "--tb-experiment-name", "run1"))
    assert args.tensorboard_dir == os.path.join("outputs", "tensorboard", "proj", "run1")
    assert parse_args(base()).tensorboard_dir.startswith(os.path.join("outputs", "tensorboard", "slime", ""))
    monkeypatch.setenv("TENSORBOARD_DIR", "/tmp/tb-here")
    assert parse_args(base()).tensorboard_dir == "/tmp/tb-here"
    assert parse_args(base("--tensorboard-dir", "tb")).tensorboard_dir == "tb"


def test_defaults_of_added_flags(files):
    args = parse_args(base())
    assert args.max_failed_ratio == 0.05
    assert args.router_policy == "round_robin"
    assert args.sglang_server_concurrency == 512
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps, args.clip_grad) == (0.9, 0.95, 1e-8, 1.0)
    assert (args.micro_batch_size, args.seed, args.lr) == (1, 1234, 1e-6)
    assert args.eval_function_path == args.rollout_function_path
    assert args.eval_reward_key is None
    # The seed's `tensorboard --logdir outputs/` works with no logging flags; checkpoints follow the run name.
    assert args.use_tensorboard is True and args.tensorboard_dir.startswith(os.path.join("outputs", "tensorboard"))
    assert parse_args(base("--no-use-tensorboard")).use_tensorboard is False
    assert args.save is None  # nothing is saved unless asked
    saving = parse_args(base("--save-interval", "5", "--tb-experiment-name", "exp1"))
    assert saving.save == os.path.join("outputs", "checkpoints", "slime", "exp1")
    assert saving.tensorboard_dir == os.path.join("outputs", "tensorboard", "slime", "exp1")


# ---- couplings -------------------------------------------------------------------------------------------


def test_colocate_shares_gpus_and_turns_on_both_offloads(files, caplog):
    caplog.set_level(logging.INFO)
    args = parse_args(without(base("--colocate"), "--rollout-num-gpus"))
    assert args.colocate and args.offload_train and args.offload_rollout and args.offload  # slime's implication
    assert args.rollout_num_gpus == 8
    # another count, as slime sizes it: the engines on the first N of max(actor, N) GPUs
    for n, where in ((4, "the first 4 of the actor's 8 GPUs (the other 4 train only)"),
                     (12, "the actor's 8 GPUs and 4 more of their own")):
        args = parse_args(base("--colocate", "--rollout-num-gpus", str(n)))
        assert args.colocate and args.rollout_num_gpus == n and args.offload_rollout
        args.rollout_num_gpus_per_engine = 2
        assert (num_bundles(args), num_colocated_engines(args)) == (max(8, n), min(8, n) // 2)
        assert where in caplog.text
    assert "no engine fits" in error_of(base("--colocate", "--rollout-num-gpus", "0"))
    args = parse_args(without(base("--colocate", "--no-offload-rollout"), "--rollout-num-gpus"))
    assert args.offload_train and not args.offload_rollout and not args.offload  # the explicit opt-out stays out


def test_disaggregated_needs_rollout_gpus(files):
    assert "--rollout-num-gpus is not set" in error_of(without(base(), "--rollout-num-gpus"))


def test_rollout_gpus_divisible_by_engine_size(files):
    msg = error_of(base("--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "4"))
    assert "--rollout-num-gpus 6 is not divisible by --rollout-num-gpus-per-engine 4" in msg


def test_engine_wider_than_a_node_takes_whole_nodes(files):
    msg = error_of(base("--rollout-num-gpus", "12", "--rollout-num-gpus-per-engine", "12", "--num-gpus-per-node", "8"))
    assert "--rollout-num-gpus-per-engine 12 is wider than a node (--num-gpus-per-node 8)" in msg and "e.g. 16" in msg
    args = parse_args(
        base("--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16", "--num-gpus-per-node", "8"))
    assert args.rollout_num_gpus_per_engine == 16


def test_single_sample_disables_std_normalisation(files):
    args = parse_args(base("--n-samples-per-prompt", "1"))
    assert args.grpo_std_normalization is False and args.disable_grpo_std_normalization is True
    assert parse_args(base()).grpo_std_normalization is True


def test_reinforce_plus_plus_needs_normalized_advantages(files):
    msg = error_of(base("--advantage-estimator", "reinforce_plus_plus"))
    assert "--normalize-advantages" in msg
    args = parse_args(base("--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"))
    assert args.normalize_advantages


def test_rollout_logprobs_exclude_tis(files):
    msg = error_of(base("--use-rollout-logprobs", "--use-tis"))
    assert "--use-rollout-logprobs" in msg and "--use-tis" in msg


def test_kl_coef_and_kl_loss_coef_exclusive(files):
    msg = error_of(base("--kl-coef", "0.1", "--use-kl-loss", "--kl-loss-coef", "0.001"))
    assert "--kl-coef 0.1" in msg and "--kl-loss-coef 0.001" in msg


def test_prompt_len_fits_context(files):
    args = parse_args(base("--rollout-max-context-len", "2048"))
    assert args.rollout_max_prompt_len == 2047
    msg = error_of(base("--rollout-max-context-len", "2048", "--rollout-max-prompt-len", "2048"))
    assert "--rollout-max-prompt-len 2048" in msg and "2047" in msg


def test_temperature_must_be_positive(files):
    assert "--rollout-temperature must be > 0, got --rollout-temperature 0.0" in error_of(base("--rollout-temperature", "0"))


def test_over_sampling_batch_size(files):
    assert parse_args(base("--over-sampling-batch-size", "48")).over_sampling_batch_size == 48
    msg = error_of(base("--over-sampling-batch-size", "16"))
    assert "--over-sampling-batch-size 16" in msg and "--rollout-batch-size 32" in msg


def test_eps_clip_high_defaults_to_eps_clip(files):
    assert parse_args(base("--eps-clip", "0.3")).eps_clip_high == 0.3
    assert parse_args(base("--eps-clip-high", "0.28")).eps_clip_high == 0.28


def test_num_epoch_leaves_num_rollout_to_the_data_source(files):
    args = parse_args(without(base("--num-epoch", "2"), "--num-rollout"))
    assert args.num_rollout is None and args.num_epoch == 2
    assert "--num-rollout" in error_of(without(base(), "--num-rollout"))


def test_ppo_has_a_critic_on_the_actor_gpus(files):
    args = parse_args(base("--advantage-estimator", "ppo"))
    assert args.use_critic and args.offload_train  # slime: actor and critic take turns with their GPUs
    assert (args.critic_num_nodes, args.critic_num_gpus_per_node) == (1, 8)
    assert parse_args(base("--advantage-estimator", "ppo", "--critic-num-gpus-per-node", "8")).use_critic
    msg = error_of(base("--advantage-estimator", "ppo", "--critic-num-gpus-per-node", "4"))
    assert "--critic-num-gpus-per-node 4" in msg and "actor's GPUs" in msg and "(8)" in msg


def test_offload_flags_resolve_as_slime_and_need_a_push_every_rollout(files):
    args = parse_args(base("--offload"))
    assert args.offload_train is True and args.offload_rollout is True
    args = parse_args(base())
    assert args.offload_train is False and args.offload_rollout is False and args.offload is False
    msg = error_of(base("--offload-rollout", "--update-weights-interval", "2"))
    assert "--update-weights-interval 2" in msg and "uninitialised" in msg and "--no-offload-rollout" in msg
    assert parse_args(base("--offload-train", "--update-weights-interval", "2")).offload_train


def test_debug_flags(files):
    args = parse_args(base("--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt"))
    assert args.debug_train_only
    assert "choose one half" in error_of(base("--debug-rollout-only", "--debug-train-only"))
    args = parse_args(base("--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt", "--load-debug-rollout-data-subsample",
                           "0.25"))
    assert args.load_debug_rollout_data_subsample == 0.25
    assert "add --load-debug-rollout-data" in error_of(base("--load-debug-rollout-data-subsample", "0.5"))
    for bad in ("0", "1.5", "-0.1"):
        assert f"--load-debug-rollout-data-subsample {float(bad)}: " in error_of(
            base("--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt", "--load-debug-rollout-data-subsample", bad))


def test_eval_prompt_data_pairs(files):
    args = parse_args(base("--eval-prompt-data", "train.jsonl", "--eval-interval", "5"))
    assert args.eval_prompt_data == ["aime", "train.jsonl"] and args.eval_interval == 5
    assert "name path pairs" in error_of(base("--eval-prompt-data", "a", "train.jsonl", "b"))
    assert "--eval-prompt-data gsm8k nope.jsonl: no such file" in error_of(
        base("--eval-prompt-data", "gsm8k", "nope.jsonl")
    )
    args = parse_args(base("--eval-prompt-data", "gsm8k", "train.jsonl@[-1:]"))
    assert args.eval_prompt_data == ["gsm8k", "train.jsonl@[-1:]"]
    assert "malformed row slice" in error_of(base("--eval-prompt-data", "gsm8k", "train.jsonl@[1]"))
    assert "--prompt-data train.jsonl@[a:b]: malformed row slice" in error_of(
        without(base(), "--prompt-data") + ["--prompt-data", "train.jsonl@[a:b]"])


def test_eval_config_is_read_and_checked_at_parse_time(files):
    (files / "eval.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, top_p: 0.7}\n")
    args = parse_args(base("--eval-config", "eval.yaml", "--eval-interval", "5"))
    assert args.eval_interval == 5 and [d.name for d in args.eval_datasets] == ["aime"]
    (files / "bad.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, topp: 0.7}\n")
    assert "bad.yaml: datasets[0] (aime): unknown key(s) ['topp']" in error_of(base("--eval-config", "bad.yaml"))
    (files / "rm.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl}\n  - {name: gsm, path: train.jsonl, "
                                   "rm_type: nonsense}\n")
    assert ("rm.yaml: datasets[1] (gsm): rm_type 'nonsense' is not a known reward type"
            in error_of(base("--eval-config", "rm.yaml")))


# ---- flag families ---------------------------------------------------------------------------------------


def test_sglang_router_and_megatron_flags_are_split(files, caplog):
    argv = base(
        "--sglang-mem-fraction-static", "0.7", "--sglang-enable-torch-compile", "--sglang-cuda-graph-bs", "1", "2",
        "4", "--sglang-context-length=8192", "--num-layers", "28", "--hidden-size", "2560", "--swiglu",
        "--untie-embeddings-and-output-weights", "--router-balance-abs-threshold", "4", "--rotary-base",
        "1000000", "--sglang-server-concurrency", "64", "--sglang-router-port", "30000", "--router-policy",
        "cache_aware", "--norm-epsilon", "-1e-6", "--train-backend", "fsdp",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        args = parse_args(argv)
    assert args.sglang_args == {
        "mem_fraction_static": "0.7",
        "enable_torch_compile": True,
        "cuda_graph_bs": ["1", "2", "4"],
        "context_length": "8192",
    }
    assert args.router_args == {"balance_abs_threshold": "4"}
    assert args.megatron_args == [
        "--num-layers", "28", "--hidden-size", "2560", "--swiglu", "--untie-embeddings-and-output-weights",
        "--rotary-base", "1000000", "--norm-epsilon", "-1e-6",
    ]  # fmt: skip
    assert (args.sglang_server_concurrency, args.sglang_router_port, args.router_policy) == (64, 30000, "cache_aware")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "fsdp" in r.getMessage()]
    assert len(warnings) == 1
    assert "--num-layers --hidden-size --swiglu --untie-embeddings-and-output-weights" in warnings[0]


def test_no_megatron_flags_no_warning(files, caplog):
    with caplog.at_level(logging.WARNING):
        parse_args(base())
    assert not [r for r in caplog.records if "Megatron flag" in r.getMessage()]


def test_stray_positional_tokens(files):
    assert "stray argument 'oops' (before any flag)" in error_of(["oops", *base()])
    msg = error_of(base("--colocate", "yes"))
    assert "'yes'" in msg and "--colocate takes no value" in msg
    msg = error_of(base("--lr", "1e-6", "2e-6"))
    assert "'2e-6'" in msg and "--lr takes at most 1 value(s)" in msg
    assert "--colocate: ignored explicit argument 'yes'" in error_of(base("--colocate=yes"))
    assert parse_args(base("--lr=2e-6")).lr == 2e-6


def test_negative_values_of_our_flags(files):
    assert parse_args(base("--rollout-top-k", "-1")).rollout_top_k == -1


def test_reserved_sglang_field_is_refused(files):
    msg = error_of(base("--sglang-tp-size", "2"))
    assert "--sglang-tp-size" in msg and "--rollout-num-gpus-per-engine" in msg


def test_unknown_choice_and_bad_type_name_the_flag(files):
    assert "--advantage-estimator" in error_of(base("--advantage-estimator", "grpoo"))
    assert "--rollout-batch-size" in error_of(base("--rollout-batch-size", "many"))


def test_split_argv_keeps_order(files):
    split = split_argv(build_parser(), ["--a", "1", "--lr", "1e-5", "--b", "--c", "x", "y"])
    assert split.known == ["--lr", "1e-5"]
    assert split.megatron_args == ["--a", "1", "--b", "--c", "x", "y"]


def test_help_mentions_cpu_ranks_and_families(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "CPU training ranks" in out and "--sglang-<field>" in out and "--router-<field>" in out


# ---- YAML override ----------------------------------------------------------------------------------------


def test_custom_config_overrides_and_is_validated(files):
    (files / "cfg.yaml").write_text(
        "rollout-batch-size: 16\nlr: '1e-5'\nadvantage_estimator: gspo\nsglang_args: {chunked_prefill_size: 4096}\n"
    )
    args = parse_args(base("--custom-config-path", "cfg.yaml", "--sglang-mem-fraction-static", "0.7"))
    assert args.rollout_batch_size == 16 and args.global_batch_size == 128
    assert args.lr == 1e-5 and args.advantage_estimator == "gspo"
    assert args.sglang_args == {"mem_fraction_static": "0.7", "chunked_prefill_size": 4096}

    (files / "bad.yaml").write_text("global_batch_size: 100\n")
    assert "--global-batch-size 100 does not divide" in error_of(base("--custom-config-path", "bad.yaml"))


def test_custom_config_keeps_plugin_keys_and_refuses_misspelt_flags(files):
    (files / "plugin.yaml").write_text("tis_mode: mask\nrs_lower_bound: null\n")  # slime's MIS example keys
    args = parse_args(base("--custom-config-path", "plugin.yaml"))
    assert args.tis_mode == "mask" and args.rs_lower_bound is None  # slime sets every key on args
    (files / "unknown.yaml").write_text("rollout_batch_sise: 16\nfoo: 1\n")
    msg = error_of(base("--custom-config-path", "unknown.yaml"))
    assert "unknown.yaml" in msg and "rollout_batch_sise: did you mean rollout_batch_size?" in msg
    (files / "choice.yaml").write_text("kl_loss_type: k9\n")
    assert "kl_loss_type: 'k9' is not one of" in error_of(base("--custom-config-path", "choice.yaml"))


# ---- files and plugins ------------------------------------------------------------------------------------


def test_hf_checkpoint_must_be_a_model_folder(files):
    (files / "empty").mkdir()
    msg = error_of(base("--hf-checkpoint", "empty"))
    assert "--hf-checkpoint empty" in msg and "config.json" in msg
    assert "--hf-checkpoint missing_dir: no such folder" in error_of(base("--hf-checkpoint", "missing_dir"))


def test_prompt_data_must_exist(files):
    assert "--prompt-data nope.jsonl: no such file" in error_of(base("--prompt-data", "nope.jsonl"))


def test_plugin_path_typos_fail_early(files):
    (files / "my_rm.py").write_text("async def score(args, sample):\n    return 1.0\n")
    args = parse_args(base("--custom-rm-path", "my_rm.py:score"))
    assert args.custom_rm_path == "my_rm.py:score"
    args = parse_args(base("--custom-rm-path", "my_rm.score"))  # dotted path, cwd on sys.path

    msg = error_of(base("--custom-rm-path", "my_rm.py:scroe"))
    assert "--custom-rm-path=my_rm.py:scroe" in msg and "score" in msg
    msg = error_of(base("--custom-generate-function-path", "no_such_pkg.generate"))
    assert "--custom-generate-function-path=no_such_pkg.generate" in msg
    msg = error_of(base("--rollout-function-path", "my_rm.generate_rollout"))
    assert "--rollout-function-path=my_rm.generate_rollout" in msg
    msg = error_of(base("--dynamic-sampling-filter-path", "filters.py"))
    assert "--dynamic-sampling-filter-path=filters.py" in msg


def test_rm_type_check(files):
    # A custom reward function makes --rm-type irrelevant, whatever the hub holds.
    (files / "my_rm.py").write_text("async def score(args, sample):\n    return 1.0\n")
    assert parse_args(base("--rm-type", "no_such_rm", "--custom-rm-path", "my_rm.py:score")).rm_type == "no_such_rm"
    assert "--rm-url" in error_of(base("--rm-type", "remote_rm"))
    msg = error_of(base("--rm-type", "no_such_rm"))
    assert "--rm-type no_such_rm" in msg and "known types" in msg
    known = min(RM_TYPES - {"remote_rm"})
    assert parse_args(base("--rm-type", f"boxed_{known}")).rm_type == f"boxed_{known}"


def test_rm_type_check_logic(monkeypatch):
    """The check against a given registry (the real one is tested above)."""
    monkeypatch.setattr(reward, "RM_TYPES", frozenset({"math", "deepscaler"}))
    ns = make_args(validate=False, rm_type="boxed_math", custom_rm_path=None, rm_url=None, reward_key="score",
                            eval_reward_key=None)  # fmt: skip
    reward.validate_reward(ns)
    assert ns.eval_reward_key == "score"
    ns.rm_type = "maths"
    with pytest.raises(SlimeArgumentError, match=r"--rm-type maths: unknown reward type; known types: \['deepscaler'"):
        reward.validate_reward(ns)


# ---- slime flags this implementation refuses or warns about (never parsed and silently ignored) -------------
@pytest.mark.parametrize("extra, message", [
    (["--use-routing-replay"], "--use-routing-replay: not supported here: MoE routing replay"),
    (["--enable-mtp-training"], "--enable-mtp-training: not supported here: multi-token-prediction layers"),
    (["--multimodal-keys", '{"image": "img"}', "--rollout-external-engine-addrs", "10.0.0.1:30000"],
     "--multimodal-keys {\"image\": \"img\"}: not supported here yet: the external engines are not sent the images"),
    (["--multimodal-keys", '{"image": "i"}', "--train-backend", "megatron", "--rollout-backend", "hf",
      "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"],
     "which --context-parallel-size > 1 splits across ranks before the model sees it"),
    (["--multimodal-keys", '{"video": "v"}', "--train-backend", "fsdp", "--rollout-backend", "hf"],
     "media types ['video']: images only"),
    (["--multimodal-keys", '{"image": "i"}', "--train-backend", "fsdp", "--rollout-backend", "hf",
      "--advantage-estimator", "ppo"], "--advantage-estimator ppo trains a critic, a text-only value model"),
    (["--train-backend", "megatron", "--ckpt-format", "torch"], "--ckpt-format torch: the megatron backend"),
    (["--model-name", "nosuchfamily"], "--model-name nosuchfamily: no HF <-> Megatron weight converter"),
])  # fmt: skip
def test_unsupported_slime_flags_are_refused_with_the_reason(files, extra, message):
    msg = error_of(base(*extra))
    assert message in msg and ";" in msg  # the reason, then what to do instead


@pytest.mark.parametrize("backend, engine, extra", [
    ("fsdp", "hf", []), ("megatron", "hf", []), ("megatron", "sglang", []),
    ("fsdp", "sglang", []),  # both trainers push the checkpoint's names, which SGLang loads
    ("megatron", "sglang", ["--partial-rollout"]),  # resumed as ids with one image token per image
    ("megatron", "hf", ["--partial-rollout"]),  # the hf engine takes a resumed sample's expanded image ids
])  # fmt: skip
def test_multimodal_keys_are_taken(files, monkeypatch, backend, engine, extra):
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")  # sglang without CUDA here
    args = parse_args(base("--multimodal-keys", '{"image": "images"}', "--train-backend", backend,
                           "--rollout-backend", engine, *extra))
    assert args.multimodal_keys == {"image": "images"}


def test_only_train_and_freeze_params_together_are_refused(files):
    msg = error_of(base("--only-train-params-name-list", "mlp", "--freeze-params-name-list", "embed", "lm_head"))
    assert "--only-train-params-name-list mlp and --freeze-params-name-list embed lm_head: give one of them" in msg
    args = parse_args(base("--freeze-params-name-list", "embed", "lm_head"))
    assert args.freeze_params_name_list == ["embed", "lm_head"] and args.only_train_params_name_list is None


@pytest.mark.parametrize("extra, message", [
    (["--save-hf", "hf_{step}", "--save", "ckpt"], "--save-hf hf_{step}: not a path template with only {rollout_id}"),
    (["--save-hf", "hf_{rollout_id}"], "--save-hf hf_{rollout_id}: the HF folder is written with each checkpoint"),
    (["--save-hf", "model", "--save", "ckpt"], "--save-hf model: names --hf-checkpoint model itself"),
    (["--ref-ckpt-step", "3"], "--ref-ckpt-step 3 without --ref-load"),
])  # fmt: skip
def test_save_hf_and_ref_ckpt_step_checks(files, extra, message):
    assert message in error_of(base(*extra))


def test_save_hf_template_parses(files):
    args = parse_args(base("--save-hf", "out/hf_{rollout_id}", "--save", "ckpt", "--ref-load", "model",
                           "--ref-ckpt-step", "2"))
    assert (args.save_hf, args.ref_ckpt_step) == ("out/hf_{rollout_id}", 2)


def test_flags_with_nothing_to_act_on_are_warned_about(files, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse_args(base("--no-load-rng", "--no-save-rng"))
    assert args.no_load_rng and args.no_save_rng
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("--no-load-rng: checkpoints here hold no RNG state") for m in warned)
    assert any(m.startswith("--no-save-rng") for m in warned)
    assert parse_args(base("--model-name", "qwen3")).model_name == "qwen3"


def test_every_parsed_flag_is_read_somewhere_outside_its_definition():
    """The defect this guards against: a flag that parses and changes nothing (refused or warned flags count as
    read: validation reads them)."""
    import re

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sources = []
    for folder, _, names in os.walk(os.path.join(repo, "slime")):
        sources += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    text = "\n".join(line for path in sources + [os.path.join(repo, "train.py"), os.path.join(repo, "train_async.py")]
                     for line in open(path) if "add_argument" not in line)
    unread = sorted(a.dest for a in build_parser()._actions if a.dest != "help" and not re.search(
        rf"(args\.{a.dest}\b|[\"']{a.dest}[\"'])", text))
    assert not unread, f"parsed but never read: {unread}"
