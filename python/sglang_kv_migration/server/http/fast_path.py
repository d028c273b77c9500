"""Our six routes without Starlette's routing and FastAPI's request machinery, for
well-formed requests.

A migration is one to four HTTP trips, each a few hundred bytes to a few MB of JSON.
Starlette's router and FastAPI's request handling (dependency solving, its body parse
and validation, response classes) cost a trip ~0.25 ms when it runs cold between other
work (a server answers a migration now and then, not in a hot loop): on the order of a
whole page's copy (`benchmark/probes/probe_http_trip.py`). This ASGI middleware answers a
POST to one of the six paths itself when its body is JSON the route accepts, with the route's own
request builder, dispatch and reply (`http_api.fast_handlers`). Anything else goes on
to the router untouched, the body replayed: a body the route refuses (its 400 names
the field), any other method, an app mounted under a root path, a body with no length
or over the limit (413).

It is the innermost of the app's middleware (`add_innermost`), whatever is added
before or after it: SGLang's API-key middleware checks every request before it (reading
the auth level of our routes, which stay in the app's route list), CORS adds its
headers to its replies, and SGLang's metrics middleware counts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import orjson

Handler = Callable[[Any], Coroutine[Any, Any, Any]]  # payload -> Response, or None


def add_innermost(app: Any, **options: Any) -> None:
    """Add `FastRoutes` to a Starlette/FastAPI `app` inside every middleware it has or
    will have (Starlette's `add_middleware` puts each new one outermost)."""
    from starlette.middleware import Middleware

    if app.middleware_stack is not None:
        raise RuntimeError("cannot add middleware after the application has started")
    app.user_middleware.append(Middleware(FastRoutes, **options))


class FastRoutes:
    def __init__(
        self,
        app: Any,
        handlers: Mapping[str, Handler],
        max_body_bytes: int,
        on_start: Callable[[float], Any],
    ):
        self.app = app
        self.handlers = dict(handlers)
        self.max_body_bytes = max_body_bytes
        self.on_start = on_start  # told when a route begins (its reply's `parse`/`route`)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = self._handler(scope)
        if handler is None:
            return await self.app(scope, receive, send)
        self.on_start(time.monotonic())
        body, disconnected = await _read_body(receive)
        if disconnected:
            return None  # nobody to answer
        response = None
        payload = _json_or_none(body)
        if payload is not None or not body:
            response = await handler(payload)
        if response is None:  # the route answers it, from the same bytes
            return await self.app(scope, _replay(body, receive), send)
        return await response(scope, receive, send)

    def _handler(self, scope: dict[str, Any]) -> Handler | None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("root_path"):
            return None
        handler = self.handlers.get(scope.get("path", ""))
        if handler is None:
            return None
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                length = value
            elif name == b"content-type" and not _is_json(value):
                return None  # FastAPI reads such a body as bytes (and refuses it)
        if length is None or not length.isdigit() or int(length) > self.max_body_bytes:
            return None
        return handler


def _is_json(content_type: bytes) -> bool:
    """FastAPI's test for a JSON body: application/json or application/*+json."""
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )


async def _read_body(receive: Any) -> tuple[bytes, bool]:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _json_or_none(body: bytes) -> Any:
    """The body as JSON, or None for what orjson refuses (the route parses it again)."""
    if not body:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that gives the body already read, then whatever comes next."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
