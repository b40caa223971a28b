"""Split one decoded model output into reasoning, visible text and tool calls (slime's `slime.agent.parsing`).

The model-family formats are SGLang's: with `reasoning_parser_name` / `tool_parser_name` set, SGLang's
`ReasoningParser` / `FunctionCallParser` do the work (they need the full `sglang` install, which imports `openai`;
without it the call fails naming what to install). Without a tool parser, or when it finds nothing, the
`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>` XML form (which coding-agent models
still emit) is recognised for the tools the request declared. Without a reasoning parser the text is not split.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ParsedModelOutput:
    """One output, parsed: `tool_uses` are `{"name": str, "input": dict}`; `ill_formed` when a call's arguments
    were not valid JSON (kept as `{"_raw_arguments": text}`)."""

    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]] = field(default_factory=list)
    ill_formed: bool = False


def require_sglang_parsers():
    """SGLang's reasoning and function-call parser modules, or an ImportError saying what is missing."""
    try:
        from sglang.srt.entrypoints.openai import protocol
        from sglang.srt.function_call import function_call_parser
        from sglang.srt.parser import reasoning_parser
    except ImportError as e:
        raise ImportError(
            f"--sglang-tool-call-parser / --sglang-reasoning-parser need SGLang's parsers, which failed to import "
            f"({e}); install the full sglang package (`pip install sglang`, which brings `openai`), or leave the "
            f"parser flags unset to use the XML tool-call fallback only"
        ) from e
    return protocol, function_call_parser, reasoning_parser


def split_reasoning(raw_output: str, reasoning_parser_name: str | None) -> tuple[str, str]:
    """(reasoning, body). With no parser the whole output is the body."""
    if not reasoning_parser_name:
        return "", raw_output
    _, _, reasoning_parser = require_sglang_parsers()
    parser = reasoning_parser.ReasoningParser(model_type=reasoning_parser_name, stream_reasoning=False)
    reasoning, body = parser.parse_non_stream(raw_output)
    reasoning, body = reasoning or "", body or ""
    if not reasoning and "</think>" in body:  # a template that opens <think> in the prompt leaves only the close
        reasoning, body = body.split("</think>", 1)
    return reasoning, body


def parse_model_output(
    raw_output: str,
    *,
    tools_schema: list[dict] | None,
    tool_parser_name: str | None,
    reasoning_parser_name: str | None,
) -> ParsedModelOutput:
    reasoning, body = split_reasoning(raw_output, reasoning_parser_name)
    body, tool_uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning, text=(body or "").strip(), tool_uses=tool_uses,
                             ill_formed=ill_formed)


def parse_tool_uses(
    body_text: str, tools_schema: list[dict] | None, tool_parser_name: str | None
) -> tuple[str, list[dict[str, Any]], bool]:
    """(text left after removing the calls, tool uses, ill_formed). Tools are only looked for when the request
    declared some (`tools_schema` in the chat template's `{"type": "function", "function": {...}}` shape)."""
    if not tools_schema:
        return body_text, [], False
    tool_uses: list[dict[str, Any]] = []
    ill_formed = False
    if tool_parser_name:
        protocol, function_call_parser, _ = require_sglang_parsers()
        tools = [protocol.Tool(type="function", function=protocol.Function(**t["function"])) for t in tools_schema]
        parser = function_call_parser.FunctionCallParser(tools=tools, tool_call_parser=tool_parser_name)
        if parser.has_tool_call(body_text):
            try:
                body_text, calls = parser.parse_non_stream(body_text)
            except Exception:  # a malformed call is the model's doing: fall back to the XML form below
                logger.exception("SGLang's %r tool-call parser failed on the model output", tool_parser_name)
                calls = []
            for call in calls:
                try:
                    arguments = json.loads(call.parameters or "{}")
                except json.JSONDecodeError:
                    arguments, ill_formed = {"_raw_arguments": call.parameters}, True
                tool_uses.append({"name": call.name or "tool", "input": arguments})
    if not tool_uses:
        body_text, tool_uses = parse_xml_tool_uses(body_text, tools_schema)
    return body_text, tool_uses, ill_formed


def parse_xml_tool_uses(body_text: str, tools_schema: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """Pull out the XML-form calls of declared tools; a call naming an undeclared tool stays in the text."""
    declared = {t.get("function", {}).get("name") for t in tools_schema}
    uses: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _XML_CALL.finditer(body_text):
        if m.group(1) not in declared:
            continue
        uses.append({"name": m.group(1),
                     "input": {p.group(1): p.group(2).strip() for p in _XML_PARAM.finditer(m.group(2))}})
        kept.append(body_text[pos:m.start()])
        pos = m.end()
    kept.append(body_text[pos:])
    return "".join(kept), uses
