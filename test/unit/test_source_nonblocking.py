"""The source never waits in its scheduler loop for device->host copies.

With a write policy that leaves the prefix on device only, a transfer request queues the
write-back and returns at once; the writes are submitted by a later loop iteration, once
the copies have completed. The copies' completion events are held back here (the CPU
harness finishes copies at once), the way a GPU's D2H copy would still be running.
"""

from __future__ import annotations

import time

import torch
from sglang_kv_migration.paths.base import KVPoll
from sglang_kv_migration.server.messages import AllocateTokenForTransferReqInput
from side_helpers import transfer_to_self


class _HeldEvent:
    """A completion event that reports "not done" until the test releases it."""

    def __init__(self, event: object, gate: dict) -> None:
        self._event = event
        self._gate = gate

    def query(self) -> bool:
        return self._gate["open"] and self._event.query()

    def synchronize(self) -> None:
        assert self._gate["open"], "the scheduler blocked on an unfinished copy"
        self._event.synchronize()


def test_transfer_returns_before_host_copies_finish(side_factory) -> None:
    side = side_factory(page_size=16, write_policy="write_through_selective")
    cache, host_pool = side.loop.ctx.tree_cache, side.identity.host_pool
    ids = list(range(7000, 7064))
    side.harness.insert_random(ids, seed=3)
    assert side.harness.match(ids).host_hit_length == 0

    # Target: slots on this same server for another prefix, written over loopback TCP.
    alloc = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=list(range(9000, 9064)),
            migration_id="self",
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            source_instance=side.identity.server_epoch,
        )
    )
    assert alloc.success, alloc.message
    kv_indices = alloc.ranks[0].kv_indices

    controller = cache.cache_controller
    gate = {"open": False}
    original_write = controller.write

    def write_with_held_events(*args, **kwargs):
        result = original_write(*args, **kwargs)
        queue = controller.ack_write_queue
        queue[:] = [type(a)(a[0], _HeldEvent(a[1], gate), a[2]) for a in queue]
        return result

    controller.write = write_with_held_events
    try:
        request = transfer_to_self(
            side,
            ids,
            kv_indices,
            alloc.ranks[0].grant,
            migration_id="self",
        )
        assert side.transfer_request_kvcache(request) is None
        inflight = side.transfers.inflight[0]
        for _ in range(20):  # loop iterations while the copies are still running
            side.poll()
        assert inflight.waiting and inflight.job.poll() is KVPoll.WAITING
        assert side.replies == []
    finally:
        controller.write = original_write
    gate["open"] = True
    deadline = time.monotonic() + 30
    while not side.replies and time.monotonic() < deadline:
        side.poll()
        time.sleep(0.001)
    assert len(side.replies) == 1 and side.replies[0].success, side.replies
    assert side.replies[0].transferred_bytes == 64 * side.identity.bytes_per_token

    # The bytes that landed in the target slots are the source's host copy.
    source_slots = torch.cat([n.host_value for n in _path(cache, ids)])
    got = _host_bytes(host_pool, side.identity.layout, kv_indices)
    want = _host_bytes(host_pool, side.identity.layout, source_slots.tolist())
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.zeros_like(got))


def _path(cache, ids):
    from sglang_kv_migration import sglang_adapter

    held = sglang_adapter.match_held_prefix(cache, ids, None)
    return sglang_adapter.path_from_root(cache, held.last_node)


def _host_bytes(host_pool, layout, slots: list[int]) -> torch.Tensor:
    """Every buffer's bytes of the given host slots, concatenated."""
    raw = host_pool.kv_buffer.view(torch.uint8).reshape(-1)
    base = host_pool.kv_buffer.data_ptr()
    parts = []
    for buf in layout.buffers:
        start = buf.ptr - base
        view = raw[start : start + buf.length].view(-1, buf.item_len)
        parts.append(view[torch.tensor(slots)].reshape(-1))
    return torch.cat(parts)
