"""Feature "transfer_batch" against real servers on 127.0.0.1: `migrate_many` sends the
transfers bound for one source in one call, each move succeeds or fails on its own, the
batch body is checked like any other, and a server without the feature gets one call
per move.

ServerPair are `mini_server` processes (see `test_http_api.py`): real HiRadixCache, our
scheduler hooks and handlers, our routes on uvicorn, Mooncake TCP, the real channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from mini_server import ServerHandle, ServerPair, ServerSpec, serving
from sglang_kv_migration import TRANSFER_BATCH_FEATURE
from sglang_kv_migration.client import (
    AsyncMigrationClient,
    MigrationClient,
    MigrationFailed,
    MigrationResult,
    Move,
)
from sglang_kv_migration.wire.bodies import MAX_BATCH_MOVES
from sglang_kv_migration.wire.convert import to_wire

PAGE = 16
HTTP_TIMEOUT_S = 30.0
TRANSFER = "/transfer_request_kvcache"


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


BATCH = [_seq(30000 + 1000 * i, (i + 2) * PAGE) for i in range(4)]
ASYNC_BATCH = [_seq(40000 + 1000 * i, 3 * PAGE) for i in range(3)]
ONE_BY_ONE = [_seq(50000 + 1000 * i, 2 * PAGE) for i in range(3)]
GOOD_BESIDE_BAD = _seq(60000, 4 * PAGE)
# More than the target's host pool (8192 slots) can hold: its allocate refuses it.
TOO_LONG = _seq(70000, 16384)
HOSTILE_SEQ = _seq(80000, 2 * PAGE)


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    held = [*BATCH, *ASYNC_BATCH, *ONE_BY_ONE, GOOD_BESIDE_BAD, HOSTILE_SEQ]
    preload = [(ids, seed) for seed, ids in enumerate(held, start=1)]
    with serving([ServerSpec(preload=preload), ServerSpec()]) as handles:
        yield ServerPair(*handles)


class _Counted:
    """An httpx client for `MigrationClient` that counts the calls of each route."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.client = httpx.Client(timeout=HTTP_TIMEOUT_S, event_hooks={"request": [self._count]})

    def _count(self, request: httpx.Request) -> None:
        self.calls[request.url.path] = self.calls.get(request.url.path, 0) + 1


def _holds(server: ServerHandle, ids: list[int]) -> int:
    return sum(server.ask(0, "held", ids))


def _same_kv(servers: ServerPair, ids: list[int]) -> None:
    source = servers.source.ask(0, "kv", ids)
    target = servers.target.ask(0, "kv", ids)
    assert len(source) == len(target)
    for a, b in zip(source, target, strict=True):  # byte for byte (random KV has NaNs)
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_both_servers_list_the_feature(servers: ServerPair) -> None:
    for server in (servers.source, servers.target):
        info = httpx.post(server.url + "/get_transfer_session_info", json={}).json()
        assert TRANSFER_BATCH_FEATURE in info["features"]


def test_migrate_many_sends_the_transfers_to_one_source_in_one_call(servers: ServerPair) -> None:
    counted = _Counted()
    with MigrationClient(http_client=counted.client) as client:
        results = client.migrate_many(
            [Move(servers.source.url, servers.target.url, ids) for ids in BATCH]
        )
    assert counted.calls.get(TRANSFER) == 1, counted.calls
    assert "/allocate_token_for_transfer" not in counted.calls  # one-call moves
    assert "/commit" not in counted.calls  # the source committed through the mailbox
    for ids, result in zip(BATCH, results, strict=True):
        assert isinstance(result, MigrationResult), result
        assert result.migrated_token_size == len(ids)
        assert result.source_committed
        # Each move's trip: the batch's parse and route, its own hop and handler.
        steps = result.steps_ms["transfer"]
        assert steps["route"] >= steps["parse"] >= 0 and "handler" in steps
        assert _holds(servers.target, ids) == len(ids)
        _same_kv(servers, ids)
    assert servers.target.ask(0, "pending") == 0


def test_a_move_that_fails_fails_alone_and_is_rolled_back(servers: ServerPair) -> None:
    before = servers.target.ask(0, "snapshot")
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        good, bad = client.migrate_many(
            [
                Move(servers.source.url, servers.target.url, GOOD_BESIDE_BAD),
                Move(servers.source.url, servers.target.url, TOO_LONG),
            ]
        )
    assert isinstance(good, MigrationResult), good
    assert good.migrated_token_size == len(GOOD_BESIDE_BAD)
    assert _holds(servers.target, GOOD_BESIDE_BAD) == len(GOOD_BESIDE_BAD)
    assert isinstance(bad, MigrationFailed)
    assert "allocate" in bad.phase or "transfer" in bad.phase, bad
    assert _holds(servers.target, TOO_LONG) == 0
    assert servers.target.ask(0, "pending") == 0
    after = servers.target.ask(0, "snapshot")
    # Only the good move's pages were added to the target's tree.
    assert after != before


def test_the_async_client_batches_too(servers: ServerPair) -> None:
    async def run() -> list[Any]:
        async with AsyncMigrationClient(timeout=HTTP_TIMEOUT_S) as client:
            return await client.migrate_many(
                [Move(servers.source.url, servers.target.url, ids) for ids in ASYNC_BATCH]
            )

    results = asyncio.run(run())
    for ids, result in zip(ASYNC_BATCH, results, strict=True):
        assert isinstance(result, MigrationResult), result
        assert result.migrated_token_size == len(ids)
        assert _holds(servers.target, ids) == len(ids)


def test_a_source_without_the_feature_gets_one_call_per_move(servers: ServerPair) -> None:
    counted = _Counted()
    with MigrationClient(http_client=counted.client) as client:
        info = client.session_info(servers.source.url)  # as an older server lists them
        info.features = [f for f in info.features if f != TRANSFER_BATCH_FEATURE]
        results = client.migrate_many(
            [Move(servers.source.url, servers.target.url, ids) for ids in ONE_BY_ONE]
        )
    assert counted.calls.get(TRANSFER) == len(ONE_BY_ONE), counted.calls
    assert all(isinstance(r, MigrationResult) for r in results), results
    assert all(_holds(servers.target, ids) == len(ids) for ids in ONE_BY_ONE)


def _one_body(servers: ServerPair) -> dict[str, Any]:
    """A well-formed one-call transfer body, as the client builds it."""
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        captured: list[dict[str, Any]] = []
        real_post = client._post

        def capture(call: Any) -> Any:
            if call.path == TRANSFER:
                captured.append(to_wire(call.body))
                return 599, {"success": False, "message": "not sent"}
            return real_post(call)

        client._post = capture  # type: ignore[method-assign]
        with pytest.raises(MigrationFailed):
            client.migrate(servers.source.url, servers.target.url, HOSTILE_SEQ)
    return captured[0]


@pytest.mark.parametrize(
    "make_body, needle",
    [
        (lambda one: {"moves": []}, "moves"),
        (lambda one: {"moves": [one] * (MAX_BATCH_MOVES + 1)}, "moves"),
        (lambda one: {"moves": [{**one, "bogus": 1}]}, "moves.0.bogus"),
        (lambda one: {"moves": [one, {**one, "target_per_rank": []}]}, "moves.1.target_per_rank"),
        (lambda one: {"moves": [one], "input_ids": [1, 2]}, "input_ids"),
        (lambda one: {"moves": "all of them"}, "moves"),
        (lambda one: [one], "body"),
    ],
)
def test_a_hostile_batch_is_refused_whole_by_name_and_nothing_is_held(
    servers: ServerPair, make_body: Any, needle: str
) -> None:
    one = _one_body(servers)
    before = servers.target.ask(0, "snapshot")
    r = httpx.post(servers.source.url + TRANSFER, json=make_body(one), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert needle in r.json()["message"], r.text
    assert servers.target.ask(0, "snapshot") == before
    assert servers.target.ask(0, "pending") == 0


def test_malformed_json_is_a_400(servers: ServerPair) -> None:
    r = httpx.post(
        servers.source.url + TRANSFER,
        content=b'{"moves": [',
        headers={"Content-Type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["message"]
