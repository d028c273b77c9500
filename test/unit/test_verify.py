"""The opt-in `verify`: the target hashes what landed before inserting it.

A real one-rank scheduler side on a CPU harness migrating into its own host slots over
real Mooncake TCP (loopback), as in `test_grants.py`: with verify the source's receipt
carries a digest of the pages it sent; `/commit` checks it against the granted slots and
refuses a mismatch (409 naming the receipt hash), inserting nothing and giving the slots
back. Without verify no digest is computed. The device path's target role is checked on
a CPU device pool.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
)
from side_helpers import transfer_to_self

KEY = hashlib.sha256(b"test verify key").digest()


@pytest.fixture
def side(side_factory) -> object:
    return side_factory(grant_key=KEY, watchdog_timeout_s=60.0, page_size=16)


def _migrate_to_self(side, mid: str, start: int, *, verify_grant: bool):
    """Insert a prefix, allocate slots for another, write the prefix's pages into them."""
    ids = list(range(start, start + 64))
    side.harness.insert_random(ids, seed=start)
    side.harness.write_back_all()
    baseline = side.harness.snapshot()
    alloc = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=list(range(start + 10_000, start + 10_064)),
            migration_id=mid,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            verify=verify_grant,
            source_instance=side.identity.server_epoch,
        )
    )
    assert alloc.success, alloc.message
    assert side.identity.signer.decode_grant(alloc.ranks[0].grant).verify is verify_grant
    request = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id=mid
    )
    side.replies.clear()
    assert side.transfer_request_kvcache(request) is None
    deadline = time.monotonic() + 30  # bounded: loopback TCP finishes in milliseconds
    while not side.replies and time.monotonic() < deadline:
        side.poll()
        time.sleep(0.001)
    assert side.replies and side.replies[0].success, side.replies
    return ids, alloc, side.replies[0], baseline


def _commit(side, mid: str, reply, **fields):
    return side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(
            migration_id=mid, receipts=[r.receipt for r in reply.ranks], **fields
        )
    )


def _source_host_slots(side, ids: list[int]) -> torch.Tensor:
    """The host slots of a prefix the side holds (on device, backed up to host)."""
    node = side.harness.match(ids).last_device_node
    nodes = sglang_adapter.path_from_root(side.harness.cache, node)
    return torch.cat([n.host_value for n in nodes])


def test_verify_passes_on_a_good_migration(side) -> None:
    ids, alloc, reply, _ = _migrate_to_self(side, "good", 1000, verify_grant=True)
    receipt = side.identity.signer.decode_receipt(reply.ranks[0].receipt)
    # The source hashed its own pages, in prefix order; the target's slots hold the same.
    want = verify.host_pages_digest(side.identity.layout, _source_host_slots(side, ids))
    assert receipt.digest == want
    slots = torch.tensor(alloc.ranks[0].kv_indices)
    assert verify.host_pages_digest(side.identity.layout, slots) == want
    out = _commit(side, "good", reply)
    assert out.success, out.message
    assert out.matched_after_commit == 64


def test_a_corrupted_byte_refuses_the_commit_and_frees_the_slots(side) -> None:
    ids, alloc, reply, baseline = _migrate_to_self(side, "bad", 2000, verify_grant=True)
    slots = alloc.ranks[0].kv_indices
    # One byte of the last granted slot changes after the transfer (a stray write).
    raw = side.identity.host_pool.kv_buffer.view(-1).view(torch.uint8)
    offset = slots[-1] * side.identity.layout.buffers[-1].item_len + (
        side.identity.layout.buffers[-1].ptr - side.identity.layout.buffers[0].ptr
    )
    raw[offset] ^= 0x5A
    out = _commit(side, "bad", reply)
    assert not out.success and out.error_kind == "conflict"
    assert "receipt hash" in out.message
    target_ids = list(range(12_000, 12_064))
    assert side.harness.match(target_ids).host_hit_length == 0  # nothing inserted
    assert side.target.pending.get("bad") is None and side.target.pending.quarantined() == 0
    assert side.harness.snapshot() == baseline  # slots and locks back at once
    again = _commit(side, "bad", reply)  # a retry cannot insert it either
    assert not again.success


def test_without_verify_no_digest_is_computed_and_commit_can_still_ask(side) -> None:
    _ids, _alloc, reply, baseline = _migrate_to_self(side, "plain", 3000, verify_grant=False)
    receipt = side.identity.signer.decode_receipt(reply.ranks[0].receipt)
    assert receipt.digest == ""  # the source did not hash: nobody asked
    out = _commit(side, "plain", reply, verify=True)
    assert not out.success and out.error_kind == "conflict"
    assert "receipt hash missing" in out.message
    assert side.harness.snapshot() == baseline


def test_server_flag_verifies_every_migration(side) -> None:
    side.target.allocations.verify_all = True  # --kv-migration-verify
    _ids, alloc, reply, _ = _migrate_to_self(side, "flag", 4000, verify_grant=True)
    assert side.identity.signer.decode_receipt(reply.ranks[0].receipt).digest
    assert _commit(side, "flag", reply).success


def test_device_digest_follows_the_rows_in_prefix_order(harness_factory) -> None:
    h = harness_factory(attention="mha", page_size=16, layer_num=3)
    path = DevicePath(h.cache)
    first, second = path.reserve(32), path.reserve(32)
    buffers = sglang_adapter.device_kv_buffers(h.cache)
    gen = torch.Generator().manual_seed(7)
    for buf in buffers:
        rows = torch.randint(0, 255, (32, buf[0].numel() * buf.element_size()), generator=gen)
        buf.view(buf.shape[0], -1).view(torch.uint8)[first] = rows.to(torch.uint8)
        buf.view(buf.shape[0], -1).view(torch.uint8)[second] = rows.to(torch.uint8)
    assert path.content_digest(first) == path.content_digest(second)
    assert path.content_digest(first) == verify.device_rows_digest(buffers, first)
    buffers[-1].view(-1).view(torch.uint8)[
        int(second[-1]) * buffers[-1][0].numel() * buffers[-1].element_size()
    ] ^= 1
    assert path.content_digest(first) != path.content_digest(second)
    path.release(first)
    path.release(second)
