"""Search-R1 custom generate function (`--custom-generate-function-path examples/search-r1/generate.py`).

The episode, as in Search-R1 (Jin et al., 2025): the model reasons and either writes
`<search> query </search>` or `<answer> ... </answer>`. A turn stops at `</search>` or `</answer>`; after a
search the top passages of the retrieval server come back inline as
`<information>Doc 1(Title: ...) text ...</information>` (loss mask 0) and the model continues the same
assistant message. The episode ends with an answer, an end-of-turn token, a turn cut by its token limit,
--max-turns model turns (default 3 here when the flag is unset), or the --rollout-max-context-len budget
(a result that does not fit ends the episode as TRUNCATED). `metadata` gets `turns` (model turns),
`search_calls` (information blocks appended) and `retrieved_passages` (passages the server returned).

Environment:
- SEARCH_R1_URL: the retrieval endpoint (default http://127.0.0.1:8765/retrieve, retrieval_server.py).
- SEARCH_R1_TOPK: passages per search (default 3).
- SEARCH_R1_RETRIEVE_FIRST=1: retrieve with the question before the first model turn (the "RAG" baseline of
  the paper; also what the CPU test uses, since a random-init tiny model never writes a search tag).

Simplifications: tags are matched on the decoded text with optional spaces inside (`< search >`), since
tokenizers decode differently; the information block is appended as plain text (Search-R1 style), not as a
chat-template tool message; a retrieval error is returned to the model as the information text rather than
failing the sample.
"""

from __future__ import annotations

import os
import re

import httpx

from slime.rollout.multi_turn import (
    append_tool_tokens,
    context_left,
    generate_turn,
    turn_budget_left,
)
from slime.rollout.sglang_rollout import get_tokenizer, init_response
from slime.utils.types import Sample

DEFAULT_URL = "http://127.0.0.1:8765/retrieve"
DEFAULT_MAX_TURNS = 3
SEARCH = re.compile(r"<\s*search\s*>(.*?)<\s*/\s*search\s*>", re.DOTALL | re.IGNORECASE)
ANSWER = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.DOTALL | re.IGNORECASE)
STOP = ["</search>", "</answer>"]
QUESTION = re.compile(r"Question:\s*(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def retrieval_url() -> str:
    return os.environ.get("SEARCH_R1_URL", DEFAULT_URL)


def last_search(text: str) -> str | None:
    found = SEARCH.findall(text)
    return found[-1].strip() if found else None


def question_of(prompt) -> str:
    text = " ".join(m.get("content", "") for m in prompt if m.get("role") == "user") if isinstance(prompt, list) \
        else str(prompt)
    match = QUESTION.search(text)
    return (match.group(1) if match else text).strip()


def format_passages(passages: list[dict]) -> str:
    docs = [f"Doc {i}(Title: {p.get('title', '')}) {p.get('text', '')}" for i, p in enumerate(passages, 1)]
    return "\n".join(docs) if docs else "No results."


async def search(query: str, topk: int | None = None) -> tuple[str, int]:
    """The information text for `query` and the number of passages retrieved (0 on a retrieval error,
    whose message becomes the text)."""
    topk = topk or int(os.environ.get("SEARCH_R1_TOPK", "3"))
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            reply = await client.post(retrieval_url(), json={"query": query, "topk": topk})
            reply.raise_for_status()
            passages = reply.json()["passages"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return f"Search failed: {type(e).__name__}: {e}", 0
    return format_passages(passages), len(passages)


def _fits(args, sample: Sample, ids: list[int]) -> bool:
    left = context_left(args, sample)
    return left is None or len(ids) < left  # room for the block and one more model token


async def _append_information(args, sample: Sample, tokenizer, query: str) -> bool:
    found, n = await search(query)
    sample.metadata["retrieved_passages"] = sample.metadata.get("retrieved_passages", 0) + n
    text = f"\n\n<information>{found}</information>\n\n"
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not _fits(args, sample, ids):
        sample.status = Sample.Status.TRUNCATED
        return False
    append_tool_tokens(sample, tokenizer, ids)
    return True


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    tokenizer = get_tokenizer(args)
    max_turns = DEFAULT_MAX_TURNS if getattr(args, "max_turns", None) is None else None
    turns = searches = 0
    sample.metadata = dict(sample.metadata or {})
    if os.environ.get("SEARCH_R1_RETRIEVE_FIRST") == "1" and not sample.response_length:
        init_response(args, sample)
        if await _append_information(args, sample, tokenizer, question_of(sample.prompt)):
            searches += 1
    while sample.status != Sample.Status.TRUNCATED and turn_budget_left(args, sample, turns, max_turns):
        text = await generate_turn(args, sample, sampling_params, stop=STOP)
        turns += 1
        if sample.status != Sample.Status.COMPLETED or ANSWER.search(text):
            break
        query = last_search(text)
        if query is None:
            break
        if not turn_budget_left(args, sample, turns, max_turns):
            sample.status = Sample.Status.TRUNCATED
            break
        if not await _append_information(args, sample, tokenizer, query):
            break
        searches += 1
    sample.metadata.update(turns=turns, search_calls=searches)
    return sample
