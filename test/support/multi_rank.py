"""Helpers shared by the tests that drive mini servers over HTTP (the multi-rank TP, PP,
TP x PP tests and the network tests): a client that keeps every reply, a migration that
fails on an injected rank, a hand-built host transfer body, and comparisons of per-rank
KV."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang_kv_migration.client.migration import MigrationClient

HTTP_TIMEOUT_S = 120.0


@dataclass
class ServerPair:
    a: ServerHandle
    b: ServerHandle
    start_s: float  # how long starting both took


@contextlib.contextmanager
def server_pair(spec_a: ServerSpec, spec_b: ServerSpec, timeout_s: float) -> Iterator[ServerPair]:
    """Two mini servers started together (each rank a process), stopped on exit."""
    t0 = time.monotonic()
    a, b = start_servers([spec_a, spec_b], timeout_s=timeout_s)
    try:
        yield ServerPair(a, b, time.monotonic() - t0)
    finally:
        a.stop()
        b.stop()


class Recorder:
    """Keeps the reply of every call a client makes, by path (httpx event hook): JSON when
    the body is JSON, else its text."""

    def __init__(self) -> None:
        self.replies: list[tuple[str, int, Any]] = []

    def hook(self, response: httpx.Response) -> None:
        response.read()
        try:
            body = response.json()
        except ValueError:
            body = response.text
        self.replies.append((response.request.url.path, response.status_code, body))

    def last(self, path: str) -> tuple[int, Any]:
        for p, status, body in reversed(self.replies):
            if p == path:
                return status, body
        raise AssertionError(f"no call to {path} was recorded")

    def client(self) -> MigrationClient:
        http = httpx.Client(timeout=HTTP_TIMEOUT_S, event_hooks={"response": [self.hook]})
        return MigrationClient(http_client=http)


def migrate_into_injected_failure(
    source_url: str, target_url: str, ids: list[int]
) -> tuple[Recorder, dict[str, Any]]:
    """Migrate `ids` where one source rank's transport refuses every write (the
    servers' `broken_transport_rank`): the client must fail at transfer, name the
    injected failure and roll the target back; the transfer trip answers 502. Returns
    the recorder (every reply) and the transfer reply."""
    import pytest
    from sglang_kv_migration.client.migration import MigrationFailed

    recorder = Recorder()
    with recorder.client() as client, pytest.raises(MigrationFailed) as failed:
        client.migrate(source_url, target_url, ids)
    assert failed.value.phase == "transfer"
    assert failed.value.rolled_back is True
    assert "injected failure" in failed.value.message
    status, transfer = recorder.last("/transfer_request_kvcache")
    assert status == 502, transfer
    return recorder, transfer


def host_transfer_body(
    ids: list[int], alloc: dict[str, Any], target_info: dict[str, Any]
) -> dict[str, Any]:
    """The `/transfer_request_kvcache` body that sends `ids` into a one-rank target's
    allocation over the host path, as the client would build it (the slots as the
    allocate reply gave them: `kv_pages` or `kv_indices`)."""
    rank, target = alloc["ranks"][0], target_info["ranks"][0]
    slots = "kv_pages" if rank.get("kv_pages") else "kv_indices"
    return {
        "input_ids": ids,
        "matched_token_size": alloc["matched_token_size"],
        "extra_token_size": alloc["extra_token_size"],
        "migration_id": alloc["migration_id"],
        "target_per_rank": [
            {
                "tp": 0,
                "pp": 0,
                "path": "host",
                slots: rank[slots],
                "grant": rank["grant"],
                "fingerprint": target["fingerprint"],
                **target["paths"]["host"],
            }
        ],
    }


# How far `close_windows` moves a server's migration clock: past any grant's write
# window and any watchdog deadline of these servers.
PAST_EVERY_WINDOW_S = 3600.0


def close_windows(server: ServerHandle, ranks: Sequence[int] | None = None) -> None:
    """Move the migration clock of `server`'s ranks (all of them by default)
    `PAST_EVERY_WINDOW_S` ahead: write windows and watchdog deadlines pass at once, so a
    test of slots coming back (out of quarantine, or expired) waits for no clock. Later
    allocations on the server keep their whole windows on the moved clock."""
    for rank in range(len(server.control)) if ranks is None else ranks:
        server.ask(rank, "advance_clock", PAST_EVERY_WINDOW_S)


def post(url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=HTTP_TIMEOUT_S)


def session_info(url: str) -> dict[str, Any]:
    r = post(url, "/get_transfer_session_info")
    assert r.status_code == 200, r.text
    return r.json()


def kv_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Byte-for-byte equality of two lists of KV tensors (any dtype)."""
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def aligned(ids: list[int], page: int) -> list[int]:
    """The whole pages of `ids`: what a migration moves."""
    return ids[: len(ids) // page * page]


def every_rank_transfer_body(
    ids: list[int], alloc: dict[str, Any], target_info: dict[str, Any]
) -> dict[str, Any]:
    """The `/transfer_request_kvcache` body that sends `ids` into every rank of a one-stage
    target's allocation over the host path (token slots), as the client would build it."""
    return {
        "input_ids": ids,
        "matched_token_size": alloc["matched_token_size"],
        "extra_token_size": alloc["extra_token_size"],
        "migration_id": alloc["migration_id"],
        "target_per_rank": [
            {
                "tp": rank["tp_rank"],
                "pp": 0,
                "path": "host",
                "kv_indices": granted["kv_indices"],
                "grant": granted["grant"],
                "fingerprint": rank["fingerprint"],
                **rank["paths"]["host"],
            }
            for rank, granted in zip(target_info["ranks"], alloc["ranks"], strict=True)
        ],
    }


def check_one_claim_per_grant(
    source: ServerHandle, target: ServerHandle, ids: list[int], alloc: dict[str, Any]
) -> None:
    """One grant, one claim, per server, where every rank of a server is its own TP rank
    (CP ranks among them): each grant names its rank's tp, so it verifies on one
    scheduler only. Swapped between ranks, the grants move nothing; the transfer then
    succeeds; sent again, it is refused as a replay on every rank, and its receipts
    neither commit nor settle: the first transfer's commit."""
    from sglang_kv_migration import grants

    body = every_rank_transfer_body(ids, alloc, session_info(target.url))
    entries = body["target_per_rank"]
    rotated = [e["grant"] for e in entries[1:] + entries[:1]]
    swapped = [{**e, "grant": g} for e, g in zip(entries, rotated, strict=True)]
    r = post(source.url, "/transfer_request_kvcache", {**body, "target_per_rank": swapped})
    assert r.status_code == 403, r.text
    assert all(x["bytes"] == 0 for x in r.json()["ranks"]), r.text
    first = post(source.url, "/transfer_request_kvcache", body)
    assert first.status_code == 200, first.text
    again = post(source.url, "/transfer_request_kvcache", body)
    assert again.status_code == 403 and "replay" in again.text, again.text
    replayed = [grants.Signer(None).decode_receipt(x["receipt"]) for x in again.json()["ranks"]]
    assert len(replayed) == len(entries)
    assert not any(x.settled or x.grant or x.success for x in replayed), replayed
    mid = alloc["migration_id"]
    receipts = [x["receipt"] for x in again.json()["ranks"]]
    r = post(target.url, "/commit", {"migration_id": mid, "receipts": receipts})
    assert r.status_code == 403, r.text
    receipts = [x["receipt"] for x in first.json()["ranks"]]
    r = post(target.url, "/commit", {"migration_id": mid, "receipts": receipts})
    assert r.status_code == 200, r.text
