"""Migration between owner-sharded attention-CP servers (a fork's layout), on CPU.

Both servers are `mini_server` with ``attn_cp_size=2`` (tp 2, attention TP 1) whose ranks
run the test-only fork stand-in (`cp_sharded.py`): the device allocator names
``round_robin:1`` (page p is CP rank p mod 2's) and allocates pages by owner, and after
the preload each source rank keeps only the bytes of the pages it owns (the others are
overwritten with `SOURCE_POISON`, on device and host). Before each migration the target's
free host slots are filled with `UNWRITTEN`, so the checks see exactly which pages each
target rank was written: its own, with the source owner's bytes, and no other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from cp_sharded import SOURCE_POISON, UNWRITTEN
from cpu_harness import HarnessConfig
from mini_server import LONG_GRANT_S, ServerHandle, ServerSpec, start_servers
from multi_rank import Recorder, aligned, check_one_claim_per_grant, post, session_info
from sglang_kv_migration.cp_owners import PageOwners, owned_positions

START_S = 480.0  # four processes importing SGLang on a slow, shared 2-core machine
PAGE = 16
OWNER = "round_robin:1"
OWNERS = PageOwners.parse(OWNER, 2)
CLAIMED = list(range(30_000, 30_000 + 3 * PAGE))


@dataclass
class Servers:
    source: ServerHandle
    target: ServerHandle
    ids: list[int]  # preloaded on the source: 9 pages and a partial one


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    harness = HarnessConfig(attention="mha", page_size=PAGE, host_layout="layer_first")
    ids = list(range(500, 500 + PAGE * 9 + 5))
    # One page first: the prefix's pages are then device pages 2..10 (page 0 is never
    # handed out), owned by ranks 0, 1, 0, ..: a run after an odd number of them starts
    # on rank 1's page.
    # After them, a prefix for the claim test (the second one is migrated by others).
    preload = [(list(range(100, 100 + PAGE)), 2), (ids, 3), (CLAIMED, 4)]
    spec = {"harness": harness, "tp_size": 2, "attn_cp_size": 2, "cp_owner": OWNER}
    # Long grants: the claim test writes several steps after its allocate.
    spec["grant_ttl_s"] = LONG_GRANT_S
    handles = start_servers(
        [ServerSpec(**spec, preload=preload), ServerSpec(**spec)], timeout_s=START_S
    )
    try:
        yield Servers(*handles, ids)
    finally:
        for handle in handles:
            handle.stop()


def _size_query(url: str, ids: list[int]) -> dict:
    r = post(url, "/get_request_extra_token_size", {"input_ids": ids})
    assert r.status_code == 200, r.text
    return r.json()


def _check_pages(servers: Servers, ids: list[int], pattern: list[int]) -> None:
    """Every target CP rank holds, at each page it owns, the source owner's bytes, and at
    every other page the bytes it had before (`UNWRITTEN`); the source ranks hold poison
    at the pages they do not own (the stand-in works)."""
    src = servers.source.ask_all("cp_host_pages", ids)
    dst = servers.target.ask_all("cp_host_pages", ids)
    assert [len(pages) for pages in dst] == [len(pattern)] * 2
    for rank in (0, 1):
        owned = set(owned_positions(pattern, rank))
        for page, owner in enumerate(pattern):
            theirs, mine = src[owner][page], dst[rank][page]
            if page in owned:
                assert torch.equal(mine, theirs), f"rank {rank} page {page}: not the owner's"
                assert not torch.all(mine == SOURCE_POISON)
            else:
                assert torch.all(mine == UNWRITTEN), f"rank {rank} wrote page {page}"
                assert torch.all(src[rank][page] == SOURCE_POISON)


def test_session_info_and_size_query_say_sharded(servers: Servers) -> None:
    info = session_info(servers.source.url)
    assert "owner_pattern" in info["features"]
    for rank in info["ranks"]:
        fp = rank["fingerprint"]
        assert (fp["attn_cp_mode"], fp["cp_owner"]) == ("sharded", OWNER)
    held = _size_query(servers.source.url, servers.ids)
    pages = len(aligned(servers.ids, PAGE)) // PAGE
    assert held["matched_token_size"] == pages * PAGE
    # Device pages 2..10 (page 1 holds the first preload), dealt to ranks in turn.
    assert held["page_owners"] == OWNERS.owners(range(2, 2 + pages)) == [0, 1] * 4 + [0]


def _allocate(servers: Servers, ids: list[int], **extra: object) -> tuple[int, dict]:
    fingerprints = [r["fingerprint"] for r in session_info(servers.source.url)["ranks"]]
    body = {"input_ids": ids, "source_fingerprints": fingerprints, "nothing_ok": True, **extra}
    r = post(servers.target.url, "/allocate_token_for_transfer", body)
    return r.status_code, r.json()


HOSTILE = {
    "too short": ([0], 400),
    "too long": ([0, 1, 0, 1], 400),
    "rank out of range": ([0, 2, 0], 400),
    "negative rank": ([0, -1, 0], 400),
    "not an int": ([0, "1", 0], 400),
    "a bool": ([0, True, 0], 400),
    "a float": ([0, 1.0, 0], 400),
    "not a list": ("0,1,0", 400),
    "missing": (None, 400),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_owner_pattern_is_refused_naming_the_field(servers: Servers, case: str) -> None:
    pattern, status = HOSTILE[case]
    ids = list(range(90_000, 90_000 + 3 * PAGE))  # three pages the target does not hold
    before = (servers.target.ask_all("snapshot"), servers.target.ask_all("pending"))
    extra = {} if pattern is None else {"page_owners": pattern}
    code, reply = _allocate(servers, ids, **extra)
    assert code == status, reply
    assert "page_owners" in reply["message"]
    assert (servers.target.ask_all("snapshot"), servers.target.ask_all("pending")) == before


def test_a_source_with_another_owner_function_is_refused_naming_cp_owner(servers: Servers) -> None:
    fingerprints = [r["fingerprint"] for r in session_info(servers.source.url)["ranks"]]
    for fp in fingerprints:
        fp["cp_owner"] = "round_robin:2"
    before = servers.target.ask_all("snapshot")
    ids = list(range(91_000, 91_000 + 2 * PAGE))
    r = post(
        servers.target.url,
        "/allocate_token_for_transfer",
        {"input_ids": ids, "source_fingerprints": fingerprints, "page_owners": [0, 1]},
    )
    assert r.status_code == 409, r.text
    assert "cp_owner: source=round_robin:2 target=round_robin:1" in r.json()["message"]
    assert servers.target.ask_all("snapshot") == before


def test_a_grant_for_another_pattern_is_refused_by_the_source(servers: Servers) -> None:
    """The client relays the pattern: one that is not the source's own (here every page
    given to rank 0) is allocated by the target, but the source refuses the transfer
    before a byte moves, since the grant binds the pattern it was allocated with."""
    ids = aligned(servers.ids, PAGE)
    src, dst = servers.source, servers.target
    assert sum(dst.ask(0, "held", ids)) == 0
    instance = session_info(src.url)["instance_id"]
    wrong = [0] * (len(ids) // PAGE)
    code, alloc = _allocate(servers, ids, page_owners=wrong, source_instance=instance)
    assert code == 200, alloc
    target_ranks = session_info(dst.url)["ranks"]
    body = {
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
            for rank, granted in zip(target_ranks, alloc["ranks"], strict=True)
        ],
    }
    r = post(src.url, "/transfer_request_kvcache", body)
    assert r.status_code == 409, r.text
    assert "not those the target allocated" in r.json()["message"]
    assert all(x["bytes"] == 0 for x in r.json()["ranks"])
    r = post(dst.url, "/abort_transfer", {"migration_id": alloc["migration_id"]})
    assert r.status_code == 200, r.text


def test_each_target_cp_rank_gets_only_its_own_pages_from_its_twin(servers: Servers) -> None:
    """A prefix the target lacks (one page: CP rank 1 owns none of it and sends nothing),
    then a longer one whose run starts on a page rank 1 owns (the target holds an odd
    number of pages: mid-pattern), with the receipts' digests checked at commit."""
    src, dst = servers.source, servers.target
    owners = _size_query(src.url, servers.ids)["page_owners"]
    # The shortest odd first part after which the run starts on rank 1's page.
    first = next(k for k in range(1, len(owners), 2) if owners[k] == 1)
    recorder = Recorder()
    for pages in (first, len(owners)):
        ids = servers.ids[: pages * PAGE]
        held_before = sum(dst.ask(0, "held", ids))
        dst.ask_all("cp_mark_free_host")
        with recorder.client() as client:
            # The second move verifies: each rank's digest covers the pages it sent.
            result = client.migrate(src.url, dst.url, ids, verify=pages > first)
        moved = pages * PAGE - held_before
        assert (result.migrated_token_size, result.matched_after_commit) == (moved, pages * PAGE)
        status, transfer = recorder.last("/transfer_request_kvcache")
        assert status == 200, transfer
        run = owners[held_before // PAGE : pages]
        # Each source rank sent its own pages of the run only.
        sent = [x["bytes"] for x in transfer["ranks"]]
        per_page = sum(sent) // len(run)
        assert sent == [per_page * run.count(r) for r in (0, 1)]
        _check_pages(servers, ids[: pages * PAGE], owners[:pages])
    assert owners[first] == 1 and first % 2 == 1
    # Every target rank committed the whole prefix (the tree is the same on all of them).
    assert dst.ask_all("held", servers.ids) == [(0, len(owners) * PAGE)] * 2
    _check_pages(servers, aligned(servers.ids, PAGE), owners)


def test_each_grant_is_claimed_once_across_the_owner_sharded_cp_ranks(servers: Servers) -> None:
    """One grant, one claim, per server, where each CP rank sends only the pages it owns:
    each grant still names its rank's tp and verifies on that scheduler only; swapped,
    nothing moves; sent again, refused as a replay on every rank, settling nothing."""
    src, dst = servers.source, servers.target
    assert sum(dst.ask(0, "held", CLAIMED)) == 0
    owners = _size_query(src.url, CLAIMED)["page_owners"]
    assert sorted(set(owners)) == [0, 1]  # both CP ranks own pages of it
    instance = session_info(src.url)["instance_id"]
    code, alloc = _allocate(servers, CLAIMED, page_owners=owners, source_instance=instance)
    assert code == 200, alloc
    check_one_claim_per_grant(src, dst, CLAIMED, alloc)
    assert dst.ask_all("held", CLAIMED) == [(0, len(CLAIMED))] * 2
