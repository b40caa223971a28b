"""Prompt datasets: JSONL (or parquet, when pyarrow is installed) rows -> `Sample`s.

Each row gives the prompt under `input_key` (a string or a list of chat messages), the label under
`label_key`, optional metadata (a dict, or a JSON string of one) under `metadata_key`, and optional tools
(a list, or a JSON string of one) under `tool_key`. With `apply_chat_template` the prompt is rendered to a
string by the tokenizer's chat template (a plain string becomes a single user message); without it the
prompt is kept as given. Prompts longer than `max_prompt_len` tokens are dropped with a logged count.

Simplifications: the whole file is read into memory; tools found in a row are also kept in
`metadata["tools"]` so custom generate functions can use them; the `Sample.tokens` are left empty
(the generate function tokenises the prompt).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_TOKENIZE_CHUNK = 1024


def _read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """Yield (where, row) with `where` = "path:line" (1-based) for error messages."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--prompt-data {path}: file not found")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert to JSONL"
            ) from e
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {i}", row
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            yield where, row


def _require(row: dict, key: str, flag: str, where: str) -> Any:
    if key not in row:
        raise ValueError(f"{where}: missing key '{key}' ({flag} {key}); keys present: {sorted(row)}")
    return row[key]


def _maybe_json(value: Any, expected: type, what: str, where: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: {what} is a string that is not valid JSON") from None
    if value is not None and not isinstance(value, expected):
        raise ValueError(f"{where}: {what} must be a {expected.__name__}, got {type(value).__name__}")
    return value


class Dataset:
    """Samples from a prompt file, in file order until `shuffle(epoch)` is called."""

    def __init__(
        self,
        path: str,
        tokenizer,
        max_prompt_len: int | None,
        input_key: str,
        label_key: str | None,
        metadata_key: str | None = None,
        tool_key: str | None = None,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict | str | None = None,
        seed: int = 42,
    ):
        if apply_chat_template and tokenizer is None:
            raise ValueError("--apply-chat-template needs a tokenizer (--hf-checkpoint)")
        if isinstance(apply_chat_template_kwargs, str):
            apply_chat_template_kwargs = json.loads(apply_chat_template_kwargs)
        self.path = path
        self.seed = seed
        template_kwargs = dict(apply_chat_template_kwargs or {})

        samples: list[Sample] = []
        for where, row in _read_rows(path):
            prompt = _require(row, input_key, "--input-key", where)
            if not isinstance(prompt, (str, list)):
                raise ValueError(
                    f"{where}: '{input_key}' must be a string or a list of chat messages, got {type(prompt).__name__}"
                )
            label = _require(row, label_key, "--label-key", where) if label_key else None
            metadata = (
                _maybe_json(row.get(metadata_key), dict, f"'{metadata_key}' (--metadata-key)", where)
                if metadata_key
                else None
            )
            metadata = dict(metadata or {})
            tools = _maybe_json(row.get(tool_key), list, f"'{tool_key}' (--tool-key)", where) if tool_key else None
            if tools:
                metadata.setdefault("tools", tools)
            if apply_chat_template:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                try:
                    prompt = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=True, tools=tools or None, **template_kwargs
                    )
                except Exception as e:
                    raise ValueError(f"{where}: chat template failed: {type(e).__name__}: {e}") from e
            samples.append(Sample(prompt=prompt, label=label, metadata=metadata))

        if max_prompt_len is not None and tokenizer is not None:
            samples = self._drop_long(samples, tokenizer, max_prompt_len, template_kwargs)
        self.origin_samples = samples
        self.samples = list(samples)

    def _drop_long(self, samples: list[Sample], tokenizer, max_prompt_len: int, template_kwargs: dict) -> list[Sample]:
        texts = []
        for s in samples:
            if isinstance(s.prompt, str):
                texts.append(s.prompt)
            else:
                # messages kept as-is (no --apply-chat-template): measure them the way a model would see them
                texts.append(
                    tokenizer.apply_chat_template(
                        s.prompt, tokenize=False, add_generation_prompt=True, **template_kwargs
                    )
                )
        lengths: list[int] = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            ids = tokenizer(texts[start : start + _TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
            lengths.extend(len(x) for x in ids)
        kept = [s for s, n in zip(samples, lengths) if n <= max_prompt_len]
        dropped = len(samples) - len(kept)
        if dropped:
            logger.warning(
                "%s: dropped %d of %d prompts longer than --rollout-max-prompt-len=%d tokens",
                self.path,
                dropped,
                len(samples),
                max_prompt_len,
            )
        return kept

    def shuffle(self, epoch: int) -> None:
        """Reorder deterministically from (seed + epoch), independent of earlier shuffles."""
        order = list(range(len(self.origin_samples)))
        random.Random(self.seed + epoch).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]
