"""What the OpenAI- and Anthropic-shaped adapters share (slime's `slime.agent.adapters.common`).

An adapter is an aiohttp app an agent CLI talks to as if it were the vendor's API. Each request:
wire body -> chat messages + tool schema (subclass `_translate`) -> the served model's chat template -> token ids
-> the engine's `/generate` (through `slime.utils.http_utils.post`, so the job's engine key goes along) -> the
output tokens and their log-probs -> parsed text / reasoning / tool calls -> a wire reply (`_build_reply`,
`_respond`) -> the turn recorded in the shared `TrajectoryManager` under the request's session id.
`finish_session` turns a session into Samples.

A subclass supplies `_register_routes`, `_session_id`, `_translate`, `_build_reply`, `_respond` (and optionally
`_preprocess_body`) plus `log_prefix`, `max_token_keys` (body keys that cap `max_new_tokens`, first found wins)
and `stop_keys`.

Images: a request holding an image block (`image`, `image_url`, `input_image`, also inside a tool result) is
answered 400 naming the block, as a vendor API answers for a model that takes no images: the turn is rendered with
the tokenizer's chat template and recorded as tokens only, so an image could reach neither the engine nor the
trainer (`flatten_content`'s "[image omitted]" is what a direct caller of it gets).

Simplifications: the whole turn is generated before the reply is sent (a streamed reply is the finished turn cut
into SSE events); a failed engine call answers 502 with the engine's error. Each `/generate` carries the session
id as `X-SMG-Routing-Key` (routing_headers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slime.agent.parsing import ParsedModelOutput, parse_model_output, require_sglang_parsers
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.http_utils import HTTPRequestError, post

__all__ = ["BaseAdapter", "Reply", "Session", "TurnRecord", "call_sglang_generate", "flatten_content",
           "manager_finish_reason", "sid_from_bearer", "sid_from_body", "tool_call_dict"]

DEFAULT_MAX_NEW_TOKENS = 4096


@dataclasses.dataclass
class Session:
    """Per-session settings: the rollout's sampling parameters and the context budget (0: none)."""

    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_context_tokens: int = 0


@dataclasses.dataclass
class Reply:
    """`manager_message` is what the trajectory stores (and must equal the client's replay of it next turn);
    `wire` is the subclass's own reply data."""

    manager_message: dict
    finish_reason: str
    wire: Any


def flatten_content(c: Any) -> str:
    """A message's content (a string or a list of OpenAI / Anthropic content blocks) as one string."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        return str(c)
    parts = []
    for block in c:
        if not isinstance(block, dict):
            parts.append(str(block))
        elif block.get("type") in ("text", "input_text", "output_text"):
            parts.append(block.get("text", ""))
        elif block.get("type") in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif "content" in block:  # tool_result and the like
            parts.append(flatten_content(block.get("content")))
        elif "text" in block:
            parts.append(str(block.get("text") or ""))
    return "\n".join(p for p in parts if p)


IMAGE_BLOCK_TYPES = ("image", "image_url", "input_image")


def first_image_block(body: dict) -> tuple[str, str] | None:
    """(where, type) of the first image content block in a request's `system` / `messages` (tool results'
    content included), e.g. ("messages[3].content[0].content[1]", "image"); None without one."""

    def walk(value: Any, where: str) -> tuple[str, str] | None:
        if isinstance(value, list):
            return next((hit for i, v in enumerate(value) if (hit := walk(v, f"{where}[{i}]"))), None)
        if not isinstance(value, dict):
            return None
        if value.get("type") in IMAGE_BLOCK_TYPES:
            return where, str(value["type"])
        return walk(value.get("content"), f"{where}.content")

    return walk(body.get("system"), "system") or walk(body.get("messages"), "messages")


def image_refusal(where: str, kind: str) -> str:
    return (f"{where} is an {kind!r} block: slime.agent's adapters serve text-only chats (a request is rendered "
            "with the served tokenizer's chat template and a session's rows are recorded as tokens without images), "
            "so the image would reach neither the engine nor the trainer; give the agent text-only inputs, or train "
            "with images through a custom generate built on slime.rollout.multi_turn (docs/vlm.md)")


def tool_call_dict(name: str, arguments: dict | None) -> dict:
    """A tool call as stored for the chat template and the trajectory: arguments a dict (the template needs a
    mapping; dict equality ignores key order) and no wire id (fresh on every reply, so it would never match)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments or {}}}


def manager_finish_reason(tool_uses: list[dict], raw_finish: str) -> str:
    return "tool_calls" if tool_uses else (raw_finish or "stop")


def sid_from_bearer(request: web.Request) -> str | None:
    """The session id an agent CLI sends as its API key: `Authorization: Bearer <sid>`."""
    auth = request.headers.get("Authorization", "")
    return (auth[7:].strip() or None) if auth.lower().startswith("bearer ") else None


def routing_headers(session_id: str | None) -> dict[str, str] | None:
    """`X-SMG-Routing-Key: <session id>`, which asks a router that honours it (SGLang's model gateway) to keep a
    session on one engine, so its growing prompt hits that engine's prefix cache; none for the default session."""
    return {"X-SMG-Routing-Key": session_id} if session_id and session_id != "default" else None


def sid_from_body(body: dict | None) -> str | None:
    """The session id in an OpenAI body: `metadata.session_id`, else `user`."""
    if not body:
        return None
    md = body.get("metadata")
    if isinstance(md, dict) and md.get("session_id"):
        return str(md["session_id"])
    return str(body["user"]) if body.get("user") else None


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The served chat template applied to `messages`, with the generation prompt, as token ids."""
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    if not isinstance(out, list):  # a BatchEncoding from recent transformers
        out = out["input_ids"]
    return list(out)


def sampling_params(session: Session, body: dict, max_token_keys: tuple[str, ...],
                    stop_keys: tuple[str, ...]) -> dict:
    """The rollout's sampling parameters, capped by the request's max tokens, its temperature / top_p / top_k and
    stop sequences taken over; special tokens kept so the output decodes to exactly what the model wrote."""
    sp = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
          "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **session.sampling_defaults}
    cap = next((int(body[k]) for k in max_token_keys if body.get(k) is not None), None)
    if cap is not None:
        sp["max_new_tokens"] = min(int(sp["max_new_tokens"]), cap)
    for key in ("temperature", "top_p", "top_k"):
        if key in body:
            sp[key] = body[key]
    stop = next((body[k] for k in stop_keys if body.get(k)), None)
    if stop:
        sp["stop"] = stop
    return sp


async def call_sglang_generate(prompt_ids: list[int], session: Session, body: dict, *, adapter: BaseAdapter,
                               session_id: str | None = None) -> TurnRecord:
    """One `/generate` on the engine (router) for `prompt_ids`; the answer's `output_token_logprobs` give the
    output tokens and their log-probs. A prompt already at the context budget is a finished turn of length 0."""
    sp = sampling_params(session, body, adapter.max_token_keys, adapter.stop_keys)
    if session.max_context_tokens > 0:
        room = session.max_context_tokens - len(prompt_ids)
        if room <= 0:
            adapter.logger.warning("[%s] sid=%s: the prompt (%d tokens) fills max_context_tokens=%d",
                                   adapter.log_prefix, session_id, len(prompt_ids), session.max_context_tokens)
            return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[], finish_reason="length")
        sp["max_new_tokens"] = min(int(sp["max_new_tokens"]), room)
    rid = uuid.uuid4().hex
    payload = {"rid": rid, "input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True}
    try:
        # no retry: a repeated /generate would sample a second, different answer
        out = await post(f"{adapter.sglang_url}/generate", payload, retries=0, headers=routing_headers(session_id))
    except asyncio.CancelledError:
        # the client went away: free the engine's slot instead of letting it generate to its cap
        asyncio.get_running_loop().create_task(_abort(adapter, rid))
        raise
    if not isinstance(out, dict) or "meta_info" not in out:
        raise HTTPRequestError(f"{adapter.sglang_url}/generate", f"{adapter.sglang_url}/generate answered "
                               f"without meta_info: {str(out)[:300]}")
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    finish = (meta.get("finish_reason") or {}).get("type") or "stop"
    return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[int(p[1]) for p in pairs], finish_reason=finish,
                      output_log_probs=[float(p[0]) for p in pairs])


async def _abort(adapter: BaseAdapter, rid: str) -> None:
    try:
        await post(f"{adapter.sglang_url}/abort_request", {"rid": rid}, retries=0, timeout=5)
    except Exception as e:  # noqa: BLE001 - best effort; the request ends at its token cap anyway
        adapter.logger.debug("[%s] abort of %s failed: %s", adapter.log_prefix, rid, e)


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


class BaseAdapter:
    logger: logging.Logger = logging.getLogger(__name__)
    log_prefix = "adapter"
    max_token_keys: tuple[str, ...] = ()
    stop_keys: tuple[str, ...] = ()

    def __init__(self, *, tokenizer, sglang_url: str, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, max_turns_per_sid: int | None = None,
                 fork_threshold_tokens: int | None = None, debug_callback: Callable[..., None] | None = None):
        if tool_parser or reasoning_parser:  # refused at start, not on the agent's first request
            require_sglang_parsers()
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.max_turns_per_sid = max_turns_per_sid
        self.debug_callback = debug_callback
        self.manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
        self.store: dict[str, Session] = {}
        self.inflight: dict[str, set[asyncio.Task]] = {}
        self.closed: set[str] = set()
        self._turns_served: dict[str, int] = {}
        self.app = web.Application(client_max_size=64 * 1024 * 1024)  # agents send long histories
        self.app.router.add_get("/healthz", _ok)
        self.app.router.add_get("/v1/models", _ok)
        self._register_routes(self.app)

    # --- wire hooks --------------------------------------------------------------------------------------------

    def _register_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _session_id(self, request: web.Request, body: dict) -> str:
        raise NotImplementedError

    def _preprocess_body(self, body: dict) -> None:
        pass

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        raise NotImplementedError

    def _build_reply(self, parsed: ParsedModelOutput, raw_finish: str, translated: list[dict],
                     tools_schema: list[dict] | None) -> Reply:
        raise NotImplementedError

    async def _respond(self, request: web.Request, body: dict, reply: Reply, in_tok: int, out_tok: int,
                       stream: bool) -> web.StreamResponse:
        raise NotImplementedError

    # --- sessions ----------------------------------------------------------------------------------------------

    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        if sid in self.store:
            raise ValueError(f"session_id {sid!r} is already open; each agent run needs its own")
        self.store[sid] = Session(dict(sampling_defaults or {}), int(max_context_tokens or 0))

    async def shutdown_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Refuse the session's further requests and wait (then cancel) the ones in flight. They run on the
        adapter's own loop, which may not be the caller's."""
        self.closed.add(sid)
        tasks = [t for t in self.inflight.pop(sid, ()) if not t.done()]
        if not tasks:
            return

        async def drain() -> None:
            _, pending = await asyncio.wait(tasks, timeout=wait_timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(), tasks[0].get_loop()))
        except Exception:
            self.logger.exception("[%s] sid=%s: draining its requests failed", self.log_prefix, sid)

    async def finish_session(self, sid: str, *, base_sample, reward: float = 0.0, extra_metadata: dict | None = None,
                             wait_timeout: float = 5.0) -> list:
        """The session's Samples (`response` decoded from each row's response tokens); [] the second time."""
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        session = self.store.pop(sid, None)
        samples = self.manager.get_trajectory(sid, base_sample=base_sample, reward=reward,
                                              extra_metadata=extra_metadata,
                                              max_sample_tokens=session.max_context_tokens if session else 0)
        for s in samples:
            n = s.response_length
            s.response = self.tokenizer.decode(s.tokens[-n:], skip_special_tokens=False) if n else ""
        return samples

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.store.pop(sid, None)
        self.manager.drop_session(sid)

    # --- one turn ----------------------------------------------------------------------------------------------

    def _over_turn_cap(self, sid: str) -> web.Response | None:
        if self.max_turns_per_sid is None:
            return None
        served = self._turns_served.get(sid, 0)
        if served >= self.max_turns_per_sid:
            msg = f"adapter: session {sid!r} reached max_turns_per_sid={self.max_turns_per_sid}; ending the run"
            self.logger.warning("[%s] %s", self.log_prefix, msg)
            return web.json_response({"error": {"type": "rate_limit_error", "message": msg}}, status=429)
        self._turns_served[sid] = served + 1
        return None

    async def _run_turn(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._preprocess_body(body)
        sid = self._session_id(request, body)
        if sid in self.closed:
            return web.Response(status=503, text=f"session {sid!r} is closed")
        image = first_image_block(body)
        if image is not None:  # refused like a vendor API refuses images for a model that does not take them
            self.logger.warning("[%s] sid=%s: %s", self.log_prefix, sid, image_refusal(*image))
            return web.json_response({"error": {"type": "invalid_request_error", "message": image_refusal(*image)}},
                                     status=400)
        refused = self._over_turn_cap(sid)
        if refused is not None:
            return refused
        session = self.store.setdefault(sid, Session())
        task = asyncio.current_task()
        self.inflight.setdefault(sid, set()).add(task)
        started = time.monotonic()
        try:
            messages, tools = self._translate(body)
            prompt_ids = render_prompt_ids(self.tokenizer, messages, tools)
            try:
                turn = await call_sglang_generate(prompt_ids, session, body, adapter=self, session_id=sid)
            except HTTPRequestError as e:
                self.logger.warning("[%s] sid=%s: %s", self.log_prefix, sid, e)
                return web.json_response({"error": {"type": "api_error", "message": f"engine: {e}"}}, status=502)
            raw = self.tokenizer.decode(turn.output_ids, skip_special_tokens=False) if turn.output_ids else ""
            parsed = parse_model_output(raw, tools_schema=tools, tool_parser_name=self.tool_parser,
                                        reasoning_parser_name=self.reasoning_parser)
            reply = self._build_reply(parsed, turn.finish_reason, messages, tools)
            turn = dataclasses.replace(turn, ill_formed=parsed.ill_formed)
            stream = body.get("stream") is True or "text/event-stream" in request.headers.get("Accept", "")
            # the reply goes out before the turn is recorded: a turn the client never received is not trained on
            try:
                response = await self._respond(request, body, reply, len(prompt_ids), len(turn.output_ids), stream)
            except ConnectionResetError:
                self.logger.warning("[%s] sid=%s: client left after %.1fs; turn not recorded", self.log_prefix, sid,
                                    time.monotonic() - started)
                return web.Response(status=499, text="client disconnected")
            if self.debug_callback is not None:
                try:
                    self.debug_callback(sid, messages, tools, reply.manager_message, turn)
                except Exception:
                    self.logger.exception("[%s] sid=%s: debug_callback failed", self.log_prefix, sid)
            self.manager.record_turn(sid, turn=turn, prompt_messages=messages,
                                     response_message=reply.manager_message, metadata={"sid": sid})
            return response
        finally:
            self.inflight.get(sid, set()).discard(task)
