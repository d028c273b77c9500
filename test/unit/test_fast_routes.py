"""`server/http/fast_path.py`: well-formed POSTs to the six routes are answered without the
router, exactly as the routes answer them; everything else reaches the routes, which
answer as before; SGLang's API-key middleware, added after, still guards them.

Real FastAPI app with SGLang's CORS middleware and its real `add_api_key_middleware`,
driven through httpx's ASGI transport; the backend records what reaches it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from sglang_kv_migration.server.http import fast_path as fast_routes
from sglang_kv_migration.server.http import routes as http_api
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    TransferRequestKVCacheReqOutput,
)


class Backend:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def call(self, request: Any) -> Any:
        self.calls.append(request)
        return TransferRequestKVCacheReqOutput(
            success=True, transferred_token_size=len(self.calls), path="device"
        )


class CountingRoutes:
    """Wraps the app inside `FastRoutes`: counts the requests that reach the routes."""

    def __init__(self, app: Any) -> None:
        self.app, self.requests = app, 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests += 1
        await self.app(scope, receive, send)


def _app(
    api_key: str | None = None, key_first: bool = False
) -> tuple[FastAPI, Backend, CountingRoutes]:
    from sglang.srt.utils.auth import add_api_key_middleware
    from starlette.middleware import Middleware

    app = FastAPI()
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"])
    if api_key is not None and key_first:  # an app that has its key check already
        add_api_key_middleware(app, api_key=None, admin_api_key=api_key)
    backend = Backend()
    http_api.add_routes(app, lambda: backend)
    app.user_middleware.append(Middleware(CountingRoutes))  # inside FastRoutes
    if api_key is not None and not key_first:  # as SGLang's launch does, after our hook
        add_api_key_middleware(app, api_key=None, admin_api_key=api_key)
    return app, backend, _counter(app)


def _counter(app: FastAPI) -> CountingRoutes:
    stack = app.build_middleware_stack()
    app.middleware_stack = stack
    layer = stack
    while not isinstance(layer, CountingRoutes):
        layer = layer.app
    return layer


def _post(app: FastAPI, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, **kwargs)

    return asyncio.run(go())


def _without_timings(body: bytes) -> dict:
    content = orjson.loads(body)
    content.pop("steps_ms", None)
    return content


def test_a_well_formed_body_is_answered_without_the_routes_as_the_route_answers_it() -> None:
    app, backend, routes = _app()
    fast = _post(app, "/abort_transfer", json={"migration_id": "m1", "receipts": ["r"]})
    assert fast.status_code == 200 and routes.requests == 0
    assert backend.calls == [AbortTransferReqInput(migration_id="m1", receipts=["r"])]
    # The same request through the route (its fast path off): the same reply and request.
    plain = FastAPI()
    plain_backend = Backend()
    for route in http_api.build_router(lambda: plain_backend).routes:
        plain.router.routes.append(route)
    slow = _post(plain, "/abort_transfer", json={"migration_id": "m1", "receipts": ["r"]})
    assert slow.status_code == 200 and plain_backend.calls == backend.calls
    assert _without_timings(fast.content) == _without_timings(slow.content)
    steps = orjson.loads(fast.content)["steps_ms"]
    assert 0 <= steps["parse"] <= steps["route"]  # the trip's own stamps, as the route's


def test_every_route_has_a_fast_handler_and_a_batch_is_served_whole() -> None:
    app, backend, routes = _app()
    router = http_api.build_router(lambda: backend)
    assert set(http_api.fast_handlers(lambda: backend)) == {r.path for r in router.routes}
    # The fast path validates with the model the route declares for its body.
    for route in router.routes:
        if route.path != http_api.TRANSFER_PATH:
            declared = [p.field_info.annotation for p in route.dependant.body_params]
            model = http_api._BODY_ROUTES[route.path][0]
            assert declared == ([model] if model else []), route.path
    assert _post(app, "/get_transfer_session_info").status_code == 200
    moves = [
        {
            "input_ids": [1, 2, 3],
            "matched_token_size": 0,
            "extra_token_size": 3,
            "migration_id": f"m{i}",
            "target_per_rank": [
                {
                    "tp": 0,
                    "pp": 0,
                    "path": "device",
                    "kv_indices": [7, 8, 9],
                    "fingerprint": {},
                    "device_kv_digest": "ab" * 32,
                }
            ],
        }
        for i in range(2)
    ]
    reply = _post(app, "/transfer_request_kvcache", json={"moves": moves})
    assert reply.status_code == 200, reply.text
    assert len(orjson.loads(reply.content)["moves"]) == 2
    assert routes.requests == 0 and len(backend.calls) == 3


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"json": {"receipts": []}}, 400, "migration_id: Field required"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400,
         "JSON decode error"),
        ({"content": b"", "headers": {"content-type": "application/json"}}, 400, "body"),
        ({"content": b'{"migration_id": "m"}', "headers": {"content-type": "text/plain"}},
         400, ""),
        ({"json": None}, 400, ""),
    ],
)  # fmt: skip
def test_anything_the_route_refuses_reaches_the_route_with_its_body(
    kwargs: dict, status: int, message: str
) -> None:
    app, backend, routes = _app()
    reply = _post(app, "/abort_transfer", **kwargs)
    assert reply.status_code == status and message in reply.json()["message"]
    assert routes.requests == 1 and backend.calls == []


def test_cross_origin_replies_carry_cors_headers_and_other_methods_go_to_the_app() -> None:
    app, backend, routes = _app()
    reply = _post(
        app, "/abort_transfer", json={"migration_id": "m"}, headers={"origin": "http://x"}
    )
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
    assert routes.requests == 0 and len(backend.calls) == 1  # the fast path, inside CORS
    assert (
        _post(app, "/abort_transfer", json={}, headers={"origin": "http://x"}).headers[
            "access-control-allow-origin"
        ]
        == "*"
    )  # and the route's 400, as before
    assert routes.requests == 1

    async def get() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/abort_transfer")).status_code

    assert asyncio.run(get()) == 405 and routes.requests == 2


def test_a_body_over_the_limit_is_refused_by_the_route_unread(monkeypatch) -> None:
    monkeypatch.setattr(http_api, "MAX_BODY_BYTES", 64)
    app, backend, routes = _app()
    reply = _post(app, "/abort_transfer", json={"migration_id": "m" * 100})
    assert reply.status_code == 413 and routes.requests == 1 and backend.calls == []


@pytest.mark.parametrize("key_first", [False, True], ids=["key-added-after", "key-added-before"])
def test_the_api_key_middleware_guards_the_fast_path_whenever_it_was_added(key_first) -> None:
    app, backend, routes = _app(api_key="admin-secret", key_first=key_first)
    refused = _post(app, "/abort_transfer", json={"migration_id": "m"})
    assert refused.status_code == 401 and backend.calls == []
    ok = _post(
        app,
        "/abort_transfer",
        json={"migration_id": "m"},
        headers={"authorization": "Bearer admin-secret"},
    )
    assert ok.status_code == 200 and len(backend.calls) == 1 and routes.requests == 0


def test_a_client_gone_before_its_body_arrived_gets_nothing_and_nothing_runs() -> None:
    backend = Backend()
    reached: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        reached.append(scope)

    middleware = fast_routes.FastRoutes(
        app, http_api.fast_handlers(lambda: backend), 1 << 20, on_start=lambda _t: None
    )
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/abort_transfer",
        "root_path": "",
        "headers": [(b"content-length", b"10")],
    }
    asyncio.run(middleware(scope, receive, send))
    assert sent == [] and reached == [] and backend.calls == []
