"""The Anthropic Messages-shaped adapter (slime's `slime.agent.adapters.anthropic`): `POST /v1/messages` (and
`/v1/messages/count_tokens`, answered with 0: clients use it as a hint only), as Claude Code calls it.

Session id: `Authorization: Bearer <sid>` (Claude Code's `ANTHROPIC_AUTH_TOKEN`), else `X-Api-Key`.
A `system` message in the middle of the list (chat templates accept one only first) is folded into the nearest
user message before it (else after it) as a `<system-reminder>` text block.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import (
    BaseAdapter,
    Reply,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    tool_call_dict,
)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)

REMINDER_OPEN, REMINDER_CLOSE = "<system-reminder>\n", "\n</system-reminder>\n"


class AnthropicAdapter(BaseAdapter):
    logger = logger
    log_prefix = "anthropic_adapter"
    max_token_keys = ("max_tokens",)
    stop_keys = ("stop_sequences",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._run_turn)
        app.router.add_post("/v1/messages/count_tokens", _count_tokens)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return request_session_id(request)

    def _preprocess_body(self, body: dict) -> None:
        fold_mid_list_system(body)

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        return translate_messages(body.get("messages") or [], body.get("system")), tools_to_chat_tools(
            body.get("tools"))

    def _build_reply(self, parsed, raw_finish, translated, tools_schema) -> Reply:
        blocks, stop_reason, stored = build_reply_parts(parsed, raw_finish)
        return Reply(manager_message=stored, finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
                     wire=(blocks, stop_reason))

    async def _respond(self, request, body, reply, in_tok, out_tok, stream) -> web.StreamResponse:
        blocks, stop_reason = reply.wire
        message = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
                   "model": body.get("model", "slime-actor"), "content": blocks, "stop_reason": stop_reason,
                   "stop_sequence": None, "usage": {"input_tokens": in_tok, "output_tokens": out_tok}}
        if stream:
            return await _stream(request, message)
        return web.json_response(message)


def _blocks(content: Any) -> list:
    return content if isinstance(content, list) else [{"type": "text", "text": flatten_content(content)}]


def request_session_id(request: web.Request) -> str:
    """The session id Claude Code sends as its API key: `Authorization: Bearer <sid>`, else `X-Api-Key`."""
    return sid_from_bearer(request) or request.headers.get("X-Api-Key", "").strip() or "default"


def translate_messages(messages: list[dict], system: Any) -> list[dict]:
    """Anthropic messages (+ `system`) as chat-template messages: each tool_result a `tool` message, each user
    text block a `user` message, an assistant's text / thinking / tool_use blocks one assistant message."""
    out: list[dict] = [{"role": "system", "content": flatten_content(system)}] if system else []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "user":
            for b in _blocks(msg.get("content")):
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    out.append({"role": "tool", "content": flatten_content(b.get("content"))})
                elif isinstance(b, dict) and b.get("type") == "text":
                    out.append({"role": "user", "content": b.get("text", "")})
                else:
                    out.append({"role": "user", "content": flatten_content([b])})
        elif role == "assistant":
            texts, thoughts, calls = [], [], []
            for b in _blocks(msg.get("content")):
                if not isinstance(b, dict):
                    continue
                if b.get("type") == "text":
                    texts.append(b.get("text", ""))
                elif b.get("type") == "thinking":
                    thoughts.append(b.get("thinking", ""))
                elif b.get("type") == "tool_use":
                    calls.append(tool_call_dict(b.get("name", "tool"), b.get("input")))
            item: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thoughts:
                item["reasoning_content"] = "".join(thoughts)
            if calls:
                item["tool_calls"] = calls
            out.append(item)
        elif role == "system":
            out.append({"role": "system", "content": flatten_content(msg.get("content"))})
    return out


def tools_to_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    out = [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema") or t.get("parameters") or {"type": "object", "properties": {}}}}
        for t in tools or [] if isinstance(t, dict) and "name" in t]
    return out or None


def build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[list[dict], str, dict]:
    """(content blocks, stop_reason, stored message)."""
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning})
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    for use in parsed.tool_uses:
        blocks.append({"type": "tool_use", "id": f"toolu_{secrets.token_hex(8)}", "name": use["name"],
                       "input": use["input"]})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    stop_reason = "tool_use" if parsed.tool_uses else ("max_tokens" if finish == "length" else "end_turn")
    stored: dict[str, Any] = {"role": "assistant", "content": parsed.text or ""}
    if parsed.reasoning:
        stored["reasoning_content"] = parsed.reasoning
    if parsed.tool_uses:
        stored["tool_calls"] = [tool_call_dict(u["name"], u.get("input")) for u in parsed.tool_uses]
    return blocks, stop_reason, stored


def fold_mid_list_system(body: dict) -> bool:
    """Move every `system` message past the first position into a user message; True when any moved."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return False
    late = [i for i, m in enumerate(msgs) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    if not late:
        return False

    def as_block_list(msg: dict) -> list:
        if not isinstance(msg.get("content"), list):
            msg["content"] = [{"type": "text", "text": msg.get("content") if isinstance(msg.get("content"), str)
                               else ""}]
        return msg["content"]

    def is_user(j: int) -> bool:
        return isinstance(msgs[j], dict) and msgs[j].get("role") == "user"

    drop = set()
    for i in late:
        block = {"type": "text", "text": REMINDER_OPEN + flatten_content(msgs[i].get("content")) + REMINDER_CLOSE}
        before = next((j for j in range(i - 1, -1, -1) if is_user(j)), None)
        after = next((j for j in range(i + 1, len(msgs)) if is_user(j)), None)
        if before is not None:
            as_block_list(msgs[before]).append(block)
            drop.add(i)
        elif after is not None:
            as_block_list(msgs[after]).insert(0, block)
            drop.add(i)
        else:
            msgs[i] = {"role": "user", "content": [block]}
    body["messages"] = [m for i, m in enumerate(msgs) if i not in drop]
    return True


async def _count_tokens(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"input_tokens": 0})


async def _stream(request: web.Request, message: dict) -> web.StreamResponse:
    """The finished message as Messages SSE events: message_start, a start / delta / stop per block,
    message_delta (stop_reason, usage), message_stop."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def event(kind: str, data: dict) -> None:
        await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"
                         .encode())

    usage = message["usage"]
    await event("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                              "usage": {**usage, "output_tokens": 0}}})
    for i, block in enumerate(message["content"]):
        if block["type"] == "thinking":
            start, delta = {"type": "thinking", "thinking": ""}, {"type": "thinking_delta",
                                                                   "thinking": block["thinking"]}
        elif block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        await event("content_block_start", {"index": i, "content_block": start})
        await event("content_block_delta", {"index": i, "delta": delta})
        await event("content_block_stop", {"index": i})
    await event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                  "usage": usage})
    await event("message_stop", {})
    return resp


# slime's names for these (its tests import them)
_request_session_id = request_session_id
_translate_messages = translate_messages
_tools_to_chat_tools = tools_to_chat_tools
_fold_mid_list_system_into_user = fold_mid_list_system
