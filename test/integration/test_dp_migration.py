"""Migration between data-parallel servers (`--dp-size 2`), with and without DP
attention, over Mooncake TCP on CPU.

Every server is `mini_server` with ``dp_size=2``: two DP ranks, each its own process
with its own real SGLang HiRadixCache and pools, and a stand-in for SGLang's
`DataParallelController` that hands our requests on as SGLang 0.5.12 does (to every DP
rank's first rank; with DP attention to DP rank 0's, which broadcasts over the whole
world). The source holds its sequence on DP rank 1 only, so a migration must find it
there; the target's DP ranks start empty, and the KV must land byte-exact on the DP
rank the allocate reply names, and on no other.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mini_server import ServerSpec
from multi_rank import Recorder, ServerPair, aligned, kv_equal, post, server_pair, session_info

PAGE = 16
DP = 2
SEQ = list(range(300, 300 + PAGE * 6 + 5))  # 6 whole pages and a tail that never moves
START_S = 420.0  # four processes importing SGLang on a slow, shared 2-core machine


@pytest.fixture(scope="module", params=[False, True], ids=["dp", "dp-attention"])
def servers(request: pytest.FixtureRequest) -> Iterator[ServerPair]:
    attention = request.param
    with server_pair(
        ServerSpec(dp_size=DP, dp_attention=attention, preload=[(SEQ, 1)], preload_dp_rank=1),
        ServerSpec(dp_size=DP, dp_attention=attention),
        timeout_s=START_S,
    ) as pair:
        yield pair


def test_session_info_lists_every_dp_rank(servers: ServerPair) -> None:
    print(f"\ntwo dp{DP} servers started in {servers.start_s:.1f}s")
    for url in (servers.a.url, servers.b.url):
        info = session_info(url)
        assert info["dp_size"] == DP
        assert [(r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in info["ranks"]] == [
            (0, 0, 0),
            (1, 0, 0),
        ]
        # Each DP rank its own transfer engine; one identity for the whole server.
        assert len({r["session_id"] for r in info["ranks"]}) == DP
        assert {r["server_epoch"] for r in info["ranks"]} == {info["server_epoch"]}
        assert "dp_ranks" in info["features"]
        assert not {"source_allocate", "source_commit"} & set(info["features"])


def test_size_query_finds_the_dp_rank_holding_the_prefix(servers: ServerPair) -> None:
    r = post(servers.a.url, "/get_request_extra_token_size", {"input_ids": SEQ})
    assert r.status_code == 200, r.text
    assert (r.json()["dp_rank"], r.json()["matched_token_size"]) == (1, len(aligned(SEQ, PAGE)))
    r = post(servers.a.url, "/get_request_extra_token_size", {"input_ids": SEQ, "dp_rank": 0})
    assert r.status_code == 200, r.text
    assert (r.json()["dp_rank"], r.json()["matched_token_size"]) == (0, 0)
    r = post(servers.a.url, "/get_request_extra_token_size", {"input_ids": SEQ, "dp_rank": DP})
    assert r.status_code == 400 and "out of range" in r.json()["message"], r.text


def test_migrates_byte_exact_onto_the_dp_rank_it_names(servers: ServerPair) -> None:
    source, target = servers.a, servers.b
    recorder = Recorder()
    with recorder.client() as client:
        result = client.migrate(source.url, target.url, SEQ)
    moved = aligned(SEQ, PAGE)
    assert result.migrated_token_size == len(moved)
    assert result.matched_after_commit == len(moved)
    landed = result.target_dp_rank
    assert landed in range(DP)
    _status, transfer = recorder.last("/transfer_request_kvcache")
    assert transfer["dp_rank"] == 1  # the source sent from the DP rank holding the prefix
    # Byte-exact on the DP rank the reply names; nothing on the other one.
    assert kv_equal(target.ask(landed, "kv", moved), source.ask(1, "kv", moved))
    assert target.ask(1 - landed, "held", moved) == (0, 0)
    # The next allocate of a longer request goes where the prefix already is.
    longer = moved + list(range(7000, 7000 + PAGE * 2))
    fingerprints = [r["fingerprint"] for r in session_info(source.url)["ranks"]]
    r = post(
        target.url,
        "/allocate_token_for_transfer",
        {"input_ids": longer, "source_fingerprints": fingerprints},
    )
    assert r.status_code == 200, r.text
    alloc = r.json()
    assert (alloc["dp_rank"], alloc["matched_token_size"]) == (landed, len(moved))
    assert target.ask(landed, "pending") == 1
    # Abort reaches that DP rank through the id alone.
    r = post(target.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 200, r.text
    assert target.ask(landed, "pending") == 0


def test_ids_naming_no_dp_rank_are_unknown(servers: ServerPair) -> None:
    for migration_id in ("0123abcd", "0123abcd.dp9", "0123abcd.dpx"):
        r = post(servers.b.url, "/commit", {"migration_id": migration_id, "receipts": ["x"]})
        assert r.status_code == 404, r.text
        r = post(servers.b.url, "/abort_transfer", {"migration_id": migration_id})
        assert r.status_code == 404, r.text
