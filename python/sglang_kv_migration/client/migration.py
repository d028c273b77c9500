"""Client for rollout managers: run a whole migration between two servers, with rollback.

    from sglang_kv_migration.client.migration import MigrationClient

    result = MigrationClient().migrate("http://src:30000", "http://dst:30000", input_ids)
    print(result.migrated_token_size, result.timings)

`AsyncMigrationClient` has the same surface with `await`. Both drive one protocol
description (`steps.migration_steps`), a generator that yields HTTP calls and receives
their JSON replies, so the sync and asyncio versions cannot drift apart. This module
holds the two drivers; the protocol is in `steps.py`, what an attempt knows and decides
before it moves anything in `plan.py` (the paths it tries, in `path_choice.py`), the
calls built from it in `call_bodies.py`, one call and its reply in `calls.py`, what the
client keeps per server in `sessions.py`, results and failures in `results.py` and the
keys in `auth.py`.

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
one call (`steps._move_in_one_trip`; on a channel error the client allocates itself). Any
failure after allocate aborts the allocation on the target before `MigrationFailed` is
raised; a failed attempt moves on to the next path (a device path refused by a full GPU
pool lands in the target's host tier instead) when the caller did not pin a path. Four
round trips once session info is cached; three when both servers take partial transfers
(feature "partial_transfer", docs/protocol.md): then the client allocates for the whole
request without asking the source, and the transfer sends what the source holds of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import httpx

from sglang_kv_migration.client import aio_http11, http11
from sglang_kv_migration.client.auth import ADMIN_ROUTES, ApiKeys, auth_hint
from sglang_kv_migration.client.batch import Move
from sglang_kv_migration.client.calls import (
    JSON_HEADERS,
    SIZE_QUERY,
    SIZE_QUERY_ROUTE,
    Call,
    checked,
    encode,
    join_url,
    json_or_bytes_text,
    json_or_text,
    size_query,
)
from sglang_kv_migration.client.path_choice import PATHS
from sglang_kv_migration.client.plan import check_path, predict_path
from sglang_kv_migration.client.results import AuthFailed, MigrationFailed, MigrationResult
from sglang_kv_migration.client.sessions import SessionCache, session_info_step
from sglang_kv_migration.client.steps import many_steps, migration_steps
from sglang_kv_migration.wire import bodies
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply

# The client's public names: importable from here as from the modules that define them.
__all__ = [
    "ADMIN_ROUTES",
    "DEFAULT_TIMEOUT_S",
    "PATHS",
    "SIZE_QUERY",
    "SIZE_QUERY_ROUTE",
    "ApiKeys",
    "AsyncMigrationClient",
    "AuthFailed",
    "MigrationClient",
    "MigrationFailed",
    "MigrationResult",
    "SessionCache",
    "auth_hint",
    "predict_path",
    "size_query",
]

DEFAULT_TIMEOUT_S = 120.0
T = TypeVar("T")


class _ClientSteps:
    """What both clients share: their keys, the session cache their migrations share and
    the protocol generators (`steps.py`) their `migrate` and `migrate_many` drive."""

    def __init__(self, api_key: str | None, admin_api_key: str | None):
        self.keys = ApiKeys(api_key, admin_api_key)
        self._sessions = SessionCache()

    def _migration_steps(
        self,
        source_url: str,
        target_url: str,
        input_ids: list[int],
        extra_key: str | None,
        path: str | None,
        verify: bool,
        held: ExtraTokenSizeReply | dict[str, Any] | None,
        running_rid: str,
    ) -> Generator[Any, Any, MigrationResult]:
        return migration_steps(
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

    def _many_steps(
        self, moves: Sequence[Move], path: str | None, verify: bool
    ) -> Generator[Any, Any, list[MigrationResult | MigrationFailed]]:
        check_path(path)  # raised here, before any request is sent
        return many_steps(moves, self._sessions, path, verify)


class MigrationClient(_ClientSteps):
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
        super().__init__(api_key, admin_api_key)

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
            self._migration_steps(
                source_url, target_url, input_ids, extra_key, path, verify, held, running_rid
            )
        )

    def migrate_many(
        self, moves: Sequence[Move], *, path: str | None = None, verify: bool = False
    ) -> list[MigrationResult | MigrationFailed]:
        """Several migrations at once (`batch.py`): each as `migrate` would move it, the
        transfers to one source in one call when it lists feature "transfer_batch".
        Returns each move's result, or the `MigrationFailed` it ended with (it was
        rolled back as `migrate` would), in the order of `moves`."""
        return self._drive(self._many_steps(moves, path, verify))

    def session_info(self, url: str) -> SessionInfoReply:
        """`/get_transfer_session_info` of `url`, from the cache migrations share (one
        call per server until it restarts). The cached model itself: what it says is
        what migrations plan with."""
        return self._drive(session_info_step(url, self._sessions))

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
        return checked(Call(path.strip("/"), url, path, body or {}), *self._raw(url, path, body))

    def close(self) -> None:
        if self._http11 is not None:
            self._http11.close()
        else:
            self._http.close()

    def __enter__(self) -> MigrationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, call: Call) -> tuple[int | None, Any]:
        try:
            return self._raw(call.url, call.path, call.body)
        except (httpx.HTTPError, *http11.ERRORS) as e:
            return None, f"{type(e).__name__}: {e}"

    def _raw(self, url: str, path: str, body: Any) -> tuple[int, Any]:
        headers = {**JSON_HEADERS, **self.keys.headers(path)}
        if self._http11 is not None:
            status, data = self._http11.post(join_url(url, path), encode(body), headers)
            return status, json_or_bytes_text(data)
        r = self._http.post(join_url(url, path), content=encode(body), headers=headers)
        return r.status_code, json_or_text(r)


class AsyncMigrationClient(_ClientSteps):
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
        super().__init__(api_key, admin_api_key)

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
            self._migration_steps(
                source_url, target_url, input_ids, extra_key, path, verify, held, running_rid
            )
        )

    async def migrate_many(
        self, moves: Sequence[Move], *, path: str | None = None, verify: bool = False
    ) -> list[MigrationResult | MigrationFailed]:
        """See `MigrationClient.migrate_many`."""
        return await self._drive(self._many_steps(moves, path, verify))

    async def session_info(self, url: str) -> SessionInfoReply:
        """See `MigrationClient.session_info`."""
        return await self._drive(session_info_step(url, self._sessions))

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
        return checked(Call(path.strip("/"), url, path, body or {}), status, payload)

    async def aclose(self) -> None:
        if self._aio is not None:
            await self._aio.aclose()
        else:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncMigrationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, call: Call) -> tuple[int | None, Any]:
        try:
            return await self._raw(call.url, call.path, call.body)
        except (httpx.HTTPError, *aio_http11.ERRORS) as e:
            return None, f"{type(e).__name__}: {e}"

    async def _raw(self, url: str, path: str, body: Any) -> tuple[int, Any]:
        headers = {**JSON_HEADERS, **self.keys.headers(path)}
        if self._aio is not None:
            status, data = await self._aio.post(join_url(url, path), encode(body), headers)
            return status, json_or_bytes_text(data)
        r = await self._http.post(join_url(url, path), content=encode(body), headers=headers)
        return r.status_code, json_or_text(r)
