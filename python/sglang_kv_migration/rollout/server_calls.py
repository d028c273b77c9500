"""What the request migrator asks of the servers, in one place: each piece's streamed
`/generate` (through the model gateway when there is one), the migrations and size
queries through the migration client (sync or asyncio), the stop's `/abort_request`, and
the load and metrics routes; with the API and admin keys each route takes. The move's
stages (`stop.py`, `live_stages.py`, `live_rounds.py`, `resume.py`) reach the servers
only through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import httpx

from sglang_kv_migration.client.auth import ApiKeys, auth_hint
from sglang_kv_migration.client.calls import SIZE_QUERY, SIZE_QUERY_ROUTE, size_query
from sglang_kv_migration.client.migration import AsyncMigrationClient, MigrationClient
from sglang_kv_migration.client.results import AuthFailed, MigrationFailed, MigrationResult
from sglang_kv_migration.rollout.generate_stream import (
    JSON_HEADERS,
    GenerateFailed,
    PieceProgress,
    encoded_body,
    read_generate_stream,
)
from sglang_kv_migration.rollout.request_types import GenerateRequest
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply

logger = logging.getLogger(__name__)

DEFAULT_GENERATE_TIMEOUT_S = 3600.0


class GatewayRouting(Protocol):
    """A gateway in front of the workers (`integrations.gateway.ModelGateway`): `stream`
    POSTs through it to the worker `worker_url` names and yields that worker's reply (its
    `status_code`, `aread()` and `aiter_lines()`, as a streamed httpx response has)."""

    def stream(
        self, http: Any, worker_url: str, body: Any, headers: Any
    ) -> AbstractAsyncContextManager[Any]: ...


class ServerCalls:
    """The servers as a request migrator reaches them (module docstring). `migration_client`
    may be an `AsyncMigrationClient` or a `MigrationClient` (run in a worker thread);
    without one, an `AsyncMigrationClient` with the same keys is made and closed with
    this. `gateway`: every `/generate` goes through it, pinned to the worker named."""

    def __init__(
        self,
        migration_client: AsyncMigrationClient | MigrationClient | None = None,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        generate_timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
        gateway: GatewayRouting | None = None,
    ):
        self.keys = ApiKeys(api_key, admin_api_key)
        self.gateway = gateway
        self._migration = migration_client or AsyncMigrationClient(
            api_key=api_key, admin_api_key=admin_api_key
        )
        self._owns_migration = migration_client is None
        self._http = http_client or httpx.AsyncClient(timeout=generate_timeout_s)
        self._owns_http = http_client is None

    async def generate(
        self, url: str, request: GenerateRequest, progress: PieceProgress
    ) -> dict[str, Any]:
        """One piece's `/generate`, streamed so that `progress` learns when its first token
        arrives (SGLang publishes no per-request queue state); returns what the same call
        without streaming would have returned."""
        body = encoded_body({**request.body(), "stream": True})
        where = url.rstrip("/") + "/generate"
        try:
            headers = {**JSON_HEADERS, **self.keys.headers("/generate")}
            progress.sent_at = time.monotonic()
            if self.gateway is None:
                opened = self._http.stream("POST", where, content=body, headers=headers)
            else:  # through the gateway, pinned to `url` (resolved and checked there)
                opened = self.gateway.stream(self._http, url, body, headers)
                where += " via the gateway"
            async with opened as r:
                if r.status_code >= 300:
                    text = (await r.aread()).decode(errors="replace")
                    hint = ""
                    if r.status_code in (401, 403):
                        hint = f" (sent {self.keys.sent('/generate')}; {auth_hint('/generate')})"
                    raise GenerateFailed(f"{where}: HTTP {r.status_code}: {text[:500]}{hint}")
                return await read_generate_stream(r.aiter_lines(), progress, where)
        except httpx.HTTPError as e:
            raise GenerateFailed(f"{where}: {type(e).__name__}: {e}") from e

    async def migrate(
        self,
        source: str,
        target: str,
        ids: list[int],
        extra_key: str | None,
        path: str | None,
        held: ExtraTokenSizeReply,
        running_rid: str = "",
    ) -> MigrationResult:
        # `path` only when asked for, so clients without the keyword keep working.
        kwargs: dict[str, Any] = {"path": path} if path is not None else {}
        kwargs["held"] = held
        if running_rid:  # feature "running_slots"
            kwargs["running_rid"] = running_rid
        client = self._migration
        if isinstance(client, AsyncMigrationClient):
            return await client.migrate(source, target, ids, extra_key, **kwargs)
        return await asyncio.to_thread(client.migrate, source, target, ids, extra_key, **kwargs)

    async def session_info(self, url: str) -> SessionInfoReply:
        client = self._migration
        if isinstance(client, AsyncMigrationClient):
            return await client.session_info(url)
        return await asyncio.to_thread(client.session_info, url)

    async def held_kv(
        self,
        url: str,
        input_ids: list[int],
        extra_key: str | None = None,
        running_rid: str = "",
    ) -> ExtraTokenSizeReply:
        """What `url` holds of `input_ids` (its `/get_request_extra_token_size` reply:
        ``matched_token_size``, device and host tier, and ``device_token_size``; with
        `running_rid`, feature "running_slots", also ``running_token_size``)."""
        try:
            info = await self.session_info(url)  # cached: no trip after the first
        except MigrationFailed:  # the query below reports what is wrong with the server
            info = None
        body = size_query(info, input_ids, extra_key, running_rid=running_rid)
        return await self._size_query(url, body)

    async def host_headroom(self, url: str) -> int | None:
        """Host slots a host-path allocate on `url` could claim now (free plus evictable
        host-only pages), None when it does not say. One size query with ``headroom``:
        what it holds of the one-token prompt asked is irrelevant."""
        reply = await self._size_query(url, size_query(None, [0], headroom=True))
        value = reply.host_headroom_tokens
        return value if isinstance(value, int) and value >= 0 else None

    async def page_size(self, url: str) -> int:
        """The server's page size, from its (cached) session info; 1 when unknown."""
        try:
            info = await self.session_info(url)
            return max(1, info.ranks[0].page_size)
        except (MigrationFailed, httpx.HTTPError, IndexError, TypeError, ValueError):
            return 1

    async def check_admin_key(self, source_url: str, target_url: str) -> None:
        """Read both servers' session info (cached by the client: free after the first
        move) so that a refused admin key raises here, before the abort, instead of
        turning every move into a silent re-prefill. Other failures are left to the
        migration, whose fallbacks handle them."""
        for url in (source_url, target_url):
            try:
                await self.session_info(url)
            except AuthFailed:
                raise
            except (MigrationFailed, httpx.HTTPError) as e:
                logger.debug("session info of %s: %s", url, e)

    async def abort_request(self, url: str, rid: str) -> None:
        """`/abort_request` of `rid` on `url`; raises `AuthFailed` when the server refuses
        the key, `httpx.HTTPError` on other failures (the stop retries those)."""
        r = await self._http.post(
            url.rstrip("/") + "/abort_request",
            json={"rid": rid},
            headers=self.keys.headers("/abort_request"),
            timeout=10.0,
        )
        self._raise_if_refused(url, "/abort_request", r)

    async def get_json(self, url: str, path: str) -> Any:
        """GET a JSON endpoint (e.g. `/v1/loads`); raises `AuthFailed` when the server
        refuses the key, `httpx.HTTPError` on other failures."""
        r = await self._http.get(
            url.rstrip("/") + path, headers=self.keys.headers(path), timeout=10.0
        )
        self._raise_if_refused(url, path, r)
        r.raise_for_status()
        return r.json()

    async def get_text(self, url: str, path: str) -> str | None:
        try:
            headers = self.keys.headers(path)
            r = await self._http.get(url.rstrip("/") + path, headers=headers, timeout=10.0)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code < 300 else None

    async def _size_query(self, url: str, body: Any) -> ExtraTokenSizeReply:
        """`/get_request_extra_token_size` of `url` with `body` (`size_query`)."""
        client = self._migration
        route = SIZE_QUERY_ROUTE
        if isinstance(client, AsyncMigrationClient):
            reply = await client.call(url, route, body)
        else:
            reply = await asyncio.to_thread(client.call, url, route, body)
        try:
            return from_dict(ExtraTokenSizeReply, reply)
        except ValueError as e:
            raise MigrationFailed(SIZE_QUERY, f"{url}{route}: malformed reply: {e}") from None

    def _raise_if_refused(self, url: str, path: str, response: httpx.Response) -> None:
        """A 401/403 is a wrong or missing key: raise at once, naming route and key."""
        if response.status_code not in (401, 403):
            return
        route = path.split("?", 1)[0]
        raise AuthFailed(
            route.strip("/"),
            route,
            f"{url.rstrip('/')}{route} refused {self.keys.sent(path)} (HTTP "
            f"{response.status_code}: {response.text[:200]}); {auth_hint(path)}",
            response.status_code,
        )

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()
        if self._owns_migration:
            await _maybe_await(_close(self._migration))


def _close(client: AsyncMigrationClient | MigrationClient) -> Any:
    if isinstance(client, AsyncMigrationClient):
        return client.aclose()
    client.close()
    return None


async def _maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value):
        await value
