"""Migration between two pipeline-parallel (PP=2) servers over Mooncake TCP, on CPU.

Every server is `mini_server` with ``pp_size=2``: one process per stage, each with a real
SGLang HiRadixCache whose pools hold only its stage's layers (layers 0-1 on stage 0,
2-3 on stage 1), the stages joined by a real gloo world group. Requests travel as in
SGLang's `event_loop_pp`: stage 0 reads them, dispatches, runs the per-iteration hook,
then hands the same list to stage 1 with SGLang's `point_to_point_pyobj`; only stage 0
holds SGLang's socket to the tokenizer side, stage 1 replies through the one our
`after_init_ipc_channels` hook opens, and the tokenizer side waits for both replies.

Two servers (four processes) serve the module: A (healthy) and B, whose stage 1 cannot
write (its transport refuses) and has a small host pool (it cannot allocate what stage 0
can). A -> B moves each stage's layers to the same stage; B -> A fails on stage 1 only
and must leave both stages of A as they were; an allocation too big for B's stage 1 is
undone on stage 0 too; B's watchdog (decided on stage 0) frees both stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mini_server import ServerHandle, ServerSpec
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

PP = 2
PAGE = 16
GOOD_IDS = list(range(100, 100 + PAGE * 8 + 5))
BROKEN_IDS = list(range(5000, 5000 + PAGE * 6 + 3))
WATCHDOG_IDS = list(range(12000, 12000 + PAGE * 3))
RECEIPT_IDS = list(range(15000, 15000 + PAGE * 2))
ONE_STAGE_IDS = list(range(16000, 16000 + PAGE))
BAD_GRANT_IDS = list(range(17000, 17000 + PAGE))
# Fits stage 0's host pool (2 x 4096 slots), not stage 1's on B (1.1 x 4096).
HUGE_IDS = list(range(20000, 20000 + PAGE * 320))
# Long: a migration on a loaded machine commits well before it, and the watchdog test
# moves stage 0's clock past it instead of waiting.
TARGET_WATCHDOG_S = 60.0
# B's write window: its grant TTL (min(1 s, watchdog / 2)) + 2 x the 2 s transfer timeout.
WRITE_WINDOW_S = 5.0
START_S = 420.0


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    with server_pair(
        ServerSpec(pp_size=PP, preload=[(GOOD_IDS, 1)]),
        ServerSpec(
            pp_size=PP,
            preload=[(BROKEN_IDS, 2)],
            broken_transport_rank=1,  # stage 1
            small_host_pool_rank=1,
            watchdog_timeout_s=TARGET_WATCHDOG_S,
        ),
        timeout_s=START_S,
    ) as pair:
        yield pair


# --------------------------------------------------------------------------- tests


def test_session_info_gathers_every_stage(servers: ServerPair) -> None:
    infos = [session_info(url) for url in (servers.a.url, servers.b.url)]
    for info in infos:
        ranks = info["ranks"]
        assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == [(0, 0), (0, 1)]
        fps = [r["fingerprint"] for r in ranks]
        # Each stage's pools hold its own layers only.
        assert [(fp["start_layer"], fp["end_layer"]) for fp in fps] == [(0, 2), (2, 4)]
        assert [(fp["pp_size"], fp["pp_rank"]) for fp in fps] == [(PP, 0), (PP, 1)]
        # One server epoch for the whole server (agreed at start-up across stages).
        assert {r["server_epoch"] for r in ranks} == {info["server_epoch"]}
    sessions = {r["session_id"] for info in infos for r in info["ranks"]}
    assert len(sessions) == 2 * PP


def test_migrate_pp2_moves_each_stages_layers(servers: ServerPair) -> None:
    src, dst = servers.a, servers.b
    ids = aligned(GOOD_IDS, PAGE)
    assert dst.ask_all("held", GOOD_IDS) == [(0, 0)] * PP
    recorder = Recorder()
    with recorder.client() as client:
        result = client.migrate(src.url, dst.url, GOOD_IDS)
    assert result.migrated_token_size == len(ids)
    assert result.matched_after_commit == len(ids)

    status, alloc = recorder.last("/allocate_token_for_transfer")
    assert status == 200 and [(r["tp_rank"], r["pp_rank"]) for r in alloc["ranks"]] == [
        (0, 0),
        (0, 1),
    ]
    status, transfer = recorder.last("/transfer_request_kvcache")
    assert status == 200, transfer
    ranks = transfer["ranks"]
    assert [(x["tp_rank"], x["pp_rank"]) for x in ranks] == [(0, 0), (0, 1)]
    assert all(x["success"] and x["bytes"] > 0 and x["receipt"] for x in ranks), ranks
    assert sum(x["bytes"] for x in ranks) == transfer["transferred_bytes"]

    src_kv = src.ask_all("kv", ids)
    dst_kv = dst.ask_all("kv", ids)
    for stage in range(PP):
        assert len(src_kv[stage]) == 2  # this stage's two layers
        assert kv_equal(dst_kv[stage], src_kv[stage]), f"stage {stage} bytes differ"
        assert ranks[stage]["bytes"] == sum(t.numel() * t.element_size() for t in src_kv[stage])
    # Stage s received stage s's layers, not a copy of another stage's.
    assert not kv_equal(src_kv[0], src_kv[1])
    assert dst.ask_all("held", GOOD_IDS) == [(len(ids), 0)] * PP


def test_transfer_failing_on_one_stage_rolls_back_every_stage(servers: ServerPair) -> None:
    src, dst = servers.b, servers.a
    assert dst.ask_all("held", BROKEN_IDS) == [(0, 0)] * PP
    before = dst.ask_all("snapshot")
    recorder, transfer = migrate_into_injected_failure(src.url, dst.url, BROKEN_IDS)
    by_stage = {x["pp_rank"]: x for x in transfer["ranks"]}
    assert sorted(by_stage) == [0, 1]
    assert by_stage[0]["success"] is True and by_stage[0]["bytes"] > 0  # stage 0 wrote
    assert by_stage[1]["success"] is False and "injected failure" in by_stage[1]["message"]
    status, abort = recorder.last("/abort_transfer")
    assert status == 200, abort

    # Both target stages are back where they were; the source's stages kept their pages.
    assert dst.ask_all("snapshot") == before
    assert dst.ask_all("held", BROKEN_IDS) == [(0, 0)] * PP
    assert src.ask_all("held", BROKEN_IDS) == [(len(aligned(BROKEN_IDS, PAGE)), 0)] * PP


def test_allocation_failing_on_one_stage_is_undone_on_every_stage(servers: ServerPair) -> None:
    dst = servers.b
    before = dst.ask_all("snapshot")
    fps = [r["fingerprint"] for r in session_info(servers.a.url)["ranks"]]
    r = post(
        dst.url,
        "/allocate_token_for_transfer",
        {"input_ids": HUGE_IDS, "source_fingerprints": fps},
    )
    assert r.status_code == 503, r.text
    assert "host pool is full" in r.json()["message"]
    # Stage 0 had allocated; the tokenizer side aborted it before answering.
    assert dst.ask_all("pending") == [0] * PP
    # Its slots sit out their write window in quarantine (closed at once by the clock),
    # then every stage is back at its baseline.
    close_windows(dst)
    assert wait_until(lambda: dst.ask_all("snapshot") == before, 30.0)
    assert dst.ask_all("held", HUGE_IDS) == [(0, 0)] * PP


def target_entry(rank: dict[str, Any], granted: dict[str, Any]) -> dict[str, Any]:
    """One `target_per_rank` entry from a target rank's session info and its allocation."""
    return {
        "tp": rank["tp_rank"],
        "pp": rank["pp_rank"],
        "session_id": rank["session_id"],
        "host_kv_data_ptrs": rank["host_kv_data_ptrs"],
        "host_kv_data_lens": rank["host_kv_data_lens"],
        "host_kv_item_lens": rank["host_kv_item_lens"],
        "kv_indices": granted["kv_indices"],
        "fingerprint": rank["fingerprint"],
        "grant": granted["grant"],
    }


def allocate(
    src: ServerHandle, dst: ServerHandle, ids: list[int], key: str | None
) -> dict[str, Any]:
    info = session_info(src.url)
    fps = [r["fingerprint"] for r in info["ranks"]]
    r = post(
        dst.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": ids,
            "extra_key": key,
            "source_fingerprints": fps,
            "source_instance": info["instance_id"],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_transfer_missing_a_stage_is_refused_before_any_stage_writes(servers: ServerPair) -> None:
    src, dst = servers.a, servers.b
    ids = ONE_STAGE_IDS  # held by the source, so only the checks can stop stage 0
    assert src.ask_all("insert", ids, 11) == [True] * PP
    dst_baseline = dst.ask_all("snapshot")
    alloc = allocate(src, dst, ids, None)
    dst_before = dst.ask_all("snapshot")
    src_before = src.ask_all("snapshot")
    stage0 = target_entry(session_info(dst.url)["ranks"][0], alloc["ranks"][0])
    body = {
        "input_ids": ids,
        "matched_token_size": 0,
        "extra_token_size": PAGE,
        "target_per_rank": [stage0],
        "migration_id": alloc["migration_id"],
    }
    r = post(src.url, "/transfer_request_kvcache", body)
    assert r.status_code == 400, r.text
    assert "no entry for tp=0 pp=1" in r.json()["message"]
    assert [(x["success"], x["bytes"]) for x in r.json()["ranks"]] == [(False, 0)] * PP
    # Neither stage pinned nor wrote: stage 1 followed stage 0's refusal.
    assert src.ask_all("snapshot") == src_before
    assert dst.ask_all("snapshot") == dst_before
    r = post(dst.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 200, r.text
    # Aborted without receipts: the slots come back once their write window closed
    # (at once, by the clock).
    close_windows(dst)
    assert wait_until(lambda: dst.ask_all("snapshot") == dst_baseline, 30.0)
    assert session_info(src.url)["success"] is True


def test_bad_grant_for_a_later_stage_is_refused_before_stage_0_writes(
    servers: ServerPair,
) -> None:
    """Stage 0 checks stage 1's grant too: a transfer whose stage-1 entry carries stage
    0's grant writes nothing anywhere (without that check stage 0 would have written
    before stage 1 refused)."""
    src, dst = servers.a, servers.b
    ids = BAD_GRANT_IDS  # held by the source, so only the checks can stop stage 0
    assert src.ask_all("insert", ids, 12) == [True] * PP
    dst_baseline = dst.ask_all("snapshot")
    alloc = allocate(src, dst, ids, None)
    entries = [
        target_entry(rank, granted)
        for rank, granted in zip(session_info(dst.url)["ranks"], alloc["ranks"], strict=True)
    ]
    entries[1]["grant"] = entries[0]["grant"]
    body = {
        "input_ids": ids,
        "matched_token_size": 0,
        "extra_token_size": PAGE,
        "target_per_rank": entries,
        "migration_id": alloc["migration_id"],
    }
    r = post(src.url, "/transfer_request_kvcache", body)
    assert r.status_code == 403, r.text
    ranks = r.json()["ranks"]
    assert [(x["pp_rank"], x["success"], x["bytes"]) for x in ranks] == [
        (0, False, 0),
        (1, False, 0),
    ]
    r = post(
        dst.url,
        "/abort_transfer",
        {"migration_id": alloc["migration_id"], "receipts": [x["receipt"] for x in ranks]},
    )
    assert r.status_code == 200, r.text
    # The request was refused before any stage claimed its grant, so no receipt can say
    # that no write under the grant can land (another request could hold it): every
    # stage keeps its slots quarantined until the write window closes, then frees them.
    assert [s.host_available for s in dst.ask_all("snapshot")] == [
        s.host_available - PAGE for s in dst_baseline
    ]
    close_windows(dst)  # the window closes at once, by the clock
    assert wait_until(lambda: dst.ask_all("snapshot") == dst_baseline, 60.0)


def test_commit_needs_every_stages_receipt(servers: ServerPair) -> None:
    """Stage 0 refuses a commit without stage 1's receipt, and stage 1 follows: nothing
    is inserted on either stage. With both receipts both stages commit."""
    src, dst = servers.a, servers.b
    ids = RECEIPT_IDS
    key = None
    assert src.ask_all("insert", ids, 7) == [True] * PP
    alloc = allocate(src, dst, ids, key)
    target_ranks = session_info(dst.url)["ranks"]
    body = {
        "input_ids": ids,
        "extra_key": key,
        "matched_token_size": 0,
        "extra_token_size": len(ids),
        "target_per_rank": [
            target_entry(rank, granted)
            for rank, granted in zip(target_ranks, alloc["ranks"], strict=True)
        ],
        "migration_id": alloc["migration_id"],
    }
    r = post(src.url, "/transfer_request_kvcache", body)
    assert r.status_code == 200, r.text
    receipts = {x["pp_rank"]: x["receipt"] for x in r.json()["ranks"]}
    assert sorted(receipts) == [0, 1]

    mid = alloc["migration_id"]
    r = post(dst.url, "/commit", {"migration_id": mid, "receipts": [receipts[0]]})
    assert r.status_code == 403, r.text
    assert "tp=0 pp=1" in r.json()["message"]
    assert dst.ask_all("held", ids, key) == [(0, 0)] * PP

    r = post(dst.url, "/commit", {"migration_id": mid, "receipts": list(receipts.values())})
    assert r.status_code == 200, r.text
    assert r.json()["matched_after_commit"] == len(ids)
    # Host-only nodes on both stages, holding each stage's own bytes.
    assert dst.ask_all("held", ids, key) == [(0, len(ids))] * PP
    src_kv, dst_kv = src.ask_all("kv", ids), dst.ask_all("kv", ids)
    assert all(kv_equal(dst_kv[s], src_kv[s]) for s in range(PP))


def test_watchdog_on_stage_0_frees_every_stage(servers: ServerPair) -> None:
    dst = servers.b
    before = dst.ask_all("snapshot")
    alloc = allocate(servers.a, dst, WATCHDOG_IDS, "watchdog")
    assert [s.host_available for s in dst.ask_all("snapshot")] == [
        s.host_available - len(WATCHDOG_IDS) for s in before
    ]
    # Stage 0's clock past the watchdog's deadline; stage 1's only past the write window
    # (short of the watchdog's), so only stage 0's watchdog can free them.
    close_windows(dst, ranks=[0])
    dst.ask(1, "advance_clock", WRITE_WINDOW_S + 1.0)
    assert wait_until(lambda: dst.ask_all("snapshot") == before, 60.0)
    r = post(dst.url, "/commit", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 410, r.text
