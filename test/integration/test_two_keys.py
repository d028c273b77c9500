"""SGLang's two keys: `api_key` for /generate and the load routes, `admin_api_key` for
/abort_request and the six migration routes.

Two CPU mini servers (real HiRadixCache, real migration routes, Mooncake TCP on
127.0.0.1) with the `/generate` stand-in, both started with ``api_key`` and
``admin_api_key`` and guarded by SGLang's own `add_api_key_middleware`. With both keys
the migrator moves a request with its KV; given only the API key, a move fails at once
with `AuthFailed` naming the refused route — not after `abort_timeout_s` of retries —
and the request keeps running where it was.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from generate_standin import StandinConfig, expected_output, held_at, hold, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
from sglang_kv_migration import cli
from sglang_kv_migration.client.migration import (
    ADMIN_ROUTES,
    ApiKeys,
    AuthFailed,
    MigrationClient,
)
from sglang_kv_migration.rollout.cost_model import CostModel, MigrationCosts, PrefillCosts
from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestMigrator,
)
from timing import wait_until

PAGE = 16
API_KEY, ADMIN_KEY = "user-key", "admin-key"
HISTORY = list(range(40_000, 40_000 + 2 * PAGE))  # an earlier turn, cached on the source
CLI_HISTORY = list(range(41_000, 41_000 + 2 * PAGE))
# The key the stand-in's own routes (its `/standin/hold` gate) ask for.
API_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Where the source holds a request a test moves: it is still there when the move comes.
HOLD_AT = 10
ALWAYS_MIGRATE = CostModel(
    MigrationCosts(bandwidth_bytes_per_s=1e12, overhead_s=0.0), PrefillCosts(seconds_per_token=1.0)
)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerHandle, ServerHandle]]:
    def spec(preload: list) -> ServerSpec:
        engine = standin_factory(StandinConfig(max_running=1, step_s=0.01, capacity_tokens=200))
        return ServerSpec(
            extension=engine, preload=preload, api_key=API_KEY, admin_api_key=ADMIN_KEY
        )

    handles = start_servers([spec([(HISTORY, 1), (CLI_HISTORY, 2)]), spec([])])
    try:
        yield handles[0], handles[1]
    finally:
        for handle in handles:
            handle.stop()


def running(server: ServerHandle) -> int:
    r = httpx.get(server.url + "/v1/loads", headers=API_HEADERS, timeout=30)
    return r.raise_for_status().json()["loads"][0]["num_running_reqs"]


class CountAborts(httpx.AsyncBaseTransport):
    """Counts the /abort_request calls the migrator sends; passes everything through."""

    def __init__(self) -> None:
        self.aborts = 0
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            self.aborts += 1
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


async def _started(handle) -> None:
    """Until `handle`'s request has its first token (bounded)."""
    deadline = time.monotonic() + 60.0
    while not handle.started and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert handle.started, "the request did not start"


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("server_keys", [(None, None), ("u", None), (None, "a"), ("u", "a")])
def test_client_sends_the_key_sglang_accepts_on_every_route(server_keys: tuple) -> None:
    """Holding the server's keys (one, the other or both), `ApiKeys` picks for each route
    the key SGLang's own auth decision accepts; holding only the API key of a two-key
    server, admin routes are refused and /generate still works."""
    api, admin = server_keys
    keys = ApiKeys(api, admin)
    for route in [*ADMIN_ROUTES, "/generate", "/v1/loads", "/get_load"]:
        level = AuthLevel.ADMIN_OPTIONAL if route in ADMIN_ROUTES else AuthLevel.NORMAL
        header = keys.headers(route).get("Authorization")
        decision = decide_request_auth(
            method="POST",
            path=route,
            authorization_header=header,
            api_key=api,
            admin_api_key=admin,
            auth_level=level,
        )
        assert decision.allowed, (route, server_keys)
    if api and admin:
        only_api = ApiKeys(api_key=api)
        refused = decide_request_auth(
            method="POST",
            path="/abort_request",
            authorization_header=only_api.headers("/abort_request")["Authorization"],
            api_key=api,
            admin_api_key=admin,
            auth_level=AuthLevel.ADMIN_OPTIONAL,
        )
        assert not refused.allowed and refused.error_status_code == 401


def test_both_keys_move_a_request_with_its_kv(servers: tuple) -> None:
    source, target = servers
    prompt = HISTORY + list(range(40_500, 40_509))
    with RequestMigrator(
        cost_model=ALWAYS_MIGRATE, api_key=API_KEY, admin_api_key=ADMIN_KEY
    ) as migrator:
        with held_at(source.url, HOLD_AT, headers=API_HEADERS):
            handle = migrator.submit(source.url, GenerateRequest(prompt, {"max_new_tokens": 40}))
            assert wait_until(lambda: running(source) == 1, 60)
            handle.migrator.move_request(handle, target.url)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 40)
    (move,) = out.moves
    assert move.outcome == "migrated", move.failure
    assert move.migration.migrated_token_size >= len(HISTORY)
    assert [s.server_url for s in out.segments] == [source.url, target.url]
    assert out.segments[1].cached_tokens == move.migration.matched_after_commit


def test_refused_abort_fails_at_once_naming_the_route(servers: tuple) -> None:
    """Only the API key, re-prefill mode (no migration route is called first): the
    source refuses the abort; the migrator raises after that one call although it would
    retry every 50 ms for 30 s, and the request finishes on the source untouched."""
    source, target = servers
    prompt = list(range(42_000, 42_020))

    async def scenario() -> tuple:
        transport = CountAborts()
        http = httpx.AsyncClient(transport=transport, timeout=60)
        async with (
            http,
            AsyncRequestMigrator(
                api_key=API_KEY, http_client=http, abort_retry_s=0.05, abort_timeout_s=30.0
            ) as migrator,
        ):
            handle = await migrator.submit(
                source.url, GenerateRequest(prompt, {"max_new_tokens": 30})
            )
            await _started(handle)
            with pytest.raises(AuthFailed) as refused:
                await migrator.move_request(handle, target.url, mode="recompute")
            moving_after = handle.moving
            await asyncio.to_thread(hold, source.url, None, headers=API_HEADERS)
            return refused.value, transport.aborts, moving_after, await handle.result()

    # The request waits at the gate until the refused move is over (else it could
    # finish first, and there would be nothing to move).
    with held_at(source.url, HOLD_AT, headers=API_HEADERS):
        failure, aborts, moving_after, out = asyncio.run(scenario())
    assert failure.route == "/abort_request" and failure.status_code == 401
    assert "/abort_request" in str(failure) and "the API key" in str(failure)
    assert "--admin-api-key" in str(failure)
    assert aborts == 1  # not retried
    assert not moving_after
    assert [s.kind for s in out.segments] == ["original"]
    assert out.output_ids == expected_output(prompt, 30)


def test_refused_admin_key_stops_a_migration_before_the_abort(servers: tuple) -> None:
    """Only the API key, migrate mode: the session-info check refuses before the abort
    is sent, so the request is not stopped (rather than silently re-prefilled)."""
    source, target = servers
    prompt = list(range(43_000, 43_020))

    async def scenario() -> tuple:
        transport = CountAborts()
        http = httpx.AsyncClient(transport=transport, timeout=60)
        async with http, AsyncRequestMigrator(api_key=API_KEY, http_client=http) as migrator:
            handle = await migrator.submit(
                source.url, GenerateRequest(prompt, {"max_new_tokens": 20})
            )
            with pytest.raises(AuthFailed) as refused:
                await migrator.move_request(handle, target.url, mode="migrate")
            await asyncio.to_thread(hold, source.url, None, headers=API_HEADERS)
            return refused.value, transport.aborts, await handle.result()

    with held_at(source.url, HOLD_AT, headers=API_HEADERS):  # not finished before the move
        failure, aborts, out = asyncio.run(scenario())
    assert failure.route == "/get_transfer_session_info"
    assert "--admin-api-key" in str(failure)
    assert aborts == 0
    assert out.output_ids == expected_output(prompt, 20)


def test_wrong_admin_key_fails_the_client_and_the_cli(servers: tuple, capsys) -> None:
    source, target = servers
    with MigrationClient(api_key=API_KEY, admin_api_key="wrong") as client:
        with pytest.raises(AuthFailed) as refused:
            client.migrate(source.url, target.url, CLI_HISTORY)
    assert refused.value.status_code == 401
    assert "/get_transfer_session_info refused the key" in str(refused.value)

    urls = ["--source", source.url, "--target", target.url]
    ids = ["--input-ids", ",".join(map(str, CLI_HISTORY))]
    assert cli.main([*urls, *ids, "--api-key", API_KEY]) == 1
    assert "--admin-api-key" in capsys.readouterr().err
    keys = ["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY]
    assert cli.main([*urls, *ids, *keys, "--path", "host", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["migrated_token_size"] == len(CLI_HISTORY)
    assert result["path"] == "host"


def test_rebalancer_with_both_keys_and_with_a_refused_one(servers: tuple) -> None:
    """With both keys the rebalancer polls (/v1/loads: API key) and moves (admin key)
    a queued request; with the wrong API key its first poll raises `AuthFailed`."""
    source, target = servers
    blocker = list(range(44_000, 44_000 + PAGE))
    queued_prompt = list(range(44_100, 44_105))
    policy = RebalancePolicy(kv_pressure=0.05, mode="recompute")

    async def scenario() -> tuple:
        async with AsyncRequestMigrator(api_key=API_KEY, admin_api_key=ADMIN_KEY) as migrator:
            first = await migrator.submit(
                source.url, GenerateRequest(blocker, {"max_new_tokens": 40})
            )
            await _started(first)
            queued = await migrator.submit(
                source.url, GenerateRequest(queued_prompt, {"max_new_tokens": 4}, priority=5)
            )
            rebalancer = Rebalancer(migrator, [source.url, target.url], policy)
            moves = []
            deadline = time.monotonic() + 60.0
            while not moves and time.monotonic() < deadline:  # until it shows in the load
                moves = await rebalancer.step()
                if not moves:
                    await asyncio.sleep(0.01)
            out = await queued.result()
            await first.result()
        async with AsyncRequestMigrator(api_key="wrong", admin_api_key=ADMIN_KEY) as bad:
            with pytest.raises(AuthFailed) as refused:
                await Rebalancer(bad, [source.url, target.url], policy).step()
        return moves, queued, out, refused.value

    # The blocker waits at the gate until the queued request was moved.
    with held_at(source.url, HOLD_AT, aborts=1, headers=API_HEADERS):
        moves, queued, out, refused = asyncio.run(scenario())
    assert [m.handle for m in moves] == [queued]
    assert out.segments[-1].server_url == target.url
    assert out.output_ids == expected_output(queued_prompt, 4)
    assert refused.route == "/v1/loads" and "the API key" in str(refused)
