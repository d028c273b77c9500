"""A cache flush (e.g. after a weight update) while migrations are pending or in flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
)
from sglang_kv_migration.server.scheduler.hooks import around_flush_cache, around_sleep_on_idle
from side_helpers import poll_until, transfer_to_self

# Runs on every supported SGLang (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang


def _allocate(side, ids: list[int], migration_id: str):
    out = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=ids,
            migration_id=migration_id,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
        )
    )
    assert out.success, out.message
    return out


def _scheduler(side, idle: bool = True):
    cache = side.loop.ctx.tree_cache
    return SimpleNamespace(kv_migration=side, is_fully_idle=lambda: idle, cache=cache)


def _flush(scheduler) -> bool:
    # What SGLang's flush_cache does to the cache, behind our AROUND hook.
    def original(s, *args, **kwargs):
        s.cache.reset()
        return True

    return around_flush_cache(original, scheduler)


def test_flush_drops_pending_allocations_and_commit_is_gone(side) -> None:
    host_pool = side.harness.kv_host_pool
    alloc = _allocate(side, list(range(100, 164)), "m1")
    assert _flush(_scheduler(side)) is True
    assert len(side.target.pending) == 0
    # The reset freed every slot, but a granted write may still land in the dropped
    # allocation's slots: they are taken out of the fresh free list again.
    slots = set(alloc.ranks[0].kv_indices)
    assert host_pool.available_size() == host_pool.size - len(slots)
    assert not slots & set(side.harness.host_free_list().tolist())
    commit = CommitTransferRequestKVCacheReqInput(migration_id="m1")
    out = side.commit_transfer_request_kvcache(commit)
    assert not out.success and out.error_kind == "gone"
    assert "flushed" in out.message
    # Once the write window has closed the watchdog gives them back, exactly once.
    side.target.pending.clock = lambda: float("inf")
    side.target.pending.expire()
    assert host_pool.available_size() == host_pool.size
    assert len(set(side.harness.host_free_list().tolist())) == host_pool.size


def test_flush_is_never_refused_and_fails_transfers_in_flight(side) -> None:
    """SGLang asserts that the flush after a weight update succeeds: never refuse it."""
    ids = list(range(400, 464))
    side.harness.insert_random(ids, seed=4)
    side.harness.write_back_all()
    alloc = _allocate(side, list(range(500, 564)), "t")
    request = transfer_to_self(side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant)
    request.migration_id = "t"
    side.transfer_request_kvcache(request)
    assert len(side.transfers) == 1
    assert _flush(_scheduler(side)) is True
    assert poll_until(side, lambda: bool(side.replies)), "no transfer reply"
    reply = side.replies[-1]
    assert not reply.success and "flushed" in reply.message
    assert len(side.transfers) == 0


def test_busy_scheduler_keeps_pending_allocations(side) -> None:
    _allocate(side, list(range(200, 232)), "m2")

    def original(s, *args, **kwargs):
        return False  # SGLang refuses to flush a busy scheduler

    assert around_flush_cache(original, _scheduler(side, idle=False)) is False
    assert side.target.pending.get("m2") is not None


def test_reset_without_the_hook_is_detected(side) -> None:
    """Any other path that resets the tree: the stale entry is forgotten, never freed."""
    host_pool = side.harness.kv_host_pool
    _allocate(side, list(range(300, 332)), "m3")
    side.loop.ctx.tree_cache.reset()
    with pytest.raises(MigrationError) as info:
        side.target.pending.commit("m3")
    assert info.value.kind is ErrorKind.GONE
    assert host_pool.available_size() == host_pool.size
    with pytest.raises(MigrationError):
        side.target.pending.abort("m3")


def test_sleep_on_idle_waits_while_a_migration_is_pending(side) -> None:
    """`--sleep-on-idle` would park the loop up to 1 s; not while ours has work."""
    slept: list[object] = []

    def original(s, *args, **kwargs):
        slept.append(s)
        return "slept"

    scheduler = _scheduler(side)
    assert not side.has_work()
    assert around_sleep_on_idle(original, scheduler) == "slept"
    _allocate(side, list(range(700, 764)), "m-sleep")
    assert side.has_work()
    assert around_sleep_on_idle(original, scheduler) is None
    assert slept == [scheduler]
    # Flag off: SGLang's own behaviour, untouched.
    off = SimpleNamespace(kv_migration=None)
    assert around_sleep_on_idle(original, off) == "slept"
    assert side.abort_transfer(AbortTransferReqInput(migration_id="m-sleep")).success
