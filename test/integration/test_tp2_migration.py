"""Migration between two-rank (TP=2) servers over Mooncake TCP, on CPU.

Every server is `mini_server` with ``tp_size=2``: one process per TP rank, each with a
real SGLang HiRadixCache from the harness, the two ranks of a server joined by a real
2-rank gloo group (rank 0 receives, `broadcast_pyobj` reaches rank 1, our handlers
gather per-rank results with `all_gather_object`). Preloaded sequences get different
random KV on each rank, as TP ranks hold different KV heads, so a byte-exact match per
rank proves that source rank r wrote into target rank r.

Two servers (four processes) serve the whole module, to keep start-up affordable on a
small machine: server A and server B, each preloaded with its own sequence, B's rank 1
transport refusing every write. A -> B is the good migration; B -> A is the one that
fails on one rank (rank 0 writes, rank 1 cannot) and must leave both ranks of A as they
were. B also runs a short watchdog for the expiry test.

Pipeline parallelism (stages holding different layers, requests handed from stage to
stage) is covered by `test_pp2_migration.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from mini_server import ServerSpec
from multi_rank import (
    Recorder,
    ServerPair,
    aligned,
    close_windows,
    kv_equal,
    migrate_into_injected_failure,
    post,
    server_pair,
    session_info,
)
from timing import wait_until

# Runs on every supported SGLang (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang

TP = 2
PAGE = 16
# 8 full pages plus an unaligned tail that is never cached nor migrated.
GOOD_IDS = list(range(100, 100 + PAGE * 8 + 5))
BROKEN_IDS = list(range(5000, 5000 + PAGE * 6 + 3))
ALLOC_IDS = list(range(9000, 9000 + PAGE * 4))
WATCHDOG_IDS = list(range(12000, 12000 + PAGE * 3))
# Long: a migration on a loaded machine commits well before it, and the watchdog test
# moves the target's clock past it instead of waiting.
TARGET_WATCHDOG_S = 60.0
START_S = 420.0  # four processes importing SGLang on a slow, shared 2-core machine


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    with server_pair(
        ServerSpec(tp_size=TP, preload=[(GOOD_IDS, 1)]),
        ServerSpec(
            tp_size=TP,
            preload=[(BROKEN_IDS, 2)],
            broken_transport_rank=1,
            watchdog_timeout_s=TARGET_WATCHDOG_S,
        ),
        timeout_s=START_S,
    ) as pair:
        yield pair


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8) for t in tensors]


# --------------------------------------------------------------------------- tests


def test_session_info_lists_both_ranks(servers: ServerPair) -> None:
    print(f"\ntwo tp{TP} servers started in {servers.start_s:.1f}s")
    for url in (servers.a.url, servers.b.url):
        info = session_info(url)
        assert info["success"] is True
        ranks = info["ranks"]
        assert [r["tp_rank"] for r in ranks] == [0, 1]
        assert [r["pp_rank"] for r in ranks] == [0, 0]
        assert len({r["session_id"] for r in ranks}) == TP, ranks
        for rank in ranks:
            fp = rank["fingerprint"]
            assert fp["tp_size"] == TP
            assert fp["tp_rank"] == rank["tp_rank"]
            assert fp["pp_size"] == 1
            assert rank["page_size"] == PAGE
            assert len(rank["host_kv_data_ptrs"]) == len(rank["host_kv_data_lens"]) > 0
    # Four distinct transfer endpoints between the two servers.
    sessions = {
        r["session_id"]
        for url in (servers.a.url, servers.b.url)
        for r in session_info(url)["ranks"]
    }
    assert len(sessions) == 2 * TP


def test_allocate_lists_kv_indices_for_both_ranks(servers: ServerPair) -> None:
    target = servers.b
    before = target.ask_all("snapshot")
    source_fps = [r["fingerprint"] for r in session_info(servers.a.url)["ranks"]]
    r = post(
        target.url,
        "/allocate_token_for_transfer",
        {"input_ids": ALLOC_IDS, "source_fingerprints": source_fps},
    )
    assert r.status_code == 200, r.text
    alloc = r.json()
    try:
        assert alloc["matched_token_size"] == 0
        assert alloc["extra_token_size"] == len(ALLOC_IDS)
        assert [(x["tp_rank"], x["pp_rank"]) for x in alloc["ranks"]] == [(0, 0), (1, 0)]
        lengths = [len(x["kv_indices"]) for x in alloc["ranks"]]
        assert lengths == [len(ALLOC_IDS)] * TP
        for x in alloc["ranks"]:
            assert len(set(x["kv_indices"])) == len(ALLOC_IDS)
        during = target.ask_all("snapshot")
        for rank in range(TP):
            assert during[rank].host_available == before[rank].host_available - len(ALLOC_IDS)
    finally:
        r = post(target.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 200, r.text
    # No transfer, so no receipt: the slots wait out their write window in quarantine
    # (closed at once by the clock).
    close_windows(target)
    assert wait_until(lambda: target.ask_all("snapshot") == before, 30.0)


def test_migrate_tp2_moves_each_ranks_bytes(servers: ServerPair) -> None:
    src, dst = servers.a, servers.b
    ids = aligned(GOOD_IDS, PAGE)
    assert dst.ask_all("held", GOOD_IDS) == [(0, 0)] * TP
    recorder = Recorder()
    with recorder.client() as client:
        t0 = time.monotonic()
        result = client.migrate(src.url, dst.url, GOOD_IDS)
        elapsed = time.monotonic() - t0
    print(f"\ntp{TP} migration of {len(ids)} tokens took {elapsed:.2f}s: {result.timings}")
    assert result.migrated_token_size == len(ids)
    assert result.matched_after_commit == len(ids)

    status, transfer = recorder.last("/transfer_request_kvcache")
    assert status == 200, transfer
    ranks = transfer["ranks"]
    assert [(x["tp_rank"], x["pp_rank"]) for x in ranks] == [(0, 0), (1, 0)]
    assert all(x["success"] for x in ranks), ranks
    # Both ranks' receipts went to the target's mailbox (its rank 0's); both target
    # ranks committed by themselves, in the same iteration (`held` below on each rank).
    assert transfer["delivered"] is True and result.source_committed
    assert "commit" not in result.steps_ms
    per_rank_bytes = [x["bytes"] for x in ranks]
    assert all(b > 0 for b in per_rank_bytes)
    assert sum(per_rank_bytes) == transfer["transferred_bytes"] == result.migrated_bytes

    # Read every rank of both servers (ask_all keeps the ranks' trees alike: each one
    # loads the host-only prefix back).
    src_kv = src.ask_all("kv", ids)
    dst_kv = dst.ask_all("kv", ids)
    for rank in range(TP):
        assert src_kv[rank] and src_kv[rank][0].shape[1] == len(ids)
        assert kv_equal(dst_kv[rank], src_kv[rank]), f"rank {rank} bytes differ"
        assert per_rank_bytes[rank] == sum(t.numel() * t.element_size() for t in src_kv[rank])
    # Rank r received rank r's bytes, not a copy of one rank's.
    assert not kv_equal(src_kv[0], src_kv[1])
    assert not kv_equal(dst_kv[0], dst_kv[1])
    assert dst.ask_all("held", GOOD_IDS) == [(len(ids), 0)] * TP


def test_failure_on_one_rank_rolls_back_every_rank(servers: ServerPair) -> None:
    src, dst = servers.b, servers.a
    assert dst.ask_all("held", BROKEN_IDS) == [(0, 0)] * TP
    before = dst.ask_all("snapshot")
    recorder, transfer = migrate_into_injected_failure(src.url, dst.url, BROKEN_IDS)
    assert transfer["error_kind"] == "transfer_failed"
    by_rank = {x["tp_rank"]: x for x in transfer["ranks"]}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0]["success"] is True and by_rank[0]["bytes"] > 0  # rank 0 did write
    assert by_rank[1]["success"] is False and "injected failure" in by_rank[1]["message"]

    # Every target rank is back where it was: slots freed, prefix unlocked, nothing held.
    assert dst.ask_all("snapshot") == before
    assert dst.ask_all("held", BROKEN_IDS) == [(0, 0)] * TP
    _, alloc = recorder.last("/allocate_token_for_transfer")
    status, abort = recorder.last("/abort_transfer")
    assert status == 200, abort
    r = post(dst.url, "/commit", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 409, r.text
    assert "aborted" in r.json()["message"]
    # The source kept its pages and released its pins on both ranks.
    assert src.ask_all("held", BROKEN_IDS) == [(len(aligned(BROKEN_IDS, PAGE)), 0)] * TP


def test_watchdog_frees_every_rank(servers: ServerPair) -> None:
    dst = servers.b
    before = dst.ask_all("snapshot")
    source_fps = [r["fingerprint"] for r in session_info(servers.a.url)["ranks"]]
    r = post(
        dst.url,
        "/allocate_token_for_transfer",
        {"input_ids": WATCHDOG_IDS, "source_fingerprints": source_fps},
    )
    assert r.status_code == 200, r.text
    migration_id = r.json()["migration_id"]
    assert [s.host_available for s in dst.ask_all("snapshot")] == [
        s.host_available - len(WATCHDOG_IDS) for s in before
    ]
    close_windows(dst)  # past the watchdog's deadline and the write window
    freed = wait_until(lambda: dst.ask_all("snapshot") == before, 60.0)
    assert freed, "watchdog did not free the allocation"
    r = post(dst.url, "/commit", {"migration_id": migration_id})
    assert r.status_code == 410, r.text


def test_request_invalid_for_one_rank_is_refused_by_every_rank(servers: ServerPair) -> None:
    """A transfer whose target list misses rank 1: the ranks agree it is invalid before
    either touches its tree, so neither pins nor writes back, and nothing deadlocks."""
    src, dst = servers.a, servers.b
    target_info = session_info(dst.url)
    rank0 = next(r for r in target_info["ranks"] if r["tp_rank"] == 0)
    # Real slots and a real grant for rank 0, so only rank 1's part is invalid.
    dst_before = dst.ask_all("snapshot")
    source_fps = [r["fingerprint"] for r in session_info(src.url)["ranks"]]
    alloc = post(
        dst.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": aligned(GOOD_IDS, PAGE)[:PAGE],
            "extra_key": "invalid-rank",  # a namespace no other test fills
            "source_fingerprints": source_fps,
            "source_instance": session_info(src.url)["instance_id"],
        },
    ).json()
    assert alloc["success"], alloc
    granted = next(r for r in alloc["ranks"] if r["tp_rank"] == 0)
    src_before = src.ask_all("snapshot")
    body = {
        "input_ids": aligned(GOOD_IDS, PAGE),
        "extra_key": "invalid-rank",
        "matched_token_size": 0,
        "extra_token_size": PAGE,
        "target_per_rank": [
            {
                "tp": 0,
                "pp": 0,
                "session_id": rank0["session_id"],
                "host_kv_data_ptrs": rank0["host_kv_data_ptrs"],
                "host_kv_data_lens": rank0["host_kv_data_lens"],
                "host_kv_item_lens": rank0["host_kv_item_lens"],
                "kv_indices": granted["kv_indices"],
                "fingerprint": rank0["fingerprint"],
                "grant": granted["grant"],
            }
        ],
        "migration_id": alloc["migration_id"],
    }
    r = post(src.url, "/transfer_request_kvcache", body)
    assert r.status_code == 400, r.text
    assert "no entry for tp=1" in r.json()["message"]
    assert src.ask_all("snapshot") == src_before
    post(dst.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    close_windows(dst)  # the aborted slots' write window
    assert wait_until(lambda: dst.ask_all("snapshot") == dst_before, 30.0)
    # Both ranks still serve the next request (no rank is stuck in a collective).
    assert session_info(src.url)["success"] is True
