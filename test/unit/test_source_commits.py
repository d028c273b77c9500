"""Feature "source_commit" on a real one-rank `MigrationSchedulerSide` (CPU harness): the
loopback transfer delivers its receipts into the side's own mailbox, and the side commits
them before the next iteration's requests; refusals, weight updates and failures."""

from __future__ import annotations

import pytest
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang_kv_migration.server.mailbox import Deliverer
from side_helpers import allocate_on, transfer_to_self

PAGE = 16


def _allocate(side, ids: list[int], migration_id: str, source_commit: bool = True):
    # Loopback: this side is the source, so the grant names its own instance.
    return allocate_on(
        side, ids, migration_id, source_commit=source_commit, source_instance=side.server_epoch
    )


def _send(side, source_ids: list[int], alloc) -> object:
    """A loopback transfer under `alloc`'s grant, polled until it replied."""
    request = transfer_to_self(side, source_ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant)
    request.migration_id = alloc.migration_id
    before = len(side.replies)
    side.transfer_request_kvcache(request)
    for _ in range(500):
        side.poll()
        if len(side.replies) > before:
            return side.replies[-1]
    raise AssertionError("no transfer reply")


@pytest.fixture
def loaded(side):
    ids = list(range(400, 400 + 4 * PAGE))
    side.harness.insert_random(ids, seed=4)
    side.harness.write_back_all()
    return side, ids


def test_a_delivered_transfer_is_committed_before_the_next_requests(loaded):
    side, ids = loaded
    target_ids = list(range(900, 900 + 4 * PAGE))
    alloc = _allocate(side, target_ids, "m1")
    assert alloc.success and alloc.source_commit, alloc.message
    reply = _send(side, ids, alloc)
    assert reply.success and reply.delivered, reply.message
    assert side.pending.get("m1") is not None  # not yet: the next iteration commits
    side.before_requests([])
    assert side.pending.get("m1") is None
    held = side.harness.match(target_ids)
    assert held.host_hit_length + len(held.device_indices) == len(target_ids)


def test_without_asking_nothing_is_delivered(loaded):
    side, ids = loaded
    alloc = _allocate(side, list(range(1000, 1000 + 2 * PAGE)), "m2", source_commit=False)
    assert alloc.success and not alloc.source_commit
    reply = _send(side, ids[: 2 * PAGE], alloc)
    assert reply.success and not reply.delivered
    side.before_requests([])
    assert side.pending.get("m2") is not None  # waits for the client's /commit


def test_forged_receipts_in_the_slot_are_refused_once_and_the_allocation_stays(loaded):
    side, _ids = loaded
    alloc = _allocate(side, list(range(1100, 1100 + 2 * PAGE)), "m3")
    mailbox = side.signer.decode_grant(alloc.ranks[0].grant).mailbox
    deliverer = Deliverer()
    try:
        assert deliverer.deliver(mailbox, ["forged.receipt"]) is None
    finally:
        deliverer.close()
    side.before_requests([])
    pending = side.pending.get("m3")
    assert pending is not None and not pending.source_commit  # not read again


def test_a_weight_update_drops_what_waits_for_its_source(loaded):
    side, ids = loaded
    waiting = _allocate(side, list(range(1200, 1200 + 2 * PAGE)), "m4")
    plain = _allocate(side, list(range(1300, 1300 + 2 * PAGE)), "m5", source_commit=False)
    assert waiting.success and plain.success
    side.before_requests([UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])])
    assert side.pending.get("m4") is None and side.pending.get("m5") is not None
    # Its source then finds the slot no longer armed: not delivered (the client commits
    # and learns the allocation is gone).
    reply = _send(side, ids[: 2 * PAGE], waiting)
    assert reply.success and not reply.delivered


def test_an_allocation_failing_after_its_slots_were_reserved_gives_them_back(
    side, monkeypatch: pytest.MonkeyPatch
):
    before = side.harness.snapshot()

    def boom(migration_id: str) -> str:
        raise RuntimeError("injected fault after reserving")

    monkeypatch.setattr(side.source_commits, "grant_slot", boom)
    out = _allocate(side, list(range(1400, 1400 + 2 * PAGE)), "m6")
    assert not out.success and out.error_kind == "internal"
    assert "injected fault" in out.message
    assert len(side.pending) == 0 and side.pending.quarantined() == 0
    assert side.harness.snapshot() == before  # the slots went back at once
