"""Staged host-path migrations between two OS processes over Mooncake TCP (issue 11).

Worst-case fragmented target pools (free lists shuffled page by page, `layer_first` at
page size 1): the target grants a staging extent at allocate, the source writes every page
into it in a few entries (plan "staged", in its signed receipt), and the target scatters
the extent into the reserved slots off the scheduler thread before it answers the commit.
Same two-process setup as `test_core_migration.py` (real HiRadixCache, real
`MigrationSchedulerSide`, real transfer engines); the session's pair of
processes (`conftest.migration_peers`), shared with that module.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from core_peers import Server, abort, commit, token_ids, transfer
from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    TransferRequestKVCacheReqInput,
)
from targets import host_target, published_host

# Runs on every supported SGLang (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang

LAYERS = 3
STAGING = 512 << 10  # room for one migration of 1024 tokens (384 KiB), not two
# Grant TTL and transfer timeout: no write expires on a loaded box (on a busy 2-core box
# a fragmented 1,000-entry write outlasted a 0.3 s grant). A test of a window moves the
# target's clock past it instead of waiting.
LONG_S = 60.0
# The write window after allocate: grant TTL + the host path's 2 x transfer timeout.
WINDOW_S = LONG_S + 2 * LONG_S
CFG = {"attention": "mha", "host_layout": "layer_first", "page_size": 1, "device_tokens": 6144}


@pytest.fixture
def servers(migration_peers: tuple[Server, Server]) -> tuple[Server, Server]:
    return migration_peers  # shared with test_core_migration.py (conftest.py)


def _setup(src: Server, dst: Server, staging: int = STAGING, **cfg: object) -> None:
    side = {
        "staging_bytes": staging,
        "grant_ttl_s": LONG_S,
        "transport": {"transfer_timeout_s": LONG_S},
    }
    src.setup(side_kwargs=side, layer_num=LAYERS, **{**CFG, **cfg})
    dst.setup(side_kwargs=side, layer_num=LAYERS, **{**CFG, **cfg})
    # Worst case on both sides: every page its own run.
    src.do("fragment_host", 1)
    dst.do("fragment_host", 2)


def allocate(
    src: Server, dst: Server, tokens: list[int], mid: str, staging: bool = True
) -> AllocateTokenForTransferReqOutput:
    alloc = dst.call(
        "allocate_token_for_transfer",
        AllocateTokenForTransferReqInput(
            input_ids=tokens,
            migration_id=mid,
            source_fingerprints=[r.fingerprint for r in src.info.ranks],
            source_instance=src.info.instance_id,
            staging=staging,
        ),
    )
    assert alloc.success, alloc.message
    return alloc


def _transfer_staged(
    src: Server,
    dst: Server,
    tokens: list[int],
    alloc: AllocateTokenForTransferReqOutput,
    staging: list[int] | None = None,
):
    """The source's transfer, passing the granted extent (or ``staging`` instead)."""
    rank = alloc.ranks[0]
    info = dst.info.ranks[0]
    target = host_target(
        0,
        0,
        published_host(info),
        kv_indices=rank.kv_indices,
        fingerprint=info.fingerprint,
        grant=rank.grant,
        staging=rank.staging if staging is None else staging,
    )
    return src.call(
        "transfer_request_kvcache",
        TransferRequestKVCacheReqInput(
            input_ids=tokens,
            matched_token_size=alloc.matched_token_size,
            extra_token_size=alloc.extra_token_size,
            target_per_rank=[target],
            migration_id=alloc.migration_id,
        ),
    )


def _assert_same_kv(src: Server, dst: Server, tokens: list[int]) -> None:
    src_len, src_kv = src.do("kv_digest", tokens)
    dst_len, dst_kv = dst.do("kv_digest", tokens)
    assert src_len == dst_len == len(tokens)
    assert dst_kv == src_kv, "KV bytes differ after commit"


def test_fragmented_pools_migrate_staged_byte_for_byte(servers):
    src, dst = servers
    _setup(src, dst)
    info = dst.info.ranks[0]
    assert info.staging_region[1] == STAGING
    assert info.stage_writer is True
    tokens = token_ids(1024, start=10_000)
    src.do("insert", tokens, 7, True)
    before = dst.snapshot()

    alloc = allocate(src, dst, tokens, "staged-1")
    rank = alloc.ranks[0]
    assert len(rank.staging) == 2 and rank.staging[1] >= 1024 * LAYERS * 2 * 64
    sent = _transfer_staged(src, dst, tokens, alloc)
    assert sent.success, sent.message
    # Direct writes would need 1024 pages x 6 buffers = 6,144 entries.
    assert sent.ranks[0].plan == "staged"
    assert sent.ranks[0].entries <= 4
    assert dst.do("staging")["free"] < STAGING  # held until the commit
    # The source's progress markers let the target copy pages into their slots while
    # the transfer runs, before any commit: all of them, shortly after the last chunk.
    nbytes = 1024 * LAYERS * 2 * 64
    deadline = time.monotonic() + 60
    while dst.do("staging")["early"] < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dst.do("staging")["early"] == nbytes
    committed = commit(dst, "staged-1", sent)
    assert committed.success, committed.message
    assert committed.matched_after_commit == len(tokens)

    _assert_same_kv(src, dst, tokens)
    staging = dst.do("staging")
    assert staging["free"] == STAGING and staging["quarantined"] == 0
    after = dst.snapshot()
    assert after.host_available == before.host_available - len(tokens)
    assert after.total_lock_ref == 0 and dst.do("pending") == 0


def test_full_arena_falls_back_to_direct_writes(servers):
    src, dst = servers
    _setup(src, dst)
    first, second = token_ids(1024, start=20_000), token_ids(1024, start=30_000)
    src.do("insert", first, 1, True)
    src.do("insert", second, 2, True)

    a = allocate(src, dst, first, "full-a")
    b = allocate(src, dst, second, "full-b")  # the arena holds one extent of this size
    assert a.ranks[0].staging and not b.ranks[0].staging
    assert dst.do("staging")["refused_full"] == 1
    sent_b = _transfer_staged(src, dst, second, b)
    sent_a = _transfer_staged(src, dst, first, a)
    assert sent_a.ranks[0].plan == "staged"
    assert sent_b.ranks[0].plan != "staged"
    assert sent_b.ranks[0].entries > 1000  # direct (or gathered): one entry per target run
    assert commit(dst, "full-b", sent_b).success
    assert commit(dst, "full-a", sent_a).success
    _assert_same_kv(src, dst, first)
    _assert_same_kv(src, dst, second)
    assert dst.do("staging")["free"] == STAGING


def test_abort_of_staged_migration_quarantines_the_extent(servers):
    src, dst = servers
    _setup(src, dst)
    first, second = token_ids(1024, start=40_000), token_ids(1024, start=50_000)
    src.do("insert", first, 1, True)
    alloc = allocate(src, dst, first, "ab-1")
    assert alloc.ranks[0].staging
    assert _transfer_staged(src, dst, first, alloc).ranks[0].plan == "staged"
    # No receipts: the source's write could still land, so the extent is not reused yet.
    assert abort(dst, "ab-1").success
    assert dst.do("staging")["quarantined"] == 1
    early = allocate(src, dst, second, "ab-2")
    assert not early.ranks[0].staging
    assert abort(dst, "ab-2").success

    dst.do("advance_clock", WINDOW_S + 1.0)  # the window has closed
    late = allocate(src, dst, second, "ab-3")
    assert late.ranks[0].staging == alloc.ranks[0].staging  # the same extent, reused
    assert dst.do("staging")["quarantined"] == 0
    # Settled receipts (the transfer finished) free the extent at once.
    src.do("insert", second, 3, True)
    sent = _transfer_staged(src, dst, second, late)
    assert abort(dst, "ab-3", sent).success
    assert dst.do("staging") | {"refused_full": 0, "granted": 0, "early": 0} == {
        "free": STAGING,
        "size": STAGING,
        "quarantined": 0,
        "refused_full": 0,
        "granted": 0,
        "early": 0,
    }


def test_forged_staging_extent_is_refused_before_any_write(servers):
    src, dst = servers
    _setup(src, dst)
    tokens = token_ids(1024, start=60_000)
    src.do("insert", tokens, 4, True)
    alloc = allocate(src, dst, tokens, "forged")
    addr, length = alloc.ranks[0].staging
    untouched = dst.do("host_digest")
    # Another extent of the arena, and one naming the pool itself: neither is granted.
    host_ptr = dst.info.ranks[0].host_kv_data_ptrs[0]
    for forged in ([addr + 4096, length], [host_ptr, length]):
        sent = _transfer_staged(src, dst, tokens, alloc, staging=forged)
        assert not sent.success
        assert sent.error_kind == ErrorKind.FORBIDDEN.value
        assert "staging extent" in sent.message
    assert dst.do("host_digest") == untouched
    # A grant without an extent does not let the source stage either.
    plain = allocate(src, dst, token_ids(1024, start=70_000), "plain", staging=False)
    assert plain.ranks[0].staging == []
    src.do("insert", token_ids(1024, start=70_000), 5, True)
    refused = _transfer_staged(src, dst, token_ids(1024, start=70_000), plain, [addr, length])
    assert refused.error_kind == ErrorKind.FORBIDDEN.value
    assert dst.do("host_digest") == untouched
    assert abort(dst, "forged").success and abort(dst, "plain").success


def test_peers_without_staging_still_migrate(servers):
    src, dst = servers
    # A target without an arena publishes no region and grants no extent.
    _setup(src, dst, staging=0)
    assert dst.info.ranks[0].staging_region == []
    assert dst.info.ranks[0].stage_writer is True  # it still writes extents as a source
    tokens = token_ids(512, start=80_000)
    src.do("insert", tokens, 6, True)
    alloc = allocate(src, dst, tokens, "old-1")
    assert alloc.ranks[0].staging == []
    sent = _transfer_staged(src, dst, tokens, alloc)
    assert sent.success and sent.ranks[0].plan != "staged"
    assert commit(dst, "old-1", sent).success
    _assert_same_kv(src, dst, tokens)

    # A source (or client) that ignores the granted extent writes the slots directly;
    # its receipt then names no plan and the commit inserts without a scatter.
    _setup(src, dst)
    src.do("insert", tokens, 6, True)
    alloc = allocate(src, dst, tokens, "old-2")
    assert alloc.ranks[0].staging
    sent = transfer(src, dst, tokens, alloc)
    assert sent.success, sent.message
    assert sent.ranks[0].plan != "staged"
    assert commit(dst, "old-2", sent).success
    _assert_same_kv(src, dst, tokens)
    assert dst.do("staging")["free"] == STAGING


def test_scheduler_thread_does_no_per_page_work(servers):
    """Calls made on the scheduler thread (handlers and per-iteration polls, both sides)
    do not grow with the number of pages: planning, gathering, writing and scattering
    run on worker threads. Counted with a profiler, so the bound cannot be timing-flaky;
    the time figure (`LoopTimer.max_s`) is printed for the record."""
    src, dst = servers
    worst = {}
    for pages in (128, 2048):
        _setup(src, dst, staging=8 << 20)
        tokens = token_ids(pages, start=90_000 + pages)
        src.do("insert", tokens, 8, True)
        for server in (src, dst):
            server.do("profile_calls", True)
        mid = f"calls-{pages}"
        alloc = allocate(src, dst, tokens, mid)
        sent = _transfer_staged(src, dst, tokens, alloc)
        assert sent.ranks[0].plan == "staged"
        assert commit(dst, mid, sent).success
        for server in (src, dst):
            calls, invocations, max_s, top = server.do("call_profile")
            server.do("profile_calls", False)
            assert invocations > 0
            worst[(server.name, pages)] = calls, top
            print(f"{server.name} {pages} pages: max {calls} calls, loop max {max_s * 1e3:.2f} ms")
    for name in ("source", "target"):
        (small, _), (large, top) = worst[(name, 128)], worst[(name, 2048)]
        # 16x the pages: a per-page loop would add thousands of calls.
        assert large <= small + 200, f"{name}: {small} calls at 128 pages, {large} at 2048: {top}"


def test_staging_fields_are_optional_in_grants_and_receipts():
    # Tokens without an extent or a plan are byte-identical to those of older servers.
    from sglang_kv_migration import grants

    signer = grants.Signer(b"k" * 32)
    grant = grants.Grant("m", 0, 0, "host", "d", 4, 1e12, "t")
    token = signer.encode(grant)
    assert b"staging" not in __import__("base64").urlsafe_b64decode(token.split(".")[0])
    assert signer.decode_grant(token) == grant
    staged = dataclasses.replace(grant, staging_addr=4096, staging_length=8192)
    assert signer.decode_grant(signer.encode(staged)).staging == (4096, 8192)


def test_verify_hashes_the_slots_after_the_staged_copy(servers):
    """Verify and staging together: the source's digest covers its pages in prefix order,
    the target hashes its slots after the extent's copy (in `commit`), and they agree."""
    src, dst = servers
    _setup(src, dst)
    tokens = token_ids(1024, start=30_000)
    src.do("insert", tokens, 9, True)
    alloc = dst.call(
        "allocate_token_for_transfer",
        AllocateTokenForTransferReqInput(
            input_ids=tokens,
            migration_id="staged-verify",
            source_fingerprints=[r.fingerprint for r in src.info.ranks],
            source_instance=src.info.instance_id,
            staging=True,
            verify=True,
        ),
    )
    assert alloc.success, alloc.message
    sent = _transfer_staged(src, dst, tokens, alloc)
    assert sent.success, sent.message
    assert sent.ranks[0].plan == "staged"
    receipt = grants.Signer(None).decode_receipt(sent.ranks[0].receipt)  # unsigned here
    assert receipt.digest  # verify was granted: the source hashed what it sent
    committed = commit(dst, "staged-verify", sent)
    assert committed.success, committed.message
    _assert_same_kv(src, dst, tokens)
    assert dst.do("pending") == 0
