"""HTTP routes of KV-cache migration, added to SGLang's FastAPI app.

Routes are thin: validate the JSON body (pydantic; malformed input is a 400 naming the
field), call the scheduler through the tokenizer manager's communicators, and map the
reply's `error_kind` to a status code. They carry SGLang's `ADMIN_OPTIONAL` auth level,
so `--api-key` / `--admin-api-key` protect them exactly like `/flush_cache`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from sglang.srt.utils.auth import AuthLevel, auth_level

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, detached
from sglang_kv_migration.server.http import fast_path as fast_routes
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
    GetRequestExtraTokenSizeReqInput,
    GetTransferSessionInfoReqInput,
    TransferRequestKVCacheReqInput,
)
from sglang_kv_migration.wire.bodies import (
    AllocateBody,
    Body,
    CommitBody,
    ExtraTokenSizeBody,
    MigrationIdBody,
    TransferBatchBody,
    TransferBody,
    body_fields,
    describe_errors,
)
from sglang_kv_migration.wire.messages import reply_content

DISABLED_MESSAGE = (
    "KV migration is disabled on this server; start it with "
    "--enable-hierarchical-cache --enable-kv-migration"
)


class MigrationBackend(Protocol):
    """What the routes need: send a request to the scheduler ranks, get the reply."""

    async def call(self, request: Any) -> Any: ...


# --------------------------------------------------------------------------- bodies

# Largest body a route reads (a 1M-token prefix with its page list is ~16 MB of JSON);
# anything larger is refused with 413 before it is read, so it cannot stall the server.
MAX_BODY_BYTES = 32 << 20
# What each body may say: `wire/bodies.py`, shared with the allocate channel.

# --------------------------------------------------------------------------- routes


# The scheduler request each route sends, from its validated body: one builder per
# route, shared by the route and by `fast_routes` (which serves well-formed bodies).


def _session_info_request(_body: None) -> GetTransferSessionInfoReqInput:
    return GetTransferSessionInfoReqInput()


def _extra_size_request(body: ExtraTokenSizeBody) -> GetRequestExtraTokenSizeReqInput:
    return GetRequestExtraTokenSizeReqInput(**body_fields(body))


def _allocate_request(body: AllocateBody) -> AllocateTokenForTransferReqInput:
    # The migration id is minted here once; every rank uses it.
    return AllocateTokenForTransferReqInput(**body_fields(body), migration_id=uuid.uuid4().hex)


def _commit_request(body: CommitBody) -> CommitTransferRequestKVCacheReqInput:
    return CommitTransferRequestKVCacheReqInput(**body_fields(body))


def _abort_request(body: MigrationIdBody) -> AbortTransferReqInput:
    return AbortTransferReqInput(**body_fields(body))


# path -> (body model, or None for a route that reads no body; its request's builder)
_BODY_ROUTES: dict[str, tuple[type[Body] | None, Callable[[Any], Any]]] = {
    "/get_transfer_session_info": (None, _session_info_request),
    "/get_request_extra_token_size": (ExtraTokenSizeBody, _extra_size_request),
    "/allocate_token_for_transfer": (AllocateBody, _allocate_request),
    "/commit": (CommitBody, _commit_request),
    "/abort_transfer": (MigrationIdBody, _abort_request),
}
TRANSFER_PATH = "/transfer_request_kvcache"


async def _dispatch(get_backend: Callable[[], MigrationBackend | None], request: Any) -> Response:
    """Send `request` to the scheduler; its reply as the route's response."""
    backend = get_backend()
    if backend is None:
        return _error(ErrorKind.UNAVAILABLE, DISABLED_MESSAGE)
    parsed = time.monotonic()
    return _reply(await backend.call(request), parsed)


async def _serve_transfer(
    payload: Any, get_backend: Callable[[], MigrationBackend | None]
) -> Response:
    """One transfer, or with `moves` several at once; RequestValidationError (before
    anything is sent) for a body that is neither."""
    if not (isinstance(payload, dict) and "moves" in payload):
        request = _transfer_request(_validated(TransferBody, payload))
        return await _dispatch(get_backend, request)
    batch = _validated(TransferBatchBody, payload)
    backend = get_backend()
    if backend is None:
        return _error(ErrorKind.UNAVAILABLE, DISABLED_MESSAGE)
    parsed = time.monotonic()
    # Sent to the scheduler back to back: it takes them up in one loop iteration.
    outputs = await asyncio.gather(*(backend.call(_transfer_request(m)) for m in batch.moves))
    return _batch_reply(outputs, parsed)


def fast_handlers(
    get_backend: Callable[[], MigrationBackend | None],
) -> dict[str, Callable[[Any], Coroutine[Any, Any, Response | None]]]:
    """Per path, what `fast_routes.FastRoutes` calls with a request's parsed JSON body:
    the route's reply, or None when the body is not one the route accepts (the route
    itself then answers, with its 400 naming the field)."""
    dispatch = functools.partial(_dispatch, get_backend)

    def typed(model: type[Body] | None, build: Callable[[Any], Any]) -> Any:
        async def serve(payload: Any) -> Response | None:
            if model is None:
                return await dispatch(build(None))
            try:
                body = model.model_validate(payload)
            except ValidationError:
                return None
            return await dispatch(build(body))

        return serve

    async def transfer(payload: Any) -> Response | None:
        try:
            return await _serve_transfer(payload, get_backend)
        except RequestValidationError:
            return None

    handlers = {path: typed(model, build) for path, (model, build) in _BODY_ROUTES.items()}
    handlers[TRANSFER_PATH] = transfer
    return handlers


def build_router(get_backend: Callable[[], MigrationBackend | None]) -> APIRouter:
    """The six routes; `get_backend()` returns None when migration is disabled."""
    router = APIRouter(route_class=_BadRequestOnInvalidBody, tags=["kv-migration"])
    dispatch = functools.partial(_dispatch, get_backend)

    # curl -X POST localhost:30000/get_transfer_session_info
    @router.post("/get_transfer_session_info")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def get_transfer_session_info() -> Response:
        """Per rank: transfer session id, host buffers and layout fingerprint."""
        return await dispatch(_session_info_request(None))

    # curl -X POST localhost:30000/get_request_extra_token_size -d '{"input_ids": [1, 2]}'
    @router.post("/get_request_extra_token_size")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def get_request_extra_token_size(body: ExtraTokenSizeBody) -> Response:
        """How much of the page-aligned prefix of input_ids this server holds."""
        return await dispatch(_extra_size_request(body))

    # curl -X POST localhost:30000/allocate_token_for_transfer \
    #   -d '{"input_ids": [...], "source_fingerprints": [...]}'
    @router.post("/allocate_token_for_transfer")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def allocate_token_for_transfer(body: AllocateBody) -> Response:
        """Target: lock the held prefix, reserve slots (host or device path) for the rest."""
        return await dispatch(_allocate_request(body))

    # curl -X POST localhost:30000/transfer_request_kvcache -d '{"input_ids": [...], ...}'
    # curl -X POST localhost:30000/transfer_request_kvcache -d '{"moves": [{...}, {...}]}'
    @router.post(TRANSFER_PATH)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def transfer_request_kvcache(request: Request) -> Response:
        """Source: copy the pages into the target ranks' reserved slots; with `moves`,
        several transfers at once (feature "transfer_batch")."""
        return await _serve_transfer(await _json_body(request), get_backend)

    # curl -X POST localhost:30000/commit -d '{"migration_id": "..."}'
    @router.post("/commit")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def commit(body: CommitBody) -> Response:
        """Target: insert the written pages into the radix cache."""
        return await dispatch(_commit_request(body))

    # curl -X POST localhost:30000/abort_transfer -d '{"migration_id": "..."}'
    @router.post("/abort_transfer")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def abort_transfer(body: MigrationIdBody) -> Response:
        """Target: free a pending allocation now instead of at the watchdog."""
        return await dispatch(_abort_request(body))

    return router


def add_routes_to_sglang_app() -> None:
    """Add the routes to SGLang's own FastAPI app, once (`plugin.before_launch_server`)."""
    warn_without_fast_http_parser()
    app = sglang_adapter.http_server_app()
    if not any(getattr(r, "path", None) == "/commit" for r in app.routes):
        add_routes(app, _sglang_backend)


def add_routes(app: Any, get_backend: Callable[[], MigrationBackend | None]) -> None:
    """Add the six routes to `app`'s own route list, each with its auth level.

    Not `app.include_router(...)`: recent FastAPI keeps an included router as one lazy
    entry whose `matches()` reports no endpoint, so SGLang's API-key middleware (which
    reads `_auth_level` from the matched endpoint) would treat our routes as NORMAL:
    open to anyone when only `--admin-api-key` is set, and open to the plain api key
    when both keys are set.
    """
    routes = app.router.routes
    before = len(routes)
    for route in build_router(get_backend).routes:
        app.router.add_api_route(
            route.path,
            route.endpoint,
            methods=sorted(route.methods),
            name=route.name,
            tags=route.tags,
            description=route.description,
            route_class_override=type(route),
        )
    # First in the list: Starlette tries the routes in order, and walking SGLang's ~90
    # routes to reach ours cost 64 us a match on CPU against 4 us first
    # (`benchmark/probes/probe_route_walk.py`), twice a trip with an API key (its middleware
    # matches again).
    # No SGLang route has one of our paths (`add_routes_to_sglang_app` checks).
    ours = routes[before:]
    del routes[before:]
    routes[0:0] = ours
    fast_routes.add_innermost(
        app,
        handlers=fast_handlers(get_backend),
        max_body_bytes=MAX_BODY_BYTES,
        on_start=_ROUTE_STARTED.set,
    )


def warn_without_fast_http_parser() -> bool:
    """Warn (once, at launch) when uvicorn will parse HTTP in pure Python (h11): without
    `httptools` every migration trip costs about a millisecond more on the server
    (`docs/benchmarks-history.md`, "The control plane on CPU"). Returns True when it warned."""
    import importlib.util
    import logging

    if importlib.util.find_spec("httptools") is not None:
        return False
    logging.getLogger(__name__).warning(
        "httptools is not installed: uvicorn parses HTTP with h11 (pure Python), about 1 ms "
        "more per KV-migration round trip; pip install httptools"
    )
    return True


# --------------------------------------------------------------------------- helpers


def _transfer_request(body: TransferBody) -> TransferRequestKVCacheReqInput:
    return TransferRequestKVCacheReqInput(**body.request_fields())


async def _json_body(request: Request) -> Any:
    """The body as JSON (parsed once by `_parse_json`, which refused what is not JSON);
    an empty body is a 400 like FastAPI's own."""
    try:
        return await request.json()
    except (ValueError, RecursionError) as e:
        raise RequestValidationError(
            [{"loc": ("body",), "msg": f"JSON decode error: {e}", "type": "json_invalid"}]
        ) from None


_Model = TypeVar("_Model", bound=BaseModel)


def _validated(model: type[_Model], payload: Any) -> _Model:
    """`payload` as `model`, or the 400 FastAPI would answer for a body of that type."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _sglang_backend() -> MigrationBackend | None:
    return sglang_adapter.http_tokenizer_manager().kv_migration_communicators


# When the route began reading the body (set per request by `_BadRequestOnInvalidBody`).
_ROUTE_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("kvmig_route_started")


def _reply(output: Any, parsed: float | None = None) -> Response:
    content = reply_content(output)
    _add_route_steps(content, parsed)
    # orjson, and no deep copy (`dataclasses.asdict` copies every int of a 32K-token list):
    # replies carry page lists as long as the prefix.
    return Response(
        orjson.dumps(content), status_code=_status_of(output), media_type="application/json"
    )


def _batch_reply(outputs: list[Any], parsed: float) -> Response:
    """Feature "transfer_batch": 200 with every transfer's reply in `moves` (each with
    the `status_code` it would have had alone); `success` only if all succeeded."""
    moves = []
    for output in outputs:
        content = reply_content(output)
        content["status_code"] = _status_of(output)
        moves.append(content)
    failed = [m for m in moves if not m["success"]]
    content = {
        "success": not failed,
        "message": f"{len(failed)} of {len(moves)} transfers failed" if failed else "",
        "moves": moves,
        "steps_ms": {},
    }
    _add_route_steps(content, parsed)
    for move in moves:  # each transfer's trip: the batch's parse and route, its own hops
        if "steps_ms" in move:
            move["steps_ms"] = {**content["steps_ms"], **move["steps_ms"]}
            move["steps_ms"]["route"] = content["steps_ms"].get("route", 0.0)
    return Response(orjson.dumps(content), status_code=200, media_type="application/json")


def _status_of(output: Any) -> int:
    return 200 if output.success else ErrorKind(output.error_kind or "internal").http_status


def _add_route_steps(content: dict[str, Any], parsed: float | None) -> None:
    """`trace.py`: the body read and parsed, and the whole route up to this reply."""
    started = _ROUTE_STARTED.get(None)
    if started is not None and parsed is not None and "steps_ms" in content:
        content["steps_ms"] = {
            "parse": round((parsed - started) * 1e3, 3),
            **content["steps_ms"],
            "route": round((time.monotonic() - started) * 1e3, 3),
        }


def _error(kind: ErrorKind, message: str) -> JSONResponse:
    return JSONResponse(
        content={"success": False, "message": message, "error_kind": kind.value},
        status_code=kind.http_status,
    )


class _BadRequestOnInvalidBody(APIRoute):
    """Our routes answer malformed input with 400 (FastAPI's default is 422), naming
    the offending field, without changing the behaviour of SGLang's own routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Any]]:
        handler = super().get_route_handler()

        # The session info route reads no body: it answers whatever it is sent.
        reads_body = self.body_field is not None or self.path == TRANSFER_PATH

        async def handle(request: Request) -> Any:
            _ROUTE_STARTED.set(time.monotonic())
            too_large = await _read_capped_body(request)
            if too_large is not None:
                return _error(ErrorKind.TOO_LARGE, too_large)
            not_json = _parse_json(request)
            if not_json is not None and reads_body:
                return _error(ErrorKind.BAD_REQUEST, f"invalid request: body: {not_json}")
            try:
                return await handler(request)
            except RequestValidationError as e:
                message = _describe(e)
                _free_refused_body(e)
                return _error(ErrorKind.BAD_REQUEST, message)

        return handle


def _free_refused_body(error: RequestValidationError) -> None:
    """Let a refused body go with its reply. FastAPI raises the validation error from a
    frame that keeps it in a local (`validation_error`), so the error's traceback and
    that frame form a cycle holding the body (parsed and raw), freed only by a full
    garbage collection: ~30 MiB per over-limit body of 2M ids. Clearing the traceback's
    finished frames and the error's links breaks it (`errors.detached`)."""
    traceback.clear_frames(error.__traceback__)
    detached(error)
    error.body = None


async def _read_capped_body(request: Request) -> str | None:
    """Read the body (cached on the request for the handler) unless it is over
    `MAX_BODY_BYTES`; return the 413 message then."""
    limit = MAX_BODY_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return f"request body of {declared} bytes is over the {limit}-byte limit"
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return f"request body is over the {limit}-byte limit"
        chunks.append(chunk)
    request._body = b"".join(chunks)  # Starlette's cache: the handler reads it from here
    return None


def _parse_json(request: Request) -> str | None:
    """Parse the body into Starlette's cache, which FastAPI and `_json_body` read: with
    orjson (3x faster than the stdlib's `json.loads` that FastAPI uses on a list of 32K
    ids), else as FastAPI would (NaN, integers beyond 64 bits). Returns why a body is not
    JSON: malformed, or nested deeper than the parser recurses (a RecursionError
    FastAPI would answer with a reply of its own shape, and `request.json()` raise)."""
    body = request._body
    if not body:
        return None
    try:
        request._json = orjson.loads(body)
        return None
    except orjson.JSONDecodeError:
        pass
    try:
        request._json = json.loads(body)
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return f"JSON decode error: {e}"
    return None


def _describe(error: RequestValidationError) -> str:
    return describe_errors(error.errors())
