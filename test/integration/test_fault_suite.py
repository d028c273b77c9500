"""Faults on real processes: concurrent migrations both ways, a target killed mid-migration,
a source killed after allocate, and a commit racing the watchdog — every case ends with
pools, node locks and host refs exactly at their baselines on the servers that live.

CPU mini servers (real scheduler side, real HTTP, real Mooncake TCP on 127.0.0.1).
`KVMIG_FAULT_ROUNDS` repeats the concurrent round (CI: 1; a soak: more).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import FAULT_PAIR_KEY
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang_kv_migration.client.migration import (
    AsyncMigrationClient,
    MigrationClient,
    MigrationFailed,
)
from sglang_kv_migration.server.same_host.allocate_channel import ALLOCATE_TIMEOUT_S
from timing import wait_until

PAGE = 16
ROUNDS = int(os.environ.get("KVMIG_FAULT_ROUNDS", "1"))
PER_SIDE = 25  # 50 concurrent migrations: 25 each way


def _seqs(base: int) -> list[list[int]]:
    return [
        list(range(base + 1000 * i, base + 1000 * i + (2 + i % 3) * PAGE)) for i in range(PER_SIDE)
    ]


@pytest.fixture
def pair(fault_pair) -> tuple[ServerHandle, ServerHandle]:
    return fault_pair


async def _migrate_all(
    a: ServerHandle, b: ServerHandle, a_seqs: list[list[int]], b_seqs: list[list[int]]
) -> list:
    async with AsyncMigrationClient(timeout=60.0, api_key=FAULT_PAIR_KEY) as client:
        jobs = [client.migrate(a.url, b.url, s) for s in a_seqs]
        jobs += [client.migrate(b.url, a.url, s) for s in b_seqs]
        return await asyncio.gather(*jobs, return_exceptions=True)


def test_fifty_concurrent_migrations_both_ways_leave_pools_exact(pair) -> None:
    a, b = pair
    migrations = 0
    for r in range(ROUNDS):
        # Fresh prefixes every round, each held by one side only (device pages of earlier
        # rounds are evicted to host first, so rounds can repeat as a soak).
        a.ask(0, "evict_device")
        b.ask(0, "evict_device")
        a_seqs, b_seqs = _seqs(10_000_000 * (2 * r + 1)), _seqs(10_000_000 * (2 * r + 2))
        for i, seq in enumerate(a_seqs):
            a.ask(0, "insert", seq, i)
        for i, seq in enumerate(b_seqs):
            b.ask(0, "insert", seq, 100 + i)
        before = (a.ask(0, "snapshot"), b.ask(0, "snapshot"))
        results = asyncio.run(_migrate_all(a, b, a_seqs, b_seqs))
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, failures[:3]
        moved = [r.migrated_token_size for r in results]
        assert moved == [len(s) for s in a_seqs + b_seqs]
        for seq in a_seqs:
            assert sum(b.ask(0, "held", seq)) == len(seq)
        for seq in b_seqs:
            assert sum(a.ask(0, "held", seq)) == len(seq)
        after = (a.ask(0, "snapshot"), b.ask(0, "snapshot"))
        for side in after:
            assert side.total_lock_ref == 0 and side.total_host_ref == 0
        for side, got, snap in ((b, sum(moved[:PER_SIDE]), 1), (a, sum(moved[PER_SIDE:]), 0)):
            slots = side.ask(0, "host_slots")
            assert slots["in_tree"] == slots["in_tree_unique"], "a host slot is held twice"
            assert slots["free"] == slots["free_unique"], "a host slot was freed twice"
            assert slots["overlap"] == 0, "a host slot is both free and in the tree"
            assert slots["in_tree"] + slots["free"] == slots["size"], "host slots leaked"
            if before[snap].host_available >= got:  # nothing had to be evicted: exact
                assert before[snap].host_available - after[snap].host_available == got
        migrations += len(results)
    print(f"fault suite: {migrations} concurrent migrations in {ROUNDS} round(s), 0 failed")


@pytest.mark.parametrize("one_trip", [True, False])
def test_a_target_killed_mid_migration_leaves_the_source_clean(one_trip: bool) -> None:
    """Killed as the transfer is sent: with one trip (feature "source_allocate") before
    it allocated, so the source answers that its process exited, and the client's own
    allocate then fails to connect; with two trips after it allocated."""
    ids = list(range(300_000, 300_000 + 64 * PAGE))
    source, target = start_servers([ServerSpec(preload=[(ids, 1)]), ServerSpec()])
    try:
        baseline = source.ask(0, "snapshot")
        sent = {"n": 0}

        def kill_target_on_transfer(request: httpx.Request) -> None:
            if request.url.path == "/transfer_request_kvcache" and not sent["n"]:
                sent["n"] += 1
                for process in target.processes:
                    process.kill()
                    process.join(10)

        with httpx.Client(timeout=30.0, event_hooks={"request": [kill_target_on_transfer]}) as http:
            client = MigrationClient(http_client=http)
            if not one_trip:
                for url in (source.url, target.url):
                    info = client.session_info(url)
                    info.features.remove("source_allocate")
            started = time.monotonic()
            with pytest.raises(MigrationFailed) as info:
                client.migrate(source.url, target.url, ids)
        assert info.value.phase == ("allocate" if one_trip else "transfer"), info.value
        assert not info.value.rolled_back  # the target is gone: nothing to roll back
        # Not the channel's timeout: the source saw the process exit.
        assert time.monotonic() - started < ALLOCATE_TIMEOUT_S
        # The source unpinned everything and keeps serving.
        assert wait_until(lambda: source.ask(0, "snapshot") == baseline, 60.0)
        info_reply = httpx.post(source.url + "/get_transfer_session_info", timeout=10)
        assert info_reply.status_code == 200
    finally:
        source.stop()
        target.stop()


def test_a_source_killed_after_allocate_is_cleaned_up_by_the_watchdog() -> None:
    ids = list(range(400_000, 400_000 + 8 * PAGE))
    source, target = start_servers(
        [ServerSpec(preload=[(ids, 1)]), ServerSpec(watchdog_timeout_s=2.0, grant_ttl_s=0.5)]
    )
    try:
        baseline = target.ask(0, "snapshot")

        def kill_source_on_transfer(request: httpx.Request) -> None:
            if request.url.path == "/transfer_request_kvcache":
                for process in source.processes:
                    process.kill()
                    process.join(10)

        with httpx.Client(timeout=10.0, event_hooks={"request": [kill_source_on_transfer]}) as http:
            with pytest.raises(MigrationFailed) as info:
                MigrationClient(http_client=http).migrate(source.url, target.url, ids)
        assert info.value.phase == "transfer"
        # The client's abort came without a receipt: quarantined, then freed after the
        # write window (0.5 s grant + 2 x 2 s transfer timeout); locks released at once.
        assert target.ask(0, "snapshot").total_lock_ref == baseline.total_lock_ref
        assert wait_until(lambda: target.ask(0, "snapshot") == baseline, 30.0)
        assert sum(target.ask(0, "held", ids)) == 0
    finally:
        source.stop()
        target.stop()


WATCHDOG_S = 2.0  # the racing commits' target's


def test_commit_racing_the_watchdog_is_all_or_nothing() -> None:
    """Commits sent around the watchdog deadline either insert (and keep) the pages or
    answer 410 and leave nothing behind; never both, never a leak."""
    seqs = [list(range(500_000 + 1000 * i, 500_000 + 1000 * i + 4 * PAGE)) for i in range(6)]
    source, target = start_servers(
        [
            ServerSpec(preload=[(s, i) for i, s in enumerate(seqs)]),
            # A 1 s grant: the transfer must start in it on a loaded box (the commit's
            # race with the watchdog is what is tested, not the transfer's with the grant).
            ServerSpec(watchdog_timeout_s=WATCHDOG_S, grant_ttl_s=WATCHDOG_S / 2),
        ]
    )
    try:
        baseline = target.ask(0, "snapshot")
        committed = 0

        def delay_commit(delay: float) -> Callable[[httpx.Request], None]:
            def hook(request: httpx.Request) -> None:
                if request.url.path == "/commit":
                    time.sleep(delay)

            return hook

        for i, seq in enumerate(seqs):
            delay = WATCHDOG_S - 0.6 + 0.2 * i  # from before to after the watchdog
            with httpx.Client(timeout=30.0, event_hooks={"request": [delay_commit(delay)]}) as h:
                try:
                    result = MigrationClient(http_client=h).migrate(source.url, target.url, seq)
                except MigrationFailed as e:
                    assert e.phase == "commit" and e.status_code == 410, e
                    assert sum(target.ask(0, "held", seq)) == 0
                else:
                    assert result.matched_after_commit == len(seq)
                    assert sum(target.ask(0, "held", seq)) == len(seq)
                    committed += len(seq)
        # Quarantined slots of expired migrations come back once their windows close.
        assert wait_until(
            lambda: target.ask(0, "snapshot").host_available == baseline.host_available - committed,
            30.0,
        )
        final = target.ask(0, "snapshot")
        assert final.total_lock_ref == 0 and final.total_host_ref == 0
    finally:
        source.stop()
        target.stop()
