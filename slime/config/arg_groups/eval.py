"""Evaluation: which datasets, how often, and the sampling overrides used for them.

Eval sampling flags left unset fall back to the rollout's at use time. `--eval-prompt-data` is normalised
to `[name, path, name, path, ...]` (a lone path is named "aime", as in slime); the `--eval-config` YAML is
read and checked here (slime/utils/eval_config.py) into `args.eval_datasets`.
"""

from __future__ import annotations

import argparse
import logging
import os

from slime.config.arg_groups._common import fail, require_existing_file, require_positive
from slime.rollout.rm_hub import validate_rm_type
from slime.utils.data import parse_prompt_path
from slime.utils.eval_config import dataset_where, load_eval_config

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


def validate_eval(args: argparse.Namespace) -> None:
    require_positive(args, "eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len")
    if args.eval_temperature is not None and args.eval_temperature < 0:
        fail(f"--eval-temperature {args.eval_temperature}: must be >= 0 (0 is greedy).")

    if args.eval_prompt_data is not None:
        values = list(args.eval_prompt_data)
        if len(values) == 1:
            logger.info("--eval-prompt-data has a single path; naming that dataset 'aime' (as slime does).")
            values = ["aime", values[0]]
        if len(values) % 2:
            fail(
                f"--eval-prompt-data {' '.join(values)}: expected name path pairs (got {len(values)} values), "
                "e.g. --eval-prompt-data aime /data/aime.jsonl gsm8k /data/gsm8k.jsonl."
            )
        names = values[0::2]
        duplicates = sorted({x for x in names if names.count(x) > 1})
        if duplicates:
            fail(f"--eval-prompt-data names {duplicates} more than one dataset; give each a distinct name.")
        for name, value in zip(values[0::2], values[1::2]):
            try:
                path, _ = parse_prompt_path(value, "--eval-prompt-data")
            except ValueError as e:
                fail(str(e))
            if not os.path.isfile(path):
                fail(f"--eval-prompt-data {name} {value}: no such file (cwd: {os.getcwd()}); fix the path.")
        args.eval_prompt_data = values

    require_existing_file("eval_config", args.eval_config)
    args.eval_datasets = None
    if args.eval_config is not None:
        try:
            args.eval_datasets = load_eval_config(args.eval_config)
            for i, ds in enumerate(args.eval_datasets):
                if ds.get("rm_type") is not None:
                    validate_rm_type(ds["rm_type"], flag=f"{dataset_where(args.eval_config, i, ds['name'])}: rm_type")
        except ValueError as e:  # EvalConfigError, or an unknown rm_type
            fail(str(e))
        if args.eval_prompt_data is not None:
            logger.warning("--eval-config %s lists the eval datasets; --eval-prompt-data is ignored.", args.eval_config)

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
