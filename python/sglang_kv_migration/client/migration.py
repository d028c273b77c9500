"""Client for rollout managers: run a whole migration between two servers, with rollback.

    from sglang_kv_migration.client.migration import MigrationClient

    result = MigrationClient().migrate("http://src:30000", "http://dst:30000", input_ids)
    print(result.migrated_token_size, result.timings)

`AsyncMigrationClient` has the same surface with `await`. Both drive one protocol
description (`_migration_steps`), a generator that yields HTTP calls and receives their
JSON replies, so the sync and asyncio versions cannot drift apart.

A migration: session info on both (cached per server until its epoch changes) →
fingerprint check → what the source holds → choose the data paths to try in turn
(`path_choice.py`: the target's GPU, then its host tier through shared memory when both
servers share a host, then the host path through Mooncake) → allocate on the
target (which reports what it already holds) → transfer from the source → commit on the
target (by the source itself when both servers list "source_commit": it hands its
receipts to the target's mailbox on the same host, and the target commits before it
handles the next request; two round trips then). When both single-rank servers also
list "source_allocate" and share a host, the allocate rides in the transfer: the
source's scheduler asks the target's allocate channel for the slots, so a migration is
one call (`_move_in_one_trip`; on a channel error the client allocates itself). Any
failure after allocate aborts the allocation on the target before `MigrationFailed` is
raised; a failed attempt moves on to the next path (a device path refused by a full GPU
pool lands in the target's host tier instead) when the caller did not pin a path. Four
round trips once session info is cached; three when both servers take partial transfers
(feature "partial_transfer", docs/protocol.md): then the client allocates for the whole
request without asking the source, and the transfer sends what the source holds of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import orjson

from sglang_kv_migration import binary_ids
from sglang_kv_migration.client import aio_http11, http11
from sglang_kv_migration.client.batch import Move, lockstep
from sglang_kv_migration.client.path_choice import (
    DEVICE,
    HOST,
    LANDING_TIERS,
    PATHS,
    SAME_HOST_PATHS,
    NoCommonPath,
    common_paths,
    path_order,
    reads_host_tier,
    target_entry,
)
from sglang_kv_migration.fingerprint import CP_SHARDED, LayoutFingerprint, explain
from sglang_kv_migration.grants import destination_digest
from sglang_kv_migration.wire import bodies
from sglang_kv_migration.wire.convert import build, from_dict, to_wire
from sglang_kv_migration.wire.features import (
    BINARY_IDS,
    BOUND_GRANTS,
    DESTINATION_DIGEST,
    EPOCH_CHECK,
    OWNER_PATTERN,
    PAGE_RANGES,
    PARTIAL_TRANSFER,
    SOURCE_ALLOCATE,
    SOURCE_COMMIT,
    SOURCE_DP_RANK,
)
from sglang_kv_migration.wire.messages import (
    AllocateReply,
    CommitReply,
    ExtraTokenSizeReply,
    RankSessionInfo,
    Reply,
    SessionInfoReply,
    TransferReply,
)
from sglang_kv_migration.wire.version import PROTOCOL_VERSION

DEFAULT_TIMEOUT_S = 120.0
T = TypeVar("T")


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did. Sizes are tokens; timings are seconds per phase."""

    source_url: str
    target_url: str
    migration_id: str  # "" when nothing had to move
    # Page-aligned prefix the source held. Without a size query (feature
    # "partial_transfer") what the migration learnt: the target's prefix plus what moved
    # when the source held less than the request, else the whole request.
    source_held_token_size: int
    target_matched_token_size: int  # what the target already held (kept, not moved)
    migrated_token_size: int
    migrated_bytes: int
    matched_after_commit: int  # prefix the target can now serve from cache
    timings: dict[str, float] = field(default_factory=dict)
    path: str = ""  # the data path that moved the pages ("" when nothing moved)
    # Why the paths auto prefers were not (or not successfully) used.
    fallback_reason: str = ""
    copy_seconds: float = 0.0  # time the data path spent moving bytes, on the source
    # Host path, per rank: how each write was shaped ("direct", "gather", "staged") and
    # how many transfer-engine entries all ranks' writes needed together.
    plans: list[str] = field(default_factory=list)
    entries: int = 0
    # Per source rank: where its part of the transfer spent its time, ms (host path).
    transfer_steps_ms: list[dict[str, float]] = field(default_factory=list)
    # Migrations it took: more than one into a target whose device-path writes land in a
    # landing arena smaller than the prefix (--enable-memory-saver).
    rounds: int = 1
    # Per phase ("extra_token_size", "allocate", "transfer", "commit"): where its round
    # trip spent its time, ms: the server's `steps_ms` (`server/diag/trace.py`; empty from
    # servers without it) and `outside`, this client's trip less the server's route.
    steps_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # The source handed its receipts to the target's mailbox and the target committed by
    # itself (feature "source_commit"): no commit trip. The target commits before it
    # handles any request sent after this result.
    source_committed: bool = False
    # Feature "dp_ranks": the target's data-parallel rank that holds the migrated KV
    # (None: a server with one). Send the continuation there: `routed_dp_rank`.
    target_dp_rank: int | None = None
    # Where the pages landed on the target: "gpu" (device path) or "host" (its host
    # tier: the shared_host and host paths), "" when nothing moved.
    landing_tier: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class MigrationFailed(Exception):
    """A phase failed. `rolled_back` says whether the target allocation was released;
    `migration_id` is set once the target had allocated (for logs and manual clean-up)."""

    def __init__(
        self,
        phase: str,
        message: str,
        status_code: int | None = None,
        rolled_back: bool = False,
    ):
        status = f" (HTTP {status_code})" if status_code is not None else ""
        super().__init__(f"{phase} failed{status}: {message}")
        self.phase = phase
        self.message = message
        self.status_code = status_code
        self.rolled_back = rolled_back
        self.migration_id = ""
        self.reply: dict[str, Any] | None = None  # the failed call's JSON reply, if any


class AuthFailed(MigrationFailed):
    """A server refused the key a call carried (HTTP 401 or 403). Never retried: a wrong
    key does not become right by waiting. `route` is the refused route."""

    def __init__(self, phase: str, route: str, message: str, status_code: int):
        super().__init__(phase, message, status_code)
        self.route = route


# SGLang 0.5.12's auth levels (sglang/srt/utils/auth.py) for the routes this package
# calls: these are ADMIN_OPTIONAL (with --admin-api-key set, only the admin key opens them;
# with only --api-key, the API key does); /generate, /v1/loads and /get_load are NORMAL
# (only the API key, when set); /metrics and /health are always open.
ADMIN_ROUTES = frozenset(
    {
        "/get_transfer_session_info",
        "/get_request_extra_token_size",
        "/allocate_token_for_transfer",
        "/transfer_request_kvcache",
        "/commit",
        "/abort_transfer",
        "/abort_request",
        "/flush_cache",
    }
)


@dataclass(frozen=True)
class ApiKeys:
    """SGLang's two keys as a client holds them: `api_key` for /generate and the load
    routes, `admin_api_key` for the admin routes (`ADMIN_ROUTES`). One key alone is sent
    everywhere, which is what a server with one key set accepts."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def key_for(self, path: str) -> str | None:
        if route_of(path) in ADMIN_ROUTES:
            return self.admin_api_key or self.api_key
        return self.api_key or self.admin_api_key

    def headers(self, path: str) -> dict[str, str]:
        key = self.key_for(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def sent(self, path: str) -> str:
        """Which key a call to `path` carries, in words (for error messages)."""
        key = self.key_for(path)
        if not key:
            return "no key"
        if key == self.admin_api_key:
            return "the admin API key (admin_api_key / --admin-api-key)"
        return "the API key (api_key / --api-key)"


def route_of(path: str) -> str:
    return "/" + path.split("?", 1)[0].strip("/")


def auth_hint(path: str) -> str:
    """What to do about a 401/403 from `path` (SGLang's rules, see `ADMIN_ROUTES`)."""
    route = route_of(path)
    if route in ADMIN_ROUTES:
        return (
            f"{route} takes the admin API key when the server sets --admin-api-key (else "
            "its --api-key): pass admin_api_key= / --admin-api-key"
        )
    return f"{route} takes the server's --api-key: pass api_key= / --api-key"


@dataclass(frozen=True)
class _Call:
    phase: str
    url: str
    path: str
    body: Any  # a `wire.bodies` model (`to_wire`), a JSON object (`call`) or None


class MigrationClient:
    """Synchronous client: keep-alive HTTP/1.1 from the standard library (`http11.py`),
    or the `httpx.Client` it is given."""

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http_client: httpx.Client | None = None,
        *,
        admin_api_key: str | None = None,
    ):
        """`api_key`, `admin_api_key`: see `ApiKeys` (every route here is an admin route,
        so `admin_api_key` is used when given, else `api_key`). `http_client`: send
        through this httpx client (proxies, custom transports) instead of `http11`."""
        self._http = http_client
        self._http11 = http11.Http11(timeout) if http_client is None else None
        self.keys = ApiKeys(api_key, admin_api_key)
        self._sessions = SessionCache()

    def migrate(
        self,
        source_url: str,
        target_url: str,
        input_ids: list[int],
        extra_key: str | None = None,
        *,
        path: str | None = None,
        verify: bool = False,
        held: ExtraTokenSizeReply | dict[str, Any] | None = None,
        running_rid: str = "",
    ) -> MigrationResult:
        """Move the KV of the longest prefix of `input_ids` the source holds.

        `path`: None/"auto" tries the device path (same host; pages on the source's
        GPU or, where it reads them in place, its host pool), then the shared_host path
        (same host: into the target's host tier, e.g. when its GPU pool is full), then
        the host path, recording why in `fallback_reason`; "device", "shared_host" or
        "host" uses only that path. `verify`: the target checks a digest of
        what landed against the source's before inserting (a mismatch fails the commit
        with 409 and inserts nothing); costs one hash pass over the bytes on each side.
        `held`: the source's `/get_request_extra_token_size` reply for these `input_ids`
        and `extra_key` when the caller already asked (e.g. to price the move), so the
        move asks once; its epoch is checked like the client's own query.
        `running_rid` (feature "running_slots", listed by both servers): the source reads
        the pages from that running request's own slots; `held` must then be its size
        query with `running_rid` (``matched_token_size``: its ``running_token_size``).
        """
        return self._drive(
            _migration_steps(
                source_url,
                target_url,
                list(input_ids),
                extra_key,
                path,
                self._sessions,
                verify,
                held,
                running_rid,
            )
        )

    def migrate_many(
        self, moves: Sequence[Move], *, path: str | None = None, verify: bool = False
    ) -> list[MigrationResult | MigrationFailed]:
        """Several migrations at once (`batch.py`): each as `migrate` would move it, the
        transfers to one source in one call when it lists feature "transfer_batch".
        Returns each move's result, or the `MigrationFailed` it ended with (it was
        rolled back as `migrate` would), in the order of `moves`."""
        _check_path(path)
        return self._drive(_many_steps(moves, self._sessions, path, verify))

    def session_info(self, url: str) -> SessionInfoReply:
        """`/get_transfer_session_info` of `url`, from the cache migrations share (one
        call per server until it restarts). The cached model itself: what it says is
        what migrations plan with."""
        return self._drive(_session_info(url, self._sessions))

    def _drive(self, steps: Generator[Any, Any, T]) -> T:
        """Run a protocol generator: it yields a call (gets its reply) or a round of
        calls (`migrate_many`: gets their replies, in order)."""
        reply: Any = None
        while True:
            try:
                call = steps.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(call, list):
                reply = [self._post(c) for c in call]
            else:
                reply = self._post(call)

    def call(
        self, url: str, path: str, body: bodies.Body | dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One raw endpoint call (`body`: a `wire.bodies` model built for `to_wire`, or a
        JSON object); its JSON reply (`from_dict` reads it into a model); raises
        `MigrationFailed` on a non-2xx reply."""
        return _checked(_Call(path.strip("/"), url, path, body or {}), *self._raw(url, path, body))

    def close(self) -> None:
        if self._http11 is not None:
            self._http11.close()
        else:
            self._http.close()

    def __enter__(self) -> MigrationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, call: _Call) -> tuple[int | None, Any]:
        try:
            return self._raw(call.url, call.path, call.body)
        except (httpx.HTTPError, *http11.ERRORS) as e:
            return None, f"{type(e).__name__}: {e}"

    def _raw(self, url: str, path: str, body: Any) -> tuple[int, Any]:
        headers = {**_JSON, **self.keys.headers(path)}
        if self._http11 is not None:
            status, data = self._http11.post(_join(url, path), _encode(body), headers)
            return status, _json_or_bytes_text(data)
        r = self._http.post(_join(url, path), content=_encode(body), headers=headers)
        return r.status_code, _json_or_text(r)


class AsyncMigrationClient:
    """asyncio client: keep-alive HTTP/1.1 on asyncio streams (`aio_http11.py`), or the
    `httpx.AsyncClient` it is given; same surface as `MigrationClient`."""

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        *,
        admin_api_key: str | None = None,
    ):
        self._http = http_client
        self._aio = aio_http11.AsyncHttp11(timeout) if http_client is None else None
        self.keys = ApiKeys(api_key, admin_api_key)
        self._sessions = SessionCache()

    async def migrate(
        self,
        source_url: str,
        target_url: str,
        input_ids: list[int],
        extra_key: str | None = None,
        *,
        path: str | None = None,
        verify: bool = False,
        held: ExtraTokenSizeReply | dict[str, Any] | None = None,
        running_rid: str = "",
    ) -> MigrationResult:
        """See `MigrationClient.migrate`."""
        return await self._drive(
            _migration_steps(
                source_url,
                target_url,
                list(input_ids),
                extra_key,
                path,
                self._sessions,
                verify,
                held,
                running_rid,
            )
        )

    async def migrate_many(
        self, moves: Sequence[Move], *, path: str | None = None, verify: bool = False
    ) -> list[MigrationResult | MigrationFailed]:
        """See `MigrationClient.migrate_many`."""
        _check_path(path)
        return await self._drive(_many_steps(moves, self._sessions, path, verify))

    async def session_info(self, url: str) -> SessionInfoReply:
        """See `MigrationClient.session_info`."""
        return await self._drive(_session_info(url, self._sessions))

    async def _drive(self, steps: Generator[Any, Any, T]) -> T:
        """See `MigrationClient._drive`; a round's calls go concurrently."""
        reply: Any = None
        while True:
            try:
                call = steps.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(call, list):
                reply = list(await asyncio.gather(*(self._post(c) for c in call)))
            else:
                reply = await self._post(call)

    async def call(
        self, url: str, path: str, body: bodies.Body | dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """See `MigrationClient.call`."""
        status, payload = await self._raw(url, path, body)
        return _checked(_Call(path.strip("/"), url, path, body or {}), status, payload)

    async def aclose(self) -> None:
        if self._aio is not None:
            await self._aio.aclose()
        else:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncMigrationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, call: _Call) -> tuple[int | None, Any]:
        try:
            return await self._raw(call.url, call.path, call.body)
        except (httpx.HTTPError, *aio_http11.ERRORS) as e:
            return None, f"{type(e).__name__}: {e}"

    async def _raw(self, url: str, path: str, body: Any) -> tuple[int, Any]:
        headers = {**_JSON, **self.keys.headers(path)}
        if self._aio is not None:
            status, data = await self._aio.post(_join(url, path), _encode(body), headers)
            return status, _json_or_bytes_text(data)
        r = await self._http.post(_join(url, path), content=_encode(body), headers=headers)
        return r.status_code, _json_or_text(r)


# --------------------------------------------------------------------------- protocol

_Reply = tuple[int | None, Any]  # (HTTP status or None on a connection error, JSON/text)
# `error_kind` of a server's refusal of a write or commit for its grant or receipts.
FORBIDDEN_KIND = "forbidden"
# The phases whose names are also wire fields (`MigrationResult.timings` keys).
SIZE_QUERY = "extra_token_size"
ALLOCATE = "allocate"
SIZE_QUERY_ROUTE = "/get_request_extra_token_size"
TRANSFER_ROUTE = "/transfer_request_kvcache"


class SessionCache:
    """Session info per server URL, reused across migrations until the server's epoch
    changes (a restart); a stale entry is dropped and the migration restarts once."""

    def __init__(self) -> None:
        self._infos: dict[str, SessionInfoReply] = {}
        # Feature "destination_digest": (source URL, its instance, digest) of the device
        # destinations each source was sent in full and accepted.
        self._sent: set[tuple[str, str, str]] = set()
        self._digests: dict[int, tuple[dict[str, Any], str]] = {}  # id -> (it, digest)
        # (source info, target info) pairs found compatible, by identity: the check
        # parses and compares every rank's fingerprint (0.15 ms a migration on CPU,
        # `bench_control_plane.py --profile`).
        self._compatible: dict[tuple[int, int], tuple[SessionInfoReply, SessionInfoReply]] = {}

    def get(self, url: str) -> SessionInfoReply | None:
        return self._infos.get(url.rstrip("/"))

    def put(self, url: str, info: SessionInfoReply) -> None:
        self._infos[url.rstrip("/")] = info
        self._forget_memos()

    def drop(self, url: str) -> None:
        self._infos.pop(url.rstrip("/"), None)
        self._forget_memos()

    def _forget_memos(self) -> None:
        # Memos of replaced infos' dicts would keep them alive (and their ids reused).
        self._digests.clear()
        self._compatible.clear()

    def check_compatible(
        self, source_info: SessionInfoReply, target_info: SessionInfoReply
    ) -> None:
        """`_check_compatible`, once per pair of cached infos."""
        key = (id(source_info), id(target_info))
        known = self._compatible.get(key)
        if known is not None and known[0] is source_info and known[1] is target_info:
            return
        _check_compatible(source_info, target_info)
        self._compatible[key] = (source_info, target_info)

    def digest_of(self, device_kv: dict[str, Any]) -> str:
        """`grants.destination_digest` of a target rank's `paths["device"]`, once per
        session info read (the dict is the cached info's own)."""
        known = self._digests.get(id(device_kv))
        if known is None or known[0] is not device_kv:
            known = self._digests[id(device_kv)] = (device_kv, destination_digest(device_kv))
        return known[1]

    def source_knows(self, url: str, instance: str, digest: str) -> bool:
        return (url.rstrip("/"), instance, digest) in self._sent

    def sent(self, url: str, instance: str, digest: str, known: bool) -> None:
        key = (url.rstrip("/"), instance, digest)
        if known:
            self._sent.add(key)
        else:
            self._sent.discard(key)


class _StaleSession(Exception):
    def __init__(self, url: str):
        super().__init__(f"{url} restarted since its session info was read")
        self.url = url


@dataclass
class _Plan:
    """What one attempt knows before it moves anything."""

    source_url: str
    target_url: str
    extra_key: str | None
    source_info: SessionInfoReply
    target_info: SessionInfoReply
    prefix: list[int]  # the page-aligned prefix the source holds
    timings: dict[str, float]
    verify: bool = False  # the target checks a digest of what landed before inserting
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # per phase, ms
    # No size query was made: `prefix` is the whole page-aligned request and the source
    # sends what it holds of it (feature "partial_transfer").
    partial: bool = False
    # The prefix's ids as `binary_ids` text, by length (allocate and transfer send the
    # same ids: encoded once); None where they cannot be sent so.
    encoded: dict[int, str | None] = field(default_factory=dict)
    sessions: SessionCache | None = None  # what sources know (feature "destination_digest")
    # Feature "dp_ranks": the source's DP rank holding the prefix, from its size query
    # (None: not asked; the source finds it itself).
    source_dp_rank: int | None = None
    # Feature "running_slots": the running request whose own slots the source reads.
    running_rid: str = ""
    # Feature "owner_pattern": an owner-sharded source's owner of each page of `prefix`
    # (its size query's), passed to the target's allocate; None for other sources.
    page_owners: list[int] | None = None


B = TypeVar("B", bound=bodies.IdsBody)
A = TypeVar("A", bound=bodies.AllocateFields)
R = TypeVar("R", bound=Reply)


def with_ids(
    body: B,
    info: SessionInfoReply | None,
    ids: list[int],
    encoded: dict[int, str | None] | None = None,
) -> B:
    """`body` carrying `ids` to the server whose session info is `info`: as
    `input_ids_u32` when it lists "binary_ids" (cheaper to parse, check and hand to its
    scheduler than a JSON list), else as `input_ids` (also without session info).
    `encoded`: prefixes of one id list encoded so far, by length (`_Plan.encoded`),
    filled in here."""
    if info is None or BINARY_IDS not in info.features:
        body.input_ids = ids
        return body
    if encoded is None:
        text = binary_ids.encode(ids)
    elif len(ids) in encoded:
        text = encoded[len(ids)]
    else:
        text = encoded[len(ids)] = binary_ids.encode(ids)
    if text is None:
        body.input_ids = ids
    else:
        body.input_ids_u32 = text
    return body


def size_query(
    info: SessionInfoReply | None,
    ids: list[int],
    extra_key: str | None = None,
    *,
    headroom: bool = False,
    running_rid: str = "",
) -> bodies.ExtraTokenSizeBody:
    """The body of `/get_request_extra_token_size` for `ids` to the server of `info`;
    `headroom`: also ask for its host headroom (planners); `running_rid` (feature
    "running_slots"): also ask how much of `ids` that running request holds."""
    body = build(bodies.ExtraTokenSizeBody, extra_key=extra_key)
    if headroom:
        body.headroom = True
    if running_rid:
        body.running_rid = running_rid
    return with_ids(body, info, ids)


def _migration_steps(
    source_url: str,
    target_url: str,
    input_ids: list[int],
    extra_key: str | None,
    path: str | None = None,
    sessions: SessionCache | None = None,
    verify: bool = False,
    held: ExtraTokenSizeReply | dict[str, Any] | None = None,
    running_rid: str = "",
) -> Generator[_Call, _Reply, MigrationResult]:
    """The migration protocol as a generator of HTTP calls (see the module docstring).
    `held`, the caller's size query, serves the first attempt only: a retry after a
    restart asks again."""
    _check_path(path)
    sessions = sessions or SessionCache()
    known = None if held is None else from_dict(ExtraTokenSizeReply, held)
    for attempt in (1, 2):
        try:
            return (
                yield from _attempt(
                    source_url,
                    target_url,
                    input_ids,
                    extra_key,
                    path,
                    sessions,
                    verify,
                    known,
                    running_rid=running_rid,
                )
            )
        except _StaleSession as stale:
            sessions.drop(stale.url)
            known = None
            if attempt == 2:
                raise MigrationFailed("session_info", str(stale)) from None
    raise AssertionError("unreachable")


def _many_steps(
    moves: Sequence[Move], sessions: SessionCache, path: str | None, verify: bool
) -> Generator[list[_Call], list[_Reply], list[MigrationResult | MigrationFailed]]:
    """`migrate_many` as rounds of calls (`batch.py`): yields each round's calls,
    receives their replies in the same order, returns one outcome per move."""
    # Session info of every server first, once each (a failure here is met again, and
    # reported, by the moves that need that server).
    urls = list(dict.fromkeys(u for m in moves for u in (m.source_url, m.target_url)))
    infos = [_session_info(url, sessions) for url in urls]
    yield from lockstep(infos, sessions, MigrationFailed)
    steps = [
        _migration_steps(
            m.source_url, m.target_url, list(m.input_ids), m.extra_key, path, sessions, verify,
            m.held,
        )
        for m in moves
    ]  # fmt: skip
    return (yield from lockstep(steps, sessions, MigrationFailed))


def _check_path(path: str | None) -> None:
    if path not in (None, "auto", *PATHS):
        raise ValueError(f"path must be one of auto, {', '.join(PATHS)}; got {path!r}")


def _attempt(
    source_url: str,
    target_url: str,
    input_ids: list[int],
    extra_key: str | None,
    path: str | None,
    sessions: SessionCache,
    verify: bool = False,
    held: ExtraTokenSizeReply | None = None,
    running_rid: str = "",
) -> Generator[_Call, _Reply, MigrationResult]:
    timings: dict[str, float] = {}
    clock = time.perf_counter

    t0 = clock()
    source_info = yield from _session_info(source_url, sessions)
    target_info = yield from _session_info(target_url, sessions)
    sessions.check_compatible(source_info, target_info)
    timings["session_info"] = clock() - t0

    sharded = _owner_sharded(source_info, target_info)
    if held is None and not sharded and _partial_ok(path, source_info, target_info):
        # One trip fewer: the transfer finds out what the source holds of the request.
        page_size = source_info.ranks[0].page_size
        prefix = input_ids[: len(input_ids) - len(input_ids) % page_size]
        steps: dict[str, dict[str, float]] = {}
        # The path does not depend on what the source holds (`_partial_ok`).
        held = ExtraTokenSizeReply(success=True)
        partial = True
    else:
        t0 = clock()
        if held is None:
            body = size_query(source_info, input_ids, extra_key)
            call = _Call(SIZE_QUERY, source_url, SIZE_QUERY_ROUTE, body)
            held = yield from _step(call, ExtraTokenSizeReply)
        _check_epoch(source_url, source_info, held.server_epoch)
        prefix = input_ids[: held.matched_token_size]
        if sharded:
            # Only the source's device pages have known owners: that part moves.
            page_size = source_info.ranks[0].page_size
            prefix = prefix[: len(held.page_owners or ()) * page_size]
        timings[SIZE_QUERY] = clock() - t0
        steps = {SIZE_QUERY: _trip_steps(held, timings[SIZE_QUERY])}
        partial = False
    plan = _Plan(
        source_url,
        target_url,
        extra_key,
        source_info,
        target_info,
        prefix,
        timings,
        verify,
        steps,
        partial=partial,
        sessions=sessions,
        source_dp_rank=None if partial else held.dp_rank,
        running_rid=running_rid,
        page_owners=list(held.page_owners or ()) if sharded else None,
    )
    if not prefix:
        return _result(plan, "", AllocateReply(success=True), None, None, "", "")

    order, reason = _path_order(path, source_info, target_info, held)
    return (yield from _move_with_fallback(plan, order, reason))


def _move_with_fallback(
    plan: _Plan, order: list[str], reason: str
) -> Generator[_Call, _Reply, MigrationResult]:
    """Move on each path of `order` in turn until one succeeds (`path_choice.py`; one
    path when the caller pinned it); each failure is rolled back and said in the next
    attempt's `fallback_reason`."""
    for path in order[:-1]:
        try:
            return (yield from _move_in_rounds(plan, path, reason))
        except MigrationFailed as failure:
            failed = f"{path} path failed at {failure.phase}: {failure.message}"
            reason = f"{reason}; {failed}" if reason else failed
    return (yield from _move_in_rounds(plan, order[-1], reason))


def _partial_ok(
    requested: str | None, source_info: SessionInfoReply, target_info: SessionInfoReply
) -> bool:
    """Skip the source's size query: both servers take partial transfers, the path
    does not depend on where the source holds the pages (a source whose device path
    reads only its GPU would need the query to fall back to the host path up front),
    and the grants need not name a DP rank of the source (feature "source_dp_rank")."""
    if not _both_list(source_info, target_info, PARTIAL_TRANSFER):
        return False
    if source_info.dp_size > 1 and SOURCE_DP_RANK in target_info.features:
        # Ask which DP rank of the source holds the prefix: the grants then name it.
        return False
    if requested in PATHS:
        return True
    common = common_paths(source_info, target_info)
    return all(reads_host_tier(p, source_info) for p in SAME_HOST_PATHS if p in common)


def _move(
    plan: _Plan, path: str, fallback_reason: str
) -> Generator[_Call, _Reply, MigrationResult]:
    """Allocate on the target, transfer from the source, commit; abort on any failure.
    One call when the source can allocate on the target itself (`_source_allocates`)."""
    if _source_allocates(plan, path):
        moved = yield from _move_in_one_trip(plan, path)
        if moved is not None:
            allocation, transfer = moved
            if allocation.extra_token_size == 0:
                _check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
                return _result(plan, "", allocation, None, None, "", fallback_reason)
            return (yield from _finish(plan, path, allocation, transfer, fallback_reason))
        # Nothing was allocated (the channel could not be used, or the target refused):
        # the allocate trip says why, or moves it.
    clock = time.perf_counter
    timings = plan.timings
    t0 = clock()
    try:
        allocation = yield from _step(_allocate_call(plan, path), AllocateReply)
    except MigrationFailed as failure:
        refusal = _parsed(AllocateReply, failure.reply)
        if refusal is not None:  # refused for a stale epoch ("epoch_check"): read info again
            _check_epoch(plan.target_url, plan.target_info, refusal.server_epoch)
        raise
    migration_id = allocation.migration_id
    timings[ALLOCATE] = timings.get(ALLOCATE, 0.0) + clock() - t0
    plan.steps[ALLOCATE] = _trip_steps(allocation, clock() - t0)
    if allocation.extra_token_size == 0:
        _check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        return _result(plan, "", allocation, None, None, "", fallback_reason)

    # From here on the target holds slots: every failure must abort them.
    try:
        _check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        t0 = clock()
        transfer = yield from _transfer_step(
            plan, lambda digest: _transfer_call(plan, allocation, path, digest)
        )
        timings["transfer"] = clock() - t0
        plan.steps["transfer"] = _trip_steps(transfer, timings["transfer"])
    except (MigrationFailed, _StaleSession) as failure:
        yield from _abort(plan, migration_id, failure, None)
        raise
    return (yield from _finish(plan, path, allocation, transfer, fallback_reason))


def _move_in_one_trip(
    plan: _Plan, path: str
) -> Generator[_Call, _Reply, tuple[AllocateReply, TransferReply] | None]:
    """Feature "source_allocate": the transfer asks the target for the slots itself.
    Returns (the target's allocate reply, the transfer reply), or None when nothing was
    allocated (the caller allocates then); a failed transfer after an allocation is
    aborted and raised."""
    t0 = time.perf_counter()
    try:
        transfer = yield from _transfer_step(
            plan, lambda digest: _one_trip_call(plan, path, digest)
        )
    except MigrationFailed as failure:
        reply = _parsed(TransferReply, failure.reply) or TransferReply(success=False)
        allocation = _parsed(AllocateReply, reply.allocation) if reply.allocation else None
        if allocation is not None and allocation.success:
            failure.migration_id = allocation.migration_id
            yield from _abort(plan, allocation.migration_id, failure, None)
            raise
        if reply.allocation:  # the target refused; a stale epoch: read session info again
            if allocation is not None:
                _check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
            return None  # its own allocate trip says why (or, new weights, moves it)
        if reply.channel_error:
            return None  # the source could not reach the target's channel
        # Any other failure is the transfer's (nothing was allocated): as with two trips.
        raise
    seconds = time.perf_counter() - t0
    plan.timings["transfer"] = plan.timings.get("transfer", 0.0) + seconds
    plan.steps["transfer"] = _trip_steps(transfer, seconds)
    allocation = from_dict(AllocateReply, transfer.allocation)
    plan.steps[ALLOCATE] = dict(allocation.steps_ms or {})
    return allocation, transfer


def _finish(
    plan: _Plan,
    path: str,
    allocation: AllocateReply,
    transfer: TransferReply,
    fallback_reason: str,
) -> Generator[_Call, _Reply, MigrationResult]:
    """After a transfer into `allocation`: commit on the target, unless the source
    handed its receipts to the target's mailbox; abort on a failure."""
    migration_id = allocation.migration_id
    commit: CommitReply | None = None
    try:
        _check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        if allocation.source_commit and transfer.delivered:
            # The receipts are in the target's mailbox: it commits by itself, before it
            # handles anything sent from now on (feature "source_commit").
            return _result(plan, path, allocation, transfer, None, migration_id, fallback_reason)
        t0 = time.perf_counter()
        body = build(bodies.CommitBody, migration_id=migration_id, receipts=_receipts(transfer))
        if plan.verify:
            body.verify = True
        commit = yield from _step(_Call("commit", plan.target_url, "/commit", body), CommitReply)
        plan.timings["commit"] = time.perf_counter() - t0
        plan.steps["commit"] = _trip_steps(commit, plan.timings["commit"])
    except (MigrationFailed, _StaleSession) as failure:
        yield from _abort(plan, migration_id, failure, transfer)
        raise
    return _result(plan, path, allocation, transfer, commit, migration_id, fallback_reason)


def _abort(
    plan: _Plan,
    migration_id: str,
    failure: MigrationFailed | _StaleSession,
    transfer: TransferReply | None,
) -> Generator[_Call, _Reply, None]:
    """Free the target's slots after `failure`. The source's receipts (even of a failed
    transfer) may prove no write can still land, which frees them at once instead of
    after quarantine."""
    if transfer is None and isinstance(failure, MigrationFailed):
        transfer = _parsed(TransferReply, failure.reply)
    body = build(bodies.MigrationIdBody, migration_id=migration_id, receipts=_receipts(transfer))
    status, _ = yield _Call("abort", plan.target_url, "/abort_transfer", body)
    if isinstance(failure, MigrationFailed):
        failure.migration_id = migration_id
        failure.rolled_back = status is not None and status < 300


def _move_in_rounds(
    plan: _Plan, path: str, fallback_reason: str
) -> Generator[_Call, _Reply, MigrationResult]:
    """`_move`, in rounds when the target's device-path writes land in a landing arena
    smaller than the prefix (memory saver): each round migrates a longer prefix, whose
    start the target holds from the round before, so each moves at most one arena."""
    limit = _landing_tokens(plan.target_info) if path == DEVICE else 0
    if not limit or len(plan.prefix) <= limit:
        return (yield from _move(plan, path, fallback_reason))
    results: list[MigrationResult] = []
    held = 0  # of the prefix, what the target holds after the rounds so far
    while held < len(plan.prefix):
        end = min(held + limit, len(plan.prefix))
        part = dataclasses.replace(plan, prefix=plan.prefix[:end], timings={})
        results.append((yield from _move(part, path, fallback_reason)))
        if results[-1].matched_after_commit < end:
            break  # a partial transfer: the source holds no more of the prefix
        held = end  # committed (or the target held it already: an empty round)
    timings = dict(plan.timings)
    for r in results:
        for k, v in r.timings.items():
            if k != "total":
                timings[k] = timings.get(k, 0.0) + v
    timings["total"] = sum(timings.values())
    last = results[-1]
    return dataclasses.replace(
        last,
        migration_id=",".join(r.migration_id for r in results if r.migration_id),
        target_matched_token_size=results[0].target_matched_token_size,
        migrated_token_size=sum(r.migrated_token_size for r in results),
        migrated_bytes=sum(r.migrated_bytes for r in results),
        timings=timings,
        copy_seconds=sum(r.copy_seconds for r in results),
        rounds=sum(1 for r in results if r.migration_id) or 1,
    )


def _landing_tokens(target_info: SessionInfoReply) -> int:
    """The fewest tokens a target rank's landing arena holds (0: writes go to the pool)."""
    ranks = target_info.ranks
    return min((r.paths[DEVICE].get("landing_tokens", 0) for r in ranks), default=0)


def _allocate_fields(plan: _Plan, path: str, model: type[A]) -> A:
    """The allocate's fields but its ids: reserve slots on the target for what it lacks
    of the prefix, on `path`."""
    infos = (plan.source_info, plan.target_info)
    body = build(
        model,
        extra_key=plan.extra_key,
        source_fingerprints=[r.fingerprint for r in plan.source_info.ranks],
        path=path,
        index_format=_index_format(plan),
        nothing_ok=True,
    )
    # Each only where the target understands it (older ones refuse unknown fields).
    if BOUND_GRANTS in plan.target_info.features:
        # Name the source, so only it may use the grant.
        body.source_instance = plan.source_info.instance_id
    if plan.source_dp_rank is not None and SOURCE_DP_RANK in plan.target_info.features:
        # Name the source's DP rank too: only its scheduler claims the grants, and the
        # target takes receipts naming them from no other. (An allocate the source
        # forwards has no such field: only single-rank sources forward one.)
        if isinstance(body, bodies.AllocateBody):
            body.source_dp_rank = plan.source_dp_rank
    if _can_stage(plan, path):
        body.staging = True
    if plan.verify:
        body.verify = True
    if plan.page_owners is not None:
        # One owner per page of the ids this allocate sends (a round sends a prefix).
        body.page_owners = plan.page_owners[: len(plan.prefix) // _page_size(plan)]
    if _both_list(*infos, SOURCE_COMMIT):
        body.source_commit = True
    if EPOCH_CHECK in plan.target_info.features:
        # A target whose epoch moved on since its info was read refuses before it
        # reserves anything (slots granted to a stale plan would be aborted unused and
        # sit out their write window: in a small landing arena, room the retry needs).
        body.expect_epoch = plan.target_info.server_epoch
    return body


def _allocate_call(plan: _Plan, path: str) -> _Call:
    """Reserve slots on the target for what it lacks of the prefix, on `path`."""
    body = _allocate_fields(plan, path, bodies.AllocateBody)
    with_ids(body, plan.target_info, plan.prefix, plan.encoded)
    return _Call(ALLOCATE, plan.target_url, "/allocate_token_for_transfer", body)


def _source_allocates(plan: _Plan, path: str) -> bool:
    """Feature "source_allocate": both servers list it, each is a single rank, and they
    share a host (the target's channel is a local socket)."""
    source, target = plan.source_info, plan.target_info
    if not _both_list(source, target, SOURCE_ALLOCATE):
        return False
    if len(source.ranks) != 1 or len(target.ranks) != 1:
        return False
    channels = source.allocate_channel or {}, target.allocate_channel or {}
    return bool(channels[1].get("address")) and channels[0].get("host") == channels[1].get("host")


def _one_trip_call(plan: _Plan, path: str, digest: str = "") -> _Call:
    """The transfer that allocates on the target first (`_source_allocates`): the
    allocate's fields ride along, the source adds the transfer's ids."""
    # The channel is a free-form object of the target's session info.
    channel = plan.target_info.allocate_channel
    body = build(
        bodies.TransferBody,
        extra_key=plan.extra_key,
        target_per_rank=[target_entry(plan.target_info.ranks[0], path, digest)],
        allocate_on_target=build(
            bodies.AllocateOnTargetBody,
            address=channel["address"],
            secret=channel["secret"],
            allocate=_allocate_fields(plan, path, bodies.AllocateFields),
        ),
    )
    with_ids(body, plan.source_info, plan.prefix, plan.encoded)
    if plan.partial:
        body.partial_ok = True
    if plan.running_rid:
        body.running_rid = plan.running_rid
    return _Call("transfer", plan.source_url, TRANSFER_ROUTE, body)


def _transfer_step(
    plan: _Plan, transfer_call: Callable[[str], _Call]
) -> Generator[_Call, _Reply, TransferReply]:
    """A transfer (`transfer_call(digest)` builds it); its device destination named by
    digest to a source that was sent it in full (feature "destination_digest": ~26 KB
    less per body for an 8B model), and sent in full again to one that no longer knows
    it."""
    call = transfer_call("")
    digest = _destination_digest(plan, call.body.target_per_rank)
    if not digest:
        return (yield from _step(call, TransferReply))
    source, instance = plan.source_url, plan.source_info.instance_id
    if plan.sessions.source_knows(source, instance, digest):
        try:
            return (yield from _step(transfer_call(digest), TransferReply))
        except MigrationFailed as failure:
            refusal = _parsed(TransferReply, failure.reply)
            if refusal is None or not refusal.destination_unknown:
                raise
            plan.sessions.sent(source, instance, digest, known=False)
    reply = yield from _step(call, TransferReply)
    plan.sessions.sent(source, instance, digest, known=True)
    return reply


def _destination_digest(plan: _Plan, entries: list[bodies.TargetRankBody]) -> str:
    """The digest of the one device entry's `device_kv`, when the source names device
    destinations by digest; "" otherwise."""
    if plan.sessions is None or len(entries) != 1 or entries[0].device_kv is None:
        return ""
    if DESTINATION_DIGEST not in plan.source_info.features:
        return ""
    return plan.sessions.digest_of(entries[0].device_kv)


def _transfer_call(plan: _Plan, allocation: AllocateReply, path: str, digest: str = "") -> _Call:
    """Ask the source to write the pages the target allocated (`allocation`); `digest`
    names the one device destination by its digest instead (`_transfer_step`)."""
    body = build(
        bodies.TransferBody,
        extra_key=plan.extra_key,
        matched_token_size=allocation.matched_token_size,
        extra_token_size=allocation.extra_token_size,
        migration_id=allocation.migration_id,
        target_per_rank=_targets(plan.target_info, allocation, path, digest),
    )
    with_ids(body, plan.source_info, plan.prefix, plan.encoded)
    if plan.partial:
        body.partial_ok = True
    if plan.source_dp_rank is not None:
        body.dp_rank = plan.source_dp_rank
    if plan.running_rid:
        body.running_rid = plan.running_rid
    return _Call("transfer", plan.source_url, TRANSFER_ROUTE, body)


def _result(
    plan: _Plan,
    path: str,
    allocation: AllocateReply,
    transfer: TransferReply | None,
    commit: CommitReply | None,
    migration_id: str,
    fallback_reason: str,
) -> MigrationResult:
    timings = plan.timings
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    target_matched = allocation.matched_token_size
    ranks = transfer.ranks if transfer else []
    seconds = [r.seconds for r in ranks]
    source_held = len(plan.prefix)
    if plan.partial and transfer and transfer.transferred_token_size < len(plan.prefix):
        source_held = target_matched + transfer.transferred_token_size
    source_committed = bool(commit is None and transfer and transfer.delivered)
    if commit is not None:
        matched_after = commit.matched_after_commit
    elif source_committed:
        matched_after = target_matched + transfer.transferred_token_size
    else:
        matched_after = target_matched
    return MigrationResult(
        source_url=plan.source_url,
        target_url=plan.target_url,
        migration_id=migration_id,
        source_held_token_size=source_held,
        target_matched_token_size=target_matched,
        migrated_token_size=transfer.transferred_token_size if transfer else 0,
        migrated_bytes=transfer.transferred_bytes if transfer else 0,
        matched_after_commit=matched_after,
        timings=timings,
        path=path,
        fallback_reason=fallback_reason,
        copy_seconds=max(seconds, default=0.0),
        plans=[r.plan for r in ranks],
        entries=sum(r.entries for r in ranks),
        transfer_steps_ms=[r.steps_ms for r in ranks],
        steps_ms=plan.steps,
        source_committed=source_committed,
        target_dp_rank=allocation.dp_rank,
        landing_tier=LANDING_TIERS.get(path, ""),
    )


def _trip_steps(reply: Reply, seconds: float) -> dict[str, float]:
    """The server's `steps_ms` of one trip plus `outside`: this trip less the route."""
    steps = dict(reply.steps_ms or {})
    if "route" in steps:
        steps["outside"] = round(max(seconds * 1e3 - steps["route"], 0.0), 3)
    return steps


def _receipts(transfer_reply: TransferReply | None) -> list[str]:
    if transfer_reply is None:
        return []
    return [r.receipt for r in transfer_reply.ranks if r.receipt]


def _session_info(url: str, sessions: SessionCache) -> Generator[_Call, _Reply, SessionInfoReply]:
    info = sessions.get(url)
    if info is None:
        call = _Call("session_info", url, "/get_transfer_session_info", None)
        info = yield from _step(call, SessionInfoReply)
        sessions.put(url, info)
    return info


def _check_epoch(url: str, info: SessionInfoReply, epoch: str) -> None:
    """A reply's `server_epoch` that is not the one `info` was read with: a restart."""
    if epoch and epoch != info.server_epoch:
        raise _StaleSession(url)


def _path_order(
    requested: str | None,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> tuple[list[str], str]:
    """`path_choice.path_order`, its refusal a failed migration."""
    try:
        return path_order(requested, source_info, target_info, held)
    except NoCommonPath as e:
        raise MigrationFailed("session_info", str(e)) from None


def _choose_path(
    requested: str | None,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> tuple[str, str]:
    """(the path tried first, why the ones auto prefers were left out: "" if none was)."""
    order, reason = _path_order(requested, source_info, target_info, held)
    return order[0], reason


def predict_path(
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
    requested: str | None = None,
) -> str:
    """The path `migrate` will try first for what the source holds (`held`: its
    `/get_request_extra_token_size` reply), "" when the servers share none. For pricing
    a move before it is made (`request_migration`, `rebalancer`)."""
    try:
        return _choose_path(requested, source_info, target_info, held)[0]
    except MigrationFailed:
        return ""


def _targets(
    target_info: SessionInfoReply, allocation: AllocateReply, path: str, digest: str = ""
) -> list[bodies.TargetRankBody]:
    slots = {(r.tp_rank, r.pp_rank): r for r in allocation.ranks}
    entries = []
    for rank in _dp_rank_ranks(target_info, allocation.dp_rank):
        granted = slots[(rank.tp_rank, rank.pp_rank)]
        entry = target_entry(rank, path, digest)
        entry.grant = granted.grant
        # Runs when the target sent them (both servers speak "page_ranges"), else pages.
        if granted.kv_page_ranges:
            entry.kv_page_ranges = granted.kv_page_ranges
        else:
            entry.kv_pages = granted.kv_pages
        if granted.staging:
            entry.staging = granted.staging
        entries.append(entry)
    return entries


def _dp_rank_ranks(info: SessionInfoReply, dp_rank: int | None) -> list[RankSessionInfo]:
    """The ranks of session info `info` that belong to DP rank `dp_rank` (feature
    "dp_ranks"; all of them for None, a server with one DP rank)."""
    if dp_rank is None:
        return info.ranks
    return [r for r in info.ranks if r.dp_rank == dp_rank]


def _both_list(source_info: SessionInfoReply, target_info: SessionInfoReply, feature: str) -> bool:
    """Both servers' session info lists `feature`."""
    return feature in source_info.features and feature in target_info.features


def _index_format(plan: _Plan) -> str:
    """How the target should list its slots: as `[first_page, count]` runs when both
    servers understand them (a fresh pool gives one run where a page list has one id
    per page), else as page ids."""
    return "ranges" if _both_list(plan.source_info, plan.target_info, PAGE_RANGES) else "pages"


def _can_stage(plan: _Plan, path: str) -> bool:
    """Ask the target for staging extents only when every source rank can write them and
    every target rank has an arena (servers without either never see the field)."""
    if path != HOST:
        return False
    sources, targets = plan.source_info.ranks, plan.target_info.ranks
    return all(r.stage_writer for r in sources) and all(r.staging_region for r in targets)


def _step(call: _Call, reply_type: type[R]) -> Generator[_Call, _Reply, R]:
    """Yield one call; return its checked JSON reply as `reply_type`."""
    status, payload = yield call
    reply = _checked(call, status, payload)
    try:
        return from_dict(reply_type, reply)
    except (ValueError, TypeError) as e:
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: malformed reply: {e}") from None


def _parsed(reply_type: type[R], payload: Any) -> R | None:
    """A failed call's JSON reply as `reply_type`; None when there is none, or it is not
    one."""
    if not payload:
        return None
    try:
        return from_dict(reply_type, payload)
    except (ValueError, TypeError):
        return None


def _checked(call: _Call, status: int | None, payload: Any) -> dict[str, Any]:
    """The JSON reply of a successful call, else `MigrationFailed` naming the phase."""
    if status is None:
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: {payload}")
    common = _parsed(Reply, payload)
    # A 403 of ours (a write refused for its grant, `error_kind` "forbidden") is this
    # migration's failure, rolled back like any other; SGLang's refusal of a key is not.
    if status in (401, 403) and (common is None or common.error_kind != FORBIDDEN_KIND):
        message = f"{call.url}{call.path} refused the key: {payload}; {auth_hint(call.path)}"
        raise AuthFailed(call.phase, route_of(call.path), message, status)
    if status >= 300 or common is None or not common.success:
        message = common.message if common is not None and common.message else payload
        failure = MigrationFailed(call.phase, f"{call.url}{call.path}: {message}", status)
        failure.reply = payload if isinstance(payload, dict) else None
        raise failure
    return payload


def _owner_sharded(source_info: SessionInfoReply, target_info: SessionInfoReply) -> bool:
    """The source's CP ranks own disjoint pages (its fingerprint says so; the target's
    agrees, `_check_compatible`): the allocate must carry its owner pattern (feature
    "owner_pattern"), which both servers must understand."""
    fingerprint = LayoutFingerprint.from_dict(source_info.ranks[0].fingerprint)
    if fingerprint.attn_cp_mode != CP_SHARDED:
        return False
    for name, info in (("source", source_info), ("target", target_info)):
        if OWNER_PATTERN not in info.features:
            raise MigrationFailed(
                "session_info",
                f"the source's CP ranks own disjoint pages (cp_owner={fingerprint.cp_owner}), "
                f"which needs page_owners on the allocate; the {name} does not list "
                f"{OWNER_PATTERN!r}",
            )
    return True


def _page_size(plan: _Plan) -> int:
    return plan.source_info.ranks[0].page_size


def _check_compatible(source_info: SessionInfoReply, target_info: SessionInfoReply) -> None:
    """Refuse before anything is allocated when the two servers cannot exchange pages."""
    for name, info in (("source", source_info), ("target", target_info)):
        if info.protocol_version != PROTOCOL_VERSION:
            raise MigrationFailed(
                "session_info",
                f"{name} speaks protocol {info.protocol_version}, this client {PROTOCOL_VERSION}",
            )
    source_ranks = {(r.tp_rank, r.pp_rank): r for r in source_info.ranks}
    target_ranks = {(r.tp_rank, r.pp_rank): r for r in target_info.ranks}
    if set(source_ranks) != set(target_ranks):
        raise MigrationFailed(
            "session_info",
            f"rank sets differ: source (tp, pp) {sorted(source_ranks)} vs target "
            f"{sorted(target_ranks)}",
        )
    for position, source_rank in source_ranks.items():
        source_fp = LayoutFingerprint.from_dict(source_rank.fingerprint)
        target_fp = LayoutFingerprint.from_dict(target_ranks[position].fingerprint)
        mismatch = source_fp.first_mismatch(target_fp)
        if mismatch is not None:
            raise MigrationFailed("session_info", f"KV layouts differ: {explain(mismatch)}")


_JSON = {"Content-Type": "application/json"}


def _encode(body: bodies.Body | dict[str, Any] | None) -> bytes:
    # orjson: bodies carry token lists as long as the prefix (stdlib json is ~10x slower).
    if isinstance(body, bodies.Body):
        return orjson.dumps(to_wire(body))
    return orjson.dumps(body or {})


def _join(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path.lstrip("/")


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text


def _json_or_bytes_text(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace")
