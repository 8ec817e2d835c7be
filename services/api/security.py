"""What the API refuses before a handler runs: requests without the token, and bodies over the
size limit; and what ``reval serve`` refuses to start with (a weak token)."""

from __future__ import annotations

import hmac
import json
import math
import os
from typing import Annotated, Any

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from reval.config import ApiConfig

DEFAULT_TOKENS = {"", "changeme", "change-me", "token", "secret", "reval"}

_bearer = HTTPBearer(auto_error=False)
Creds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
"""The bearer credentials (module level: FastAPI resolves annotations by name)."""


class Auth:
    """The token check: ``Authorization: Bearer <token>``, the token from the environment
    variable ``api.token_env`` compared in constant time. ``write`` guards every mutating
    endpoint; ``read`` the reads (runs, ``/docs``, ``/openapi.json``) when
    ``api.reads_need_token()`` (``auth_reads``; by default whenever the API binds a
    non-loopback address); ``metrics`` ``/metrics`` when ``api.metrics_need_token()``."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.token = os.environ.get(cfg.token_env, "")

    def check(self, creds: HTTPAuthorizationCredentials | None) -> None:
        env = self.cfg.token_env
        if creds is None or creds.scheme.lower() != "bearer":
            raise HTTPException(401, f"bearer token required: set {env} to the API's "
                                "token (reval runs sends it as Authorization: Bearer)",
                                {"WWW-Authenticate": "Bearer"})  # fmt: skip
        if not self.token or not hmac.compare_digest(
            creds.credentials.encode(), self.token.encode()
        ):
            raise HTTPException(403, f"wrong token: not the {env} this API was started with")

    def write(self, creds: Creds) -> None:
        self.check(creds)

    def read(self, creds: Creds) -> None:
        if self.cfg.reads_need_token():
            self.check(creds)

    def metrics(self, creds: Creds) -> None:
        if self.cfg.metrics_need_token():
            self.check(creds)


class BodyLimit:
    """413 for a body over ``limit`` bytes: by its Content-Length up front, and for a chunked
    body while it streams in (counted as it arrives, never buffered whole)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"detail": f"body over {self.limit} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(send)
            return
        seen = 0
        started = refused = False

        async def counted() -> Any:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Answer 413 now and tell the app the client left (FastAPI would turn an
                    # exception raised here into a 400).
                    if not started:
                        await self._refuse(send)
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: Any) -> None:
            nonlocal started
            if refused:
                return  # the app's own answer after the 413: dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, watched)


MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 30.0
"""A token's length times the Shannon entropy of its own characters must reach this (a measure
of how varied it is, not of how it was made): 16 random hex digits measure 51 bits on average
and never below 32 in 200,000 draws; ``aaaaaaaaaaaaaaaa`` measures 0, ``abababababababab`` 16."""


def token_problem(token: str) -> str | None:
    """What is wrong with an API token (None: nothing): empty or a default, shorter than
    ``MIN_TOKEN_CHARS``, or too little entropy (one character repeated, a short pattern)."""
    if token.strip().lower() in DEFAULT_TOKENS:
        return "is empty or a default"
    if len(token) < MIN_TOKEN_CHARS:
        return f"is shorter than {MIN_TOKEN_CHARS} characters"
    counts = [token.count(c) for c in set(token)]
    bits = sum(n * math.log2(len(token) / n) for n in counts)
    if bits < MIN_TOKEN_BITS:
        return f"has too little entropy ({bits:.0f} bits, at least {MIN_TOKEN_BITS:.0f})"
    return None
