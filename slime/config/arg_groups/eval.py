"""Evaluation: which datasets, how often, and the sampling overrides used for them.

Eval sampling flags left unset fall back to the rollout's. The datasets (`--eval-config` YAML, else the
`--eval-prompt-data` name/path pairs, a lone path named "aime" as in slime) are resolved here by
slime/utils/eval_config.py into `args.eval_datasets` (`EvalDatasetConfig`s, every setting resolved), and
`--eval-prompt-data` becomes their `[name, path, name, path, ...]`. A dataset's rm_type, custom_rm_path and
custom_generate_function_path are checked like the flags of those names; with the built-in eval rollout, a
dataset setting it cannot act on (`eval_config.NOT_ACTED_ON`) is refused.
"""

from __future__ import annotations

import argparse
import json
import logging

from slime.config.arg_groups._common import fail, require_existing_file, require_positive
from slime.config.arg_groups.rollout import DEFAULT_ROLLOUT_FUNCTION
from slime.rollout.rm_hub import validate_rm_type
from slime.utils.backend_specs import engine_spec
from slime.utils.eval_config import EvalDatasetConfig, dataset_where, eval_source, not_acted_on, resolve_eval_datasets
from slime.utils.misc import load_hook

logger = logging.getLogger(__name__)

FUNCTION_FLAGS = ("eval_function_path",)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("eval", "Evaluation datasets, interval and sampling overrides.")
    g.add_argument(
        "--eval-function-path",
        type=str,
        default=None,
        help="Rollout function used for evaluation (default: --rollout-function-path).",
    )
    g.add_argument("--eval-interval", type=int, default=None, help="Evaluate after every N rollouts.")
    g.add_argument(
        "--eval-prompt-data",
        type=str,
        nargs="+",
        default=None,
        help="Eval datasets as name path pairs: aime /data/aime.jsonl gsm8k /data/gsm8k.jsonl "
        "(a lone path is named 'aime').",
    )
    g.add_argument(
        "--eval-config",
        type=str,
        default=None,
        help="YAML with eval defaults and datasets (name, path, rm_type, keys, n_samples_per_eval_prompt, "
        "temperature, top_p, top_k, max_response_len, stop, ...); overrides --eval-prompt-data.",
    )
    g.add_argument("--skip-eval-before-train", action="store_true", help="Do not evaluate at rollout 0.")
    g.add_argument("--eval-input-key", type=str, default=None, help="Prompt key of eval records (default --input-key).")
    g.add_argument("--eval-label-key", type=str, default=None, help="Label key of eval records (default --label-key).")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Responses per eval prompt.")
    g.add_argument("--eval-temperature", type=float, default=None, help="Eval temperature (default: the rollout's).")
    g.add_argument("--eval-top-p", type=float, default=None, help="Eval top-p (default: the rollout's).")
    g.add_argument("--eval-top-k", type=int, default=None, help="Eval top-k (default: the rollout's).")
    g.add_argument(
        "--eval-max-response-len", type=int, default=None, help="Eval max_new_tokens (default: the rollout's)."
    )
    g.add_argument("--eval-tool-key", type=str, default=None, help="Tools key of eval records (default --tool-key).")
    g.add_argument("--eval-min-new-tokens", type=int, default=None,
                   help="min_new_tokens of eval requests (a dataset's min_new_tokens overrides it; the hf engine "
                   "does not implement it: refused with --rollout-backend hf).")
    g.add_argument("--eval-max-prompt-len", type=int, default=None,
                   help="Drop eval prompts longer than this many tokens (default: none dropped, as in slime; "
                   "--rollout-max-prompt-len does not apply to eval prompts).")
    g.add_argument("--eval-max-context-len", type=int, default=None,
                   help="slime: the eval context length (default: --rollout-max-context-len).")


def validate_eval(args: argparse.Namespace) -> None:
    require_positive(args, "eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len",
                     "eval_max_prompt_len", "eval_max_context_len")
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    if args.eval_temperature is not None and args.eval_temperature < 0:
        fail(f"--eval-temperature {args.eval_temperature}: must be >= 0 (0 is greedy).")

    require_existing_file("eval_config", args.eval_config)
    if args.eval_config is not None and args.eval_prompt_data is not None:
        logger.warning("--eval-config %s lists the eval datasets; --eval-prompt-data is ignored.", args.eval_config)
    try:
        args.eval_datasets = resolve_eval_datasets(args)
        for i, ds in enumerate(args.eval_datasets):
            check_eval_dataset(args, dataset_where(eval_source(args), i, ds.name), ds)
    except (ValueError, TypeError, ImportError, AttributeError) as e:  # EvalConfigError, a bad rm_type or hook
        fail(str(e))
    args.eval_prompt_data = [x for ds in args.eval_datasets for x in (ds.name, ds.path)] or None

    if args.eval_interval is not None and args.eval_prompt_data is None and args.eval_config is None:
        # The seed's launch example passes --eval-interval alone; slime asserts here, we switch eval off loudly.
        logger.warning(
            "--eval-interval %s is set but there is no eval data (--eval-prompt-data NAME PATH or "
            "--eval-config FILE): evaluation is off.",
            args.eval_interval,
        )
        args.eval_interval = None
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path


def check_eval_images(args: argparse.Namespace, where: str, keys: dict) -> None:
    """A dataset's images (its `multimodal_keys`, else --multimodal-keys) are read like the training data's: the
    run must be one with images (--multimodal-keys), whose checks (engine, trainer) cover them, and images only."""
    if not args.multimodal_keys:
        fail(f"{where}: multimodal_keys: {json.dumps(keys)} in a run without --multimodal-keys: evaluation with "
             "images runs in a run with images; add --multimodal-keys '{\"image\": \"<row key>\"}' (docs/vlm.md), "
             "or remove the dataset's multimodal_keys")
    unknown = sorted(set(keys) - {"image"})
    if unknown:
        fail(f"{where}: multimodal_keys: {json.dumps(keys)}: media types {unknown}: images only; map only \"image\" "
             "to the rows' key")


def check_eval_dataset(args: argparse.Namespace, where: str, ds: EvalDatasetConfig) -> None:
    """A dataset's reward type and hooks load like their flags'; the built-in eval rollout acts on its settings."""
    if ds.rm_type is not None:
        validate_rm_type(ds.rm_type, flag=f"{where}: rm_type")
    for key, flag in (("custom_rm_path", "--custom-rm-path"),
                      ("custom_generate_function_path", "--custom-generate-function-path")):  # fmt: skip
        path = getattr(ds, key)
        if path is not None and path != getattr(args, key):  # the flag's own value is checked with the flag
            try:
                load_hook(path, flag)
            except (ImportError, AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: {key}: {e}") from e
    engine = engine_spec(args)
    on = [f"{k}: {getattr(ds, k)!r}" for k, off in engine.unsupported_sampling if getattr(ds, k) not in (None, off)]
    if on:
        fail(f"{where}: {', '.join(on)}: the {engine.name} engine (--rollout-backend {engine.name}) does not implement "
             f"{'this sampling setting' if len(on) == 1 else 'these sampling settings'}; remove it (min_new_tokens "
             "may come from --eval-min-new-tokens), or use --rollout-backend sglang")
    if ds.multimodal_keys is not None:
        check_eval_images(args, where, ds.multimodal_keys)
    unused = not_acted_on(ds)
    if unused and (args.eval_function_path or args.rollout_function_path) == DEFAULT_ROLLOUT_FUNCTION:
        fail(f"{where}: {', '.join(f'{k}: {getattr(ds, k)!r}' for k in unused)}: the built-in eval rollout "
             f"({DEFAULT_ROLLOUT_FUNCTION}) does not act on {'this setting' if len(unused) == 1 else 'these settings'}; "
             "remove it, or evaluate with an --eval-function-path of your own that reads it")
