"""slime's command line: assemble the per-area argument groups, parse, validate.

Three families of flags share one command line:
- slime's own flags, defined by the modules of `slime/config/arg_groups/` and parsed normally;
- `--sglang-<field>` flags forwarded to every SGLang server, kept raw in `args.sglang_args`
  (`{"mem_fraction_static": "0.7"}`; a bare flag is True, several values a list) and `--router-<field>`
  flags forwarded to sglang-router, kept in `args.router_args` (slime's own `--sglang-server-concurrency`,
  `--sglang-router-ip/-port/-request-timeout-secs` and `--router-policy` are ordinary flags);
- Megatron-LM's flags (e.g. `${MODEL_ARGS[@]}` from scripts/models), defined in
  `slime/config/arg_groups/megatron.py`: parsed into typed attributes like ours, and their raw tokens also kept,
  in order, in `args.megatron_args`. Any other `--flag` is an error naming it, with a "did you mean" hint.

Simplifications: forwarded values stay strings until their backend type-checks them; the fsdp backend
ignores the Megatron flags (with one warning). `--custom-config-path` YAML
overrides the command line and is then validated like it.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from slime.backends.fsdp_utils import checkpoint as fsdp_checkpoint
from slime.backends.megatron_utils import checkpoint as megatron_checkpoint
from slime.backends.megatron_utils.args import require_model_args
from slime.backends.megatron_utils.config_check import ConfigMismatchError, check_against_hf_config
from slime.config.arg_groups import FUNCTION_FLAGS, SlimeArgumentError, add_all_arguments, validate_all
from slime.config.arg_groups.data import DEFAULT_DATA_SOURCE, check_training_divisibility
from slime.config.arg_groups.megatron import (
    MEGATRON_DESTS,
    add_megatron_arguments,
    check_megatron_roles,
    validate_megatron,
)
from slime.config.arg_groups.rollout import DEFAULT_ROLLOUT_FUNCTION, check_hf_checkpoint
from slime.config.plan import check_memory_fits
from slime.rollout.rm_hub import RM_TYPES
from slime.utils.backend_specs import train_spec
from slime.utils.checkpoint_layout import has_checkpoint, save_folders
from slime.utils.data import chat_template_missing, check_prompt_file, no_chat_template_message
from slime.utils.misc import load_hook, read_yaml

logger = logging.getLogger(__name__)

__all__ = ["SlimeArgumentError", "build_parser", "parse_args", "split_argv", "validate_args"]

CustomArguments = Callable[[argparse.ArgumentParser], "argparse.ArgumentParser | None"]

# How validation finds the checkpoint --load names, per checkpoint format (TrainBackendSpec.checkpoint_format):
# the trainers read the same folders with the same functions.
CHECKPOINT_FINDERS = {"torch_dist": megatron_checkpoint.find_checkpoint, "hf": fsdp_checkpoint.find_checkpoint}

_SGLANG_PREFIX = "--sglang-"
_ROUTER_PREFIX = "--router-"

_EPILOG = """\
Flags not listed above:
  --sglang-<field> VALUE   forwarded to every SGLang server as ServerArgs.<field>
                           (e.g. --sglang-mem-fraction-static 0.7); kept in args.sglang_args
  --router-<field> VALUE   forwarded to sglang-router; kept in args.router_args
  Megatron-LM flags (the "megatron ..." groups above, e.g. ${MODEL_ARGS[@]} from scripts/models) are
  also kept as raw tokens in args.megatron_args; the fsdp backend ignores them. Any other flag is an error.
Batch identity: rollout_batch_size x n_samples_per_prompt == global_batch_size x num_steps_per_rollout.
Without CUDA, --actor-num-gpus-per-node counts CPU training ranks and --rollout-num-gpus CPU engines.
"""


# Fields no flag sets directly: `parse_args` fills the forwarded flag families, validation resolves the rest.
# Declared as parser defaults so that every args object built from the parser has them (code reads `args.x`).
DERIVED_FIELDS: dict[str, str] = {
    "use_cuda": "CUDA is available here (or --dry-run-cuda plans a GPU run)",
    "sglang_args": "the --sglang-<field> flags, {field: value}",
    "router_args": "the --router-<field> flags, {field: value}",
    "megatron_args": "the Megatron flags' raw tokens, in order",
    "use_critic": "the advantage estimator trains a value model (slime/algorithm/estimators.py)",
    "grpo_std_normalization": "not --disable-grpo-std-normalization (slime's positive name)",
    "rewards_normalization": "not --disable-rewards-normalization (slime's positive name)",
    "rollout_global_dataset": "prompts come from --prompt-data (not --disable-rollout-global-dataset)",
    "eval_datasets": "the datasets of --eval-config, read and checked",
    "run_name": "<project>/<experiment or start time>: the run's folder under outputs/",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises SlimeArgumentError instead of printing usage and exiting."""

    def error(self, message: str):
        raise SlimeArgumentError(f"{message} (see --help)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser(add_custom_arguments: CustomArguments | None = None) -> argparse.ArgumentParser:
    """The whole command line. `add_custom_arguments(parser)` (slime's hook for a plugin's own flags) adds flags
    first, so a plugin may also take a name slime defines later (`reset_arg` changes an existing default)."""
    # allow_abbrev=False: an unknown Megatron flag must never be taken for a prefix of one of ours.
    parser = _Parser(
        prog=os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py",
        usage="%(prog)s [slime flags] [--sglang-<field> ...] [--router-<field> ...] [Megatron flags]",
        description="slime: RL post-training of LLMs (training backend + rollout engines behind sglang-router).",
        epilog=_EPILOG,
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    add_all_arguments(parser)
    add_megatron_arguments(parser)
    parser.add_argument(
        "--custom-config-path",
        type=str,
        default=None,
        help="YAML mapping of argument names (rollout_batch_size or rollout-batch-size) to values; overrides "
        "the command line, then everything is validated. Unknown names are an error.",
    )
    parser.set_defaults(**dict.fromkeys(DERIVED_FIELDS))
    return parser


# slime's names that are the opposite of ours: (our dest, slime's dest) of the same --disable-* flag.
NEGATED_DESTS = (
    ("disable_rollout_global_dataset", "rollout_global_dataset"),
    ("disable_grpo_std_normalization", "grpo_std_normalization"),
    ("disable_rewards_normalization", "rewards_normalization"),
)


def complete_namespace(args: Any, parser: argparse.ArgumentParser | None = None) -> Any:
    """Give `args` (any object with attributes, e.g. a plugin's or a test's partial namespace) every argument it
    lacks, at the parser's default; a lacking `disable_*` flag follows slime's positive name when that is set."""
    defaults = vars((parser or build_parser()).parse_args([]))
    for ours, slimes in NEGATED_DESTS:
        if not hasattr(args, ours) and getattr(args, slimes, None) is not None:
            setattr(args, ours, not getattr(args, slimes))
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def reset_arg(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """slime's helper for `add_custom_arguments`: give the flag `name` a new default, or add it when the parser
    does not have it."""
    action = parser._option_string_actions.get(name)
    if action is None:
        parser.add_argument(name, **kwargs)
    elif "default" in kwargs:
        action.default = kwargs["default"]


@dataclass
class SplitArgv:
    """The command line sorted into the three families (see the module docstring)."""

    known: list[str] = field(default_factory=list)
    sglang_args: dict[str, Any] = field(default_factory=dict)
    router_args: dict[str, Any] = field(default_factory=dict)
    megatron_args: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value, not a flag
        return False
    except ValueError:
        return True


def _max_values(action: argparse.Action) -> float:
    nargs = action.nargs
    if nargs is None or nargs == argparse.OPTIONAL:
        return 1
    if nargs in (argparse.ZERO_OR_MORE, argparse.ONE_OR_MORE, argparse.REMAINDER):
        return math.inf
    return int(nargs)


def _forwarded_value(values: list[str]) -> str | bool | list[str]:
    if not values:
        return True
    return values[0] if len(values) == 1 else list(values)


def split_argv(parser: argparse.ArgumentParser, argv: list[str]) -> SplitArgv:
    """Sort argv into our flags (with their values), --sglang-*, --router-* and Megatron tokens.

    A value belongs to the flag before it; tokens a flag of ours cannot take, and tokens before any flag,
    are stray positionals and an error.
    """
    out = SplitArgv()
    options = parser._option_string_actions
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not _is_flag(token):
            where = f"after {argv[i - 1]!r}" if i else "before any flag"
            raise SlimeArgumentError(
                f"stray argument {token!r} ({where}): slime takes no positional arguments; "
                "check for a missing flag name or an unquoted value with spaces."
            )
        name, has_inline, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        j = i + 1
        while j < len(argv) and argv[j] != "--" and not _is_flag(argv[j]):
            j += 1
        values = argv[i + 1 : j]

        if name in options:
            most = _max_values(options[name])
            room = max(most - (1 if has_inline else 0), 0)  # `--flag=v` on a no-value flag: argparse says so
            if len(values) > room:
                takes = "no value" if most == 0 else f"at most {most} value(s)"
                raise SlimeArgumentError(
                    f"stray argument {values[int(room)]!r} after {name} ({name} takes {takes}); "
                    "remove it or add the flag it belongs to."
                )
            if len(values) == 1 and values[0].startswith("-") and not has_inline:
                out.known.append(f"{token}={values[0]}")  # argparse would read `-1e-6` as a flag
            else:
                out.known += [token, *values]
            if options[name].dest in MEGATRON_DESTS:
                out.megatron_args += [token, *values]
        elif name.startswith(_SGLANG_PREFIX):
            key = name[len(_SGLANG_PREFIX) :].replace("-", "_")
            out.sglang_args[key] = _forwarded_value(([inline] if has_inline else []) + values)
        elif name.startswith(_ROUTER_PREFIX):
            key = name[len(_ROUTER_PREFIX) :].replace("-", "_")
            out.router_args[key] = _forwarded_value(([inline] if has_inline else []) + values)
        else:
            # Kept in order with the Megatron tokens (as slime passes them on); parse_args refuses them.
            out.megatron_args += [token, *values]
            out.unknown.append(name)
        i = j
    return out


def check_unknown_flags(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """An unknown flag is an error naming it, with the closest known flag(s) as a hint."""
    import difflib

    if not names:
        return
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.75)
        parts.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    raise SlimeArgumentError(
        f"unknown flag(s): {', '.join(parts)}. Flags are slime's own, Megatron-LM's (see --help), "
        "--sglang-<field> (forwarded to SGLang) or --router-<field> (forwarded to sglang-router)."
    )


@lru_cache(maxsize=1)
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def apply_custom_config(parser: argparse.ArgumentParser, args: argparse.Namespace, path: str) -> None:
    """Override attributes of `args` from a YAML mapping; values given as strings are typed like the flag."""
    data = read_yaml(path, "--custom-config-path", SlimeArgumentError) or {}
    if not isinstance(data, dict):
        raise SlimeArgumentError(f"--custom-config-path {path}: expected a mapping of argument names to values.")

    actions = {a.dest: a for a in parser._actions}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if "custom_config_path" in data:
        raise SlimeArgumentError(f"--custom-config-path {path}: a config cannot name another config; drop the key.")
    unknown = sorted(k for k in data if not hasattr(args, k))
    typos = {k: difflib.get_close_matches(k, list(actions), n=1, cutoff=0.85) for k in unknown}
    typos = {k: m[0] for k, m in typos.items() if m}
    if typos:
        raise SlimeArgumentError(
            f"--custom-config-path {path}: " + "; ".join(f"{k}: did you mean {m}?" for k, m in sorted(typos.items()))
            + " (a key that is no slime flag is kept for plugins, but these look like misspelt flags; fix them)"
        )
    for key in unknown:  # slime's contract: every key becomes an attribute (plugins such as MIS read theirs)
        logger.info("--custom-config-path %s: %s is no slime flag; set as args.%s for plugins", path, key, key)
        setattr(args, key, data.pop(key))
    for key, value in data.items():
        action = actions.get(key)
        if action is not None and isinstance(value, str) and callable(action.type):
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                raise SlimeArgumentError(f"--custom-config-path {path}: {key}: {value!r} is not valid: {e}") from e
        if action is not None and action.choices is not None and value is not None and value not in action.choices:
            raise SlimeArgumentError(
                f"--custom-config-path {path}: {key}: {value!r} is not one of {list(action.choices)}."
            )
        current = getattr(args, key)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}  # YAML adds to forwarded flags given on the command line
        if current is not None and current != value:
            logger.info("--custom-config-path %s: %s %r -> %r", path, key, current, value)
        setattr(args, key, value)


def check_function_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Load every plugin function named by a `*-path` flag the user set, and check it takes the arguments slime
    passes it (`slime.utils.misc.HOOK_CONTRACTS`), so typos and wrong signatures fail before Ray starts.

    Built-in defaults are not loaded here: they are loaded (and tested) by the code that uses them.
    """
    for dest in FUNCTION_FLAGS:
        value = getattr(args, dest)
        if value is None or value == parser.get_default(dest):
            continue
        if dest == "eval_function_path" and value == parser.get_default("rollout_function_path"):
            continue  # derived from the default rollout function
        try:
            load_hook(value, "--" + dest.replace("_", "-"))
        except Exception as e:
            raise SlimeArgumentError(str(e)) from e


def validate_slime_flags(args: argparse.Namespace) -> argparse.Namespace:
    """slime's own flags: every area's validation (deriving defaults in place). What slime's
    `slime_validate_args` covers; `validate_args` adds the Megatron flags, plugin paths and files."""
    if args.use_cuda is None:
        args.use_cuda = _cuda_available()
    for name, empty in (("sglang_args", dict), ("router_args", dict), ("megatron_args", list)):
        if getattr(args, name) is None:
            setattr(args, name, empty())
    validate_all(args)
    return args


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Run every area's validation (deriving defaults in place), then check the plugin paths."""
    parser = parser or build_parser()
    validate_slime_flags(args)
    check_hf_checkpoint(args)
    validate_megatron(args)
    if not args.debug_rollout_only:
        check_training_divisibility(args)  # Megatron-LM's check in slime: data-parallel size needs its flags
    check_megatron_roles(args, _check_training_layout)
    check_function_flags(args, parser)
    check_model_args(args)
    check_prompt_rows(args, parser)
    check_checkpoint_to_load(args)
    if args.megatron_args and not train_spec(args).model_from_megatron_flags:
        flags = [t for t in args.megatron_args if _is_flag(t)]
        logger.warning(
            "--train-backend %s: %d Megatron flag(s) are not used by %s (the model comes from --hf-checkpoint): %s",
            args.train_backend,
            len(flags),
            args.train_backend,
            " ".join(flags),
        )
    return args


def _check_training_layout(args: argparse.Namespace) -> None:
    """The Megatron and batch-layout checks of a training group's args (a --megatron-config-path role's copy)."""
    validate_megatron(args)
    check_training_divisibility(args)


def check_before_start(args: argparse.Namespace) -> None:
    """What the training ranks would refuse at start-up, checked by train.py / train_async.py before Ray starts
    (parse_args leaves it out so that flag-level tests may parse partial architectures): --train-backend
    megatron needs MODEL_ARGS; the default rollout needs a reward function; a colocated run whose engines and
    training state, both resident, overfill this machine's GPU by the --dry-run estimate is refused (unless
    --skip-memory-check; a dry run enforces the same refusal for the GPU size it plans)."""
    if train_spec(args).model_from_megatron_flags and not args.debug_rollout_only:
        require_model_args(args)
    check_reward_source(args)
    if args.colocate and args.use_cuda and not args.dry_run and not args.skip_memory_check:
        gpu_bytes = _local_gpu_bytes()
        if gpu_bytes is not None:  # a driver without a GPU of its own cannot say what the nodes hold
            check_memory_fits(args, gpu_bytes)


def _local_gpu_bytes() -> float | None:
    """GPU 0's memory as torch reports it, asked in a child process: the driver itself keeps no CUDA context on a
    GPU the engines and trainers share. None without CUDA or when the child cannot tell."""
    if not _cuda_available():
        return None
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return float(out.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        logger.warning("could not read the GPU's memory; the colocated memory check is skipped")
        return None


def check_model_args(args: argparse.Namespace) -> None:
    """MODEL_ARGS vs --hf-checkpoint's config.json: an error for megatron, a warning for fsdp."""
    if not args.num_layers or not args.hf_checkpoint:
        return  # no architecture flags given: nothing to cross-check
    if not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        return  # the rollout checks report a missing checkpoint where one is needed
    try:
        check_against_hf_config(args, args.hf_checkpoint)
    except ConfigMismatchError as e:
        if train_spec(args).model_from_megatron_flags:
            raise SlimeArgumentError(str(e)) from e
        logger.warning("--train-backend %s (model from --hf-checkpoint; Megatron flags unused): %s",
                       args.train_backend, e)


def check_prompt_rows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The head of --prompt-data parses (rows, keys) and, with --apply-chat-template, the tokenizer of
    --hf-checkpoint has a chat template: read from the files, before Ray starts. The whole file is read (and a
    bad row further down reported with its file:line) when the data source loads it, before the engines start.
    The prompt key is checked here only when --input-key is given: with the default ("input") a missing key is
    reported by the data source, as before (flag-only command lines, in tests too, pass files without it)."""
    if args.debug_train_only or not args.rollout_global_dataset or args.prompt_data is None:
        return
    if args.data_source_path != DEFAULT_DATA_SOURCE:
        return  # a data source of its own may read the file differently
    input_key = args.input_key if args.input_key != parser.get_default("input_key") else None
    try:
        check_prompt_file(args.prompt_data, input_key, args.label_key, args.metadata_key, args.tool_key)
    except (ValueError, OSError) as e:
        raise SlimeArgumentError(str(e)) from e
    if args.apply_chat_template and args.hf_checkpoint and chat_template_missing(args.hf_checkpoint):
        raise SlimeArgumentError(no_chat_template_message(f"--hf-checkpoint {args.hf_checkpoint}"))


def check_reward_source(args: argparse.Namespace) -> None:
    """The default rollout scores every sample with --rm-type, --custom-rm-path or the row's metadata rm_type:
    with none of them (in the first rows of --prompt-data) every sample would fail after the engines start."""
    if args.rm_type or args.custom_rm_path or args.debug_train_only or not args.prompt_data:
        return
    if (args.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION or args.custom_generate_function_path
            or args.data_source_path != DEFAULT_DATA_SOURCE or not args.rollout_global_dataset):
        return  # functions or data sources of their own may set the rewards
    head = check_prompt_file(args.prompt_data, None, args.label_key, args.metadata_key, args.tool_key)
    if head is None or any((sample.metadata or {}).get("rm_type") for sample in head):
        return
    raise SlimeArgumentError(
        f"no reward function: set --rm-type (one of {sorted(RM_TYPES)}; e.g. math for answers checked against "
        f"--label-key), --custom-rm-path pkg.module.fn, or give the rows of --prompt-data {args.prompt_data} a "
        f"metadata rm_type (--metadata-key {args.metadata_key})"
    )


def check_checkpoint_to_load(args: argparse.Namespace) -> None:
    """When --load holds a checkpoint (the fsdp critic's under --load/critic too), its latest marker names a
    complete iteration folder: checked before Ray starts (the trainers read the same folder). A folder with
    no marker yet is a fresh run, not an error."""
    if not args.load or args.debug_rollout_only:
        return
    spec = train_spec(args)
    find_checkpoint = CHECKPOINT_FINDERS[spec.checkpoint_format]
    for folder in filter(has_checkpoint, save_folders(args.load, with_critic=spec.has_critic)):
        try:
            find_checkpoint(folder)
        except (ValueError, OSError) as e:
            raise SlimeArgumentError(str(e)) from e


def parse_command_line(
    argv: list[str], add_custom_arguments: CustomArguments | None = None
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """(parser, args) for a command line, parsed but not validated: the three flag families sorted, unknown
    flags and ill-typed values refused. tools/check_launch_script.py reports this step apart from validation."""
    parser = build_parser(add_custom_arguments)
    split = split_argv(parser, list(argv))
    check_unknown_flags(parser, split.unknown)
    args = parser.parse_args(split.known)
    args.sglang_args = split.sglang_args
    args.router_args = split.router_args
    args.megatron_args = split.megatron_args
    args.use_cuda = _cuda_available()
    return parser, args


def parse_args(
    argv: list[str] | None = None, add_custom_arguments: CustomArguments | None = None
) -> argparse.Namespace:
    """Parse and validate a slime command line (default: sys.argv[1:]); raises SlimeArgumentError."""
    parser, args = parse_command_line(sys.argv[1:] if argv is None else argv, add_custom_arguments)
    if args.custom_config_path is not None:
        apply_custom_config(parser, args, args.custom_config_path)
    return validate_args(args, parser)


def parse_model_flags(
    argv: list[str], tool_parser: argparse.ArgumentParser
) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(tool flags, slime flags) from one command line."""
    tool, rest = tool_parser.parse_known_args(argv)
    parser = build_parser()
    split = split_argv(parser, rest)
    check_unknown_flags(parser, split.unknown)
    args = parser.parse_args(split.known)
    args.megatron_args = split.megatron_args
    args.train_backend = "megatron"
    args.use_cuda = _cuda_available()
    if args.rope_kernel == "auto":  # the tools build a model to convert its checkpoint and train nothing
        args.rope_kernel = "torch"
    validate_megatron(args)
    check_model_args(args)
    return tool, args
