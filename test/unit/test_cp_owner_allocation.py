"""Owner-sharded CP allocation on real SGLang objects (CPU): the adapter's
`alloc_pages_with_owners` over the test fork's owner-aware allocator (`cp_sharded.py`),
its refusal of pages that do not match, a target that does not shard refusing an owner
pattern by name, and the client refusing a sharded source whose target lacks the
feature."""

from __future__ import annotations

import pytest
from cp_sharded import make_owner_sharded
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.cp_owners import PageOwners
from sglang_kv_migration.errors import ErrorKind, MigrationError

PAGE = 4


def test_alloc_pages_with_owners_gives_pages_of_the_asked_owners(harness_factory):
    h = harness_factory(page_size=PAGE, device_tokens=64)
    owners = make_owner_sharded(h, "round_robin:1", 2)
    # The adapter reads the fork's hook off the allocator.
    assert sglang_adapter.cp_page_owners(h.cache, 2) == owners
    h.allocator.alloc(PAGE)  # page 1: the free pages now start on rank 0's page 2
    before = h.allocator.available_size()
    pattern = [1, 1, 0, 1]  # mid-pattern, two of rank 1's in a row
    slots = sglang_adapter.alloc_pages_with_owners(h.cache, owners, pattern)
    pages = (slots[::PAGE] // PAGE).tolist()
    assert owners.owners(pages) == pattern
    assert slots.tolist() == [p * PAGE + t for p in pages for t in range(PAGE)]
    assert h.allocator.available_size() == before - len(pattern) * PAGE
    assert not set(pages) & set(h.allocator.free_pages.tolist())


def test_an_allocation_that_does_not_match_is_freed_and_refused(harness_factory):
    h = harness_factory(page_size=PAGE, device_tokens=64)
    owners = make_owner_sharded(h, "round_robin:1", 2)
    before = h.allocator.available_size()
    # A fork whose allocator hands out the wrong pages: the plugin checks, frees, refuses.
    h.allocator.alloc_pages_with_owners = lambda pattern: h.allocator.alloc(len(pattern) * PAGE)
    with pytest.raises(MigrationError, match="cp_owner=round_robin:1") as refused:
        sglang_adapter.alloc_pages_with_owners(h.cache, owners, [0, 0, 0])
    assert refused.value.kind is ErrorKind.CONFLICT
    assert h.allocator.available_size() == before


def test_no_pages_of_an_owner_left_is_unavailable_and_keeps_nothing(harness_factory):
    h = harness_factory(page_size=PAGE, device_tokens=16)  # pages 1..4
    owners = make_owner_sharded(h, "round_robin:1", 2)
    before = h.allocator.available_size()
    with pytest.raises(MigrationError) as refused:
        sglang_adapter.alloc_pages_with_owners(h.cache, owners, [1, 1, 1])
    assert refused.value.kind is ErrorKind.UNAVAILABLE
    assert h.allocator.available_size() == before


def test_a_stock_allocator_names_no_owner_function(harness_factory):
    h = harness_factory(page_size=PAGE, device_tokens=64)
    assert sglang_adapter.cp_page_owners(h.cache, 2) is None
    with pytest.raises(MigrationError, match="alloc_pages_with_owners"):
        sglang_adapter.alloc_pages_with_owners(h.cache, PageOwners(cp_size=2), [0])


def test_the_source_reads_a_runs_owners_off_its_device_pages(harness_factory):
    h = harness_factory(page_size=PAGE, device_tokens=64)
    owners = make_owner_sharded(h, "round_robin:1", 2)
    ids = list(range(10, 10 + 5 * PAGE))
    slots = h.insert_random(ids, seed=1)
    expected = owners.owners((slots[::PAGE] // PAGE).tolist())
    assert sglang_adapter.device_prefix_owners(h.cache, owners, ids, None) == expected
    run = sglang_adapter.run_owners(h.cache, owners, ids, None, 2 * PAGE, 5 * PAGE)
    assert run == expected[2:]
    h.evict_device_all()  # host only now: the owners are not known here
    with pytest.raises(MigrationError, match="on device") as refused:
        sglang_adapter.run_owners(h.cache, owners, ids, None, 0, PAGE)
    assert refused.value.kind is ErrorKind.CONFLICT
    assert sglang_adapter.device_prefix_owners(h.cache, owners, ids, None) == []


def test_a_target_that_does_not_shard_refuses_an_owner_pattern_by_name(side):
    from sglang_kv_migration.server.messages import AllocateTokenForTransferReqInput

    ids = list(range(1000, 1000 + 32))
    before = side.harness.snapshot()
    out = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=ids,
            migration_id="m-owners",
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            page_owners=[0, 1],
        )
    )
    assert not out.success and out.error_kind == ErrorKind.BAD_REQUEST.value
    assert "page_owners" in out.message and "attn_cp_mode=sharded" in out.message
    assert side.harness.snapshot() == before
    assert len(side.target.pending) == 0


def test_the_client_refuses_a_sharded_source_whose_target_lacks_the_feature():
    from sglang_kv_migration.client.migration import MigrationFailed
    from sglang_kv_migration.client.plan import owner_sharded
    from sglang_kv_migration.fingerprint import KVCacheShape, LayoutFingerprint
    from sglang_kv_migration.wire import features
    from sglang_kv_migration.wire.messages import RankSessionInfo, SessionInfoReply

    shape = KVCacheShape("bfloat16", "mha", 0, 1, 2, 16, 0, 0, PAGE, "layer_first")

    def info(cp_owners: PageOwners | None, listed: bool) -> SessionInfoReply:
        ranks = [
            RankSessionInfo(
                tp,
                0,
                PAGE,
                LayoutFingerprint.from_shape(
                    shape,
                    model="m",
                    tp_size=2,
                    tp_rank=tp,
                    pp_size=1,
                    pp_rank=0,
                    attn_cp_size=2,
                    cp_owners=cp_owners,
                ).to_dict(),
            )
            for tp in range(2)
        ]
        reply = SessionInfoReply(success=True, ranks=ranks)
        if not listed:
            reply.features.remove(features.OWNER_PATTERN)
        return reply

    sharded = PageOwners(cp_size=2)
    assert owner_sharded(info(sharded, True), info(sharded, True))
    assert not owner_sharded(info(None, True), info(None, False))
    with pytest.raises(MigrationFailed, match="target does not list 'owner_pattern'"):
        owner_sharded(info(sharded, True), info(sharded, False))
