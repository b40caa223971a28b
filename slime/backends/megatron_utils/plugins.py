"""slime's plugin points of the megatron backend, with slime's contracts (docs/megatron_backend.md, 'Plugins').

- `--custom-megatron-init-path`: fn(args), on every rank once megatron-core's parallel groups exist, before the
  model is built;
- `--custom-megatron-before-log-prob-hook-path`: fn(args, model, store_prefix) before each forward-only log-prob
  pass ("" the old policy, "ref_" the reference model; `model` the list of model chunks);
- `--custom-megatron-before-train-step-hook-path`: fn(args, rollout_id, step_id, model, optimizer,
  opt_param_scheduler) before each optimizer step's forward/backward, after the gradients are zeroed;
- `--custom-model-provider-path`: fn(pre_process=, post_process=[, vp_stage=][, config=]) -> GPTModel per model
  chunk, instead of the built-in construction. slime's providers read Megatron-LM's global args
  (`megatron.training.get_args()`), which megatron-core does not ship: here `get_args()` of this module gives the
  run's args on a training rank, and a provider may also name `config` (the TransformerConfig of the flags);
- `--spec MODULE FUNCTION` (Megatron-LM's flag; one `pkg.mod.fn` token works too): the layer spec. A function
  is called as slime calls it, fn(args, config, vp_stage), and returns a layer/block spec or a model provider
  (a callable taking `pre_process`); anything else is the spec itself. slime's own `slime_plugins.models` specs
  are slime's fork of Megatron-LM: `glm4.get_glm_spec` is the built-in spec here (its extra norms are
  --post-self-attn-layernorm / --post-mlp-layernorm); the others are architectures not built here (refused).

The hooks are loaded once per rank, with every other hook of the run (`slime.utils.hooks`), by
`MegatronHooks.from_args` at the start of the actor's `init`; a --spec is loaded at validation too, so a typo
fails before Ray starts, and again when the model is built.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.utils.errors import SlimeArgumentError
from slime.utils.hooks import hooks_of
from slime.utils.misc import load_function

BUILTIN_EQUIVALENTS = {
    "slime_plugins.models.glm4:get_glm_spec": "GLM-4's sandwich norms (--post-self-attn-layernorm / "
                                              "--post-mlp-layernorm) are part of the built-in spec",
}
NOT_BUILT = {
    "slime_plugins.models.qwen3_5": "Qwen3.5 (gated DeltaNet linear attention)",
    "slime_plugins.models.qwen3_5_vl": "Qwen3.5-VL (gated DeltaNet linear attention, vision tower)",
    "slime_plugins.models.qwen3_next": "Qwen3-Next (gated DeltaNet linear attention)",
    "slime_plugins.models.glm5": "GLM-5 (DSA sparse-attention indexer)",
    "slime_plugins.models.minimax_m2": "MiniMax-M2",
}


_ARGS: argparse.Namespace | None = None


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The run's args on a megatron training rank (what Megatron-LM's `megatron.training.get_args()` gives slime's
    plugins)."""
    if _ARGS is None:
        raise RuntimeError("slime.backends.megatron_utils.plugins.get_args(): no megatron training rank has started "
                           "in this process (the args are set when MegatronTrainRayActor.init begins)")
    return _ARGS


@dataclass(frozen=True)
class MegatronHooks:
    """The megatron backend's three hooks under the names its actor calls them by: a view of the rank's
    `slime.utils.hooks.Hooks` record, which `from_args` resolves (every hook of the run, at the start of
    `MegatronTrainRayActor.init`)."""

    init: Callable | None = None
    before_log_prob: Callable | None = None
    before_train_step: Callable | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MegatronHooks:
        hooks = hooks_of(args)
        return cls(init=hooks.custom_megatron_init, before_log_prob=hooks.custom_megatron_before_log_prob_hook,
                   before_train_step=hooks.custom_megatron_before_train_step_hook)


def spec_path(args: argparse.Namespace) -> str | None:
    """--spec as one `module:name` path (None: the built-in spec)."""
    spec = args.spec
    if not spec:
        return None
    if isinstance(spec, str):
        spec = [spec]
    if len(spec) == 1:
        return spec[0]
    if len(spec) == 2:
        return f"{spec[0]}:{spec[1]}"
    raise SlimeArgumentError(f"--spec {' '.join(spec)}: expected MODULE FUNCTION (two tokens, as Megatron-LM's "
                             "--spec), e.g. --spec my_models.spec get_spec")


def check_spec(args: argparse.Namespace) -> None:
    """Validation: --spec's form, slime's model plugins, and (except in a dry run, where megatron-core may be
    missing) that it loads."""
    if args.dry_run:
        _refuse_not_built(args)
    else:
        load_spec(args)


def _refuse_not_built(args: argparse.Namespace) -> None:
    path = spec_path(args)
    module = (path or "").split(":")[0]
    for prefix, what in NOT_BUILT.items():
        if module == prefix or module.startswith(prefix + "."):
            raise SlimeArgumentError(
                f"--spec {' '.join(args.spec)}: slime's {what} layers need slime's fork of Megatron-LM and are not "
                "built here; this backend builds GPT-style models (dense, MoE, MLA, GLM-4's sandwich norms)."
            )


def load_spec(args: argparse.Namespace) -> Any:
    """The user's --spec object (function or spec), or None for the built-in spec; refuses slime's model plugins
    for architectures not built here."""
    path = spec_path(args)
    if path is None or path in BUILTIN_EQUIVALENTS:
        return None
    _refuse_not_built(args)
    try:
        return load_function(path, "--spec")
    except Exception as e:
        raise SlimeArgumentError(str(e)) from e


def custom_layer_spec(spec: Any, args: argparse.Namespace, config, vp_stage: int | None) -> Any:
    """What a loaded --spec gives for one model chunk: slime calls a function as fn(args, config, vp_stage)."""
    return spec(args, config, vp_stage) if callable(spec) else spec


def is_model_provider(obj: Any) -> bool:
    if not callable(obj):
        return False
    try:
        return "pre_process" in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def call_model_provider(provider: Callable, pre_process: bool, post_process: bool, vp_stage: int | None, config):
    """slime's call: pre_process and post_process by keyword, plus vp_stage and config when the provider names
    them."""
    params = inspect.signature(provider).parameters
    kwargs: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
    if "vp_stage" in params:
        kwargs["vp_stage"] = vp_stage
    if "config" in params:
        kwargs["config"] = config
    return provider(**kwargs)
