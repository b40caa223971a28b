"""retool pattern, as an eval dataset's own generate and reward functions (`custom_generate_function_path` /
`custom_rm_path` of an `--eval-config` dataset, slime's eval_multi_task example): one model turn, then a
"code interpreter" result (the number after the last number the model wrote) appended as tool tokens, then a
last model turn of two tokens (`generate` continues a sample from all its tokens; `max_new_tokens` counts the
response so far). Takes `evaluation` (slime passes it when the
signature has it); the tool calls are counted on the sample as a plain attribute, as slime's strands example
does, and read back by the reward.
"""

from __future__ import annotations

import re

from slime.rollout.sglang_rollout import GenerateState, generate as model_turn
from slime.utils.types import Sample

from tests.e2e_cpu.plugins.record import record

_NUMBER = re.compile(r"\d+")


def interpreter(text: str) -> str:
    numbers = _NUMBER.findall(text)
    return f" result {int(numbers[-1]) + 1} " if numbers else " result none "


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    state = GenerateState(args)
    sample = await model_turn(args, sample, dict(sampling_params))
    sample.tool_calls = 0
    if sample.status != Sample.Status.ABORTED:
        ids = state.tokenizer(interpreter(sample.response), add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=ids, trainable=False, text=interpreter(sample.response))
        sample.tool_calls = 1
        sample.status = Sample.Status.PENDING  # `generate` continues from the tokens the sample has
        params = dict(sampling_params)
        params["max_new_tokens"] = sample.response_length + 2  # two more model tokens after the tool's
        sample = await model_turn(args, sample, params)
    record("retool_generate", evaluation=evaluation, index=sample.index, tool_calls=sample.tool_calls)
    return sample


async def reward(args, sample: Sample) -> float:
    """0.1 for having used the tool, 1.0 when the final answer names the label."""
    if str(sample.label) in _NUMBER.findall(sample.response.split("result")[-1]):
        return 1.0
    return 0.1 if getattr(sample, "tool_calls", 0) else 0.0
