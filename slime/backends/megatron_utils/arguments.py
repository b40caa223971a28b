"""Megatron argument checks at slime's path (`slime.backends.megatron_utils.arguments`).

`hf_validate_args(args, hf_config)` (slime's `_hf_validate_args`) is the MODEL_ARGS vs config.json check of
slime/backends/megatron_utils/config_check.py for a config given as an object (transformers' `AutoConfig`, or
any namespace; its `text_config` for multimodal models) instead of a folder; a mismatch raises
`HFConfigMismatchError`, both our `ConfigMismatchError` and the `AssertionError` slime raises.

`validate_allgather_cp` is slime's rule for `--allgather-cp`: with context parallelism it is only correct for
DSA attention models (DeepSeek-V3.2, GLM-5), whose sequence layout it was written for; any other model would
have its tokens silently reordered. No DSA model is built here, so the configuration validation
(slime/config/arg_groups/megatron.py) refuses `--allgather-cp` with CP > 1 through this check, which names the
reason. `_validate_allgather_cp_supported` is slime's name for it.
"""

from __future__ import annotations

from typing import Any

from slime.backends.megatron_utils.config_check import ConfigMismatchError, find_mismatches

ALLGATHER_CP_ARCHITECTURES = frozenset({"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"})


def is_dsa_model(hf_config: Any) -> bool:
    """The HF config (an object with `architectures`, or a config.json dict) names a DSA attention model."""
    if hf_config is None:
        return False
    names = hf_config.get("architectures") if isinstance(hf_config, dict) else getattr(hf_config, "architectures", None)
    return any(name in ALLGATHER_CP_ARCHITECTURES for name in names or [])


def validate_allgather_cp(args: Any, hf_config: Any = None) -> None:
    """Raise ValueError when --allgather-cp is combined with --context-parallel-size > 1 on a non-DSA model."""
    if not getattr(args, "allgather_cp", False) or getattr(args, "context_parallel_size", 1) <= 1:
        return
    if is_dsa_model(hf_config):
        return
    raise ValueError(
        f"--allgather-cp with --context-parallel-size {args.context_parallel_size} is only supported for DSA "
        "attention models (DeepSeek-V3.2, GLM-5); other models use the zigzag context-parallel layout, which "
        "all-gather CP would silently scramble. Remove --allgather-cp or set --context-parallel-size 1."
    )


_validate_allgather_cp_supported = validate_allgather_cp


class HFConfigMismatchError(ConfigMismatchError, AssertionError):
    """MODEL_ARGS disagree with the HF config; the message names every field, flag and both values."""


def hf_config_dict(hf_config: Any) -> dict:
    """A config.json-like dict of an HF config object (or dict), the language model's part for multimodal ones."""
    cfg = hf_config if isinstance(hf_config, dict) else (
        hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config)))  # fmt: skip
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        text = hf_config_dict(text)
    return text if isinstance(text, dict) else cfg


def hf_validate_args(args: Any, hf_config: Any) -> None:
    problems = find_mismatches(args, hf_config_dict(hf_config))
    if problems:
        raise HFConfigMismatchError("hf_validate_args failed: " + "; ".join(problems))


_hf_validate_args = hf_validate_args
