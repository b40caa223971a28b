"""Every flag slime defines parses here with slime's meaning and default: the flags of features not built here
(refused, warned about, or left to plugins), slime's weight-sync couplings, slime's entry points at
slime.utils.arguments, per-role Megatron overrides, and slime's Megatron-side checks (pure CPU)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from slime.backends.megatron_utils.arguments import hf_validate_args, validate_allgather_cp
from slime.config.arg_groups.not_built import NOT_BUILT
from slime.config.arguments import SlimeArgumentError, build_parser, parse_args
from slime.utils import arguments as slime_arguments
from slime.utils.errors import SlimeArgumentError as FloorArgumentError
from slime.utils.megatron_roles import MegatronRoleConfigError, parse_megatron_role_args, role_args
from tests.conftest import model_args


def base(*extra: str) -> list[str]:
    return [
        "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8", "--hf-checkpoint", "model",
        "--prompt-data", "train.jsonl", "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "3", *extra,
    ]  # fmt: skip


def error_of(argv: list[str]) -> str:
    with pytest.raises(SlimeArgumentError) as info:
        parse_args(argv)
    return str(info.value)


# ---- flags of features not built here -----------------------------------------------------------------------
def test_not_built_flags_parse_with_slimes_defaults(files):
    args = parse_args(base())
    # slime's published defaults (slime/utils/arguments.py), spot-checked by value
    assert args.train_env_vars == {} and args.log_probs_chunk_size == -1 and args.data_pad_size_multiplier == 128
    assert args.profile_target == ["train_overall"] and args.memory_snapshot_dir == "." and args.opsm_delta == 1e-4
    assert args.loss_mask_type == "qwen" and args.rollout_task_type == "math" and args.fetch_trajectory_retry_times == -1
    assert args.wandb_random_suffix is True and args.qwen_gdn_backend == "fla" and args.fp8_recipe == "delayed"
    assert args.mtp_loss_scaling_factor == 0.2 and args.ci_train_rollout_logprob_abs_diff_threshold == 0.1
    assert args.opd_kl_coef == 1.0 and args.use_opd is False and args.fp8_format is None
    assert args.update_weight_mode == "full" and args.rollout_data_transport == "object-store"
    assert args.compute_advantages_and_returns is True and args.eval_max_context_len is None
    assert args.start_rollout_id == 0  # slime: a run with nothing to resume starts at 0
    assert len(NOT_BUILT) == len({r.dest for r in NOT_BUILT})


@pytest.mark.parametrize("extra, expected", [
    (["--moe-enable-deepep"], "--moe-enable-deepep: not supported here: DeepEP's expert all-to-all kernels"),
    (["--fp8-format", "e4m3"], "--fp8-format e4m3: not supported here: FP8 training needs TransformerEngine"),
    (["--use-gated-attention", "--attention-output-gate"], "--use-gated-attention: not supported here: Qwen3-Next"),
    (["--enable-mtp-training"], "--enable-mtp-training: not supported here: multi-token-prediction"),
    (["--use-routing-replay"], "--use-routing-replay: not supported here: MoE routing replay"),
    (["--prefill-num-servers", "2"], "--prefill-num-servers 2: not supported here: prefill/decode"),
])  # fmt: skip
def test_refused_flags_name_the_flag_the_reason_and_what_to_do(files, extra, expected):
    message = error_of(base(*extra))
    assert message.startswith(expected), message
    assert "; " in message  # then what to do instead


def test_train_env_vars_are_a_json_object_of_strings(files):
    args = parse_args(base("--train-env-vars", '{"A": "1", "B": 2, "C": true}'))
    assert args.train_env_vars == {"A": "1", "B": "2", "C": "true"}
    assert "--train-env-vars [1]: must be a JSON object" in error_of(base("--train-env-vars", "[1]"))
    assert "'X'={'y': 1} is not an environment variable" in error_of(base("--train-env-vars", '{"X": {"y": 1}}'))


def test_every_refused_flag_is_named_in_the_error(files):
    message = error_of(base("--use-gated-attention", "--attention-output-gate", "--moe-shared-expert-gate"))
    assert "(also refused: --attention-output-gate, --moe-shared-expert-gate)" in message


def test_megatron_flags_of_the_table_are_kept_with_the_megatron_tokens(files):
    parser = build_parser()
    from slime.config.arguments import split_argv

    split = split_argv(parser, ["--num-layers", "2", "--moe-enable-deepep", "--use-opd"])
    assert split.megatron_args == ["--num-layers", "2", "--moe-enable-deepep"]  # --use-opd is slime's own


def test_warned_flags_run_and_say_they_are_not_acted_on(files, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse_args(base("--log-probs-chunk-size", "1024", "--ci-test", "--profile-target", "train_actor"))
    assert args.log_probs_chunk_size == 1024 and args.ci_test and args.profile_target == ["train_actor"]
    warned = " | ".join(r.getMessage() for r in caplog.records)
    for flag in ("--log-probs-chunk-size", "--ci-test", "--profile-target"):
        assert f"{flag}: not acted on here" in warned


def test_plugin_flags_are_kept_for_the_plugin_and_not_warned_about(files, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse_args(base("--rollout-buffer-url", "http://buffer:8889", "--loss-mask-type", "qwen3"))
    assert args.rollout_buffer_url == "http://buffer:8889" and args.loss_mask_type == "qwen3"
    assert not [r for r in caplog.records if "rollout-buffer-url" in r.getMessage()]


def test_a_default_given_explicitly_is_what_the_run_does(files):
    args = parse_args(base("--fp8-recipe", "delayed", "--qwen-gdn-backend", "fla", "--opd-kl-coef", "1.0"))
    assert args.fp8_recipe == "delayed"


# ---- weight sync, debug, eval, algorithm: slime's couplings --------------------------------------------------
@pytest.mark.parametrize("extra, expected", [
    (["--update-weight-mode", "delta"], "--update-weight-mode delta requires --update-weight-transport=disk"),
    (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d",
      "--colocate", "--rollout-num-gpus", "8"], "--update-weight-mode delta is not supported with --colocate"),
    (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d"],
     "--update-weight-mode delta requires --update-weight-local-checkpoint-dir"),
    (["--release-train"], "--release-train requires --update-weight-transport disk and --save"),
    (["--rollout-data-transport", "nixl"], "--rollout-data-transport nixl: not supported here yet"),
    (["--save-debug-rollout-data", "/tmp/d_{rollout_id}.pt", "--save-debug-train-data", "/tmp/d_{rollout_id}.pt"],
     "--save-debug-train-data must not be equal to --save-debug-rollout-data"),
    (["--disable-compute-advantages-and-returns"], "--disable-compute-advantages-and-returns with --loss-type "
                                                   "policy_loss"),
])  # fmt: skip
def test_slimes_couplings_with_slimes_wording(files, extra, expected):
    assert expected in error_of(base(*extra))


def test_sft_runs_may_skip_the_advantages(files):
    args = parse_args(base("--disable-compute-advantages-and-returns", "--loss-type", "sft_loss"))
    assert args.compute_advantages_and_returns is False


def test_eval_flags_fall_back_like_slimes(files):
    (files / "eval.jsonl").write_text('{"prompt": "2+2?", "label": "4"}\n')
    args = parse_args(base("--rollout-max-context-len", "4096", "--eval-prompt-data", "aime", "eval.jsonl",
                           "--eval-tool-key", "functions"))
    assert args.eval_max_context_len == 4096  # slime: defaults to --rollout-max-context-len
    assert args.eval_datasets[0].tool_key == "functions"
    assert "min_new_tokens: 8" in error_of(base("--eval-prompt-data", "aime", "eval.jsonl", "--eval-min-new-tokens",
                                                "8"))  # the hf engine does not implement it


def test_start_rollout_id_is_kept_and_left_to_a_checkpoint(files):
    assert parse_args(base("--start-rollout-id", "100")).start_rollout_id == 100
    (files / "ckpt").mkdir()
    (files / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    resumed = types.SimpleNamespace(rollout_batch_size=4, num_rollout=1, rollout_num_gpus=8, load="ckpt",
                                    rollout_global_dataset=False)  # fmt: skip
    # a checkpoint to resume: the trainer starts after its iteration, so validation leaves the id unset
    assert slime_arguments.slime_validate_args(resumed).start_rollout_id is None


# ---- slime's Megatron-side checks --------------------------------------------------------------------------
def test_padded_vocab_size_must_be_the_derived_one(files):
    qwen = model_args("qwen3-4B")
    assert parse_args(base(*qwen, "--padded-vocab-size", "151936")).padded_vocab_size == 151936
    message = error_of(base(*qwen, "--padded-vocab-size", "152064"))
    assert "--padded-vocab-size 152064" in message and "(= 151936 for --vocab-size 151936)" in message


def test_allgather_cp_is_slimes_dsa_only_rule(files, caplog):
    message = error_of(base("--allgather-cp", "--context-parallel-size", "2"))
    assert "--allgather-cp with --context-parallel-size 2 is only supported for DSA attention models" in message
    with caplog.at_level(logging.WARNING):
        parse_args(base("--allgather-cp"))
    assert any("--allgather-cp has no effect" in r.getMessage() for r in caplog.records)
    cp2 = types.SimpleNamespace(allgather_cp=True, context_parallel_size=2)
    validate_allgather_cp(cp2, {"architectures": ["GlmMoeDsaForCausalLM"]})  # a DSA model: slime allows it
    with pytest.raises(ValueError, match="only supported for DSA"):
        validate_allgather_cp(cp2, {"architectures": ["Qwen3ForCausalLM"]})


def test_hf_validate_args_names_each_mismatch_as_an_assertion(files):
    args = parse_args(base(*model_args("qwen3-4B")))
    config = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "vocab_size": 151936,
              "intermediate_size": 9728, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "num_key_value_heads": 8,
              "head_dim": 128, "tie_word_embeddings": True, "model_type": "qwen3", "hidden_act": "silu"}  # fmt: skip
    hf_validate_args(args, types.SimpleNamespace(text_config=types.SimpleNamespace(**config)))
    with pytest.raises(AssertionError, match="intermediate_size: config.json says 8192, --ffn-hidden-size gives 9728"):
        hf_validate_args(args, {**config, "intermediate_size": 8192})


def test_megatron_config_path_gives_each_training_group_its_roles_args(files, caplog):
    (files / "roles.yaml").write_text("critic:\n  lr: 1e-5\n")
    assert "the file must have a top-level 'megatron' list" in error_of(base("--megatron-config-path", "roles.yaml"))
    (files / "roles.yaml").write_text("megatron:\n"
                                      "  - {name: default, role: actor, overrides: {lr: 2e-6, micro_batch_size: 2}}\n"
                                      "  - {name: default, role: critic, overrides: {lr: '1e-5', kl_coef: 0.3}}\n")
    args = parse_args(base("--megatron-config-path", "roles.yaml", "--advantage-estimator", "ppo", "--kl-coef",
                           "0.05", "--global-batch-size", "64"))
    actor, critic = role_args(args, "actor"), role_args(args, "critic")
    assert (actor.lr, actor.micro_batch_size, actor.kl_coef) == (2e-6, 2, 0.05)
    assert (critic.lr, critic.micro_batch_size, critic.kl_coef) == (1e-5, 1, 0)  # the critic drops the KL term
    assert (args.lr, args.micro_batch_size, args.kl_coef) == (1e-6, 1, 0.05)  # the driver's args stay as given
    assert role_args(parse_args(base()), "critic").lr == 1e-6  # no file: both groups get the args themselves
    # a role's override is checked as its own command line would be, before Ray starts
    (files / "roles.yaml").write_text("megatron:\n  - {role: actor, overrides: {global_batch_size: 60}}\n")
    msg = error_of(base("--megatron-config-path", "roles.yaml"))
    assert msg.startswith("--megatron-config-path roles.yaml: with the actor's overrides {'global_batch_size': 60}: "
                          "--global-batch-size 60 is not divisible by the data-parallel size 8"), msg
    # the critic's entry is only read when a critic is trained; then its overrides are checked too
    (files / "roles.yaml").write_text("megatron:\n  - {role: critic, overrides: {global_batch_size: 60}}\n")
    with caplog.at_level(logging.WARNING):
        parse_args(base("--megatron-config-path", "roles.yaml"))
    assert "the critic's overrides are not used: --advantage-estimator grpo trains no critic" in caplog.text
    assert "with the critic's overrides {'global_batch_size': 60}" in error_of(
        base("--megatron-config-path", "roles.yaml", "--advantage-estimator", "ppo"))


# ---- per-role Megatron overrides (slime.utils.megatron_roles) ------------------------------------------------
def _role_args(**kw):
    values = dict(lr=2e-6, tensor_model_parallel_size=1, kl_coef=0.1, use_opd=True, actor_num_nodes=1,
                  custom_advantage_function_path="my.adv", untie_embeddings_and_output_weights=False)
    return types.SimpleNamespace(**{**values, **kw})


def test_role_overrides_are_typed_and_the_critic_drops_actor_only_settings(tmp_path):
    path = tmp_path / "roles.yaml"
    path.write_text("megatron:\n"
                    "  - {name: default, role: actor, overrides: {lr: 1e-6, tensor_model_parallel_size: 4}}\n"
                    "  - {name: default, role: critic, args: {lr: '1e-5', num_nodes: 9, my_flag: 3}}\n")
    base_args = _role_args()
    actor = parse_megatron_role_args(base_args, str(path), "actor")
    critic = parse_megatron_role_args(base_args, str(path), "critic")
    assert (actor.lr, actor.tensor_model_parallel_size, actor.kl_coef, actor.use_opd) == (1e-6, 4, 0.1, True)
    assert critic.lr == 1e-5 and isinstance(critic.lr, float)  # YAML's '1e-5' string takes lr's type
    assert (critic.kl_coef, critic.use_opd, critic.custom_advantage_function_path) == (0, False, None)
    assert critic.untie_embeddings_and_output_weights is True and critic.my_flag == 3
    assert not hasattr(critic, "num_nodes") and critic.actor_num_nodes == 1  # GPU counts follow the command line
    assert base_args.lr == 2e-6 and base_args.kl_coef == 0.1  # copies: the base is untouched


def test_a_role_without_an_entry_inherits_and_a_bad_layout_is_both_error_kinds(tmp_path):
    path = tmp_path / "roles.yaml"
    path.write_text("megatron:\n  - {role: actor, overrides: {lr: 1e-6}}\n")
    critic = parse_megatron_role_args(_role_args(), str(path), "critic")
    assert critic.lr == 2e-6 and critic.kl_coef == 0
    for text in ("{}", "lr: 1e-5\n", "megatron: {role: critic}\n"):
        path.write_text(text)
        with pytest.raises(MegatronRoleConfigError, match="top-level 'megatron' list") as info:
            parse_megatron_role_args(_role_args(), str(path), "critic")
        assert isinstance(info.value, AssertionError) and isinstance(info.value, FloorArgumentError)
    path.write_text("megatron:\n  - {role: critic}\n  - {role: critic}\n")
    with pytest.raises(MegatronRoleConfigError, match="2 entries have role critic"):
        parse_megatron_role_args(_role_args(), str(path), "critic")


# ---- slime's entry points at slime.utils.arguments -------------------------------------------------------------
def test_parse_args_takes_a_plugins_own_flags(files, monkeypatch):
    def add_custom_arguments(parser):
        parser.add_argument("--my-plugin-depth", type=int, default=3)
        slime_arguments.reset_arg(parser, "--my-plugin-depth", default=5)
        return parser

    monkeypatch.setattr(sys, "argv", ["train.py", *base()])
    assert slime_arguments.parse_args(add_custom_arguments).my_plugin_depth == 5
    monkeypatch.setattr(sys, "argv", ["train.py", *base("--my-plugin-depth", "7")])
    assert slime_arguments.parse_args(add_custom_arguments).my_plugin_depth == 7
    assert "unknown flag(s): --my-plugin-depth" in str(pytest.raises(SlimeArgumentError, slime_arguments.parse_args).value)


def test_slime_validate_args_completes_a_partial_namespace_and_validates_slimes_flags():
    ns = types.SimpleNamespace(rollout_batch_size=4, n_samples_per_prompt=2, num_rollout=1, colocate=True,
                               actor_num_gpus_per_node=2, rollout_global_dataset=False, debug_train_only=False,
                               rollout_function_path="my.rollout", hf_checkpoint="/nowhere")  # fmt: skip
    slime_arguments.slime_validate_args(ns)
    assert ns.rollout_num_gpus == 2 and ns.global_batch_size == 8 and ns.eps_clip_high == 0.2
    assert ns.rollout_global_dataset is False and ns.disable_rollout_global_dataset is True  # slime's positive name
    assert ns.start_rollout_id == 0 and ns.eval_function_path == "my.rollout"
    bad = types.SimpleNamespace(rollout_batch_size=4, num_rollout=1, rollout_num_gpus=8, rollout_temperature=0.0,
                                rollout_global_dataset=False)  # fmt: skip
    with pytest.raises(ValueError, match="--rollout-temperature must be > 0"):
        slime_arguments.slime_validate_args(bad)


def test_dump_details_sets_both_dumps_like_slime_unless_given(files):
    args = parse_args(base("--dump-details", "/d"))
    assert args.save_debug_rollout_data == "/d/rollout_data/{rollout_id}.pt"
    assert args.save_debug_train_data == "/d/train_data/{rollout_id}.pt"
    args = parse_args(base("--dump-details", "/d", "--save-debug-train-data", "/t_{rollout_id}.pt"))
    assert args.save_debug_train_data == "/t_{rollout_id}.pt"
    assert "must not be equal" in error_of(base("--save-debug-rollout-data", "/x.pt", "--save-debug-train-data",
                                                "/x.pt"))
