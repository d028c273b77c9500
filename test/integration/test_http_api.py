"""The HTTP routes, the clients and the CLI against real servers on 127.0.0.1.

Every "server" is `mini_server`: one process with a real HiRadixCache from the CPU
harness, our real scheduler hooks and handlers, zmq plus SGLang's FanOutCommunicator
between the HTTP and scheduler sides, our FastAPI routes on uvicorn (with SGLang's API
key middleware where keys are set), and Mooncake TCP between servers.

All servers of the module start in one `start_servers` call (start-up is the slow part)
and each test works on its own token prefix, so tests do not depend on each other.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpu_harness
import httpx
import pytest
import torch
from mini_server import ServerHandle, ServerSpec, start_servers
from multi_rank import close_windows
from sglang_kv_migration import PROTOCOL_VERSION
from sglang_kv_migration.client.migration import (
    AsyncMigrationClient,
    MigrationClient,
    MigrationFailed,
)
from sglang_kv_migration.server.http.routes import DISABLED_MESSAGE
from sglang_kv_migration.wire import binary_ids, features
from timing import wait_until

PAGE = 16
WATCHDOG_S = 2.0
HTTP_TIMEOUT_S = 30.0

# `server/diag/trace.py`: the steps of one trip (`outside` is added by the client).
TRIP_STEPS = ("outside", "parse", "to_scheduler", "scheduler", "to_tokenizer", "route")

ROUTES = (
    "/get_transfer_session_info",
    "/get_request_extra_token_size",
    "/allocate_token_for_transfer",
    "/transfer_request_kvcache",
    "/commit",
    "/abort_transfer",
)

# The routes, client and host path on every supported SGLang (CI runs the marker on
# 0.5.23 too).
pytestmark = pytest.mark.any_sglang


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# One prefix per test; distinct first tokens keep them on separate radix branches.
SEQ_E2E = _seq(1000, 8 * PAGE + 5)  # 128 page-aligned tokens
SEQ_ASYNC = _seq(2000, 4 * PAGE)
SEQ_COMMIT = _seq(3000, 3 * PAGE)
SEQ_CLI = _seq(4000, 5 * PAGE)
SEQ_MISMATCH = _seq(4500, 4 * PAGE)
SEQ_BROKEN = _seq(5000, 4 * PAGE)
SEQ_WATCHDOG = _seq(6000, 2 * PAGE)  # held by no server: allocate only
SEQ_ABORT = _seq(6500, 2 * PAGE)  # held by no server: allocate only
SEQ_NOT_HELD = _seq(9000, 2 * PAGE)
SEQ_STAGED = _seq(7000, 8 * PAGE)
SEQ_PARTIAL = _seq(8000, 6 * PAGE)  # the source holds its first 3 pages
SEQ_PARTIAL_VERIFY = _seq(8500, 5 * PAGE)  # the source holds its first 2 pages
SEQ_MAILBOX = _seq(10000, 4 * PAGE)
SEQ_MAILBOX_OFF = _seq(10500, 2 * PAGE)
SEQ_NEW_WEIGHTS = _seq(11000, 2 * PAGE)  # held by no server: allocate only
SEQ_MAILBOX_ABORTED = _seq(11500, 2 * PAGE)
SEQ_STALE = _seq(12000, 3 * PAGE)


@dataclass
class Servers:
    source: ServerHandle  # page 16, preloaded
    target: ServerHandle  # page 16, short watchdog
    broken: ServerHandle  # page 16, preloaded, every transport write fails
    page64: ServerHandle  # page 64, small host pool
    keyed: ServerHandle  # api key + admin key, migration disabled


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    harness = cpu_harness.HarnessConfig
    specs = [
        ServerSpec(
            preload=[
                (SEQ_E2E, 1),
                (SEQ_ASYNC, 2),
                (SEQ_COMMIT, 3),
                (SEQ_CLI, 4),
                (SEQ_MISMATCH, 5),
                (SEQ_STAGED, 7),
                (SEQ_PARTIAL[: 3 * PAGE], 8),
                (SEQ_PARTIAL_VERIFY[: 2 * PAGE], 9),
                (SEQ_MAILBOX, 10),
                (SEQ_MAILBOX_OFF, 11),
                (SEQ_MAILBOX_ABORTED, 12),
                (SEQ_STALE, 13),
            ]
        ),
        ServerSpec(watchdog_timeout_s=WATCHDOG_S),
        ServerSpec(preload=[(SEQ_BROKEN, 6)], broken_transport_rank=0),
        ServerSpec(harness=harness(page_size=64, device_tokens=256)),
        ServerSpec(enable_kv_migration=False, api_key="k", admin_api_key="adm"),
    ]
    handles = start_servers(specs)
    try:
        yield Servers(*handles)
    finally:
        for handle in handles:
            handle.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _post(http: httpx.Client, server: ServerHandle, path: str, body: Any = None) -> httpx.Response:
    return http.post(server.url + path, json=body if body is not None else {})


def _session_info(http: httpx.Client, server: ServerHandle) -> dict[str, Any]:
    r = _post(http, server, "/get_transfer_session_info")
    assert r.status_code == 200, r.text
    return r.json()


def _fingerprints(http: httpx.Client, server: ServerHandle) -> list[dict[str, Any]]:
    return [rank["fingerprint"] for rank in _session_info(http, server)["ranks"]]


def _same_kv(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _kv_bytes_per_token(kv: list[torch.Tensor], num_tokens: int) -> int:
    return sum(t.numel() * t.element_size() for t in kv) // num_tokens


# --------------------------------------------------------------------------- routes


def test_openapi_lists_the_six_routes(servers: Servers, http: httpx.Client) -> None:
    r = http.get(servers.source.url + "/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    for route in ROUTES:
        assert "post" in paths.get(route, {}), f"{route} missing from {sorted(paths)}"


def test_session_info_per_rank(servers: Servers, http: httpx.Client) -> None:
    info = _session_info(http, servers.source)
    assert info["success"] is True
    assert info["protocol_version"] == PROTOCOL_VERSION
    assert len(info["ranks"]) == 1
    rank = info["ranks"][0]
    assert (rank["tp_rank"], rank["pp_rank"]) == (0, 0)
    assert rank["session_id"].startswith("127.0.0.1:")
    assert int(rank["session_id"].rsplit(":", 1)[1]) > 0
    n = len(rank["host_kv_data_ptrs"])
    assert n > 0 and len(rank["host_kv_data_lens"]) == n and len(rank["host_kv_item_lens"]) == n
    assert all(p > 0 for p in rank["host_kv_data_ptrs"])
    assert all(length > 0 for length in rank["host_kv_data_lens"])
    assert rank["page_size"] == PAGE
    assert rank["fingerprint"]["page_size"] == PAGE
    assert rank["fingerprint"]["protocol_version"] == PROTOCOL_VERSION
    # Each server has its own transfer engine.
    other = _session_info(http, servers.target)["ranks"][0]
    assert other["session_id"] != rank["session_id"]


def test_extra_token_size(servers: Servers, http: httpx.Client) -> None:
    r = _post(http, servers.source, "/get_request_extra_token_size", {"input_ids": SEQ_E2E})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["matched_token_size"], body["extra_token_size"], body["total_token_size"]) == (
        128,
        0,
        128,
    )
    r = _post(http, servers.target, "/get_request_extra_token_size", {"input_ids": SEQ_NOT_HELD})
    assert r.status_code == 200
    assert (r.json()["matched_token_size"], r.json()["extra_token_size"]) == (0, 2 * PAGE)
    # The same ids as bytes (feature "binary_ids"): the same answer.
    assert features.BINARY_IDS in _session_info(http, servers.source)["features"]
    as_bytes = {binary_ids.FIELD: binary_ids.encode(SEQ_E2E[:100])}
    r = _post(http, servers.source, "/get_request_extra_token_size", as_bytes)
    assert r.status_code == 200, r.text
    assert (r.json()["matched_token_size"], r.json()["total_token_size"]) == (96, 96)


def _bad_transfer_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": SEQ_NOT_HELD,
        "matched_token_size": 0,
        "extra_token_size": PAGE,
        "migration_id": "m",
        "target_per_rank": [
            {
                "tp": 0,
                "pp": 0,
                "session_id": "127.0.0.1:1",
                "host_kv_data_ptrs": [4096],
                "host_kv_data_lens": [4096],
                "host_kv_item_lens": [64],
                "kv_indices": list(range(PAGE)),
                "fingerprint": {},
            }
        ],
    }
    body.update(changes)
    return body


def _rank_with(**changes: Any) -> list[dict[str, Any]]:
    return [{**_bad_transfer_body()["target_per_rank"][0], **changes}]


MALFORMED = [
    ("/get_request_extra_token_size", {"input_ids": 5}, "input_ids"),
    ("/get_request_extra_token_size", {"input_ids": [1, -2]}, "input_ids.1"),
    ("/get_request_extra_token_size", {"input_ids": []}, "input_ids"),
    ("/get_request_extra_token_size", {"input_ids": [1, True]}, "input_ids.1"),
    ("/get_request_extra_token_size", {"input_ids": ["1"]}, "input_ids.0"),
    ("/get_request_extra_token_size", {"input_ids": [1], "bogus": 1}, "bogus"),
    ("/get_request_extra_token_size", {}, "input_ids"),
    ("/allocate_token_for_transfer", {"input_ids": [1, 2]}, "source_fingerprints"),
    (
        "/allocate_token_for_transfer",
        {"input_ids": [1], "source_fingerprints": [{}], "extra_token_size": -1},
        "extra_token_size",
    ),
    (
        "/allocate_token_for_transfer",
        {"input_ids": [1], "source_fingerprints": [], "migration_id": "x"},
        "migration_id",  # minted by the server, never taken from the body
    ),
    ("/transfer_request_kvcache", _bad_transfer_body(target_per_rank=[]), "target_per_rank"),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_indices=[0, 1, 2])),
        "kv_indices",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(host_kv_item_lens=[64, 64])),
        "host_kv_item_lens",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(session_id="no-port")),
        "session_id",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with() + _rank_with()),
        "twice",
    ),
    ("/transfer_request_kvcache", _bad_transfer_body(extra_token_size=0), "extra_token_size"),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(matched_token_size=PAGE * 2),
        "exceeds len(input_ids)",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(staging=[4096])),
        "staging",
    ),
    (
        "/allocate_token_for_transfer",
        {"input_ids": [1], "source_fingerprints": [{}], "staging": "yes"},
        "staging",
    ),
    ("/get_request_extra_token_size", {"input_ids": [1, 1 << 63]}, "input_ids.1"),
    ("/get_request_extra_token_size", {"input_ids": [1, 2, 1 << 64]}, "input_ids.2"),
    (
        "/allocate_token_for_transfer",
        {"input_ids": [1], "source_fingerprints": [{}], "index_format": "runs"},
        "index_format",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_indices=[-1] + list(range(1, PAGE)))),
        "kv_indices.0",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_indices=[], kv_page_ranges=[[0, 0]])),
        "kv_page_ranges.0",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_indices=[], kv_page_ranges=[[-3, 1]])),
        "kv_page_ranges.0",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(
            target_per_rank=_rank_with(kv_indices=[], kv_page_ranges=[[0, 1], [5, 1, 1]])
        ),
        "kv_page_ranges.1",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_indices=[], kv_page_ranges=[[0, 3]])),
        "do not divide extra_token_size",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(target_per_rank=_rank_with(kv_page_ranges=[[0, 1]])),
        "exactly one of kv_indices, kv_pages and kv_page_ranges",
    ),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(
            target_per_rank=_rank_with(kv_indices=[], kv_page_ranges=[[0, 1 << 21], [0, 1]])
        ),
        "over the",
    ),
    ("/commit", {}, "migration_id"),
    ("/commit", {"migration_id": ""}, "migration_id"),
    ("/commit", {"migration_id": 7}, "migration_id"),
    ("/abort_transfer", {}, "migration_id"),
    ("/abort_transfer", {"migration_id": "x" * 129}, "migration_id"),
    # Feature "binary_ids": the ids as base64 little-endian uint32, instead of the list.
    ("/get_request_extra_token_size", {"input_ids_u32": "!!!!"}, "input_ids_u32: not base64"),
    ("/get_request_extra_token_size", {"input_ids_u32": "AQAA"}, "not whole 4-byte ids"),
    (
        "/get_request_extra_token_size",
        {"input_ids": [1], "input_ids_u32": "AQAAAA=="},
        "exactly one of input_ids (non-empty) and input_ids_u32",
    ),
    ("/get_request_extra_token_size", {"input_ids_u32": 5}, "input_ids_u32"),
    (
        "/transfer_request_kvcache",
        _bad_transfer_body(input_ids=[], input_ids_u32=binary_ids.encode(list(range(PAGE - 1)))),
        "exceeds len(input_ids) = 15",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "names"), MALFORMED, ids=[f"{p}-{n}" for p, _b, n in MALFORMED]
)
def test_malformed_input_is_400_naming_the_field(
    servers: Servers, http: httpx.Client, path: str, body: Any, names: str
) -> None:
    server = servers.source if path == "/transfer_request_kvcache" else servers.target
    before = server.ask(0, "snapshot")
    r = _post(http, server, path, body)
    assert r.status_code == 400, r.text
    reply = r.json()
    assert reply["success"] is False
    assert reply["error_kind"] == "bad_request"
    assert names in reply["message"], reply["message"]
    assert server.ask(0, "snapshot") == before


@pytest.mark.parametrize("path", ROUTES[1:])
def test_non_json_body_is_400(servers: Servers, http: httpx.Client, path: str) -> None:
    before = servers.target.ask(0, "snapshot")
    r = http.post(
        servers.target.url + path,
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["message"]
    assert servers.target.ask(0, "snapshot") == before


# --------------------------------------------------------------------------- client


def _hide_features(client: MigrationClient, urls: list[str], *features: str) -> None:
    """Make `client` plan as if the servers did not list `features` (older servers)."""
    for url in urls:
        info = client.session_info(url)  # the cached info the client plans from
        info.features = [f for f in info.features if f not in features]


@pytest.mark.parametrize("flow", ["one_trip", "two_trips"])
def test_client_migrates_partial_then_rest_then_nothing(servers: Servers, flow: str) -> None:
    """One trip: the source allocates on the target through its channel (feature
    "source_allocate"), the client's default with single-rank servers on one host; two
    trips: the client allocates (as with a target without a channel)."""
    src, dst = servers.source, servers.target
    aligned = SEQ_E2E[:128]
    dst.ask(0, "flush")  # as the other flow's run found it
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        if flow == "two_trips":
            _hide_features(client, [src.url, dst.url], "source_allocate")
        # A shorter prefix first: the target then holds the first 64 tokens with the
        # source's bytes, so the second migration moves only the tail.
        first = client.migrate(src.url, dst.url, SEQ_E2E[:64])
        assert (first.source_held_token_size, first.target_matched_token_size) == (64, 0)
        assert first.migrated_token_size == 64
        assert first.matched_after_commit == 64
        assert sum(dst.ask(0, "held", SEQ_E2E)) == 64

        second = client.migrate(src.url, dst.url, SEQ_E2E)
        assert second.migration_id not in ("", first.migration_id)
        assert second.source_held_token_size == 128
        assert second.target_matched_token_size == 64
        assert second.migrated_token_size == 64
        assert second.matched_after_commit == 128
        # Both servers take partial transfers (no size query on the source) and have a
        # mailbox: the source handed its receipts over, the target committed by itself,
        # before it answered anything sent after the transfer's reply.
        assert first.source_committed and second.source_committed
        trips = {"transfer"} if flow == "one_trip" else {"allocate", "transfer"}
        assert set(second.timings) == {"session_info", "total", *trips}
        assert sum(dst.ask(0, "held", SEQ_E2E)) == 128
        # Where each trip's time went (`server/diag/trace.py`): every step of every trip, and
        # the server's part of a trip is no more than the client's trip.
        assert set(second.steps_ms) == {"allocate", "transfer"}
        if flow == "one_trip":
            # The allocate is the target scheduler's part only (no HTTP trip of its own);
            # the source's wait for it is part of its `waited`. (Not compared with the
            # target's part: the source may lose its CPU between its send and the end of
            # its handler, while the target answers.)
            allocate = second.steps_ms["allocate"]
            target_steps = {"scheduler", "queued", "match_reserve", "slots", "grant", "iteration"}
            assert set(allocate) == target_steps and allocate["scheduler"] > 0
            assert allocate["iteration"] >= 1  # the target loop iteration that answered
            transfer = second.steps_ms["transfer"]
            assert 0 <= transfer["allocate"] <= transfer["waited"]
            # ... and the target's own steps, in the transfer's reply too.
            assert {f"target_{k}": allocate[k] for k in target_steps}.items() <= transfer.items()
        for phase, steps in second.steps_ms.items():
            if phase not in trips:
                continue
            assert set(TRIP_STEPS) <= set(steps), (phase, steps)
            assert all(v >= 0 for v in steps.values()), (phase, steps)
            assert steps["route"] <= second.timings[phase] * 1e3 + 0.01, (phase, steps)
            inside = sum(steps[k] for k in ("to_scheduler", "scheduler", "to_tokenizer"))
            assert steps["parse"] + inside <= steps["route"] + 0.01, (phase, steps)
        transfer_steps = second.steps_ms["transfer"]
        assert transfer_steps["polls"] >= 1  # replied from a later poll()
        # The scheduler's part, split: handler, wait for the copy, the reply's own work.
        split = sum(transfer_steps[k] for k in ("handler", "waited", "replying"))
        assert 0 < split <= transfer_steps["scheduler"] + 0.01, transfer_steps

        source_kv = src.ask(0, "kv", aligned)
        target_kv = dst.ask(0, "kv", aligned)
        assert len(source_kv) == cpu_harness.HarnessConfig().layer_num
        assert _same_kv(source_kv, target_kv)
        per_token = _kv_bytes_per_token(source_kv, len(aligned))
        assert first.migrated_bytes == 64 * per_token
        assert second.migrated_bytes == 64 * per_token

        again = client.migrate(src.url, dst.url, SEQ_E2E)
        assert again.migration_id == ""
        assert (again.migrated_token_size, again.migrated_bytes) == (0, 0)
        assert again.target_matched_token_size == 128
        assert again.matched_after_commit == 128


def test_client_stages_a_fragmented_migration(servers: Servers, http: httpx.Client) -> None:
    src, dst = servers.source, servers.target
    rank = _session_info(http, dst)["ranks"][0]
    assert rank["stage_writer"] is True and rank["staging_region"][1] == 4 << 20
    assert set(rank["paths"]["host"]) == {  # unchanged: clients copy it into transfers
        "session_id",
        "host_kv_data_ptrs",
        "host_kv_data_lens",
        "host_kv_item_lens",
    }
    dst.ask(0, "fragment_host", 11)  # every page of the allocation its own run
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(src.url, dst.url, SEQ_STAGED)
    assert result.migrated_token_size == len(SEQ_STAGED)
    # 8 scattered pages x 8 layer buffers would be 64 entries written directly.
    assert result.plans == ["staged"] and result.entries == 1
    (steps,) = result.transfer_steps_ms  # one source rank, its host-path steps in ms
    assert {"host_copies", "queued", "probe", "plan", "wire"} <= steps.keys()
    assert steps["wire"] > 0
    assert _same_kv(src.ask(0, "kv", SEQ_STAGED), dst.ask(0, "kv", SEQ_STAGED))
    slots = dst.ask(0, "host_slots")
    assert slots["overlap"] == 0 and slots["in_tree"] == slots["in_tree_unique"]


def test_client_moves_what_the_source_holds_without_a_size_query(servers: Servers) -> None:
    src, dst = servers.source, servers.target
    before = dst.ask(0, "snapshot")
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(src.url, dst.url, SEQ_PARTIAL + [1, 2])
    held = 3 * PAGE
    # No size query. (A commit trip too when the target granted a staging extent: the
    # pool may be fragmented by the test before; such a commit waits for a scatter.)
    assert set(result.steps_ms) - {"commit"} == {"allocate", "transfer"}
    assert ("commit" in result.steps_ms) != result.source_committed
    assert result.migrated_token_size == result.matched_after_commit == held
    assert result.source_held_token_size == held
    assert sum(dst.ask(0, "held", SEQ_PARTIAL)) == held
    assert _same_kv(src.ask(0, "kv", SEQ_PARTIAL[:held]), dst.ask(0, "kv", SEQ_PARTIAL[:held]))
    # The target allocated six pages and kept the three that were written.
    after = dst.ask(0, "snapshot")
    assert after.host_available == before.host_available - held
    assert after.total_lock_ref == 0


def test_verify_covers_exactly_what_a_partial_transfer_wrote(servers: Servers) -> None:
    """The source digests the pages it sent, the target the slots they landed in: a cut
    send verifies (the unwritten slots are not part of either digest)."""
    src, dst = servers.source, servers.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(src.url, dst.url, SEQ_PARTIAL_VERIFY, verify=True)
    held = 2 * PAGE
    # A verified move commits with a reply: a mailbox commit could not tell the client
    # that what landed failed its digest.
    assert not result.source_committed and "commit" in result.steps_ms
    assert result.migrated_token_size == result.matched_after_commit == held
    assert _same_kv(
        src.ask(0, "kv", SEQ_PARTIAL_VERIFY[:held]), dst.ask(0, "kv", SEQ_PARTIAL_VERIFY[:held])
    )


def _as_older_servers(client: MigrationClient, *urls: str) -> None:
    """Make `client` see `urls` as servers without partial transfers (the cached
    session info it plans from), as it would see servers that predate them."""
    for url in urls:
        info = client.session_info(url)  # the cached info itself
        info.features = [f for f in info.features if f != features.PARTIAL_TRANSFER]


@pytest.mark.parametrize("older", [False, True], ids=["partial", "size-query"])
def test_client_nothing_held_by_source(servers: Servers, older: bool) -> None:
    before = servers.target.ask(0, "snapshot")
    with MigrationClient() as client:
        if older:
            _as_older_servers(client, servers.source.url, servers.target.url)
        result = client.migrate(servers.source.url, servers.target.url, SEQ_NOT_HELD)
    assert (result.source_held_token_size, result.migrated_token_size) == (0, 0)
    assert result.matched_after_commit == 0
    if older:  # the size query said nothing is held: nothing allocated
        assert result.migration_id == "" and set(result.steps_ms) == {"extra_token_size"}
    else:  # allocated, nothing sent, committed nothing: every slot went back
        assert len(result.migration_id) == 32
        assert set(result.steps_ms) == {"allocate", "transfer"}  # the source committed
    assert servers.target.ask(0, "snapshot") == before


def test_async_client_migrates(servers: Servers) -> None:
    async def run() -> Any:
        async with AsyncMigrationClient(timeout=HTTP_TIMEOUT_S) as client:
            return await client.migrate(servers.source.url, servers.target.url, SEQ_ASYNC)

    result = asyncio.run(run())
    assert result.migrated_token_size == len(SEQ_ASYNC)
    assert result.matched_after_commit == len(SEQ_ASYNC)
    assert sum(servers.target.ask(0, "held", SEQ_ASYNC)) == len(SEQ_ASYNC)
    assert _same_kv(servers.source.ask(0, "kv", SEQ_ASYNC), servers.target.ask(0, "kv", SEQ_ASYNC))


# --------------------------------------------------------------------------- commit/abort


@pytest.mark.parametrize("path", ["/commit", "/abort_transfer"])
def test_unknown_migration_id_is_404(servers: Servers, http: httpx.Client, path: str) -> None:
    r = _post(http, servers.target, path, {"migration_id": "no-such-id"})
    assert r.status_code == 404, r.text
    assert r.json()["error_kind"] == "not_found"
    # Failures say where their trip went too; the scheduler's raw stamps stay inside.
    assert set(r.json()["steps_ms"]) == {"parse", "route", *TRIP_STEPS[1:]} - {"outside"}
    assert "trace" not in r.json()
    assert "no-such-id" in r.json()["message"]


def test_second_commit_is_harmless_and_abort_after_commit_conflicts(
    servers: Servers, http: httpx.Client
) -> None:
    with MigrationClient() as client:
        result = client.migrate(servers.source.url, servers.target.url, SEQ_COMMIT)
    assert result.migrated_token_size == len(SEQ_COMMIT)
    before = servers.target.ask(0, "snapshot")

    r = _post(http, servers.target, "/commit", {"migration_id": result.migration_id})
    assert r.status_code == 200, r.text
    assert r.json()["matched_after_commit"] == result.matched_after_commit == len(SEQ_COMMIT)

    r = _post(http, servers.target, "/abort_transfer", {"migration_id": result.migration_id})
    assert r.status_code == 409, r.text
    assert "committed" in r.json()["message"]
    assert servers.target.ask(0, "snapshot") == before
    assert sum(servers.target.ask(0, "held", SEQ_COMMIT)) == len(SEQ_COMMIT)


def _allocate(
    http: httpx.Client, target: ServerHandle, ids: list[int], fingerprints: list[dict], **extra: Any
) -> httpx.Response:
    body = {"input_ids": ids, "source_fingerprints": fingerprints, **extra}
    return _post(http, target, "/allocate_token_for_transfer", body)


# --------------------------------------------------------------------------- source commit


def test_the_next_request_sees_what_the_source_committed(
    servers: Servers, http: httpx.Client
) -> None:
    """Two trips: the source hands its receipts to the target's mailbox before it
    replies, and the target commits before it handles anything sent after that reply
    (here a size query straight after each migration)."""
    src, dst = servers.source, servers.target
    assert features.SOURCE_COMMIT in _session_info(http, dst)["features"]
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        for pages in range(1, 5):  # one page more each time: a commit every time
            prefix = SEQ_MAILBOX[: pages * PAGE]
            result = client.migrate(src.url, dst.url, prefix)
            reply = _post(http, dst, "/get_request_extra_token_size", {"input_ids": prefix})
            assert reply.json()["matched_token_size"] == len(prefix), (pages, reply.json())
            assert result.source_committed and set(result.steps_ms) == {"allocate", "transfer"}
            assert result.migrated_token_size == PAGE
            assert result.matched_after_commit == len(prefix)
    assert _same_kv(src.ask(0, "kv", SEQ_MAILBOX), dst.ask(0, "kv", SEQ_MAILBOX))
    assert dst.ask(0, "pending") == 0 and dst.ask(0, "snapshot").total_lock_ref == 0


def test_without_the_feature_the_client_commits(servers: Servers) -> None:
    src, dst = servers.source, servers.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        info = client.session_info(dst.url)  # the cached info: a target without a mailbox
        info.features = [f for f in info.features if f != features.SOURCE_COMMIT]
        result = client.migrate(src.url, dst.url, SEQ_MAILBOX_OFF)
    assert not result.source_committed
    assert set(result.steps_ms) == {"allocate", "transfer", "commit"}
    assert result.matched_after_commit == len(SEQ_MAILBOX_OFF)
    assert sum(dst.ask(0, "held", SEQ_MAILBOX_OFF)) == len(SEQ_MAILBOX_OFF)


class _AbortAfterAllocate(httpx.BaseTransport):
    """Real HTTP; right after the allocate reply, the target's allocation is aborted (as
    a flush, a weight update or the watchdog would end it while the copy runs)."""

    def __init__(self) -> None:
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._real.handle_request(request)
        if request.url.path == "/allocate_token_for_transfer":
            response.read()
            body = {"migration_id": response.json()["migration_id"]}
            abort = request.url.copy_with(path="/abort_transfer")
            assert httpx.post(str(abort), json=body, timeout=HTTP_TIMEOUT_S).status_code == 200
        return response

    def close(self) -> None:
        self._real.close()


def test_an_allocation_that_ended_before_the_delivery_fails_the_migration(
    servers: Servers,
) -> None:
    """The source delivers only into a slot the target still waits on: here it does not,
    so the client commits itself and reports the target's answer, not a success."""
    src, dst = servers.source, servers.target
    before = dst.ask(0, "snapshot")
    http_client = httpx.Client(transport=_AbortAfterAllocate(), timeout=HTTP_TIMEOUT_S)
    with MigrationClient(http_client=http_client) as client:
        _hide_features(client, [src.url, dst.url], "source_allocate")  # an allocate trip
        with pytest.raises(MigrationFailed) as failed:
            client.migrate(src.url, dst.url, SEQ_MAILBOX_ABORTED)
    assert failed.value.phase == "commit" and failed.value.status_code == 409, failed.value
    assert "aborted" in failed.value.message
    assert sum(dst.ask(0, "held", SEQ_MAILBOX_ABORTED)) == 0
    close_windows(dst)  # the slots wait out the grant's write window, closed at once
    deadline = time.monotonic() + 30
    while dst.ask(0, "snapshot") != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dst.ask(0, "snapshot") == before


def _grant_fields(grant: str) -> dict[str, Any]:
    payload = grant.split(".")[0]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_only_an_allocate_that_asks_gets_a_mailbox_slot_and_new_weights_drop_it(
    servers: Servers, http: httpx.Client
) -> None:
    dst = servers.target
    before = dst.ask(0, "snapshot")
    fingerprints = _fingerprints(http, servers.source)
    asked = _allocate(http, dst, SEQ_NEW_WEIGHTS, fingerprints, source_commit=True).json()
    plain = _allocate(http, dst, SEQ_NEW_WEIGHTS[:PAGE] + [1] * PAGE, fingerprints).json()
    verified = _allocate(
        http, dst, SEQ_NEW_WEIGHTS[:PAGE] + [2] * PAGE, fingerprints, source_commit=True,
        verify=True,
    ).json()  # fmt: skip
    assert asked["source_commit"] is True and plain["source_commit"] is False
    assert verified["source_commit"] is False  # its commit must answer the client
    assert "mailbox" not in _grant_fields(verified["ranks"][0]["grant"])
    mailbox = _grant_fields(asked["ranks"][0]["grant"])["mailbox"]
    name, slot, nonce = mailbox.split("/")
    assert name.startswith("kvmig-mbox-") and int(slot) >= 0 and len(nonce) == 32
    assert "mailbox" not in _grant_fields(plain["ranks"][0]["grant"])
    # A weight update reaching the target drops what waits for its source's commit: no
    # commit request would carry the new weight version. The other allocation stays.
    assert dst.ask(0, "new_weights") == 1
    r = _post(http, dst, "/commit", {"migration_id": asked["migration_id"]})
    assert r.status_code == 410 and "weights changed" in r.json()["message"], r.text
    assert dst.ask(0, "pending") == 2
    for allocation in (plain, verified):
        r = _post(http, dst, "/abort_transfer", {"migration_id": allocation["migration_id"]})
        assert r.status_code == 200, r.text
    close_windows(dst)  # both sets of slots wait out their write windows, closed at once
    deadline = time.monotonic() + 30
    while dst.ask(0, "snapshot") != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dst.ask(0, "snapshot") == before


def test_abort_frees_the_allocation(servers: Servers, http: httpx.Client) -> None:
    target = servers.target
    before = target.ask(0, "snapshot")
    r = _allocate(http, target, SEQ_ABORT, _fingerprints(http, servers.source))
    assert r.status_code == 200, r.text
    alloc = r.json()
    assert alloc["extra_token_size"] == len(SEQ_ABORT)
    assert len(alloc["ranks"][0]["kv_indices"]) == len(SEQ_ABORT)
    assert target.ask(0, "snapshot").host_available == before.host_available - len(SEQ_ABORT)

    mid = alloc["migration_id"]
    assert _post(http, target, "/abort_transfer", {"migration_id": mid}).status_code == 200
    # No transfer, so no receipt saying no write can land: the slots are quarantined for
    # the grant's write window (1 s grant + 2 x 2 s transfer timeout on these servers).
    quarantined = target.ask(0, "snapshot")
    assert quarantined.host_available == before.host_available - len(SEQ_ABORT)
    assert quarantined.total_lock_ref == before.total_lock_ref
    close_windows(target)  # the window closes at once, by the clock
    deadline = time.monotonic() + 30
    while target.ask(0, "snapshot") != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert target.ask(0, "snapshot") == before
    # Repeating an abort is harmless (rollback paths may repeat it); commit is a conflict.
    assert _post(http, target, "/abort_transfer", {"migration_id": mid}).status_code == 200
    assert _post(http, target, "/commit", {"migration_id": mid}).status_code == 409
    assert target.ask(0, "snapshot") == before


def test_allocate_with_stale_extra_size_is_409(servers: Servers, http: httpx.Client) -> None:
    before = servers.target.ask(0, "snapshot")
    r = _allocate(
        http,
        servers.target,
        SEQ_ABORT,
        _fingerprints(http, servers.source),
        extra_token_size=len(SEQ_ABORT) + PAGE,
    )
    assert r.status_code == 409, r.text
    assert "measure again" in r.json()["message"]
    assert servers.target.ask(0, "snapshot") == before


def test_watchdog_expires_an_uncommitted_allocation(servers: Servers, http: httpx.Client) -> None:
    target = servers.target
    before = target.ask(0, "snapshot")
    pending = target.ask(0, "pending")
    started = time.monotonic()
    r = _allocate(http, target, SEQ_WATCHDOG, _fingerprints(http, servers.source))
    assert r.status_code == 200, r.text
    mid = r.json()["migration_id"]
    held = target.ask(0, "snapshot")
    assert held.host_available == before.host_available - len(SEQ_WATCHDOG)

    # The watchdog ends it, not before its deadline; its slots then sit out the rest of
    # the write window in quarantine (closed at once, by the clock).
    expired = wait_until(lambda: target.ask(0, "pending") == pending, WATCHDOG_S + 60.0, 0.05)
    assert expired, f"not expired {time.monotonic() - started:.1f}s after allocate"
    assert time.monotonic() - started >= WATCHDOG_S * 0.9
    close_windows(target)
    assert wait_until(lambda: target.ask(0, "snapshot") == before, 60.0), "not freed"

    r = _post(http, target, "/commit", {"migration_id": mid})
    assert r.status_code == 410, r.text
    assert r.json()["error_kind"] == "gone"
    assert "expired" in r.json()["message"]
    assert _post(http, target, "/abort_transfer", {"migration_id": mid}).status_code == 410
    assert target.ask(0, "snapshot") == before


def test_host_pool_full_is_503_and_leaks_nothing(servers: Servers, http: httpx.Client) -> None:
    server = servers.page64
    before = server.ask(0, "snapshot")
    too_many = (before.host_available // 64 + 1) * 64
    r = _allocate(http, server, _seq(7000, too_many), _fingerprints(http, server))
    assert r.status_code == 503, r.text
    assert r.json()["error_kind"] == "unavailable"
    assert "host pool is full" in r.json()["message"]
    assert server.ask(0, "snapshot") == before


# --------------------------------------------------------------------------- failures


def test_layout_mismatch_is_refused_before_allocating(servers: Servers, http: httpx.Client) -> None:
    before = servers.page64.ask(0, "snapshot")
    with MigrationClient() as client, pytest.raises(MigrationFailed) as failed:
        client.migrate(servers.source.url, servers.page64.url, SEQ_MISMATCH)
    assert failed.value.phase == "session_info"
    assert "page_size" in failed.value.message
    assert failed.value.rolled_back is False

    r = _allocate(http, servers.page64, _seq(7000, 64), _fingerprints(http, servers.source))
    assert r.status_code == 409, r.text
    assert r.json()["error_kind"] == "conflict"
    assert "page_size" in r.json()["message"]
    assert servers.page64.ask(0, "snapshot") == before


def test_transfer_failure_rolls_back_the_target(servers: Servers) -> None:
    target = servers.target
    before = target.ask(0, "snapshot")
    source_before = servers.broken.ask(0, "snapshot")
    with MigrationClient() as client, pytest.raises(MigrationFailed) as failed:
        client.migrate(servers.broken.url, target.url, SEQ_BROKEN)
    assert failed.value.phase == "transfer"
    assert failed.value.status_code == 502
    assert "injected failure" in failed.value.message
    assert failed.value.rolled_back is True
    assert len(failed.value.migration_id) == 32
    assert target.ask(0, "snapshot") == before
    assert sum(target.ask(0, "held", SEQ_BROKEN)) == 0
    # The rolled-back allocation is gone: committing it now is refused.
    r = httpx.post(target.url + "/commit", json={"migration_id": failed.value.migration_id})
    assert r.status_code == 409 and "aborted" in r.json()["message"]
    # The failed source unpinned what it pinned.
    assert servers.broken.ask(0, "snapshot") == source_before


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        ("Bearer k", 401),  # with an admin key set, ADMIN_OPTIONAL takes only that key
        ("Bearer adm", 503),
    ],
)
def test_auth_on_keyed_server(
    servers: Servers, http: httpx.Client, authorization: str | None, status: int
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    valid_bodies: dict[str, Any] = {
        "/get_transfer_session_info": {},
        "/get_request_extra_token_size": {"input_ids": [1]},
        "/allocate_token_for_transfer": {"input_ids": [1], "source_fingerprints": [{}]},
        "/transfer_request_kvcache": _bad_transfer_body(),  # well-formed, bogus values
        "/commit": {"migration_id": "x"},
        "/abort_transfer": {"migration_id": "x"},
    }
    for path in ROUTES:
        body = valid_bodies[path]
        r = http.post(servers.keyed.url + path, json=body, headers=headers)
        assert r.status_code == status, f"{path}: {r.status_code} {r.text}"
        if status == 503:
            assert r.json()["message"] == DISABLED_MESSAGE
            assert "disabled" in r.json()["message"]


def test_routes_carry_admin_optional_auth_level() -> None:
    """SGLang's middleware must find `ADMIN_OPTIONAL` on every route of an app that
    `add_routes` built (FastAPI's lazy `include_router` would hide it: NORMAL)."""
    from fastapi import FastAPI
    from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope
    from sglang_kv_migration.server.http.routes import add_routes

    app = FastAPI()
    add_routes(app, lambda: None)
    for path in ROUTES:
        scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
        assert _get_auth_level_from_app_and_scope(app, scope) is AuthLevel.ADMIN_OPTIONAL, path


def test_client_reports_auth_and_disabled(servers: Servers) -> None:
    keyed = servers.keyed.url
    with MigrationClient(api_key="k") as client, pytest.raises(MigrationFailed) as failed:
        client.migrate(keyed, keyed, SEQ_NOT_HELD)
    assert (failed.value.phase, failed.value.status_code) == ("session_info", 401)

    with MigrationClient(api_key="adm") as client, pytest.raises(MigrationFailed) as failed:
        client.call(keyed, "/get_transfer_session_info")
    assert failed.value.status_code == 503
    assert "disabled" in failed.value.message


# --------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("sglang-kv-migrate", path=str(Path(sys.executable).parent))
    assert script is not None, "console script sglang-kv-migrate is not installed"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120, check=False)


def _ids_arg(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def test_cli_success_json(servers: Servers) -> None:
    done = _cli(
        "--source",
        servers.source.url,
        "--target",
        servers.target.url,
        "--input-ids",
        _ids_arg(SEQ_CLI),
        "--json",
        "--verify",  # the target checks the source's digest before inserting
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["success"] is True
    assert out["migrated_token_size"] == len(SEQ_CLI)
    assert out["matched_after_commit"] == len(SEQ_CLI)
    assert sum(servers.target.ask(0, "held", SEQ_CLI)) == len(SEQ_CLI)

    # Plain output, nothing left to move: still a success.
    again = _cli(
        "--source",
        servers.source.url,
        "--target",
        servers.target.url,
        "--input-ids",
        _ids_arg(SEQ_CLI),
    )
    assert again.returncode == 0, again.stderr
    assert "nothing to migrate" in again.stdout


def test_cli_failure_json(servers: Servers) -> None:
    mismatch = _cli(
        "--source",
        servers.source.url,
        "--target",
        servers.page64.url,
        "--input-ids",
        _ids_arg(SEQ_MISMATCH),
        "--json",
    )
    assert mismatch.returncode == 1, mismatch.stderr
    out = json.loads(mismatch.stdout)
    assert out["success"] is False
    assert out["phase"] == "session_info"
    assert "page_size" in out["message"]

    unreachable = f"http://127.0.0.1:{cpu_harness.free_port()}"
    down = _cli(
        "--source", unreachable, "--target", servers.target.url, "--input-ids", "1,2", "--json"
    )
    assert down.returncode == 1, down.stderr
    out = json.loads(down.stdout)
    assert out["success"] is False
    assert out["status_code"] is None


@pytest.mark.parametrize(
    "args",
    [
        ["--input-ids", "a,b"],
        ["--input-ids", ""],
        ["--input-ids", "[1, -1]"],
    ],
)
def test_cli_bad_arguments_exit_2(args: list[str]) -> None:
    done = _cli("--source", "http://127.0.0.1:1", "--target", "http://127.0.0.1:2", *args)
    assert done.returncode == 2
    assert "input ids" in done.stderr


# --------------------------------------------------------------------------- stale epoch
# Last in this module: a KV memory cycle gives the shared target a new epoch.


def test_an_allocate_for_a_stale_epoch_reserves_nothing(
    servers: Servers, http: httpx.Client
) -> None:
    """Feature "epoch_check": after a KV memory resume (new epoch) an allocate that names
    the old epoch is a conflict before anything is reserved, and the reply carries the
    new epoch."""
    target = servers.target
    info = _session_info(http, target)
    assert "epoch_check" in info["features"]
    old = info["server_epoch"]
    fingerprints = _fingerprints(http, servers.source)
    assert target.ask(0, "memory_cycle") >= 1
    before = target.ask(0, "snapshot")
    r = _allocate(http, target, SEQ_WATCHDOG, fingerprints, expect_epoch=old)
    assert r.status_code == 409, r.text
    reply = r.json()
    new = _session_info(http, target)["server_epoch"]
    assert new != old and reply["server_epoch"] == new
    assert old in reply["message"] and "/get_transfer_session_info" in reply["message"]
    assert target.ask(0, "snapshot") == before and target.ask(0, "pending") == 0
    # (The new epoch is accepted: the next test migrates with it. Not here: an aborted
    # allocation's slots would sit out a write window while that test counts them.)
    too_long = _allocate(http, target, SEQ_WATCHDOG, fingerprints, expect_epoch="e" * 1025)
    assert too_long.status_code == 400 and "expect_epoch" in too_long.text


def test_a_client_with_stale_session_info_wastes_no_allocation(servers: Servers) -> None:
    """A client that cached the target's session info before a KV memory resume: its
    allocate is refused for the stale epoch, it reads the info again and migrates; no
    slots of an aborted allocation sit out a write window on the target."""
    src, dst = servers.source, servers.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        first = client.migrate(src.url, dst.url, SEQ_STALE[:PAGE])
        assert first.migrated_token_size == PAGE
        stale = client.session_info(dst.url).server_epoch
        assert dst.ask(0, "memory_cycle") >= 1
        before = dst.ask(0, "snapshot")
        result = client.migrate(src.url, dst.url, SEQ_STALE)
        assert client.session_info(dst.url).server_epoch != stale  # read again
    assert result.migrated_token_size == 2 * PAGE and result.matched_after_commit == len(SEQ_STALE)
    after = dst.ask(0, "snapshot")
    # Exactly the migrated pages left the free host slots: none sits in quarantine.
    assert after.host_available == before.host_available - 2 * PAGE, (before, after)
    assert dst.ask(0, "pending") == 0 and after.total_lock_ref == 0
