"""Client for rollout managers: run a whole migration between two servers, with rollback.

    from sglang_kv_migration.client import MigrationClient

    result = MigrationClient().migrate("http://src:30000", "http://dst:30000", input_ids)
    print(result.migrated_token_size, result.timings)

`AsyncMigrationClient` has the same surface with `await`. Both drive one protocol
description (`_migration_steps`), a generator that yields HTTP calls and receives their
JSON replies, so the sync and asyncio versions cannot drift apart.

A migration: session info on both → fingerprint check → held sizes → allocate on the
target → transfer from the source → commit on the target. Any failure after allocate
aborts the allocation on the target before `MigrationFailed` is raised.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import httpx

from sglang_kv_migration import PROTOCOL_VERSION
from sglang_kv_migration.layout import LayoutFingerprint

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did. Sizes are tokens; timings are seconds per phase."""

    source_url: str
    target_url: str
    migration_id: str  # "" when nothing had to move
    source_held_token_size: int  # page-aligned prefix the source held
    target_matched_token_size: int  # what the target already held (kept, not moved)
    migrated_token_size: int
    migrated_bytes: int
    matched_after_commit: int  # prefix the target can now serve from cache
    timings: dict[str, float] = field(default_factory=dict)

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


@dataclass(frozen=True)
class _Call:
    phase: str
    url: str
    path: str
    body: dict[str, Any]


class MigrationClient:
    """Synchronous client (httpx)."""

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http_client: httpx.Client | None = None,
    ):
        self._http = http_client or httpx.Client(timeout=timeout)
        self._headers = _auth_headers(api_key)

    def migrate(
        self,
        source_url: str,
        target_url: str,
        input_ids: list[int],
        extra_key: str | None = None,
    ) -> MigrationResult:
        steps = _migration_steps(source_url, target_url, list(input_ids), extra_key)
        reply: Any = None
        while True:
            try:
                call = steps.send(reply)
            except StopIteration as done:
                return done.value
            reply = self._post(call)

    def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One raw endpoint call; raises `MigrationFailed` on a non-2xx reply."""
        return _checked(_Call(path.strip("/"), url, path, body or {}), *self._raw(url, path, body))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MigrationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, call: _Call) -> tuple[int | None, Any]:
        try:
            return self._raw(call.url, call.path, call.body)
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}"

    def _raw(self, url: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        r = self._http.post(_join(url, path), json=body or {}, headers=self._headers)
        return r.status_code, _json_or_text(r)


class AsyncMigrationClient:
    """asyncio client (httpx.AsyncClient); same surface as `MigrationClient`."""

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
    ):
        self._http = http_client or httpx.AsyncClient(timeout=timeout)
        self._headers = _auth_headers(api_key)

    async def migrate(
        self,
        source_url: str,
        target_url: str,
        input_ids: list[int],
        extra_key: str | None = None,
    ) -> MigrationResult:
        steps = _migration_steps(source_url, target_url, list(input_ids), extra_key)
        reply: Any = None
        while True:
            try:
                call = steps.send(reply)
            except StopIteration as done:
                return done.value
            reply = await self._post(call)

    async def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        status, payload = await self._raw(url, path, body)
        return _checked(_Call(path.strip("/"), url, path, body or {}), status, payload)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMigrationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, call: _Call) -> tuple[int | None, Any]:
        try:
            return await self._raw(call.url, call.path, call.body)
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}"

    async def _raw(self, url: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        r = await self._http.post(_join(url, path), json=body or {}, headers=self._headers)
        return r.status_code, _json_or_text(r)


# --------------------------------------------------------------------------- protocol

_Reply = tuple[int | None, Any]  # (HTTP status or None on a connection error, JSON/text)


def _migration_steps(
    source_url: str, target_url: str, input_ids: list[int], extra_key: str | None
) -> Generator[_Call, _Reply, MigrationResult]:
    """The migration protocol as a generator of HTTP calls (see the module docstring)."""
    timings: dict[str, float] = {}
    clock = time.perf_counter

    t0 = clock()
    source_info = yield from _step(
        _Call("session_info", source_url, "/get_transfer_session_info", {})
    )
    target_info = yield from _step(
        _Call("session_info", target_url, "/get_transfer_session_info", {})
    )
    source_ranks = _ranks_by_position(source_info)
    target_ranks = _ranks_by_position(target_info)
    _check_compatible(source_info, target_info, source_ranks, target_ranks)
    timings["session_info"] = clock() - t0

    t0 = clock()
    source_held = (
        yield from _step(
            _Call(
                "extra_token_size",
                source_url,
                "/get_request_extra_token_size",
                {"input_ids": input_ids, "extra_key": extra_key},
            )
        )
    )["matched_token_size"]
    prefix = input_ids[:source_held]
    target_held = 0
    if source_held:
        target_held = (
            yield from _step(
                _Call(
                    "extra_token_size",
                    target_url,
                    "/get_request_extra_token_size",
                    {"input_ids": prefix, "extra_key": extra_key},
                )
            )
        )["matched_token_size"]
    timings["extra_token_size"] = clock() - t0

    def nothing_to_move() -> MigrationResult:
        return MigrationResult(
            source_url=source_url,
            target_url=target_url,
            migration_id="",
            source_held_token_size=source_held,
            target_matched_token_size=target_held,
            migrated_token_size=0,
            migrated_bytes=0,
            matched_after_commit=target_held,
            timings=timings,
        )

    if source_held - target_held <= 0:
        return nothing_to_move()

    t0 = clock()
    allocation = yield from _step(
        _Call(
            "allocate",
            target_url,
            "/allocate_token_for_transfer",
            {
                "input_ids": prefix,
                "extra_key": extra_key,
                "extra_token_size": source_held - target_held,
                "source_fingerprints": [r["fingerprint"] for r in source_ranks.values()],
            },
        )
    )
    migration_id = allocation["migration_id"]
    timings["allocate"] = clock() - t0

    # From here on the target holds slots: every failure must abort them.
    try:
        t0 = clock()
        kv_indices = {(r["tp_rank"], r["pp_rank"]): r["kv_indices"] for r in allocation["ranks"]}
        transfer = yield from _step(
            _Call(
                "transfer",
                source_url,
                "/transfer_request_kvcache",
                {
                    "input_ids": prefix,
                    "extra_key": extra_key,
                    "matched_token_size": allocation["matched_token_size"],
                    "extra_token_size": allocation["extra_token_size"],
                    "migration_id": migration_id,
                    "target_per_rank": [
                        {
                            "tp": rank["tp_rank"],
                            "pp": rank["pp_rank"],
                            "session_id": rank["session_id"],
                            "host_kv_data_ptrs": rank["host_kv_data_ptrs"],
                            "host_kv_data_lens": rank["host_kv_data_lens"],
                            "host_kv_item_lens": rank["host_kv_item_lens"],
                            "kv_indices": kv_indices[position],
                            "fingerprint": rank["fingerprint"],
                        }
                        for position, rank in target_ranks.items()
                    ],
                },
            )
        )
        timings["transfer"] = clock() - t0

        t0 = clock()
        commit = yield from _step(
            _Call("commit", target_url, "/commit", {"migration_id": migration_id})
        )
        timings["commit"] = clock() - t0
    except MigrationFailed as failure:
        failure.migration_id = migration_id
        status, _ = yield _Call(
            "abort", target_url, "/abort_transfer", {"migration_id": migration_id}
        )
        failure.rolled_back = status is not None and status < 300
        raise

    timings["total"] = sum(timings.values())
    return MigrationResult(
        source_url=source_url,
        target_url=target_url,
        migration_id=migration_id,
        source_held_token_size=source_held,
        target_matched_token_size=allocation["matched_token_size"],
        migrated_token_size=transfer["transferred_token_size"],
        migrated_bytes=transfer["transferred_bytes"],
        matched_after_commit=commit["matched_after_commit"],
        timings=timings,
    )


def _step(call: _Call) -> Generator[_Call, _Reply, dict[str, Any]]:
    """Yield one call; return its checked JSON reply."""
    status, payload = yield call
    return _checked(call, status, payload)


def _checked(call: _Call, status: int | None, payload: Any) -> dict[str, Any]:
    """The JSON reply of a successful call, else `MigrationFailed` naming the phase."""
    if status is None:
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: {payload}")
    if status >= 300 or not isinstance(payload, dict) or not payload.get("success", False):
        message = payload.get("message", payload) if isinstance(payload, dict) else payload
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: {message}", status)
    return payload


def _ranks_by_position(info: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["tp_rank"], r["pp_rank"]): r for r in info["ranks"]}


def _check_compatible(
    source_info: dict[str, Any],
    target_info: dict[str, Any],
    source_ranks: dict[tuple[int, int], dict[str, Any]],
    target_ranks: dict[tuple[int, int], dict[str, Any]],
) -> None:
    """Refuse before anything is allocated when the two servers cannot exchange pages."""
    for name, info in (("source", source_info), ("target", target_info)):
        if info.get("protocol_version") != PROTOCOL_VERSION:
            raise MigrationFailed(
                "session_info",
                f"{name} speaks protocol {info.get('protocol_version')}, this client "
                f"{PROTOCOL_VERSION}",
            )
    if set(source_ranks) != set(target_ranks):
        raise MigrationFailed(
            "session_info",
            f"rank sets differ: source (tp, pp) {sorted(source_ranks)} vs target "
            f"{sorted(target_ranks)}",
        )
    for position, source_rank in source_ranks.items():
        source_fp = LayoutFingerprint.from_dict(source_rank["fingerprint"])
        target_fp = LayoutFingerprint.from_dict(target_ranks[position]["fingerprint"])
        mismatch = source_fp.first_mismatch(target_fp)
        if mismatch is not None:
            raise MigrationFailed("session_info", f"KV layouts differ: {mismatch}")


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _join(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path.lstrip("/")


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
