"""Data: prompts, how many rollouts, and the batch sizes that tie generation to training steps.

The batch identity (checked here, with the numbers and the nearest valid sizes in the error):
    rollout_batch_size × n_samples_per_prompt == global_batch_size × num_steps_per_rollout
Give one of --global-batch-size / --num-steps-per-rollout and the other is derived; give neither and each
rollout is one training step (global batch = all samples of the rollout). Simplification: the training-side
divisibility check reads Megatron's TP/PP/CP sizes from the raw `args.megatron_args` tokens.
"""

from __future__ import annotations

import argparse
import json
import logging

from slime.algorithm.estimators import ESTIMATORS, estimator_of
from slime.config.arg_groups._common import (
    SlimeArgumentError,
    fail,
    json_object,
    refuse,
    require_existing_file,
    require_positive,
)
from slime.utils.backend_specs import engine_spec, train_spec
from slime.utils.checkpoint_layout import has_checkpoint
from slime.utils.data import parse_prompt_path
from slime.utils.mask_utils import LOSS_MASK_TYPES

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"

FUNCTION_FLAGS = ("data_source_path",)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "Prompt data, run length and batch sizes.")
    g.add_argument(
        "--num-rollout",
        type=int,
        default=None,
        help="Rollouts to run (if unset: --num-epoch × dataset size ÷ --rollout-batch-size, once the data is read).",
    )
    g.add_argument("--num-epoch", type=int, default=None, help="Epochs over the prompts (ignored with --num-rollout).")
    g.add_argument(
        "--disable-rollout-global-dataset",
        action="store_true",
        help="Do not load --prompt-data into the data source (a custom rollout function brings its own prompts).",
    )
    g.add_argument(
        "--data-source-path",
        type=str,
        default=DEFAULT_DATA_SOURCE,
        help="Class handing out prompt groups (and holding the partial-rollout buffer).",
    )
    g.add_argument(
        "--prompt-data",
        type=str,
        default=None,
        help="Prompt file: JSONL (or parquet). PATH@[start:end] keeps a Python slice of its rows, taken before "
        "filtering and shuffling (e.g. train.jsonl@[:1000], train.jsonl@[-200:]).",
    )
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="Render prompts (strings or messages) with the chat template.",
    )
    g.add_argument(
        "--apply-chat-template-kwargs",
        type=json_object,
        default={},
        help="Extra keyword arguments of apply_chat_template, as JSON (e.g. '{\"enable_thinking\": false}').",
    )
    g.add_argument("--input-key", type=str, default="input", help="Prompt key of each record.")
    g.add_argument("--label-key", type=str, default=None, help="Label key of each record.")
    g.add_argument("--metadata-key", type=str, default="metadata", help="Metadata key of each record.")
    g.add_argument("--tool-key", type=str, default="tools", help="Key of the tool specs passed to the chat template.")
    g.add_argument(
        "--loss-mask-type", choices=list(LOSS_MASK_TYPES), default="qwen",
        help="How slime.rollout.sft_rollout marks the trained tokens of a conversation (slime.utils.mask_utils): "
        "qwen (each message rendered alone), qwen3 (each next to a probe user turn, keeping its think block), "
        "qwen3_5 (character spans of the assistant turns), distill_qwen (the last message's content only); "
        "docs/sft.md.",
    )
    g.add_argument(
        "--multimodal-keys",
        type=json_object,
        default=None,
        help='slime: media type -> record key, as JSON (e.g. \'{"image": "images"}\'): each <image> in the prompt '
        "takes the row's next image (path, base64 or data URI), read with --hf-checkpoint's processor. Images "
        "only, with --rollout-backend hf and either trainer (megatron: a Qwen2.5-VL, without sequence / context "
        "parallelism; docs/vlm.md); refused otherwise.",
    )
    g.add_argument(
        "--streaming-data",
        action="store_true",
        help="Read --prompt-data (JSONL) lazily: hold only each row's byte offset (8 bytes a row) and template / "
        "length-filter prompts as they are handed out; --rollout-shuffle then shuffles windows of 10,000 rows.",
    )
    g.add_argument(
        "--num-data-workers",
        type=int,
        default=1,
        help="Processes that parse, chat-template and length-filter --prompt-data when it is loaded whole "
        "(same prompts in the same order as 1; not used with --streaming-data).",
    )
    g.add_argument(
        "--start-rollout-id",
        type=int,
        default=None,
        help="First rollout id (default: the one after the checkpoint in --load, else 0).",
    )
    g.add_argument("--rollout-batch-size", type=int, default=None, help="Prompts per rollout (required).")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="Responses generated per prompt (group size).")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (default: rollout batch × n ÷ --num-steps-per-rollout).",
    )
    g.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=None,
        help="Optimizer steps per rollout (default: rollout batch × n ÷ --global-batch-size, else 1).",
    )
    g.add_argument(
        "--balance-data", action="store_true",
        help="Within each optimizer step, give the data-parallel ranks equal numbers of samples with close token "
        "counts (longest first, to the rank with the fewest tokens) instead of contiguous shares.",
    )
    g.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="Pack micro-batches up to --max-tokens-per-gpu instead of --micro-batch-size samples.",
    )
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Token budget of a packed micro-batch.")
    g.add_argument(
        "--log-probs-max-tokens-per-gpu",
        type=int,
        default=None,
        help="Token budget when only computing log-probs (default: --max-tokens-per-gpu).",
    )


def validate_data(args: argparse.Namespace) -> None:
    if args.multimodal_keys:
        engine = engine_spec(args)
        if not engine.takes_images:
            refuse("multimodal_keys", json.dumps(args.multimodal_keys),
                   f"the {engine.name} engines are not sent the images here (the image_data path is built for the "
                   "engines this run launches)", "use --rollout-backend sglang or hf (docs/vlm.md)")
        if train_spec(args).megatron_parallelism and args.context_parallel_size > 1:
            refuse("multimodal_keys", json.dumps(args.multimodal_keys),
                   "the Megatron vision-language model places the image features into the embeddings of the whole "
                   "sequence, which --context-parallel-size > 1 splits across ranks before the model sees it",
                   "drop --context-parallel-size with images (--sequence-parallel is supported)")
        if args.advantage_estimator in ESTIMATORS and estimator_of(args).needs_critic:
            refuse("multimodal_keys", json.dumps(args.multimodal_keys),
                   f"--advantage-estimator {args.advantage_estimator} trains a critic, a text-only value model",
                   "use a critic-free estimator (grpo, gspo, reinforce_plus_plus, ...) with images")
        unknown = sorted(set(args.multimodal_keys) - {"image"})
        if unknown:
            refuse("multimodal_keys", json.dumps(args.multimodal_keys), f"media types {unknown}: images only",
                   'map only "image" to the rows\' key, e.g. \'{"image": "images"}\'')
    if args.rollout_batch_size is None:
        fail("--rollout-batch-size is required: the number of prompts per rollout, e.g. --rollout-batch-size 32.")
    require_positive(
        args,
        "rollout_batch_size",
        "n_samples_per_prompt",
        "global_batch_size",
        "num_steps_per_rollout",
        "num_rollout",
        "num_epoch",
        "num_data_workers",
        "max_tokens_per_gpu",
        "log_probs_max_tokens_per_gpu",
    )
    args.rollout_global_dataset = not args.disable_rollout_global_dataset

    if args.num_rollout is None and args.num_epoch is None:
        fail("Neither --num-rollout nor --num-epoch is set; give one (e.g. --num-rollout 100).")
    if args.num_rollout is not None and args.num_epoch is not None:
        logger.info("Both --num-rollout and --num-epoch are set; --num-epoch is ignored.")
    if args.num_rollout is None and not args.rollout_global_dataset:
        fail(f"--num-epoch {args.num_epoch} counts epochs of --prompt-data, which --disable-rollout-global-dataset "
             "does not load; give --num-rollout instead (slime's rule).")
    # With only --num-epoch, num_rollout stays None: the data source resolves it once it knows the dataset size
    # (slime's count: --num-epoch × dataset size // --rollout-batch-size).

    if args.start_rollout_id is not None and args.start_rollout_id < 0:
        fail(f"--start-rollout-id {args.start_rollout_id}: must be >= 0.")
    if args.start_rollout_id is None and not has_checkpoint(args.load):
        args.start_rollout_id = 0  # slime: a fresh run starts at 0; a resumed one where its checkpoint says

    needs_prompts = (
        args.rollout_global_dataset and args.data_source_path == DEFAULT_DATA_SOURCE and not args.debug_train_only
    )
    if needs_prompts and args.prompt_data is None:
        fail(
            "--prompt-data is required by the default data source: a JSONL file of prompts "
            "(or pass --disable-rollout-global-dataset / --data-source-path for a source of your own)."
        )
    # --debug-train-only still reads --prompt-data (an engine-free rollout such as slime.rollout.sft_rollout)
    # unless the samples come from a dump
    if args.prompt_data is not None and not (args.debug_train_only and args.load_debug_rollout_data):
        check_prompt_data(args)

    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            fail("--use-dynamic-batch-size needs --max-tokens-per-gpu N (the token budget of a micro-batch).")
        if args.log_probs_max_tokens_per_gpu is None:
            args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu

    resolve_batch_identity(args)  # its split over data-parallel ranks: check_training_divisibility (Megatron's check)


def check_prompt_data(args: argparse.Namespace) -> None:
    """--prompt-data PATH[@[start:end]] names an existing file; --streaming-data needs it to be JSONL."""
    try:
        path, _ = parse_prompt_path(args.prompt_data, "--prompt-data")
    except ValueError as e:
        fail(str(e))
    require_existing_file("prompt_data", path)
    if args.streaming_data and path.endswith(".parquet"):
        fail(f"--streaming-data reads JSONL line by line, but --prompt-data {args.prompt_data} is parquet: "
             "convert it to JSONL or drop --streaming-data.")  # fmt: skip
    if args.streaming_data and args.num_data_workers > 1:
        logger.info("--num-data-workers %d is not used with --streaming-data: prompts are built as they are read.",
                    args.num_data_workers)  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: float, candidates: list[int]) -> list[int]:
    below = [c for c in candidates if c < value]
    above = [c for c in candidates if c > value]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _steps(k: int) -> str:
    return f"{k} step{'s' if k != 1 else ''} per rollout"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def resolve_batch_identity(args: argparse.Namespace) -> None:
    """Derive the missing one of global_batch_size / num_steps_per_rollout, or check that the two agree."""
    rbs, n = args.rollout_batch_size, args.n_samples_per_prompt
    gbs, steps = args.global_batch_size, args.num_steps_per_rollout
    total = rbs * n
    head = f"--rollout-batch-size {rbs} × --n-samples-per-prompt {n} = {total} samples per rollout"
    identity = "rollout_batch_size × n_samples_per_prompt must equal global_batch_size × num_steps_per_rollout"

    if gbs is None and steps is None:
        gbs, steps = total, 1
    elif gbs is None:
        if total % steps != 0:
            near = " or ".join(f"{s} (--global-batch-size {total // s})" for s in _nearest(steps, _divisors(total)))
            fail(
                f"{head}, which cannot be split into --num-steps-per-rollout {steps} equal steps "
                f"(global_batch_size would be {_fmt(total / steps)}). Nearest valid --num-steps-per-rollout: "
                f"{near} ({identity})."
            )
        gbs = total // steps
    elif steps is None:
        if total % gbs != 0:
            near = " or ".join(
                f"{c} ({_steps(total // c)})" for c in _nearest(gbs, _valid_global_batch_sizes(args, total))
            )
            fail(
                f"{head}, which --global-batch-size {gbs} does not divide (num_steps_per_rollout would be "
                f"{_fmt(total / gbs)}). Nearest valid --global-batch-size: {near} ({identity}; "
                "or give --num-steps-per-rollout instead and the global batch size follows)."
            )
        steps = total // gbs
    elif gbs * steps != total:
        if total % gbs == 0:
            hint = f", e.g. --global-batch-size {gbs} with --num-steps-per-rollout {total // gbs}"
        elif total % steps == 0:
            hint = f", e.g. --num-steps-per-rollout {steps} with --global-batch-size {total // steps}"
        else:
            hint = ""
        fail(
            f"{head}, but --global-batch-size {gbs} × --num-steps-per-rollout {steps} = {gbs * steps} "
            f"({identity}). Give only one of the two and the other is derived{hint}."
        )
    args.global_batch_size, args.num_steps_per_rollout = gbs, steps


def data_parallel_size(args: argparse.Namespace) -> tuple[int, str]:
    """Data-parallel world size of the actor, and a phrase explaining it (for error messages)."""
    ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    how = (
        f"{ranks} actor ranks = --actor-num-nodes {args.actor_num_nodes} × "
        f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node}"
    )
    if not train_spec(args).megatron_parallelism:
        return ranks, how
    # the parsed values (not the command line's tokens): a --megatron-config-path role's copy overrides them
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if ranks % (tp * pp * cp) != 0:
        fail(
            f"{how}, which TP {tp} × PP {pp} × CP {cp} = {tp * pp * cp} does not divide; make the rank count a "
            "multiple of the model-parallel size."
        )
    return ranks // (tp * pp * cp), f"{how}, ÷ (TP {tp} × PP {pp} × CP {cp})"


def _step_unit(args: argparse.Namespace) -> int:
    dp, _ = data_parallel_size(args)
    return dp if args.use_dynamic_batch_size else dp * args.micro_batch_size


def _valid_global_batch_sizes(args: argparse.Namespace, total: int) -> list[int]:
    """Divisors of the rollout's sample count; those that also split evenly over the ranks first."""
    divisors = _divisors(total)
    if args.debug_rollout_only:
        return divisors
    try:
        unit = _step_unit(args)
    except SlimeArgumentError:  # a bad parallel layout is reported by its own check right after
        return divisors
    fitting = [d for d in divisors if d % unit == 0]
    return fitting or divisors


def check_training_divisibility(args: argparse.Namespace) -> None:
    """The global batch must split evenly over data-parallel ranks (and into micro-batches per rank)."""
    dp, how = data_parallel_size(args)
    gbs, total = args.global_batch_size, args.rollout_batch_size * args.n_samples_per_prompt
    unit = _step_unit(args)
    if gbs % unit == 0:
        return
    what = f"data-parallel size {dp}" + (
        "" if args.use_dynamic_batch_size else f" × --micro-batch-size {args.micro_batch_size} = {unit}"
    )
    valid = [d for d in _divisors(total) if d % unit == 0]
    if valid:
        fix = "Nearest valid --global-batch-size: " + " or ".join(
            f"{c} ({_steps(total // c)})" for c in _nearest(gbs, valid)
        )
    else:
        fix = (
            f"No global batch size divides the {total} samples per rollout and splits over {unit}: change "
            "--rollout-batch-size / --n-samples-per-prompt or the number of actor ranks"
        )
    fail(f"--global-batch-size {gbs} is not divisible by the {what} ({how}). {fix}.")
