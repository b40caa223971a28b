"""slime's and Megatron-LM's flags for features this implementation does not have, in one table.

Each flag parses with slime's (or Megatron-LM's) type, choices and default, so a slime launch script's command
line parses unchanged; validation then acts on the value the user gave:
- `refuse`: what would be trained (or which software runs) differs from the user's intent, or the feature needs
  software this project cannot install: the run stops, naming the flag, why, and what to do instead;
- `warn`: only speed, memory or logging would differ (a recompute, a chunk size, a profiler, a CI assertion):
  a warning says the flag is not acted on, and the run goes on;
- `plugin`: the flag exists for plugins (slime's rollout-buffer example reads it; slime's own code does not):
  parsed and left for the plugin that asks for it.
A value equal to the default is never refused: it is what the run does anyway.

When a feature is built, its flag moves from this table to its area's module, where the code that acts on it
is (docs/architecture.md, "A flag").
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from slime.config.arg_groups._common import fail, flag
from slime.config.arg_groups.megatron import MEGATRON_DESTS

logger = logging.getLogger(__name__)

_DEEPEP = "pip install deep_ep (built against your CUDA and NVSHMEM)"
_TE = "pip install transformer-engine[pytorch]"


@dataclass(frozen=True)
class NotBuilt:
    """One flag of a feature not built here: its dest, argparse settings, and what validation says when it is set."""

    dest: str
    kwargs: dict[str, Any]
    why: str
    instead: str
    kind: str = "refuse"  # refuse | warn | plugin
    megatron: bool = False  # a Megatron-LM flag: its tokens are kept in args.megatron_args too
    option: str | None = None  # the flag, when it is not --<dest with dashes>

    @property
    def flag(self) -> str:
        return self.option or flag(self.dest)


_BOOL = {"action": "store_true"}
_QWEN_GATED = ("Qwen3-Next / Qwen3.5 gated attention and their gated-delta-net linear-attention layers are not built "
               "here (their --spec is slime_plugins' model code)")  # fmt: skip
_QWEN_GATED_INSTEAD = "train a Qwen3 or Qwen3-MoE checkpoint (scripts/models/qwen3-*.sh)"
_DSA = "DeepSeek-V3.2 / GLM-5 sparse attention (DSA) and its indexer are not built here"
_DEEPGEMM = ("the SGLang-compatible block-FP8 DeepGEMM forward needs deep_gemm and TransformerEngine's FP8 layers, "
             "which the megatron backend here does not build")  # fmt: skip
_WARN_PERF = "only speed or memory differ, not what is trained"

NOT_BUILT: tuple[NotBuilt, ...] = (
    # ---- Megatron-LM: kernels and software this project cannot install ----
    NotBuilt("moe_enable_deepep", _BOOL, f"DeepEP's expert all-to-all kernels are not installed here ({_DEEPEP})",
             "drop it: --moe-token-dispatcher-type alltoall exchanges the same tokens over NCCL", megatron=True),
    NotBuilt("fp8_format", {"type": str, "choices": ["e4m3", "hybrid"], "default": None},
             f"FP8 training needs TransformerEngine's FP8 layers ({_TE}), which the megatron backend here does not "
             "build", "drop --fp8-format / --fp8-recipe to train in --bf16", megatron=True),
    NotBuilt("fp8_recipe", {"type": str, "choices": ["tensorwise", "delayed", "mxfp8", "blockwise"],
                            "default": "delayed"},  # fmt: skip
             f"FP8 training needs TransformerEngine's FP8 layers ({_TE}), which the megatron backend here does not "
             "build", "drop --fp8-format / --fp8-recipe to train in --bf16", megatron=True),
    NotBuilt("enable_experimental", _BOOL, f"Megatron-LM's experimental features are not built here ({_DSA})",
             "train a model family of scripts/models/ without DSA", megatron=True),
    NotBuilt("use_gated_attention", _BOOL, _QWEN_GATED, _QWEN_GATED_INSTEAD, megatron=True),
    NotBuilt("attention_output_gate", _BOOL, _QWEN_GATED, _QWEN_GATED_INSTEAD, megatron=True),
    NotBuilt("moe_shared_expert_gate", _BOOL, _QWEN_GATED, _QWEN_GATED_INSTEAD, megatron=True),
    NotBuilt("qwen_gdn_backend", {"type": str, "choices": ["fla", "flashqla"], "default": "fla"}, _QWEN_GATED,
             _QWEN_GATED_INSTEAD),
    NotBuilt("freeze_indexer", _BOOL, _DSA, "drop it"),
    NotBuilt("megatron_deepgemm_forward_layers", {"nargs": "+", "type": int, "default": None}, _DEEPGEMM, "drop it"),
    NotBuilt("megatron_deepgemm_forward_modules", {"nargs": "+", "default": None}, _DEEPGEMM, "drop it"),
    NotBuilt("megatron_deepgemm_moe_forward_layers", {"nargs": "+", "type": int, "default": None}, _DEEPGEMM,
             "drop it"),
    NotBuilt("megatron_deepgemm_moe_forward_modules", {"nargs": "+", "default": None}, _DEEPGEMM, "drop it"),
    # ---- training features ----
    NotBuilt("enable_mtp_training", _BOOL, "multi-token-prediction layers are built (--mtp-num-layers) but not "
             "trained here", "drop it (the MTP layers stay as loaded)"),
    NotBuilt("mtp_loss_scaling_factor", {"type": float, "default": 0.2}, "the MTP loss only exists with "
             "--enable-mtp-training, which is not built here", "drop it", kind="warn"),
    NotBuilt("use_routing_replay", _BOOL, "MoE routing replay (arXiv 2507.18071) is not built here", "drop it"),
    NotBuilt("use_rollout_routing_replay", _BOOL, "MoE rollout routing replay (arXiv 2510.11370) is not built here",
             "drop it"),
    NotBuilt("recompute_loss_function", _BOOL, _WARN_PERF, "drop it", kind="warn"),
    NotBuilt("log_probs_chunk_size", {"type": int, "default": -1}, _WARN_PERF, "drop it", kind="warn"),
    NotBuilt("balance_by_flops", _BOOL, "micro-batches are packed first-fit by tokens here; " + _WARN_PERF, "drop it",
             kind="warn"),
    NotBuilt("data_pad_size_multiplier", {"type": int, "default": 128}, "packed sequences are not padded to a "
             "multiple here; " + _WARN_PERF, "drop it", kind="warn"),
    NotBuilt("async_save", _BOOL, "checkpoints are saved synchronously here; " + _WARN_PERF, "drop it", kind="warn"),
    # ---- rollout, data ----
    NotBuilt("prefill_num_servers", {"type": int, "default": None}, "prefill/decode disaggregated SGLang engines "
             "are not built here", "drop it (every engine serves both)"),
    NotBuilt("sglang_config", {"type": str, "default": None}, "SGLang server groups from a YAML (PD "
             "disaggregation, per-group overrides) are not built here",
             "use --rollout-num-gpus-per-engine and --sglang-<field> flags, which apply to every engine"),
    NotBuilt("load_forge_rollout_data", {"type": str, "default": None}, "slime.rollout.forge_load is not built here",
             "replay saved rollouts with --load-debug-rollout-data"),
    NotBuilt("http_proxy", {"type": str, "default": None}, "slime's HTTP clients here do not go through a proxy",
             "set HTTP_PROXY / NO_PROXY in the environment instead", kind="warn"),
    NotBuilt("use_distributed_post", _BOOL, "requests are posted from the rollout manager here; " + _WARN_PERF,
             "drop it", kind="warn"),
    NotBuilt("rollout_buffer_url", {"type": str, "default": None}, "read by slime's rollout-buffer plugin",
             "", kind="plugin"),
    NotBuilt("fetch_trajectory_retry_times", {"type": int, "default": -1}, "read by slime's rollout-buffer plugin",
             "", kind="plugin"),
    NotBuilt("min_batch_collection_ratio", {"type": float, "default": 1}, "read by slime's rollout-buffer plugin",
             "", kind="plugin"),
    NotBuilt("rollout_task_type", {"type": str, "default": "math"}, "read by slime's rollout-buffer plugin",
             "", kind="plugin"),
    # ---- logging, profiling, CI ----
    NotBuilt("wandb_random_suffix", {"action": "store_false", "default": True}, "wandb runs here are named by "
             "--wandb-group / the run name, with no random suffix to disable", "drop it", kind="warn",
             option="--disable-wandb-random-suffix"),
    NotBuilt("wandb_always_use_train_step", _BOOL, "metrics are logged at the rollout step here", "drop it",
             kind="warn"),
    NotBuilt("wandb_run_id", {"type": str, "default": None}, "wandb runs are not resumed by id here", "drop it",
             kind="warn"),
    NotBuilt("log_reward_category", {"type": str, "default": None}, "reward categories are not logged here",
             "drop it", kind="warn"),
    NotBuilt("log_correct_samples", _BOOL, "correct samples are not logged apart here", "use --log-passrate",
             kind="warn"),
    NotBuilt("memory_snapshot_dir", {"type": str, "default": "."}, "no memory profiler runs here", "drop it",
             kind="warn"),
    NotBuilt("memory_snapshot_num_steps", {"type": int, "default": None}, "no memory profiler runs here", "drop it",
             kind="warn"),
    NotBuilt("profile_target", {"type": str, "choices": ["train_overall", "train_actor", "train_log_probs"],
                                "default": ["train_overall"], "nargs": "+"},  # fmt: skip
             "no profiler runs here", "drop it", kind="warn"),
    NotBuilt("memory_recorder", {"type": str, "choices": ["torch", "memray"], "default": "torch"},
             "no memory profiler runs here", "drop it", kind="warn"),
    NotBuilt("record_memory_history", _BOOL, "no memory profiler runs here", "drop it", kind="warn"),
    NotBuilt("ci_test", _BOOL, "slime's CI assertions are not run here (tests/ checks the same invariants)",
             "drop it", kind="warn"),
    NotBuilt("ci_disable_kl_checker", _BOOL, "slime's CI assertions are not run here", "drop it", kind="warn"),
    NotBuilt("ci_train_rollout_logprob_abs_diff_threshold", {"type": float, "default": 0.1},
             "slime's CI assertions are not run here", "drop it", kind="warn"),
    NotBuilt("ci_save_grad_norm", {"type": str, "default": None}, "slime's CI assertions are not run here", "drop it",
             kind="warn"),
    NotBuilt("ci_load_grad_norm", {"type": str, "default": None}, "slime's CI assertions are not run here", "drop it",
             kind="warn"),
)


def add_not_built_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "not built here",
        "slime / Megatron-LM flags of features this implementation does not have. They parse with slime's "
        "defaults; set to anything else, they are refused with the reason (or warned about when only speed, memory "
        "or logging would differ).",
    )
    for record in NOT_BUILT:
        action = g.add_argument(record.flag, dest=record.dest, help=_help(record), **record.kwargs)
        if record.megatron:
            MEGATRON_DESTS.add(action.dest)


def _help(record: NotBuilt) -> str:
    if record.kind == "plugin":
        return f"slime: {record.why}; nothing else acts on it."
    what = "refused when set" if record.kind == "refuse" else "warned about when set (not acted on)"
    return f"slime: {what}: {record.why}."


def _default(record: NotBuilt) -> Any:
    default = record.kwargs.get("default", record.kwargs.get("action") == "store_false")
    kind = record.kwargs.get("type")
    return kind(default) if callable(kind) and isinstance(default, str) else default


def set_flags(args: argparse.Namespace) -> list[NotBuilt]:
    """The records whose flag was given a value other than its default."""
    return [r for r in NOT_BUILT if r.kind != "plugin" and getattr(args, r.dest) != _default(r)]


def validate_not_built(args: argparse.Namespace) -> None:
    given = set_flags(args)
    for record in given:
        if record.kind == "warn":
            logger.warning("%s: not acted on here: %s; %s.", record.flag, record.why, record.instead)
    refused = [r for r in given if r.kind == "refuse"]
    if refused:
        record = refused[0]
        value = getattr(args, record.dest)
        shown = "" if value is True else f" {' '.join(map(str, value)) if isinstance(value, list) else value}"
        more = f" (also refused: {', '.join(r.flag for r in refused[1:])})" if refused[1:] else ""
        fail(f"{record.flag}{shown}: not supported here: {record.why}; {record.instead}{more}.")


NOT_BUILT_DESTS = frozenset(r.dest for r in NOT_BUILT)
PLUGIN_FLAGS = tuple(r.dest for r in NOT_BUILT if r.kind == "plugin")

__all__ = ["NOT_BUILT", "NOT_BUILT_DESTS", "PLUGIN_FLAGS", "NotBuilt", "add_not_built_arguments", "validate_not_built"]
