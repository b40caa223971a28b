"""search-r1 pattern (`--custom-generate-function-path`, `--custom-rm-path`): the model answers in turns; after
a turn its text goes to a search tool whose passage is appended as environment tokens (loss mask 0, no
log-probs), then the model continues. Requests go straight to the router's `/generate` with the token ids so
far (token in, token out), as slime's search-r1 example does; `GenerateState(args).tokenizer` tokenises.

The "search engine" is a dict in this file (no server): a word of the query picks a passage.
"""

from __future__ import annotations

import re

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_TURNS = 2
PASSAGES = {str(n): f"after {n} comes {n + 1}" for n in range(10)}
_WORD = re.compile(r"[A-Za-z0-9]+")


def search(query: str) -> str:
    for word in _WORD.findall(query):
        if word in PASSAGES:
            return PASSAGES[word]
    return "nothing found"


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = list(state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
    sample.metadata["searches"] = 0
    for turn in range(MAX_TURNS):
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        output = await post(url, {"input_ids": sample.tokens, "sampling_params": dict(sampling_params),
                                  "return_logprob": True})
        pairs = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                      trainable=True, meta_info=output["meta_info"], text=output["text"])
        if turn == 0:
            sample.metadata["answer"] = output["text"]
        if sample.status == Sample.Status.ABORTED or turn + 1 == MAX_TURNS:
            break
        observation = f" {search(output['text'])} "
        ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=ids, trainable=False, text=observation)
        sample.metadata["searches"] += 1
    return sample


async def reward(args, sample: Sample) -> float:
    """1 when the first word of the first answer is the label (the toy task's rule)."""
    words = _WORD.findall(sample.metadata.get("answer", ""))
    return 1.0 if words and words[0].lower() == str(sample.label).lower() else 0.0
