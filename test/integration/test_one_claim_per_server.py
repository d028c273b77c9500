"""One grant, one claim, per server: the attacks of a second DP rank on a grant the first
is writing under, on real CPU servers over Mooncake TCP.

The source is a `mini_server` with ``dp_size=2`` (two DP ranks, each its own process,
tree and pools; SGLang's `DataParallelController` stood in for; with and without DP
attention, which hands requests on differently), the target a plain
one-rank server. A grant binds the source *server* and a (tp, pp) position, and both DP
ranks have a scheduler there. The source's DP rank 0 writes through a gate
(`write_gate.py`): its write has started, as far as the source can tell, and stays on
the wire until the test opens the gate, with no slowed link and no clock to race.

- Abort: DP rank 1 claims the same grant, fails (it holds nothing), and its receipt
  said `settled`: `/abort_transfer` with it freed the slots DP rank 0 was still writing.
- Commit: both DP ranks hold the prefix (different bytes); DP rank 1 wrote the granted
  slots too, and `/commit` with its receipts inserted while DP rank 0 still wrote.
- A grant naming a DP rank (feature "source_dp_rank"): only that DP rank claims it, and
  the target takes receipts naming it from no other.
"""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from mini_server import ServerSpec
from multi_rank import ServerPair, aligned, host_transfer_body, kv_equal, post, server_pair
from sglang_kv_migration import grants
from timing import wait_until

PAGE = 16
START_S = 420.0  # three processes importing SGLang on a slow, shared 2-core machine
# Long grants: a write held at the gate must still be inside its grant when it goes.
GRANT_TTL_S = 30.0
ON_BOTH = list(range(40_000, 40_000 + 8 * PAGE))  # preloaded on both DP ranks, own bytes
ONLY_DP0 = list(range(50_000, 50_000 + 8 * PAGE))  # inserted on DP rank 0 by the test
ON_DP1 = list(range(60_000, 60_000 + 8 * PAGE))  # inserted on DP rank 1 by the test
# The source's DP ranks are its global ranks 0 and 1 (one TP rank each).
DP0, DP1 = 0, 1


@pytest.fixture(scope="module", params=[False, True], ids=["dp", "dp-attention"])
def servers(request: pytest.FixtureRequest) -> Iterator[ServerPair]:
    attention = request.param
    with server_pair(
        ServerSpec(
            dp_size=2, dp_attention=attention, preload=[(ON_BOTH, 1)], grant_ttl_s=GRANT_TTL_S
        ),
        ServerSpec(grant_ttl_s=GRANT_TTL_S),
        timeout_s=START_S,
    ) as pair:
        yield pair


def _allocate(servers: ServerPair, ids: list[int], **fields: Any) -> dict[str, Any]:
    source = post(servers.a.url, "/get_transfer_session_info").json()
    r = post(
        servers.b.url,
        "/allocate_token_for_transfer",
        {
            "input_ids": ids,
            "source_fingerprints": [rank["fingerprint"] for rank in source["ranks"]],
            "source_instance": source["instance_id"],
            **fields,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _body(servers: ServerPair, ids: list[int], alloc: dict[str, Any]) -> dict[str, Any]:
    target_info = post(servers.b.url, "/get_transfer_session_info").json()
    return host_transfer_body(ids, alloc, target_info)


def _receipts(reply: httpx.Response) -> list[str]:
    return [rank["receipt"] for rank in reply.json().get("ranks", [])]


def _sent_while_held(
    servers: ServerPair, pool: concurrent.futures.Executor, body: dict[str, Any]
) -> concurrent.futures.Future:
    """DP rank 0's transfer of `body`, its write held at the gate (waited for)."""
    source = servers.a
    source.ask(DP0, "hold_writes")
    first = pool.submit(post, source.url, "/transfer_request_kvcache", {**body, "dp_rank": 0})
    assert wait_until(lambda: source.ask(DP0, "held_writes") == 1, 120.0, interval_s=0.05), (
        "DP rank 0 never started its write"
    )
    return first


def _settled_by_its_own_receipts(servers: ServerPair, mid: str, first: httpx.Response) -> None:
    """The first transfer's own receipts (its claimant's, the write over) free the slots."""
    assert first.status_code == 200, first.text
    r = post(servers.b.url, "/abort_transfer", {"migration_id": mid, "receipts": _receipts(first)})
    assert r.status_code == 200, r.text


def test_a_second_dp_rank_s_receipt_frees_no_slot_the_first_is_writing(
    servers: ServerPair,
) -> None:
    source, target = servers.a, servers.b
    source.ask(DP0, "insert", ONLY_DP0, 5)
    alloc = _allocate(servers, ONLY_DP0)
    mid, slots = alloc["migration_id"], alloc["ranks"][0]["kv_indices"]
    body = _body(servers, ONLY_DP0, alloc)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            first = _sent_while_held(servers, pool, body)
            # The same grant on DP rank 1, which holds none of the prefix.
            second = post(source.url, "/transfer_request_kvcache", {**body, "dp_rank": 1})
            aborted = post(
                target.url, "/abort_transfer", {"migration_id": mid, "receipts": _receipts(second)}
            )
            assert aborted.status_code == 200, aborted.text
            # DP rank 0 is still writing: not one of its slots may be handed out.
            freed = target.ask(0, "free_overlap", slots)
            assert freed == 0, f"{freed} slots freed while DP rank 0 still writes them"
            assert second.status_code == 403 and "replay" in second.text, second.text
            assert not any(grants.Signer(None).decode_receipt(r).settled for r in _receipts(second))
        finally:
            source.ask(DP0, "release_writes")
        reply = first.result(timeout=120)
    # Its write landed in quarantined slots; its own receipts settle them.
    _settled_by_its_own_receipts(servers, mid, reply)
    assert wait_until(lambda: target.ask(0, "free_overlap", slots) == len(slots), 30.0)


def test_a_second_dp_rank_cannot_write_or_commit_under_the_first_s_grant(
    servers: ServerPair,
) -> None:
    source, target = servers.a, servers.b
    ids = aligned(ON_BOTH, PAGE)
    assert source.ask(DP0, "held", ids) != (0, 0) and source.ask(DP1, "held", ids) != (0, 0)
    alloc = _allocate(servers, ids)
    mid = alloc["migration_id"]
    body = _body(servers, ids, alloc)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            first = _sent_while_held(servers, pool, body)
            second = post(source.url, "/transfer_request_kvcache", {**body, "dp_rank": 1})
            committed = post(
                target.url, "/commit", {"migration_id": mid, "receipts": _receipts(second)}
            )
            # DP rank 0 is still writing these slots: nothing may be inserted over them.
            assert committed.status_code == 403, committed.text
            assert target.ask(0, "held", ids) == (0, 0)
            assert second.status_code == 403 and "replay" in second.text, second.text
        finally:
            source.ask(DP0, "release_writes")
        reply = first.result(timeout=120)
    assert reply.status_code == 200, reply.text
    r = post(target.url, "/commit", {"migration_id": mid, "receipts": _receipts(reply)})
    assert r.status_code == 200, r.text
    # What the target holds is DP rank 0's KV: the claimant's, and only its.
    landed = target.ask(0, "kv", ids)
    assert kv_equal(landed, source.ask(DP0, "kv", ids))
    assert not kv_equal(landed, source.ask(DP1, "kv", ids))


def _grant_payload(token: str) -> dict[str, Any]:
    return orjson.loads(base64.urlsafe_b64decode(token.split(".")[0]))


def test_a_grant_naming_a_dp_rank_is_claimed_there_and_its_receipts_come_from_there(
    servers: ServerPair,
) -> None:
    """The client asks the source which DP rank holds the prefix and names it in the
    allocate (feature "source_dp_rank"): the grants bind it; the same grant sent to the
    other DP rank is refused before it is claimed, and the target takes no receipt of
    that grant from another DP rank, even one signed as the source would."""
    from sglang_kv_migration.client.migration import MigrationClient

    source, target = servers.a, servers.b
    source.ask(DP1, "insert", ON_DP1, 6)
    with MigrationClient() as client:
        result = client.migrate(source.url, target.url, ON_DP1)
    assert result.migrated_token_size == len(ON_DP1)
    assert kv_equal(target.ask(0, "kv", ON_DP1), source.ask(DP1, "kv", ON_DP1))

    more = ON_DP1 + list(range(61_000, 61_000 + 4 * PAGE))
    source.ask(DP1, "insert", more, 7)
    alloc = _allocate(servers, more, source_dp_rank=1)
    grant = alloc["ranks"][0]["grant"]
    assert _grant_payload(grant)["source_dp_rank"] == 1
    body = _body(servers, more, alloc)
    wrong = post(source.url, "/transfer_request_kvcache", {**body, "dp_rank": 0})
    assert wrong.status_code == 403 and "for DP rank 1 of the source" in wrong.text, wrong.text
    right = post(source.url, "/transfer_request_kvcache", {**body, "dp_rank": 1})
    assert right.status_code == 200, right.text
    (receipt,) = [grants.Signer(None).decode_receipt(r) for r in _receipts(right)]
    assert (receipt.dp_rank, receipt.settled, receipt.success) == (1, True, True)
    # A receipt naming the grant from DP rank 0 (what a second claimant would sign).
    impostor = grants.Signer(None).encode(grants.Receipt(**{**vars(receipt), "dp_rank": 0}))
    mid = alloc["migration_id"]
    r = post(target.url, "/commit", {"migration_id": mid, "receipts": [impostor]})
    assert r.status_code == 403 and "DP rank 0 of the source" in r.text, r.text
    r = post(target.url, "/commit", {"migration_id": mid, "receipts": _receipts(right)})
    assert r.status_code == 200, r.text
