"""Bearer-token authentication of the `hf` engine's HTTP API, with SGLang 0.5.16's `--api-key` semantics.

With a key, every request needs `Authorization: Bearer <key>` (the scheme case-insensitive, the key compared in
constant time), except `OPTIONS` and paths starting with `/health` or `/metrics` (liveness probes and scrapers
carry no secret; this opens `/health_generate` too, as in SGLang). Unknown paths are refused like known ones, so
a probe learns nothing about which routes exist. A refused request answers 401 before any handler runs: nothing
changes in the engine. SGLang's answer body is `{"error": "Unauthorized"}`; ours also says how to fix it.

Simplified: SGLang's second key (`--admin-api-key`, for its admin-only endpoints) has no counterpart here.
"""

from __future__ import annotations

import json
import secrets

API_KEY_ENV = "SLIME_ENGINE_API_KEY"  # the server's --api-key default: a key there stays out of `ps`
OPEN_PREFIXES = ("/health", "/metrics")
UNAUTHORIZED = ("Unauthorized: this engine requires an API key (it was started with --api-key; slime: "
                "--engine-api-key). Send the header 'Authorization: Bearer <key>': slime's plugins read the key as "
                "args.engine_api_key, and slime.utils.http_utils post/get add the header by themselves for the "
                "job's engines and router.")


def is_open(method: str, path: str) -> bool:
    """True for what SGLang serves without a key: OPTIONS, and /health* and /metrics* paths."""
    return method == "OPTIONS" or path.startswith(OPEN_PREFIXES)


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """`Authorization: Bearer <api_key>` exactly (the scheme in any case), compared in constant time."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


class APIKeyMiddleware:
    """Pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would hide client disconnects from the
    /generate handler, which aborts a request whose client went away)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        if bearer_matches(authorization, self.api_key):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": UNAUTHORIZED}, "message": UNAUTHORIZED, "success": False}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
