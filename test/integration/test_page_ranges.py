"""Page lists as `[first_page, count]` runs (`page_ranges.py`, wire feature "page_ranges").

Unit tests of the conversion and of the client's choice, then two CPU mini servers with
page size 1 (the case where a page list is as long as the prefix): a 32K-token migration
travels as one run and lands byte for byte; a fragmented target pool gives many runs and
still lands; runs that name other pages than the grant are refused; bad runs are 400s
naming the problem (the HTTP validation cases sit with the others in test_http_api.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import cpu_harness
import httpx
import orjson
import pytest
import torch
from mini_server import ServerHandle, ServerSpec, start_servers
from multi_rank import HTTP_TIMEOUT_S, kv_equal, post, session_info
from sglang_kv_migration.client.call_bodies import _index_format, _targets
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.client.plan import Plan
from sglang_kv_migration.wire.convert import from_dict, to_wire
from sglang_kv_migration.wire.features import PAGE_RANGES as FEATURE
from sglang_kv_migration.wire.messages import (
    AllocatedRank,
    AllocateReply,
    RankSessionInfo,
    SessionInfoReply,
)
from sglang_kv_migration.wire.page_ranges import pages_from_ranges, to_page_ranges

BIG = list(range(500_000, 500_000 + 32768))
FRAGMENTED = list(range(600_000, 600_000 + 2048))
FORGED = list(range(700_000, 700_000 + 64))

# --------------------------------------------------------------------------- unit


def _slots(pages: list[int], page_size: int) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@pytest.mark.parametrize(
    ("pages", "runs"),
    [
        (list(range(5, 5 + 32768)), [[5, 32768]]),
        ([7], [[7, 1]]),
        ([3, 4, 5, 9, 10, 2, 3], [[3, 3], [9, 2], [2, 2]]),
        ([4, 3, 2, 1], [[4, 1], [3, 1], [2, 1], [1, 1]]),  # descending: no run of two
        ([0, 0, 1], [[0, 1], [0, 2]]),  # a repeat breaks the run (and is kept)
    ],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_runs_round_trip(pages: list[int], runs: list[list[int]], page_size: int) -> None:
    assert to_page_ranges(_slots(pages, page_size), page_size) == runs
    assert pages_from_ranges(runs).tolist() == pages


def test_random_pages_round_trip() -> None:
    gen = torch.Generator().manual_seed(3)
    pages = torch.randperm(5000, generator=gen)[:3000]
    runs = to_page_ranges(pages, 1)
    assert len(runs) > 100
    assert torch.equal(pages_from_ranges(runs), pages)


def test_empty_and_bad_runs() -> None:
    assert to_page_ranges(torch.empty(0, dtype=torch.int64), 4) == []
    assert pages_from_ranges([]).tolist() == []
    for bad in ([[1, 0]], [[-1, 2]], [[1, 2, 3]], [[1]]):
        with pytest.raises(ValueError):
            pages_from_ranges(bad)


def _plan(source_features: list[str] | None, target_features: list[str] | None) -> Plan:
    def info(features: list[str] | None) -> SessionInfoReply:
        wire = {"success": True} if features is None else {"success": True, "features": features}
        return from_dict(SessionInfoReply, wire)

    return Plan("s", "t", None, info(source_features), info(target_features), [], {})


def test_client_uses_runs_only_when_both_servers_list_them() -> None:
    assert _index_format(_plan([FEATURE], [FEATURE, "other"])) == "ranges"
    assert _index_format(_plan([FEATURE], None)) == "pages"  # a server from before
    assert _index_format(_plan(None, [FEATURE])) == "pages"
    assert _index_format(_plan([], [FEATURE])) == "pages"


def test_client_passes_on_what_the_target_sent() -> None:
    host = {"session_id": "h:1", "host_kv_data_ptrs": [1], "host_kv_data_lens": [1]}
    host["host_kv_item_lens"] = [1]
    rank = RankSessionInfo(0, 0, 1, {}, paths={"host": host})
    info = SessionInfoReply(success=True, ranks=[rank])
    runs = AllocateReply(success=True, ranks=[AllocatedRank(0, 0, [], kv_page_ranges=[[3, 4]])])
    pages = AllocateReply(success=True, ranks=[AllocatedRank(0, 0, [], kv_pages=[3, 4])])
    (entry,) = (to_wire(e) for e in _targets(info, runs, "host"))
    assert entry["kv_page_ranges"] == [[3, 4]] and "kv_pages" not in entry
    (entry,) = (to_wire(e) for e in _targets(info, pages, "host"))
    assert entry["kv_pages"] == [3, 4] and "kv_page_ranges" not in entry


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ServerHandle, ServerHandle]]:
    harness = cpu_harness.HarnessConfig(page_size=1, device_tokens=len(BIG) + 4096)
    source = ServerSpec(harness=harness, preload=[(BIG, 1), (FRAGMENTED, 2), (FORGED, 3)])
    a, b = start_servers([source, ServerSpec(harness=harness)])
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


class _Bodies:
    """Request bodies the client sent, by path (httpx event hook). The client relays the
    target's runs itself: it does not see "source_allocate" (with it the source takes
    them from the target's allocate channel, `test_source_allocate.py`)."""

    def __init__(self) -> None:
        self.sent: dict[str, dict[str, Any]] = {}

    def hook(self, request: httpx.Request) -> None:
        self.sent[request.url.path] = orjson.loads(request.content)

    def client(self, *servers: ServerHandle) -> MigrationClient:
        http = httpx.Client(timeout=HTTP_TIMEOUT_S, event_hooks={"request": [self.hook]})
        client = MigrationClient(http_client=http)
        for server in servers:
            info = client.session_info(server.url)  # the cached info it plans from
            info.features = [f for f in info.features if f != "source_allocate"]
        return client


def test_servers_list_the_feature(pair: tuple[ServerHandle, ServerHandle]) -> None:
    for server in pair:
        assert FEATURE in session_info(server.url)["features"]


def test_32k_tokens_travel_as_one_run_and_land(pair: tuple[ServerHandle, ServerHandle]) -> None:
    source, target = pair
    bodies = _Bodies()
    with bodies.client(source, target) as client:
        result = client.migrate(source.url, target.url, BIG)
    assert (result.path, result.migrated_token_size) == ("host", len(BIG))
    assert result.matched_after_commit == len(BIG)
    assert bodies.sent["/allocate_token_for_transfer"]["index_format"] == "ranges"
    (entry,) = bodies.sent["/transfer_request_kvcache"]["target_per_rank"]
    assert "kv_pages" not in entry
    [[first, count]] = entry["kv_page_ranges"]  # a fresh pool: one run
    assert count == len(BIG) and first >= 0
    assert kv_equal(source.ask(0, "kv", BIG), target.ask(0, "kv", BIG))


def test_fragmented_pool_gives_many_runs(pair: tuple[ServerHandle, ServerHandle]) -> None:
    source, target = pair
    target.ask(0, "fragment_host", 5)
    bodies = _Bodies()
    with bodies.client(source, target) as client:
        result = client.migrate(source.url, target.url, FRAGMENTED)
    assert result.migrated_token_size == len(FRAGMENTED)
    (entry,) = bodies.sent["/transfer_request_kvcache"]["target_per_rank"]
    runs = entry["kv_page_ranges"]
    assert len(runs) > 100 and sum(count for _, count in runs) == len(FRAGMENTED)
    assert kv_equal(source.ask(0, "kv", FRAGMENTED), target.ask(0, "kv", FRAGMENTED))
    slots = target.ask(0, "host_slots")
    assert slots["overlap"] == 0 and slots["in_tree"] == slots["in_tree_unique"]


def test_runs_other_than_granted_are_refused(pair: tuple[ServerHandle, ServerHandle]) -> None:
    source, target = pair
    info = session_info(target.url)
    r = post(
        target.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": FORGED,
            "source_fingerprints": [x["fingerprint"] for x in session_info(source.url)["ranks"]],
            "source_instance": session_info(source.url)["instance_id"],
            "index_format": "ranges",
        },
    )
    assert r.status_code == 200, r.text
    allocation = r.json()
    runs = allocation["ranks"][0]["kv_page_ranges"]
    assert sum(count for _, count in runs) == len(FORGED)
    assert allocation["ranks"][0]["kv_pages"] == []
    target_info = from_dict(SessionInfoReply, info)
    entry = to_wire(_targets(target_info, from_dict(AllocateReply, allocation), "host")[0])
    try:
        # The same number of pages, the first run one page further on: not what the
        # grant names.
        entry["kv_page_ranges"] = [[runs[0][0] + 1, runs[0][1]], *runs[1:]]
        body = {
            "input_ids": FORGED,
            "matched_token_size": 0,
            "extra_token_size": len(FORGED),
            "migration_id": allocation["migration_id"],
            "target_per_rank": [entry],
        }
        r = post(source.url, "/transfer_request_kvcache", body)
        assert r.status_code == 403, r.text
        assert "grant does not name these target slots" in r.json()["message"]
    finally:
        r = post(target.url, "/abort_transfer", {"migration_id": allocation["migration_id"]})
        assert r.status_code == 200, r.text


def test_huge_runs_are_refused_before_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: one pair naming 2**21 pages (32M slots at page 16) is refused from its
    count alone; nothing is expanded (the spy would fail)."""
    from sglang_kv_migration.errors import MigrationError
    from sglang_kv_migration.server.source import validation as source_validation
    from sglang_kv_migration.wire import page_ranges
    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

    def spy(_ranges: Any) -> Any:
        raise AssertionError("pages_from_ranges was called")

    monkeypatch.setattr(page_ranges, "pages_from_ranges", spy)
    target = TransferRequestKVCacheTarget(tp=0, pp=0, kv_page_ranges=[[0, 1 << 21]])
    with pytest.raises(MigrationError, match="kv_page_ranges name 33554432 slots") as info:
        source_validation.target_slots(target, 16, 1 << 21)
    assert info.value.kind.value == "bad_request"
    pages = TransferRequestKVCacheTarget(tp=0, pp=0, kv_pages=[0] * 3)
    with pytest.raises(MigrationError, match="kv_pages name 48 slots"):
        source_validation.target_slots(pages, 16, 32)
    monkeypatch.undo()
    good = TransferRequestKVCacheTarget(tp=0, pp=0, kv_page_ranges=[[2, 2]])
    assert source_validation.target_slots(good, 4, 8).tolist() == list(range(8, 16))
