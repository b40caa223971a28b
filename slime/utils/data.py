"""Prompt datasets: JSONL (or parquet, when pyarrow is installed) rows -> `Sample`s (slime's `slime.utils.data`).

Each row gives the prompt under `prompt_key` (`--input-key`; a string or a list of chat messages), the label under
`label_key`, optional metadata (a dict, or a JSON string of one) under `metadata_key`, and optional tools
(a list, or a JSON string of one) under `tool_key`. With `apply_chat_template` the prompt is rendered to a
string by the tokenizer's chat template (a plain string becomes a single user message); without it the
prompt is kept as given. With `multimodal_keys` ({"image": "images", ...}) the prompt becomes chat messages whose
`<image>` / `<video>` / `<audio>` placeholders take the row's media in order (`processing_utils.
build_multimodal_messages`); with a `processor`, the media are read for it into `Sample.multimodal_inputs`.
Prompts longer than `max_length` tokens are dropped with a logged count (`filter_long_prompt`: text through the
tokenizer in batches, prompts with media one by one through the processor, so image tokens count; the order is
kept); a file that leaves no prompt at all is an error saying why (no rows, or the limit and the shortest
prompt's length). `check_prompt_file` parses the head of a file without a tokenizer, for `parse_args` to report
bad rows early.

`PATH@[start:end]` takes a Python slice of the file's rows (blank lines are not rows) before anything
else happens to them. A JSONL file is first indexed by the byte offsets of its rows (8 bytes a row); rows
are then read back by offset, so only the selected rows are parsed.

- `read_file(path)` yields the rows (dicts) of a file, slice applied; `_parse_generalized_path` is slime's name
  for `parse_prompt_path`.
- `Dataset(path, tokenizer, processor, max_length, *, prompt_key, ...)` (slime's signature) builds every
  `Sample` up front, optionally in `num_workers` processes (each loads the tokenizer / processor once from its
  `name_or_path`); the result does not depend on the number of workers.
- `StreamingDataset` (`--streaming-data`, JSONL only) keeps just the offsets and builds samples when they
  are read; its shuffle permutes windows of `STREAMING_WINDOW` rows and the rows within each window.
- `process_rollout_data` is slime's train-side step that makes the batch-wide lists of a data-parallel rank's
  payload line up with its own samples.

Simplifications: parquet files are read whole; tools found in a row are also kept in `metadata["tools"]`
so custom generate functions can use them; the `Sample.tokens` are left empty (the generate function
tokenises the prompt); unlike slime, a malformed JSONL line is an error naming file:line, not skipped.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import random
import re
from array import array
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from slime.utils.processing_utils import build_multimodal_messages, load_processor, process_vision_info
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_TOKENIZE_CHUNK = 1024
STREAMING_WINDOW = 10_000

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>[^:\]]*):(?P<stop>[^:\]]*)\]$")


def parse_prompt_path(value: str, flag: str = "--prompt-data") -> tuple[str, slice | None]:
    """`data.jsonl@[start:end]` -> ("data.jsonl", slice(start, end)); a plain path -> (path, None)."""
    if "@[" not in value or os.path.exists(value):
        return value, None
    match = _SLICE.match(value)
    try:
        bounds = [int(x) if x.strip() else None for x in (match["start"], match["stop"])] if match else None
    except ValueError:
        bounds = None
    if bounds is None:
        raise ValueError(
            f"{flag} {value}: malformed row slice; write PATH@[start:end] with optional integers "
            "(negative ones count from the end), e.g. data.jsonl@[0:1000] or data.jsonl@[-200:]"
        )
    return match["path"], slice(*bounds)


def _parse_generalized_path(value: str) -> tuple[str, slice | None]:
    """slime's name for `parse_prompt_path`: `path@[start:end]` -> (path, slice(start, end))."""
    return parse_prompt_path(value)


# --- reading rows ----------------------------------------------------------------------------------------
# A row travels as (loc, raw): raw is the line's bytes (JSONL) or a dict (parquet); loc is (path, offset)
# for JSONL, turned into "path:line" only when an error needs it, or the "path:row i" string for parquet.


def index_lines(path: str) -> array:
    """Byte offsets of the non-blank lines of `path`."""
    offsets = array("q")
    pos = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return offsets


def _line_number(path: str, offset: int) -> int:
    count, left = 1, offset
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count


def _where(loc) -> str:
    return loc if isinstance(loc, str) else f"{loc[0]}:{_line_number(*loc)}"


class _JsonlRows:
    """The rows of a JSONL file (or a slice of them), held as byte offsets: 8 bytes a row."""

    def __init__(self, path: str, rows: slice | None):
        self.path = path
        self.offsets = index_lines(path)
        if rows is not None:
            self.offsets = self.offsets[rows]

    def __len__(self) -> int:
        return len(self.offsets)

    def items(self, positions: Iterable[int]) -> list[tuple[Any, Any]]:
        out = []
        with open(self.path, "rb") as f:
            for i in positions:
                f.seek(self.offsets[i])
                out.append(((self.path, self.offsets[i]), f.readline()))
        return out


class _ParquetRows:
    def __init__(self, path: str, rows: slice | None):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert to JSONL") from e
        table = pq.read_table(path).to_pylist()
        numbers = range(1, len(table) + 1)
        self.rows = list(zip((f"{path}:row {i}" for i in numbers), table))
        if rows is not None:
            self.rows = self.rows[rows]

    def __len__(self) -> int:
        return len(self.rows)

    def items(self, positions: Iterable[int]) -> list[tuple[Any, Any]]:
        return [self.rows[i] for i in positions]


def _open_rows(path: str, rows: slice | None, flag: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path}: file not found")
    return _ParquetRows(path, rows) if path.endswith(".parquet") else _JsonlRows(path, rows)


def read_file(path: str, flag: str = "--prompt-data"):
    """Yield the rows (dicts) of a JSONL or parquet file, `path@[start:end]` taking a Python slice of them
    (negative bounds count from the end). A malformed line raises ValueError naming file:line."""
    rows = _open_rows(*parse_prompt_path(path, flag), flag)
    for start in range(0, len(rows), _TOKENIZE_CHUNK):
        for loc, raw in rows.items(range(start, min(start + _TOKENIZE_CHUNK, len(rows)))):
            try:
                yield _parse(raw)
            except _RowError as e:
                raise ValueError(f"{_where(loc)}: {e}") from None


# --- rows -> samples ------------------------------------------------------------------------------------


class _RowError(ValueError):
    """A problem with one row; the caller prefixes its file:line."""


@dataclass(frozen=True)
class RowFormat:
    """How a row becomes a `Sample` (the key and template flags, and the length limit)."""

    input_key: str | None  # None: the prompt is not read (a check of the other keys only)
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None
    apply_chat_template: bool = False
    template_kwargs: dict | None = None
    max_prompt_len: int | None = None
    multimodal_keys: dict | None = None  # media type -> row key (--multimodal-keys)


def _parse(raw) -> dict:
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _RowError(
                f"malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object: fix or delete "
                "this line"
            ) from None
        if not isinstance(raw, dict):
            raise _RowError(f"expected a JSON object per line, got {type(raw).__name__}")
    return raw


def _require(row: dict, key: str, flag: str) -> Any:
    if key not in row:
        raise _RowError(f"missing key '{key}' ({flag} {key}); keys present: {sorted(row)}: set {flag} to the key "
                        "that holds it, or fix the row")
    return row[key]


def _maybe_json(value: Any, expected: type, what: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _RowError(f"{what} is a string that is not valid JSON") from None
    if value is not None and not isinstance(value, expected):
        raise _RowError(f"{what} must be a {expected.__name__}, got {type(value).__name__}")
    return value


def _to_sample(raw, fmt: RowFormat, tokenizer, processor=None) -> Sample:
    row = _parse(raw)
    prompt = _require(row, fmt.input_key, "--input-key") if fmt.input_key is not None else ""
    if not isinstance(prompt, (str, list)):
        raise _RowError(
            f"'{fmt.input_key}' must be a string or a list of chat messages, got {type(prompt).__name__}"
        )
    label = _require(row, fmt.label_key, "--label-key") if fmt.label_key else None
    metadata = {}
    if fmt.metadata_key:
        metadata = dict(_maybe_json(row.get(fmt.metadata_key), dict, f"'{fmt.metadata_key}' (--metadata-key)") or {})
    tools = _maybe_json(row.get(fmt.tool_key), list, f"'{fmt.tool_key}' (--tool-key)") if fmt.tool_key else None
    if tools:
        metadata.setdefault("tools", tools)
    if fmt.apply_chat_template or fmt.multimodal_keys:
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if fmt.multimodal_keys:
        try:
            prompt = build_multimodal_messages(prompt, row, fmt.multimodal_keys)
        except ValueError as e:
            raise _RowError(f"'{fmt.input_key}' with --multimodal-keys {json.dumps(fmt.multimodal_keys)}: {e}") from None
    media = process_vision_info(prompt, processor) if processor is not None else None
    if fmt.apply_chat_template:
        try:
            prompt = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, tools=tools or None, **(fmt.template_kwargs or {})
            )
        except Exception as e:
            raise _RowError(f"chat template failed: {type(e).__name__}: {e}") from e
    return Sample(prompt=prompt, label=label, metadata=metadata, multimodal_inputs=media)


def _has_media(sample: Sample) -> bool:
    return bool(sample.multimodal_inputs) and any(v is not None for v in sample.multimodal_inputs.values())


def _prompt_lengths(samples: list[Sample], tokenizer, processor=None, template_kwargs: dict | None = None) -> list[int]:
    """Token length of each prompt: text prompts through the tokenizer in batches; with a processor, prompts
    carrying media one at a time through it, with their media (image tokens count)."""
    texts = [
        s.prompt
        if isinstance(s.prompt, str)
        # messages kept as-is (no --apply-chat-template): measure them the way a model would see them
        else tokenizer.apply_chat_template(s.prompt, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
        for s in samples
    ]
    lengths: list[int | None] = [None] * len(samples)
    text_only = [i for i, s in enumerate(samples) if processor is None or not _has_media(s)]
    for start in range(0, len(text_only), _TOKENIZE_CHUNK):
        chunk = text_only[start : start + _TOKENIZE_CHUNK]
        ids = tokenizer([texts[i] for i in chunk], add_special_tokens=False)["input_ids"]
        for i, x in zip(chunk, ids, strict=True):
            lengths[i] = len(x)
    for i, s in enumerate(samples):
        if lengths[i] is None:
            media = {k: v for k, v in s.multimodal_inputs.items() if v is not None}
            lengths[i] = len(processor(text=texts[i], **media)["input_ids"][0])
    return lengths


def _split_by_length(samples: list[Sample], lengths: list[int], max_length: int) -> tuple[list[Sample], list[int]]:
    """(the samples within `max_length`, in order; the lengths of those over it)."""
    kept = [s for s, n in zip(samples, lengths) if n <= max_length]
    return kept, [n for n in lengths if n > max_length]


def filter_long_prompt(origin_samples: list[Sample], tokenizer, processor, max_length: int | None) -> list[Sample]:
    """The samples whose prompt is at most `max_length` tokens, in their order (slime's signature); all of them
    when `max_length` is None. Chat-message prompts are measured through the tokenizer's chat template."""
    if max_length is None or not origin_samples:
        return origin_samples
    kept, too_long = _split_by_length(origin_samples, _prompt_lengths(origin_samples, tokenizer, processor), max_length)
    logger.info("filter_long_prompt: dropped %d of %d prompts longer than %d tokens",
                len(too_long), len(origin_samples), max_length)  # fmt: skip
    return kept


def build_samples(items: list[tuple[Any, Any]], fmt: RowFormat, tokenizer,
                  processor=None) -> tuple[list[Sample], int, int | None]:  # fmt: skip
    """The samples of `items` ((loc, raw) rows) in order, minus prompts over the limit; that count; and the
    token length of the shortest prompt dropped (None when none was)."""
    samples = []
    for loc, raw in items:
        try:
            samples.append(_to_sample(raw, fmt, tokenizer, processor))
        except _RowError as e:
            raise ValueError(f"{_where(loc)}: {e}") from e.__cause__
    if fmt.max_prompt_len is None or tokenizer is None:
        return samples, 0, None
    lengths = _prompt_lengths(samples, tokenizer, processor, fmt.template_kwargs)
    kept, too_long = _split_by_length(samples, lengths, fmt.max_prompt_len)
    return kept, len(too_long), min(too_long, default=None)


_worker_tokenizer = None
_worker_processor = None


def _init_worker(tokenizer_path: str | None, processor_path: str | None = None) -> None:
    global _worker_tokenizer, _worker_processor
    if tokenizer_path:
        from transformers import AutoTokenizer

        _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=True)
    if processor_path:
        _worker_processor = load_processor(processor_path, trust_remote_code=True)


def _build_in_worker(items, fmt: RowFormat):
    return build_samples(items, fmt, _worker_tokenizer, _worker_processor)


def _load_path(obj, what: str, num_workers: int) -> str | None:
    """Where a worker process loads `obj` (a tokenizer or processor) from: its name_or_path."""
    if obj is None:
        return None
    path = getattr(obj, "name_or_path", None) or getattr(getattr(obj, "tokenizer", None), "name_or_path", None)
    if not path:
        raise ValueError(f"--num-data-workers {num_workers}: the {what} has no name_or_path for the workers to "
                         f"load it from; load it with from_pretrained(path) or use --num-data-workers 1")  # fmt: skip
    return path


def _build_all(rows, fmt: RowFormat, tokenizer, processor, num_workers: int) -> tuple[list[Sample], int, int | None]:
    """Every row of `rows` as samples, in chunks; with `num_workers` > 1 the chunks go to spawned worker
    processes and come back in order. Spawn, not fork: the caller may be a threaded Ray actor. Each worker
    starts by importing transformers and loading the tokenizer (seconds), so workers pay off on big files."""
    n = len(rows)
    size = _TOKENIZE_CHUNK if num_workers <= 1 else max(1, min(_TOKENIZE_CHUNK, math.ceil(n / (4 * num_workers))))
    chunks = (range(start, min(start + size, n)) for start in range(0, n, size))
    samples: list[Sample] = []
    dropped = 0
    shortest: int | None = None

    def collect(result):
        nonlocal dropped, shortest
        samples.extend(result[0])
        dropped += result[1]
        if result[2] is not None:
            shortest = result[2] if shortest is None else min(shortest, result[2])

    if num_workers <= 1 or n == 0:
        for chunk in chunks:
            collect(build_samples(rows.items(chunk), fmt, tokenizer, processor))
        return samples, dropped, shortest

    paths = (_load_path(tokenizer, "tokenizer", num_workers), _load_path(processor, "processor", num_workers))
    pool = ProcessPoolExecutor(
        num_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=paths,
    )
    try:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.submit(_build_in_worker, rows.items(chunk), fmt))
            if len(pending) >= 2 * num_workers:  # bounded read-ahead: raw rows are not all held at once
                collect(pending.popleft().result())
        while pending:
            collect(pending.popleft().result())
    except BrokenProcessPool as e:
        raise RuntimeError(
            f"--num-data-workers {num_workers}: a worker process died ({e}). Workers are spawned, which re-imports "
            "the main module: run from a script file (not stdin) with its entry point under "
            "`if __name__ == '__main__':`, or use --num-data-workers 1."
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return samples, dropped, shortest


def _row_format(tokenizer, max_prompt_len, input_key, label_key, metadata_key, tool_key, apply_chat_template,
                apply_chat_template_kwargs, multimodal_keys=None) -> RowFormat:  # fmt: skip
    if apply_chat_template and tokenizer is None:
        raise ValueError("--apply-chat-template needs a tokenizer (--hf-checkpoint)")
    if apply_chat_template and hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        raise ValueError(no_chat_template_message(getattr(tokenizer, "name_or_path", None) or "the tokenizer"))
    if isinstance(apply_chat_template_kwargs, str):
        apply_chat_template_kwargs = json.loads(apply_chat_template_kwargs)
    if isinstance(multimodal_keys, str):
        multimodal_keys = json.loads(multimodal_keys)
    return RowFormat(input_key, label_key, metadata_key, tool_key, apply_chat_template,
                     dict(apply_chat_template_kwargs or {}), max_prompt_len, multimodal_keys or None)  # fmt: skip


def no_chat_template_message(where: str) -> str:
    return (
        f"--apply-chat-template: the tokenizer of {where} has no chat template (no chat_template in "
        "tokenizer_config.json, no chat_template.jinja); drop --apply-chat-template to use the prompts as given, "
        "or use a tokenizer that has one (e.g. copy chat_template.jinja from the instruct model)"
    )


def chat_template_missing(model_dir: str) -> bool:
    """True when the HF folder `model_dir` has tokenizer files but no chat template in any of the places
    transformers reads one from (checked without loading the tokenizer)."""
    config = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False  # no tokenizer files to judge by: the tokenizer load reports what is wrong
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return False
    if os.path.isdir(os.path.join(model_dir, "additional_chat_templates")):
        return False
    try:
        with open(config) as f:
            return not json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return False


_LENGTH_FLAG = "--rollout-max-prompt-len"


def _no_prompts_message(flag: str, path: str, rows: int, dropped: int, shortest: int | None, max_prompt_len,
                        length_flag: str = _LENGTH_FLAG) -> str:  # fmt: skip
    if rows == 0:
        if "@[" in path and not os.path.exists(path):
            return f"{flag} {path}: no prompts left: the row slice selects no rows of the file; widen or drop the slice"
        return (f"{flag} {path}: no prompts left: the file has no rows (blank lines are not rows); give a JSONL file "
                "with one JSON object per line")  # fmt: skip
    context = " (and --rollout-max-context-len)" if length_flag == _LENGTH_FLAG else ""
    return (
        f"{flag} {path}: no prompts left: all {dropped} prompts are longer than {length_flag}="
        f"{max_prompt_len} tokens (the shortest has {shortest}); raise {length_flag}{context} to at least "
        f"{shortest}, or shorten the prompts"
    )


PREFLIGHT_ROWS = 100


def check_prompt_file(value: str, input_key: str | None, label_key: str | None = None, metadata_key: str | None = None,
                      tool_key: str | None = None, flag: str = "--prompt-data",
                      limit: int = PREFLIGHT_ROWS) -> list[Sample] | None:
    """Parse the first `limit` rows of a JSONL prompt file (no tokenizer, no template, no length filter) so
    that an empty file, a malformed line near the top or a wrong key fails before anything is started; returns
    those rows' samples. `input_key` None skips the prompt-key check. Raises ValueError naming `file:line`
    (parquet: not read, None returned)."""
    path, rows = parse_prompt_path(value, flag)
    if path.endswith(".parquet"):
        return None
    if rows is None:  # read only the head of the file: it may be huge
        items, pos = [], 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    items.append(((path, pos), line))
                    if len(items) >= limit:
                        break
                pos += len(line)
        total = len(items)
    else:
        selected = _JsonlRows(path, rows)
        total = len(selected)
        items = selected.items(range(min(limit, total)))
    if total == 0:
        raise ValueError(_no_prompts_message(flag, value, 0, 0, None, None))
    return build_samples(items, RowFormat(input_key, label_key, metadata_key, tool_key), None)[0]


def _log_dropped(where: str, dropped: int, total: int, max_prompt_len, length_flag: str = _LENGTH_FLAG) -> None:
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than %s=%d tokens",
                       where, dropped, total, length_flag, max_prompt_len)  # fmt: skip


# --- datasets -------------------------------------------------------------------------------------------


class Dataset:
    """Samples from a prompt file, in file order until `shuffle(epoch)` is called (slime's signature:
    `Dataset(path, tokenizer, processor, max_length, *, prompt_key=..., ...)`).

    `samples` is the current order, `origin_samples` the file order, `epoch_id` the epoch last shuffled for
    (-1: none). `dropped` counts the prompts over `max_length`. `flag` / `length_flag` (ours) name the flags
    that gave `path` / `max_length` in errors and logs (the eval rollout: its dataset, `--eval-max-prompt-len`).
    """

    def __init__(
        self,
        path: str,
        tokenizer,
        processor=None,
        max_length: int | None = None,
        *,
        prompt_key: str = "text",
        multimodal_keys: dict | str | None = None,
        label_key: str | None = None,
        tool_key: str | None = None,
        metadata_key: str | None = "metadata",
        seed: int = 42,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict | str | None = None,
        num_workers: int = 1,
        flag: str = "--prompt-data",
        length_flag: str = _LENGTH_FLAG,
    ):
        fmt = _row_format(tokenizer, max_length, prompt_key, label_key, metadata_key, tool_key,
                          apply_chat_template, apply_chat_template_kwargs, multimodal_keys)  # fmt: skip
        self.path = path
        self.seed = seed
        self.epoch_id = -1
        rows = _open_rows(*parse_prompt_path(path, flag), flag)
        samples, dropped, shortest = _build_all(rows, fmt, tokenizer, processor, num_workers)
        if not samples:
            raise ValueError(_no_prompts_message(flag, path, len(rows), dropped, shortest, max_length, length_flag))
        _log_dropped(path, dropped, len(rows), max_length, length_flag)
        self.dropped = dropped
        self.origin_samples = samples
        self.samples = list(samples)

    def shuffle(self, new_epoch_id: int) -> None:
        """Reorder deterministically from (seed + epoch), independent of earlier shuffles (the order slime's
        `random.seed(seed + epoch); random.shuffle(...)` gives); a repeat call for the same epoch is a no-op."""
        if new_epoch_id == self.epoch_id:
            return
        order = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]
        self.epoch_id = new_epoch_id

    def read(self, start: int, stop: int) -> list[Sample]:
        """Samples at positions [start, stop) of the current order."""
        return self.samples[start:stop]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]


class StreamingDataset:
    """A JSONL prompt file read on access: only the rows' byte offsets are held (8 bytes a row).

    `len()` counts rows *before* the length filter (prompts over `max_length` are dropped when read,
    so `read` may return fewer samples than positions). `shuffle(epoch)` permutes, from
    (seed, epoch), the order of the windows of `window` consecutive rows (a short last window stays last)
    and the rows within each window, computed one window at a time, so memory stays flat.
    """

    def __init__(
        self,
        path: str,
        tokenizer,
        processor=None,
        max_length: int | None = None,
        *,
        prompt_key: str = "text",
        multimodal_keys: dict | str | None = None,
        label_key: str | None = None,
        tool_key: str | None = None,
        metadata_key: str | None = "metadata",
        seed: int = 42,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict | str | None = None,
        window: int = STREAMING_WINDOW,
        flag: str = "--prompt-data",
    ):
        self.fmt = _row_format(tokenizer, max_length, prompt_key, label_key, metadata_key, tool_key,
                               apply_chat_template, apply_chat_template_kwargs, multimodal_keys)  # fmt: skip
        real_path, rows = parse_prompt_path(path, flag)
        if real_path.endswith(".parquet"):
            raise ValueError(f"{flag} {path}: --streaming-data reads JSONL line by line; convert the parquet file "
                             "to JSONL or drop --streaming-data")  # fmt: skip
        self.path, self.tokenizer, self.processor, self.seed, self.window = path, tokenizer, processor, seed, window
        self.rows = _open_rows(real_path, rows, flag)
        if len(self.rows) == 0:
            raise ValueError(_no_prompts_message(flag, path, 0, 0, None, max_length))
        self.epoch: int | None = None  # None: file order
        self._window_order: list[int] = []
        self._cached: tuple[int, list[int]] | None = None
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.rows)

    def shuffle(self, epoch: int) -> None:
        self.epoch = epoch
        full, rest = divmod(len(self.rows), self.window)
        windows = list(range(full))
        random.Random(f"{self.seed}:{epoch}").shuffle(windows)
        self._window_order = windows + [full] * (rest > 0)  # a short last window stays last: positions map simply
        self._cached = None

    def _row_at(self, position: int) -> int:
        if self.epoch is None:
            return position
        k, within = divmod(position, self.window)
        w = self._window_order[k]
        if self._cached is None or self._cached[0] != w:
            order = list(range(w * self.window, min((w + 1) * self.window, len(self.rows))))
            random.Random(f"{self.seed}:{self.epoch}:{w}").shuffle(order)
            self._cached = (w, order)
        return self._cached[1][within]

    def read(self, start: int, stop: int) -> list[Sample]:
        """Samples (templated and length-filtered now) at positions [start, stop) of the current order."""
        items = self.rows.items(self._row_at(i) for i in range(start, min(stop, len(self.rows))))
        samples, dropped, _ = build_samples(items, self.fmt, self.tokenizer, self.processor)
        if dropped:
            if not self.dropped:
                logger.warning("%s: prompts longer than --rollout-max-prompt-len=%d tokens are skipped as they are "
                               "read (running count in StreamingDataset.dropped)", self.path, self.fmt.max_prompt_len)
            self.dropped += dropped
        return samples


# --- the train side ---------------------------------------------------------------------------------------


def process_rollout_data(args, rollout_data_ref, dp_rank: int, dp_size: int) -> dict:
    """The payload of data-parallel rank `dp_rank` (slime's train-side step), made consistent with its samples.

    `rollout_data_ref[dp_rank].inner` is the Ray object ref of a dict (or, in one process, the dict itself) whose
    per-sample lists hold this rank's samples and whose `partition` lists their positions in the whole batch.
    `total_lengths` arrives for the whole batch and is cut down to this rank's samples; `raw_reward` stays
    whole (pass-rate metrics group the full batch by prompt) and `local_raw_reward` is added: this rank's
    rewards, aligned with its other lists. `args` is unused (slime's signature). Simplification: slime also
    records the whole batch's lengths for its FLOPs timer; nothing here reads them.
    """
    import ray  # Ray is needed only where this runs (a training actor); the data module stays light without it

    if len(rollout_data_ref) != dp_size:
        raise ValueError(f"process_rollout_data: {len(rollout_data_ref)} payloads for dp_size={dp_size}; "
                         "pass one per data-parallel rank")  # fmt: skip
    inner = rollout_data_ref[dp_rank].inner
    rollout_data = ray.get(inner) if isinstance(inner, ray.ObjectRef) else dict(inner)
    partition = rollout_data["partition"]
    rollout_data["total_lengths"] = [rollout_data["total_lengths"][i] for i in partition]
    if "raw_reward" in rollout_data:
        rollout_data["local_raw_reward"] = [rollout_data["raw_reward"][i] for i in partition]
    return rollout_data


def num_rollout_of_epochs(args, dataset_size: int) -> int:
    """The rollout count of --num-epoch epochs over `dataset_size` prompts: whole rollouts of --rollout-batch-size
    per epoch (the training loop resolves an unset --num-rollout with it; the `--dry-run` planner counts with it)."""
    return dataset_size // args.rollout_batch_size * (args.num_epoch or 1)
