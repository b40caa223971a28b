"""The OpenAI Chat-Completions-shaped adapter (slime's `slime.agent.adapters.openai`): `POST /v1/chat/completions`,
as the Codex CLI and other OpenAI clients call it. The Responses API (`/v1/responses`) is not served.

Session id: `Authorization: Bearer <sid>` (the client's API key), else `metadata.session_id` / `user` in the body.
What the trajectory stores for a reply is what such clients echo back next turn: arguments as a dict, no call ids,
no reasoning text, only the first tool call, empty content beside a tool call (the wire reply says `content: null`
then, since some clients split a text-plus-call turn in two when echoing it).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import (
    BaseAdapter,
    Reply,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    sid_from_body,
    tool_call_dict,
)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)


class OpenAIAdapter(BaseAdapter):
    logger = logger
    log_prefix = "openai_adapter"
    max_token_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_keys = ("stop",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._run_turn)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return request_session_id(request, body)

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise web.HTTPBadRequest(text="'messages' must be a list of chat messages")
        return translate_messages(messages), tools_to_chat_tools(body.get("tools"))

    def _build_reply(self, parsed, raw_finish, translated, tools_schema) -> Reply:
        wire, stored, wire_finish = build_reply_parts(parsed, raw_finish)
        return Reply(manager_message=stored, finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
                     wire=(wire, wire_finish))

    async def _respond(self, request, body, reply, in_tok, out_tok, stream) -> web.StreamResponse:
        message, finish = reply.wire
        if stream:
            return await _stream(request, body, message, finish, in_tok, out_tok)
        return web.json_response({
            "id": f"chatcmpl_{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "slime-actor"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": _usage(in_tok, out_tok),
        })


def arguments_as_dict(arguments: Any) -> dict:
    """Wire arguments (a JSON string) as a dict; what does not decode to an object is kept as `_raw_arguments`."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        return {"_raw_arguments": str(arguments)}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def request_session_id(request: web.Request, body: dict | None) -> str:
    """`Authorization: Bearer <sid>` (the client's API key), else `metadata.session_id` / `user` in the body."""
    return sid_from_bearer(request) or sid_from_body(body) or "default"


def translate_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat-template messages, in the form the trajectory stored its replies (wire ids
    dropped, arguments dicts), so a replayed history matches it."""
    out: list[dict] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        if role in ("system", "user", "tool"):
            out.append({"role": role, "content": flatten_content(msg.get("content"))})
        elif role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": flatten_content(msg.get("content"))}
            if msg.get("reasoning_content"):
                item["reasoning_content"] = msg["reasoning_content"]
            calls = []
            for call in msg.get("tool_calls") or []:
                if isinstance(call, dict):
                    fn = call.get("function") or {}
                    args = fn.get("arguments") if fn.get("arguments") is not None else call.get("arguments")
                    calls.append(tool_call_dict(fn.get("name") or call.get("name") or "tool",
                                                arguments_as_dict(args)))
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def tools_to_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI tools (nested `function` or flat) as the chat template's function schemas; non-function tools
    are left out."""
    out = []
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if fn.get("name"):
            out.append({"type": "function", "function": {
                "name": fn["name"], "description": fn.get("description", ""),
                "parameters": fn.get("parameters") or {"type": "object", "properties": {}}}})
    return out or None


def build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[dict, dict, str]:
    """(wire message, stored message, wire finish_reason)."""
    wire_calls, stored_calls = [], []
    for use in parsed.tool_uses[:1]:
        args = use.get("input") if isinstance(use.get("input"), dict) else {"_raw_arguments": str(use.get("input"))}
        wire_calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {
            "name": use.get("name", "tool"), "arguments": json.dumps(args, ensure_ascii=False, sort_keys=True)}})
        stored_calls.append(tool_call_dict(use.get("name", "tool"), args))
    wire: dict[str, Any] = {"role": "assistant", "content": None if wire_calls else (parsed.text or None)}
    stored: dict[str, Any] = {"role": "assistant", "content": "" if wire_calls else (parsed.text or "")}
    if parsed.reasoning:
        wire["reasoning_content"] = parsed.reasoning
    if wire_calls:
        wire["tool_calls"], stored["tool_calls"] = wire_calls, stored_calls
    wire_finish = "tool_calls" if parsed.tool_uses else ("length" if finish == "length" else "stop")
    return wire, stored, wire_finish


def _usage(in_tok: int, out_tok: int) -> dict:
    return {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok}


async def _stream(request, body, message: dict, finish: str, in_tok: int, out_tok: int) -> web.StreamResponse:
    """The finished turn as Chat-Completions SSE chunks: role, reasoning, content, all tool calls in one chunk
    (clients merge per-index argument fragments across chunks), the finish with usage, `[DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    head = {"id": f"chatcmpl_{secrets.token_hex(12)}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.get("model", "slime-actor")}

    async def send(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> None:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        if usage:
            chunk["usage"] = usage
        await resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    await send({"role": "assistant"})
    if message.get("reasoning_content"):
        await send({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        await send({"content": message["content"]})
    if message.get("tool_calls"):
        await send({"tool_calls": [{**c, "index": i} for i, c in enumerate(message["tool_calls"])]})
    await send({}, finish, _usage(in_tok, out_tok))
    await resp.write(b"data: [DONE]\n\n")
    return resp


# slime's names for these (its tests import them)
_request_session_id = request_session_id
_translate_messages = translate_messages
_tools_to_chat_tools = tools_to_chat_tools
