"""The longest prompt of the head of --prompt-data, in tokens, for a plan whose prompt length is not bounded.

Without --rollout-max-prompt-len / --rollout-max-context-len a sample is the response plus a prompt of any length;
estimates that need the whole sample (the hf engine's KV slots grow by doubling, so a prompt of a few tokens can
double them) use the longest of the first `HEAD_ROWS` prompts, turned into tokens as the run does: the data
source's row format (keys, --apply-chat-template with its kwargs and tools), then the default generate's
`prompt_ids` with --hf-checkpoint's tokenizer. A sample of the file, not all of it: the plan says so.

Not measured (None): no tokenizer files in the --hf-checkpoint folder, a parquet file (read whole, too slow for a
plan), a data source of one's own, or any error reading or tokenising (the run reports those itself).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass

from slime.config.arg_groups.data import DEFAULT_DATA_SOURCE
from slime.rollout.generation import get_tokenizer, prompt_ids
from slime.utils.data import RowFormat, build_samples, parse_prompt_path, read_file

logger = logging.getLogger(__name__)

HEAD_ROWS = 100
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class PromptSample:
    longest: int  # tokens of the longest prompt among them
    rows: int  # prompts measured


def measure_prompts(args) -> PromptSample | None:
    """The longest of the first HEAD_ROWS prompts of --prompt-data in tokens (see the module docstring)."""
    if not args.prompt_data or not args.rollout_global_dataset or args.data_source_path != DEFAULT_DATA_SOURCE:
        return None
    path, rows = parse_prompt_path(args.prompt_data, "--prompt-data")
    if path.endswith(".parquet") or not _has_tokenizer(args.hf_checkpoint):
        return None
    try:
        tokenizer = get_tokenizer(args)
        items = list(_head(args.prompt_data, path, rows is not None))
        kwargs = args.apply_chat_template_kwargs
        fmt = RowFormat(args.input_key, None, None, args.tool_key, args.apply_chat_template,
                        json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs or {}))
        samples = build_samples(items, fmt, tokenizer)[0]
        lengths = [len(prompt_ids(args, s.prompt)) for s in samples]
    except Exception as e:  # noqa: BLE001 - a plan without the measurement is still a plan
        logger.info("--dry-run: prompt lengths of %s not measured (%s: %s)", args.prompt_data, type(e).__name__, e)
        return None
    return PromptSample(max(lengths), len(lengths)) if lengths and max(lengths) > 0 else None


def _has_tokenizer(folder: str | None) -> bool:
    """A local folder with tokenizer files (a hub name is not looked up: a plan makes no network calls)."""
    return bool(folder) and any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _head(value: str, path: str, sliced: bool):
    """(where, raw row) of the first HEAD_ROWS rows: read directly from the top of a whole file, through the
    data module's reader for a `path@[start:end]` slice."""
    if sliced:
        yield from ((value, row) for row in itertools.islice(read_file(value), HEAD_ROWS))
        return
    with open(path, "rb") as f:
        lines = (line for line in f if line.strip())
        yield from ((path, line) for line in itertools.islice(lines, HEAD_ROWS))
