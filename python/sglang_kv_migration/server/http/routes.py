"""HTTP routes of KV-cache migration, added to SGLang's FastAPI app.

Routes are thin: validate the JSON body (pydantic; malformed input is a 400 naming the
field), call the scheduler through the tokenizer manager's communicators, and map the
reply's `error_kind` to a status code. They carry SGLang's `ADMIN_OPTIONAL` auth level,
so `--api-key` / `--admin-api-key` protect them exactly like `/flush_cache`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal, Protocol, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError
from sglang.srt.utils.auth import AuthLevel, auth_level

from sglang_kv_migration import binary_ids, page_ranges, sglang_adapter
from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.io_types import (
    AbortTransferReqInput,
    AllocateOnTarget,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
    GetRequestExtraTokenSizeReqInput,
    GetTransferSessionInfoReqInput,
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheTarget,
)
from sglang_kv_migration.server.http import fast_path as fast_routes
from sglang_kv_migration.targets import HostTarget

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
MAX_TOKENS = 1 << 21  # input_ids / kv_indices / kv_pages per request
MAX_ID_CHARS = 128  # migration_id
MAX_DP_RANK = 4095  # dp_rank (SGLang's --dp-size is far smaller)
MAX_EPOCH_CHARS = 1024  # server_epoch: instance, KV memory generation, weight_version
MAX_KEY_CHARS = 4096  # extra_key
MAX_TOKEN_CHARS = 4096  # a grant or receipt
MAX_BATCH_MOVES = 64  # transfers in one call (feature "transfer_batch")
# Free-form JSON fields, in bytes of their JSON: a target's `device_kv` (~26 KB for an 8B
# model's 64 buffers, ~400 bytes a buffer) and a layout fingerprint (~0.5 KB).
MAX_DEVICE_KV_BYTES = 1 << 20
MAX_FINGERPRINT_BYTES = 64 << 10
MAX_RANKS = 1024  # target ranks, source fingerprints and receipts in one body

MAX_ID = (1 << 63) - 1  # token ids and slots are int64 on the scheduler side


def _ids_in_range(values: list[int], info: ValidationInfo) -> list[int]:
    """Every element in [0, MAX_ID]. Two C-level passes (min, max) instead of pydantic's
    per-element constraint, which costs three times the strict int check itself on
    32K-token lists; the slow search for the culprit runs only on bad input."""
    if values and (min(values) < 0 or max(values) > MAX_ID):
        index, bad = next((i, v) for i, v in enumerate(values) if not 0 <= v <= MAX_ID)
        raise PydanticCustomError(
            "id_range",
            "{field}.{index} = {value}: must be an integer in [0, 2**63)",
            {"field": info.field_name, "index": index, "value": bad},
        )
    return values


def _json_within(limit: int) -> BeforeValidator:
    """A field of free-form JSON of at most `limit` bytes and 254 levels (orjson's own
    limit; pickling deeper values to the scheduler would recurse too deep), checked
    before pydantic copies it: such a value goes on to the scheduler as it came."""

    def check(value: Any, info: ValidationInfo) -> Any:
        try:
            size = len(orjson.dumps(value))
        except orjson.JSONEncodeError as e:
            raise PydanticCustomError(
                "json_bounds",
                "{field} is not JSON of at most 254 levels: {problem}",
                {"field": info.field_name, "problem": str(e)},
            ) from None
        if size > limit:
            raise PydanticCustomError(
                "json_size",
                "{field} holds {size} bytes of JSON, over the {limit}-byte limit",
                {"field": info.field_name, "size": size, "limit": limit},
            )
        return value

    return BeforeValidator(check)


def _at_most(count: int) -> BeforeValidator:
    """A list of at most `count` items, counted before any item is validated (pydantic's
    `max_length` validates every item first)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and len(value) > count:
            raise PydanticCustomError(
                "too_long",
                "{field} has {size} items, over the {limit}-item limit",
                {"field": info.field_name, "size": len(value), "limit": count},
            )
        return value

    return BeforeValidator(check)


# Lists of ids: strict ints (the models are strict: no bools, no strings), range checked
# as a whole by `_ids_in_range`.
IdList = Annotated[
    list[int], _at_most(MAX_TOKENS), Field(max_length=MAX_TOKENS), AfterValidator(_ids_in_range)
]
# [first_page, count] runs of page ids (`page_ranges.py`); each pair checked in the model.
PageRanges = Annotated[
    list[Annotated[list[int], Field(min_length=2, max_length=2)]],
    _at_most(MAX_TOKENS),
    Field(max_length=MAX_TOKENS),
]
ExtraKey = Annotated[str, Field(max_length=MAX_KEY_CHARS)]
NonNegative = Annotated[int, Field(ge=0)]
Fingerprint = Annotated[dict[str, Any], _json_within(MAX_FINGERPRINT_BYTES)]
Address = Annotated[int, Field(ge=0)]
# Feature "dp_ranks": a data-parallel rank of the server (checked against its --dp-size
# by `dp_ranks.py`); None lets the server choose.
DpRank = Annotated[int | None, Field(default=None, ge=0, le=MAX_DP_RANK)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _IdsBody(_Body):
    """A body with the request's token ids: `input_ids` (a JSON list), or `input_ids_u32`
    (feature "binary_ids": little-endian uint32, base64; `binary_ids.py`), exactly one."""

    input_ids: IdList = Field(default_factory=list)
    input_ids_u32: str = ""
    _ids_raw: bytes = PrivateAttr(default=b"")

    @model_validator(mode="after")
    def _one_form_of_ids(self) -> _IdsBody:
        if bool(self.input_ids) == bool(self.input_ids_u32):
            raise ValueError("give exactly one of input_ids (non-empty) and input_ids_u32")
        if self.input_ids_u32:
            try:
                self._ids_raw = binary_ids.decode(self.input_ids_u32, MAX_TOKENS)
            except ValueError as e:
                raise ValueError(f"input_ids_u32: {e}") from None
        return self

    @property
    def token_count(self) -> int:
        return len(self.input_ids) or binary_ids.count(self._ids_raw)


class ExtraTokenSizeBody(_IdsBody):
    extra_key: ExtraKey | None = None
    headroom: bool = False  # also report the host pool's headroom (planners)
    dp_rank: DpRank = None  # feature "dp_ranks": ask this DP rank only


class AllocateFields(_Body):
    """An allocate's fields but its ids (the allocate a transfer forwards to its target
    through the allocate channel, feature "source_allocate", takes the transfer's ids)."""

    extra_key: ExtraKey | None = None
    extra_token_size: NonNegative = 0
    source_fingerprints: Annotated[list[Fingerprint], _at_most(MAX_RANKS)] = Field(min_length=1)
    path: Literal["host", "device"] = "host"
    index_format: Literal["tokens", "pages", "ranges"] = "tokens"
    nothing_ok: bool = False
    staging: bool = False  # the source writes staging extents (its `stage_writer`)
    verify: bool = False
    # The source's session info `instance_id` (feature "bound_grants").
    source_instance: str = Field(default="", max_length=MAX_ID_CHARS)
    # Feature "source_commit": the source commits through this server's mailbox.
    source_commit: bool = False
    # Feature "epoch_check": the session info `server_epoch` the caller planned with.
    expect_epoch: str = Field(default="", max_length=MAX_EPOCH_CHARS)


class AllocateBody(_IdsBody, AllocateFields):
    dp_rank: DpRank = None  # feature "dp_ranks": allocate on this DP rank


class AllocateOnTargetBody(_Body):
    """Feature "source_allocate": the source asks the target (on its host) for the slots
    itself, through the channel the target's session info names (`allocate_channel`)."""

    address: str = Field(max_length=256)
    secret: str = Field(pattern=r"^[0-9a-f]{32}$")
    allocate: AllocateFields


class TargetRankBody(_Body):
    tp: NonNegative
    pp: NonNegative
    path: Literal["host", "device"] = "host"
    # Host path: the target rank's transfer session and host buffers.
    session_id: str = Field(default="", pattern=r"^(.+:\d+)?$")
    host_kv_data_ptrs: list[Address] = Field(default_factory=list)
    host_kv_data_lens: list[Address] = Field(default_factory=list)
    host_kv_item_lens: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    # Device path: the target rank's `paths["device"]` from its session info.
    device_kv: Annotated[dict[str, Any] | None, _json_within(MAX_DEVICE_KV_BYTES)] = None
    # Feature "destination_digest": `device_kv` named by its digest (a source that was
    # sent it in full before; `server/source/known_destinations.py`).
    device_kv_digest: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # The allocated slots: token slots, or whole pages (protocol 2), or runs of whole
    # pages (feature "page_ranges").
    kv_indices: IdList = Field(default_factory=list)
    kv_pages: IdList = Field(default_factory=list)
    kv_page_ranges: PageRanges = Field(default_factory=list)
    fingerprint: Fingerprint
    grant: str = Field(default="", max_length=MAX_TOKEN_CHARS)
    # Host path: the staging extent [addr, length] the allocate reply granted this rank.
    staging: list[Address] = Field(default_factory=list, max_length=2)

    @property
    def names_slots(self) -> bool:
        return bool(self.kv_indices or self.kv_pages or self.kv_page_ranges)

    @model_validator(mode="after")
    def _consistent(self) -> TargetRankBody:
        # Exactly one for a transfer into granted slots, none when the source asks the
        # target for them (`TransferBody._consistent_sizes` says which).
        if sum(map(bool, (self.kv_indices, self.kv_pages, self.kv_page_ranges))) > 1:
            raise ValueError(SLOT_FIELDS_MESSAGE)
        if self.kv_page_ranges:
            _check_page_ranges(self.kv_page_ranges)
        if self.staging and (
            self.path != "host" or len(self.staging) != 2 or min(self.staging) == 0
        ):
            raise ValueError("staging must be [addr, length], both > 0, on the host path")
        if self.path == "device":
            if bool(self.device_kv) == bool(self.device_kv_digest):
                raise ValueError(
                    "give exactly one of device_kv and device_kv_digest for path 'device'"
                )
            return self
        if self.device_kv_digest:
            raise ValueError("device_kv_digest is for path 'device'")
        if not self.session_id or not self.host_kv_data_ptrs:
            raise ValueError("session_id and host_kv_data_ptrs are required for path 'host'")
        problem = HostTarget.from_wire(dict(self)).buffer_count_problem()
        if problem is not None:
            raise ValueError(problem)
        return self


SLOT_FIELDS_MESSAGE = "give exactly one of kv_indices, kv_pages and kv_page_ranges"


class TransferBody(_IdsBody):
    extra_key: ExtraKey | None = None
    # Both 0 with `allocate_on_target` (the target's allocate reply says them), else the
    # allocate reply's; extra_token_size > 0.
    matched_token_size: NonNegative = 0
    extra_token_size: NonNegative = 0
    target_per_rank: Annotated[list[TargetRankBody], _at_most(MAX_RANKS)] = Field(min_length=1)
    migration_id: str = Field(default="", max_length=MAX_ID_CHARS)
    # Feature "partial_transfer": send what this source holds of the range.
    partial_ok: bool = False
    # Feature "source_allocate": no slots, grant or migration id in the body; the source
    # allocates on the target itself (single-rank servers on one host).
    allocate_on_target: AllocateOnTargetBody | None = None
    dp_rank: DpRank = None  # feature "dp_ranks": the DP rank holding the prefix

    @model_validator(mode="after")
    def _consistent_sizes(self) -> TransferBody:
        if self.allocate_on_target is not None:
            return self._consistent_for_source_allocate()
        if self.extra_token_size <= 0:
            raise ValueError("extra_token_size must be greater than 0")
        # `_one_form_of_ids` has decoded input_ids_u32: pydantic runs a base class's
        # validators before a subclass's.
        end = self.matched_token_size + self.extra_token_size
        if end > self.token_count:
            raise ValueError(
                f"matched_token_size + extra_token_size = {end} exceeds len(input_ids) = "
                f"{self.token_count}"
            )
        for target in self.target_per_rank:
            if not target.names_slots:
                raise ValueError(f"target tp={target.tp} pp={target.pp}: {SLOT_FIELDS_MESSAGE}")
            if target.kv_indices and len(target.kv_indices) != self.extra_token_size:
                raise ValueError(
                    f"target tp={target.tp} pp={target.pp}: {len(target.kv_indices)} "
                    f"kv_indices for extra_token_size={self.extra_token_size}"
                )
            pages = len(target.kv_pages) or page_ranges.count_pages(target.kv_page_ranges)
            if pages and self.extra_token_size % pages:
                raise ValueError(
                    f"target tp={target.tp} pp={target.pp}: {pages} pages (kv_pages or "
                    f"kv_page_ranges) do not divide extra_token_size={self.extra_token_size} "
                    "into pages"
                )
        if len({t.path for t in self.target_per_rank}) != 1:
            raise ValueError("every target rank must use the same path")
        ranks = [(t.tp, t.pp) for t in self.target_per_rank]
        if len(set(ranks)) != len(ranks):
            raise ValueError("target_per_rank lists a (tp, pp) rank twice")
        return self

    def _consistent_for_source_allocate(self) -> TransferBody:
        """With `allocate_on_target` the target's reply gives sizes, slots, grant and id:
        the body names none of them, and one target rank (single-rank servers)."""
        if self.matched_token_size or self.extra_token_size or self.migration_id:
            raise ValueError(
                "with allocate_on_target, matched_token_size, extra_token_size and "
                "migration_id come from the target: leave them out"
            )
        if len(self.target_per_rank) != 1:
            raise ValueError("allocate_on_target takes one target rank (TP 1, PP 1)")
        target = self.target_per_rank[0]
        if target.names_slots or target.grant:
            raise ValueError(
                "with allocate_on_target the target rank names no slots and no grant "
                "(the target's allocate reply gives them)"
            )
        if target.staging:
            raise ValueError("with allocate_on_target the target rank names no staging")
        return self

    def forwarded_allocate(self) -> tuple[bytes, bytes]:
        """What the source sends to the target's allocate channel: the JSON object of
        `allocate_on_target.allocate`, and this transfer's ids as little-endian uint32
        bytes (a zmq frame of their own: no base64 to decode on the target's scheduler
        thread). Ids of 2**32 and above go in the JSON as a list instead (bytes empty)."""
        assert self.allocate_on_target is not None
        fields = self.allocate_on_target.allocate.model_dump(exclude_defaults=True)
        raw = self._ids_raw or binary_ids.to_bytes(self.input_ids)
        if not raw:
            fields["input_ids"] = self.input_ids
        return orjson.dumps(fields), raw


class TransferBatchBody(_Body):
    """Feature "transfer_batch": several transfers in one call, each a whole transfer
    body. They reach the scheduler together and run as if sent at once; the reply lists
    each one's reply, in order, with the status it would have had alone."""

    moves: Annotated[list[TransferBody], _at_most(MAX_BATCH_MOVES)] = Field(min_length=1)


def _check_page_ranges(ranges: list[list[int]]) -> None:
    """Each run is [first_page >= 0, count >= 1], and all of them name at most
    MAX_TOKENS pages (the source expands them)."""
    total = 0
    for i, (first, count) in enumerate(ranges):
        if first < 0 or count < 1 or first > MAX_ID - count:
            raise ValueError(
                f"kv_page_ranges.{i} = [{first}, {count}]: must be [first_page >= 0, count >= 1]"
            )
        total += count
    if total > MAX_TOKENS:
        raise ValueError(f"kv_page_ranges name {total} pages, over the {MAX_TOKENS} limit")


class MigrationIdBody(_Body):
    migration_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    receipts: Annotated[
        list[Annotated[str, Field(max_length=MAX_TOKEN_CHARS)]], _at_most(MAX_RANKS)
    ] = Field(default_factory=list)


class CommitBody(MigrationIdBody):
    verify: bool = False


# --------------------------------------------------------------------------- routes


# The scheduler request each route sends, from its validated body: one builder per
# route, shared by the route and by `fast_routes` (which serves well-formed bodies).


def _session_info_request(_body: None) -> GetTransferSessionInfoReqInput:
    return GetTransferSessionInfoReqInput()


def _extra_size_request(body: ExtraTokenSizeBody) -> GetRequestExtraTokenSizeReqInput:
    return GetRequestExtraTokenSizeReqInput(**_fields(body))


def _allocate_request(body: AllocateBody) -> AllocateTokenForTransferReqInput:
    # The migration id is minted here once; every rank uses it.
    return AllocateTokenForTransferReqInput(**_fields(body), migration_id=uuid.uuid4().hex)


def _commit_request(body: CommitBody) -> CommitTransferRequestKVCacheReqInput:
    return CommitTransferRequestKVCacheReqInput(**_fields(body))


def _abort_request(body: MigrationIdBody) -> AbortTransferReqInput:
    return AbortTransferReqInput(**_fields(body))


# path -> (body model, or None for a route that reads no body; its request's builder)
_BODY_ROUTES: dict[str, tuple[type[_Body] | None, Callable[[Any], Any]]] = {
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

    def typed(model: type[_Body] | None, build: Callable[[Any], Any]) -> Any:
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
    targets = [TransferRequestKVCacheTarget(**_fields(t)) for t in body.target_per_rank]
    on_target = body.allocate_on_target
    if on_target is not None:  # built here, off the scheduler thread
        on_target = AllocateOnTarget(
            on_target.address, on_target.secret, *body.forwarded_allocate()
        )
    return TransferRequestKVCacheReqInput(
        **_fields(body, exclude=frozenset({"target_per_rank", "allocate_on_target"})),
        target_per_rank=targets,
        allocate_on_target=on_target,
    )


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


def _fields(body: BaseModel, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The body's fields as they are: `model_dump()` would copy every int of the token
    lists, and the validated body is not used again. Ids sent as base64 go on as the
    bytes they decode to."""
    fields = {name: getattr(body, name) for name in type(body).model_fields if name not in exclude}
    if isinstance(body, _IdsBody):
        fields[binary_ids.FIELD] = body._ids_raw
    return fields


# BaseReq bookkeeping and the scheduler's raw stamps (`trace.py`): never leave the server.
_INTERNAL_FIELDS = frozenset({"rid", "http_worker_ipc", "trace"})

# When the route began reading the body (set per request by `_BadRequestOnInvalidBody`).
_ROUTE_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("kvmig_route_started")


def allocate_request(
    body: Any, *, migration_id: str, weight_version: str, ids: bytes = b""
) -> AllocateTokenForTransferReqInput:
    """An allocate from a JSON object that did not come through a route (the allocate
    channel, `channel_allocations.py`), validated like the route's body; `ids`: its ids
    as little-endian uint32 bytes, when the object has none. ValueError naming what is
    wrong."""
    try:
        parsed = (AllocateFields if ids else AllocateBody).model_validate(body)
    except ValidationError as e:
        raise ValueError(_describe_errors(e.errors())) from None
    fields = _fields(parsed)
    if ids:
        try:
            binary_ids.check_bytes(ids, MAX_TOKENS)
        except ValueError as e:
            raise ValueError(f"the ids frame: {e}") from None
        fields.update(input_ids=[], input_ids_u32=ids)
    return AllocateTokenForTransferReqInput(
        **fields, migration_id=migration_id, weight_version=weight_version
    )


def reply_content(output: Any) -> dict[str, Any]:
    """A scheduler reply as the JSON object a route answers with (without the internal
    fields)."""
    return {
        f.name: _plain(getattr(output, f.name))
        for f in dataclasses.fields(output)
        if f.name not in _INTERNAL_FIELDS
    }


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


def _plain(value: Any) -> Any:
    """Dataclasses (and lists of them) as dicts; everything else as it is."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return [_plain(v) for v in value]
    return value


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
                return _error(ErrorKind.BAD_REQUEST, _describe(e))

        return handle


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
    return _describe_errors(error.errors())


def _describe_errors(errors: Any) -> str:
    parts = []
    for item in list(errors)[:5]:
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
