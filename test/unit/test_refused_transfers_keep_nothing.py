"""A source keeps nothing of a transfer it refused: no `device_kv` description (only a
verified grant that names one makes the source remember it), and no reference cycle
through the error it answered with, so the transfer's record and body are freed as its
reply goes out, without waiting for CPython's cyclic garbage collector.

A real one-rank `MigrationSchedulerSide` on the CPU harness; the device path is added
as in `test_known_destinations.py` (its copy needs CUDA and is not reached)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from sglang_kv_migration import grants
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

PAGE = 16


def _device_kv(n: int) -> dict:
    buffers = [{"handle": f"h{n}-{i}", "nbytes": 1 << 20} for i in range(4)]
    return {"host_identity": "h", "gpu_uuid": "GPU-0", "instance_id": f"t{n}", "buffers": buffers}


def _device_transfer(side, ids: list[int], device_kv: dict, grant: str = ""):
    target = TransferRequestKVCacheTarget(
        tp=0,
        pp=0,
        path="device",
        device_kv=device_kv,
        kv_indices=list(range(len(ids))),
        fingerprint=side.identity.fingerprint.to_dict(),
        grant=grant,
    )
    return TransferRequestKVCacheReqInput(
        input_ids=ids,
        matched_token_size=0,
        extra_token_size=len(ids),
        migration_id="m-device",
        target_per_rank=[target],
    )


def _grant_for(side, req: TransferRequestKVCacheReqInput) -> str:
    """The grant a target would issue this source for `req`'s one entry."""
    target = req.target_per_rank[0]
    slots = torch.tensor(target.kv_indices, dtype=torch.int64)
    grant = grants.Grant(
        migration_id=req.migration_id,
        tp=0,
        pp=0,
        path="device",
        slots_digest=grants.slots_digest(slots),
        num_tokens=len(slots),
        expires_at=time.time() + 60,
        tokens_digest=grants.tokens_digest(req.input_ids, req.extra_key),
        destination=grants.destination_digest(target.device_kv),
        source=side.identity.server_epoch,
    )
    return side.identity.signer.encode(grant)


@pytest.fixture
def device_side(side_factory) -> object:
    from sglang_kv_migration.paths.device.path import DevicePath

    side = side_factory(page_size=PAGE)
    side.transfers.paths = {**side.transfers.paths, "device": DevicePath(side.harness.cache)}
    return side


def test_a_description_is_remembered_only_once_a_verified_grant_names_it(device_side):
    side = device_side
    ids = list(range(100, 100 + PAGE))
    known = side.transfers.destinations
    refused = [
        _device_transfer(side, ids, _device_kv(1)),  # no grant
        _device_transfer(side, ids, _device_kv(2), grant="e30=."),  # a malformed one
    ]
    # A grant for another description: it verifies for neither.
    other = _device_transfer(side, ids, _device_kv(3))
    other.target_per_rank[0].grant = _grant_for(side, _device_transfer(side, ids, _device_kv(4)))
    refused.append(other)
    for req in refused:
        side.transfer_request_kvcache(req)
        side.poll()
        assert side.replies[-1].error_kind == "forbidden", side.replies[-1].message
    assert len(known) == 0

    granted = _device_transfer(side, ids, _device_kv(5))
    granted.target_per_rank[0].grant = _grant_for(side, granted)
    side.transfer_request_kvcache(granted)
    side.poll()
    assert side.replies[-1].error_kind != "forbidden", side.replies[-1].message
    assert len(known) == 1  # (the copy itself fails here: no CUDA)
    named = TransferRequestKVCacheTarget(
        tp=0, pp=0, path="device", device_kv_digest=grants.destination_digest(_device_kv(5))
    )
    known.resolve(named)
    assert named.device_kv == _device_kv(5)


def test_a_server_without_the_device_path_remembers_no_description(side) -> None:
    ids = list(range(100, 100 + PAGE))
    req = _device_transfer(side, ids, _device_kv(1))
    req.target_per_rank[0].grant = _grant_for(side, req)
    side.transfer_request_kvcache(req)
    side.poll()
    assert side.replies[-1].error_kind == "conflict"  # no device path here
    assert len(side.transfers.destinations) == 0


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_refused_transfers_are_freed_with_their_reply_without_the_collector(
    device_side, collector_off
) -> None:
    """Refused before the ranks agree (no grant), by the path's start (the device copy
    needs CUDA), and for an unknown digest: each record, request and error is freed by
    reference counting alone once its reply went out."""
    from side_helpers import transfer_to_self

    side = device_side
    ids = list(range(100, 100 + PAGE))

    def granted() -> TransferRequestKVCacheReqInput:
        req = _device_transfer(side, ids, _device_kv(5))
        req.target_per_rank[0].grant = _grant_for(side, req)
        return req

    def unknown_digest() -> TransferRequestKVCacheReqInput:
        entry = TransferRequestKVCacheTarget(
            tp=0,
            pp=0,
            path="device",
            device_kv_digest="ab" * 32,
            kv_indices=list(range(PAGE)),
            fingerprint=side.identity.fingerprint.to_dict(),
        )
        return TransferRequestKVCacheReqInput(
            input_ids=ids, extra_token_size=PAGE, target_per_rank=[entry]
        )

    requests = {
        "no grant": lambda: transfer_to_self(side, ids, list(range(PAGE))),
        "no device copy": granted,
        "unknown digest": unknown_digest,
    }
    for why, make in requests.items():
        req = make()
        side.transfer_request_kvcache(req)
        record = side.transfers.inflight[-1]
        alive = [weakref.ref(record), weakref.ref(req)]
        del record, req
        side.poll()
        assert not side.replies[-1].success, why
        assert [ref() for ref in alive] == [None, None], why
