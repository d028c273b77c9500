"""Migration between attention-context-parallel servers (``--attn-cp-size 2``), on CPU.

SGLang 0.5.12 splits a prefill's compute over the CP ranks but all-gathers K/V and writes
the whole result into every CP rank's pool (layers/utils/cp_utils.py); HiCache agrees
over the CP group (hiradix_cache.py). So every CP rank holds the whole prefix, and CP
ranks with the same attention TP rank hold the same bytes. SGLang numbers them as TP
ranks (``tp_rank = cp_rank * attn_tp_size + attn_tp_rank``), so ranks pair by tp rank as
without CP: each target CP rank is written by its twin on the source, every source rank
sends (see docs/protocol.md, "Rank pairing", for why not one rank fanning out).

Each server is `mini_server` with ``attn_cp_size=2``: one process per rank, HiRadixCache
built with SGLang's CP and attention-TP groups (as the scheduler builds it), preloaded
with the same KV on CP twins and different KV per attention TP rank. Two shapes: the
DeepSeek-V3.2 one, an NSA model (SGLang's `NSATokenToKVPool` and its KV + indexer host
pool group) with CP=2 at page size 64 (tp 2, attention TP 1), and an MHA model with CP=2
and attention TP 2 (tp 4). A TP=2 server without CP must be refused, naming
``attn_cp_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cpu_harness import HarnessConfig
from mini_server import LONG_GRANT_S, ServerHandle, ServerSpec, start_servers
from multi_rank import Recorder, aligned, check_one_claim_per_grant, kv_equal, post, session_info

START_S = 480.0  # up to ten processes importing SGLang on a slow, shared 2-core machine


SHAPES = {
    # tp, attn_cp, the model's pools
    "nsa_cp2": (2, 2, HarnessConfig(attention="nsa", page_size=64, host_layout="layer_first")),
    "mha_cp2_attn_tp2": (4, 2, HarnessConfig(attention="mha", page_size=16)),
}


@dataclass
class Servers:
    source: ServerHandle
    target: ServerHandle
    plain: ServerHandle | None  # the same ranks without CP
    ids: list[int]  # preloaded on the source
    page: int
    attention: str


@pytest.fixture(scope="module", params=list(SHAPES))
def servers(request: pytest.FixtureRequest) -> Iterator[Servers]:
    tp, cp, harness = SHAPES[request.param]
    ids = list(range(300, 300 + harness.page_size * 6 + 7))
    # A second prefix, for the claim test (the first is migrated whole by another test).
    claimed = list(range(20_000, 20_000 + harness.page_size * 2))
    # Long grants: the claim test writes several steps after its allocate.
    shape = {"harness": harness, "tp_size": tp, "attn_cp_size": cp, "grant_ttl_s": LONG_GRANT_S}
    specs = [ServerSpec(**shape, preload=[(ids, 1), (claimed, 2)]), ServerSpec(**shape)]
    if tp == 2:
        specs.append(ServerSpec(harness=harness, tp_size=tp))
    handles = start_servers(specs, timeout_s=START_S)
    try:
        plain = handles[2] if tp == 2 else None
        yield Servers(*handles[:2], plain, ids, harness.page_size, harness.attention)
    finally:
        for handle in handles:
            handle.stop()


def test_session_info_names_cp_size_and_mode(servers: Servers) -> None:
    ranks = session_info(servers.source.url)["ranks"]
    tp = len(ranks)
    assert [r["tp_rank"] for r in ranks] == list(range(tp))
    for rank in ranks:
        fp = rank["fingerprint"]
        assert (fp["tp_size"], fp["attn_cp_size"], fp["attn_cp_mode"]) == (tp, 2, "replicated")
        pools = "kv+indexer" if servers.attention == "nsa" else "kv"
        assert fp.get("host_pools", "kv") == pools


def test_every_cp_rank_gets_the_pages_from_its_twin(servers: Servers) -> None:
    src, dst, preloaded = servers.source, servers.target, servers.ids
    ids = aligned(preloaded, servers.page)
    tp = len(src.control)
    attn_tp = tp // 2
    assert dst.ask_all("held", preloaded) == [(0, 0)] * tp
    recorder = Recorder()
    with recorder.client() as client:
        result = client.migrate(src.url, dst.url, preloaded)
    assert (result.migrated_token_size, result.matched_after_commit) == (len(ids), len(ids))
    status, transfer = recorder.last("/transfer_request_kvcache")
    assert status == 200, transfer
    # Every source rank wrote its twin: one write per rank, the same bytes each.
    assert [x["tp_rank"] for x in transfer["ranks"]] == list(range(tp))
    assert all(x["success"] and x["bytes"] > 0 for x in transfer["ranks"])
    assert len({x["bytes"] for x in transfer["ranks"]}) == 1

    src_kv = src.ask_all("kv", ids)
    dst_kv = dst.ask_all("kv", ids)
    for rank in range(tp):
        assert kv_equal(dst_kv[rank], src_kv[rank]), f"rank {rank} bytes differ"
        # CP twins hold the same pages (SGLang's all-gather), on the target too.
        assert kv_equal(dst_kv[rank], dst_kv[rank % attn_tp])
    if attn_tp > 1:
        # Attention TP ranks hold different heads: a wrong pairing would show.
        assert not kv_equal(dst_kv[0], dst_kv[1])
    assert dst.ask_all("held", preloaded) == [(len(ids), 0)] * tp


def test_a_server_without_cp_is_refused_naming_the_field(servers: Servers) -> None:
    if servers.plain is None:
        pytest.skip("the server without CP runs with the tp 2 shape only")
    cp_server, plain = servers.source, servers.plain
    before = plain.ask_all("snapshot")
    for source, target, want in (
        (cp_server, plain, "attn_cp_size: source=2 target=1"),
        (plain, cp_server, "attn_cp_size: source=1 target=2"),
    ):
        fps = [r["fingerprint"] for r in session_info(source.url)["ranks"]]
        r = post(
            target.url,
            "/allocate_token_for_transfer",
            {"input_ids": aligned(servers.ids, servers.page), "source_fingerprints": fps},
        )
        assert r.status_code == 409, r.text
        assert want in r.json()["message"]
    assert plain.ask_all("snapshot") == before


def test_each_grant_is_claimed_once_across_the_cp_ranks(servers: Servers) -> None:
    """One grant, one claim, per server: CP ranks are TP ranks, so each grant verifies on
    one scheduler only (swapped between CP ranks, nothing moves), and the transfer sent
    again is refused as a replay on every CP rank, with receipts that settle nothing."""
    src, dst = servers.source, servers.target
    ids = list(range(20_000, 20_000 + servers.page * 2))
    assert dst.ask_all("held", ids) == [(0, 0)] * len(dst.control)
    info = session_info(src.url)
    r = post(
        dst.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": ids,
            "source_fingerprints": [rank["fingerprint"] for rank in info["ranks"]],
            "source_instance": info["instance_id"],
        },
    )
    assert r.status_code == 200, r.text
    check_one_claim_per_grant(src, dst, ids, r.json())
    assert dst.ask_all("held", ids) == [(0, len(ids))] * len(dst.control)  # on host
