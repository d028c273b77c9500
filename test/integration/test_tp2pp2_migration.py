"""Migration between two TP=2 x PP=2 servers over Mooncake TCP, on CPU.

Like `test_pp2_migration.py`, with two TP ranks per stage: four processes per server
(global rank = pp_rank * 2 + tp_rank, as SGLang numbers them), each stage's TP ranks
joined by their own gloo group, each stage's pools holding its own two layers. Every
rank preloads different random KV, so a byte-exact match per rank proves that source
rank (tp, pp) wrote into target rank (tp, pp). B's rank (tp=1, pp=1) cannot write: a
migration from B fails there only and leaves all four ranks of A as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mini_server import ServerSpec
from multi_rank import ServerPair, aligned, kv_equal, server_pair
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed

TP, PP = 2, 2
PAGE = 16
GOOD_IDS = list(range(100, 100 + PAGE * 6 + 5))
BROKEN_IDS = list(range(5000, 5000 + PAGE * 4 + 3))
PARTIAL_IDS = list(range(9000, 9000 + PAGE * 7))  # A holds the first 4 pages
POSITIONS = [(tp, pp) for pp in range(PP) for tp in range(TP)]  # global rank order
START_S = 600.0  # eight processes importing SGLang on a small shared machine


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    with server_pair(
        ServerSpec(tp_size=TP, pp_size=PP, preload=[(GOOD_IDS, 1), (PARTIAL_IDS[: 4 * PAGE], 3)]),
        ServerSpec(tp_size=TP, pp_size=PP, preload=[(BROKEN_IDS, 2)], broken_transport_rank=3),
        timeout_s=START_S,
    ) as pair:
        yield pair


def test_each_rank_moves_its_own_heads_and_layers(servers: ServerPair) -> None:
    src, dst = servers.a, servers.b
    ids = aligned(GOOD_IDS, PAGE)
    with MigrationClient() as client:
        result = client.migrate(src.url, dst.url, GOOD_IDS)
    assert result.migrated_token_size == result.matched_after_commit == len(ids)
    src_kv, dst_kv = src.ask_all("kv", ids), dst.ask_all("kv", ids)
    for rank, position in enumerate(POSITIONS):
        assert len(src_kv[rank]) == 2, position  # this stage's two layers
        assert kv_equal(dst_kv[rank], src_kv[rank]), f"rank {position} bytes differ"
    # Four different slices: no rank received another rank's bytes.
    for i in range(len(POSITIONS)):
        for j in range(i + 1, len(POSITIONS)):
            assert not kv_equal(src_kv[i], src_kv[j])
    per_rank = sum(t.numel() * t.element_size() for t in src_kv[0])
    assert result.migrated_bytes == per_rank * len(POSITIONS)


def test_failure_on_one_rank_of_one_stage_rolls_back_every_rank(servers: ServerPair) -> None:
    src, dst = servers.b, servers.a
    before = dst.ask_all("snapshot")
    with MigrationClient() as client, pytest.raises(MigrationFailed) as failed:
        client.migrate(src.url, dst.url, BROKEN_IDS)
    assert failed.value.phase == "transfer" and failed.value.rolled_back is True
    ranks = failed.value.reply["ranks"]
    assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == POSITIONS
    assert [r["success"] for r in ranks] == [True, True, True, False]
    assert dst.ask_all("snapshot") == before
    assert dst.ask_all("held", BROKEN_IDS) == [(0, 0)] * len(POSITIONS)
    assert src.ask_all("held", BROKEN_IDS) == [(len(aligned(BROKEN_IDS, PAGE)), 0)] * len(POSITIONS)


def test_a_partial_transfer_cuts_every_rank_alike(servers: ServerPair) -> None:
    """No size query (feature "partial_transfer"): the target allocates 7 pages on every
    rank, every source rank sends the 4 it holds, and every target rank inserts those 4
    and frees the other 3 at once."""
    src, dst = servers.a, servers.b
    held = 4 * PAGE
    before = dst.ask_all("snapshot")
    with MigrationClient() as client:
        result = client.migrate(src.url, dst.url, PARTIAL_IDS)
    assert set(result.steps_ms) == {"allocate", "transfer", "commit"}
    assert result.migrated_token_size == result.matched_after_commit == held
    assert [sum(h) for h in dst.ask_all("held", PARTIAL_IDS)] == [held] * len(POSITIONS)
    src_kv, dst_kv = src.ask_all("kv", PARTIAL_IDS[:held]), dst.ask_all("kv", PARTIAL_IDS[:held])
    for rank, position in enumerate(POSITIONS):
        assert kv_equal(dst_kv[rank], src_kv[rank]), f"rank {position} bytes differ"
    after = dst.ask_all("snapshot")
    for rank, position in enumerate(POSITIONS):
        assert after[rank].host_available == before[rank].host_available - held, position
        assert after[rank].total_lock_ref == 0, position
