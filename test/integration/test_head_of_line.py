"""One stalled target does not hold up a source's migrations to other targets.

Three CPU mini servers (real scheduler side, real HTTP, real Mooncake TCP): the source
starts a transfer into target A, A is stopped with SIGSTOP before the bytes arrive, and a
whole migration from the same source to target B must still finish while A's transfer
is held up — the source's HTTP layer keeps several transfers in flight and its
transport has one worker per peer. Then A resumes and its transfer completes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from mini_server import LONG_GRANT_S, ServerHandle, ServerSpec, start_servers
from multi_rank import host_transfer_body
from sglang_kv_migration.client.migration import MigrationClient

PAGE = 16
STALLED_IDS = list(range(40_000, 40_000 + 64 * PAGE))
FREE_IDS = list(range(50_000, 50_000 + 8 * PAGE))
WARM_IDS = list(range(60_000, 60_000 + 2 * PAGE))
FRESH_IDS = list(range(65_000, 65_000 + 8 * PAGE))
SECOND_FREE_IDS = list(range(55_000, 55_000 + 8 * PAGE))
# The grant of the target stopped before its first handshake: the source's write to it
# fails by the grant's write deadline (this + half its 4 s late-write margin), long
# enough for a whole migration to another target to finish meanwhile on a loaded box.
FRESH_GRANT_S = 8.0


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerHandle]]:
    """Source, a target stopped mid-transfer, a healthy target, and a target stopped
    before the source ever reached it."""
    handles = start_servers(
        [
            ServerSpec(
                preload=[
                    (STALLED_IDS, 1),
                    (FREE_IDS, 2),
                    (WARM_IDS, 3),
                    (FRESH_IDS, 4),
                    (SECOND_FREE_IDS, 5),
                ],
                transfer_timeout_s=20.0,
            ),
            # Its write must start however late the loaded box gets to it.
            ServerSpec(grant_ttl_s=LONG_GRANT_S),
            ServerSpec(),
            ServerSpec(grant_ttl_s=FRESH_GRANT_S),
        ]
    )
    try:
        yield handles
    finally:
        for handle in handles:
            for process in handle.processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGCONT)
            handle.stop()


def _post(url: str, path: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def test_a_stopped_target_does_not_hold_up_another(servers) -> None:
    source, stalled, free, _fresh = servers
    # The source has been talking to both targets (connections set up) before one stalls.
    with MigrationClient() as client:
        assert client.migrate(source.url, stalled.url, WARM_IDS).migrated_token_size
    alloc, transfer_body = _allocate(source, stalled, STALLED_IDS)
    stalled_pid = stalled.processes[0].pid
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        result: dict = {}
        blocked = threading.Thread(
            target=lambda: result.update(
                reply=_post(source.url, "/transfer_request_kvcache", transfer_body, 60.0)
            ),
            daemon=True,
        )
        blocked.start()
        time.sleep(0.5)  # the transfer to the stopped target is in flight on the source
        assert blocked.is_alive(), "the transfer to a stopped target finished"

        with MigrationClient(timeout=60.0) as client:
            moved = client.migrate(source.url, free.url, FREE_IDS)
        assert moved.migrated_token_size == len(FREE_IDS)
        # Done while the stopped target's transfer still waits (it could end only by the
        # source's 20 s transfer timeout): the healthy one was not queued behind it.
        assert blocked.is_alive(), "the stopped target answered"
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    blocked.join(60)
    assert not blocked.is_alive()
    reply = result["reply"].json()
    assert reply["success"], reply
    committed = _post(
        stalled.url,
        "/commit",
        {"migration_id": alloc["migration_id"], "receipts": [r["receipt"] for r in reply["ranks"]]},
    )
    assert committed.status_code == 200, committed.text


def test_a_target_stopped_before_the_first_handshake_holds_up_nothing(servers) -> None:
    """Mooncake's binding opens a peer's segment (the first handshake) under one
    engine-wide lock; the transport probes a new peer first, on a thread of its own."""
    source, _stalled, free, fresh = servers
    alloc, transfer_body = _allocate(source, fresh, FRESH_IDS)  # HTTP only: no handshake
    fresh_pid = fresh.processes[0].pid
    os.kill(fresh_pid, signal.SIGSTOP)
    try:
        result: dict = {}
        started_stalled = time.monotonic()

        def send() -> None:
            result["reply"] = _post(source.url, "/transfer_request_kvcache", transfer_body, 90.0)
            result["seconds"] = time.monotonic() - started_stalled

        blocked = threading.Thread(target=send, daemon=True)
        blocked.start()
        time.sleep(0.5)  # the source's worker for the stopped target is in its handshake
        assert blocked.is_alive(), "the transfer to a stopped target finished"
        with MigrationClient(timeout=60.0) as client:
            moved = client.migrate(source.url, free.url, SECOND_FREE_IDS)
        assert moved.migrated_token_size == len(SECOND_FREE_IDS)
        # Done while the stalled transfer still waits in its handshake: the healthy one
        # was not queued behind it.
        assert blocked.is_alive(), "the transfer to the stopped target ended first"
        # The stalled transfer fails by its grant's write deadline (`FRESH_GRANT_S` + half
        # the target's 4 s late-write margin), not at Mooncake's 60 s socket timeout.
        blocked.join(60)
        assert not blocked.is_alive(), "the transfer to the stopped target did not fail"
    finally:
        os.kill(fresh_pid, signal.SIGCONT)
    reply = result["reply"]
    assert reply.status_code == 502, reply.text
    assert "handshake probe" in reply.json()["message"]
    assert result["seconds"] <= FRESH_GRANT_S + 30.0, result["seconds"]
    aborted = _post(fresh.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    assert aborted.status_code == 200, aborted.text


def _allocate(source: ServerHandle, target: ServerHandle, ids: list[int]) -> tuple[dict, dict]:
    """Allocate `ids` on `target` over HTTP; return the reply and the transfer body."""
    info = _post(source.url, "/get_transfer_session_info", {}).json()
    target_info = _post(target.url, "/get_transfer_session_info", {}).json()
    alloc = _post(
        target.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": ids,
            "source_fingerprints": [r["fingerprint"] for r in info["ranks"]],
            "source_instance": info["instance_id"],
            "index_format": "pages",
        },
    ).json()
    assert alloc["success"], alloc
    body = host_transfer_body(ids, alloc, target_info)
    return alloc, body
