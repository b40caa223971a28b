"""A custom generate for train.py runs of the built-in multi-turn rollout with images
(`--custom-generate-function-path tests.e2e_cpu.plugins.image_tool_loop.generate`, docs/vlm.md).

`slime.rollout.multi_turn.tool_loop` on the sample: every model turn is one token (every token id is a stop id, so
a turn ends with "stop" and the loop goes on) and counts as a tool call, to --max-turns; each tool result is the
text "look again" with a new image, the prompt's first image cropped to its left part (so each observation differs
in size from the prompt's image). A test plugin: the tool does nothing a policy could learn from.
"""

from __future__ import annotations

from slime.rollout.generation import get_processor, sample_images
from slime.rollout.multi_turn import tool_loop


async def generate(args, sample, sampling_params, evaluation=False):
    tokenizer = get_processor(args).tokenizer
    params = dict(sampling_params, stop_token_ids=list(range(len(tokenizer))))
    first = sample_images(sample)[0]

    def call_tool(call):
        width = max(28, first.width // (2 + len(sample_images(sample)) % 2))
        crop = first.crop((0, 0, width, first.height))
        return [{"type": "text", "text": "look again"}, {"type": "image", "image": crop}]

    return await tool_loop(args, sample, params, call_tool=call_tool, parse_call=lambda text: "look")
