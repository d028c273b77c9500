"""Feature "destination_digest": a device destination named by digest, on both ends.

The source resolves a digest only among the descriptions it was sent in full and hashed
itself; the client names a destination by digest only to a source that accepted it in
full, and sends it in full again when the source says it no longer knows it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import orjson
import pytest
from sglang_kv_migration import grants
from sglang_kv_migration.client.calls import Call, encode
from sglang_kv_migration.client.migration import MigrationFailed, SessionCache
from sglang_kv_migration.client.path_choice import target_entry
from sglang_kv_migration.client.plan import Plan
from sglang_kv_migration.client.steps import _transfer_step
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.source.known_destinations import (
    KnownDestinations,
    UnknownDestination,
)
from sglang_kv_migration.wire import features
from sglang_kv_migration.wire.bodies import TransferBody
from sglang_kv_migration.wire.convert import build
from sglang_kv_migration.wire.messages import (
    AllocateOnTarget,
    RankSessionInfo,
    SessionInfoReply,
    TransferReply,
    TransferRequestKVCacheTarget,
)
from side_helpers import SilentTarget


def _device_kv(n: int = 0) -> dict:
    buffers = [{"handle": f"h{n}-{i}", "nbytes": 1 << 20} for i in range(4)]
    return {"host_identity": "h", "gpu_uuid": "GPU-0", "instance_id": f"t{n}", "buffers": buffers}


def _entry(**fields) -> TransferRequestKVCacheTarget:
    return TransferRequestKVCacheTarget(tp=0, pp=0, path="device", **fields)


def _remembered(known: KnownDestinations, wire: dict) -> TransferRequestKVCacheTarget:
    """`wire` kept as a source keeps it once a verified grant named its digest."""
    entry = _entry(device_kv=wire)
    known.remember(entry, grants.destination_digest(wire))
    return entry


def test_a_digest_resolves_only_to_a_description_the_source_was_sent():
    known = KnownDestinations()
    wire = _device_kv()
    digest = grants.destination_digest(wire)
    with pytest.raises(UnknownDestination):
        known.resolve(_entry(device_kv_digest=digest))  # never sent in full
    full = _entry(device_kv=wire)
    known.resolve(full)  # sent in full: left as it came, not kept (no grant named it yet)
    assert full.device_kv is wire and len(known) == 0
    _remembered(known, wire)
    named = _entry(device_kv_digest=digest)
    known.resolve(named)
    assert named.device_kv is wire
    # Its digest is found without hashing again, and is the grant's digest of it.
    assert known.digest_of(named.device_kv) == digest
    # The same description granted again is deduplicated to the one remembered.
    again = _remembered(known, copy.deepcopy(wire))
    assert again.device_kv is wire and len(known) == 1
    # A digest a client made up for another description names nothing.
    with pytest.raises(UnknownDestination):
        known.resolve(_entry(device_kv_digest=grants.destination_digest(_device_kv(9))))
    # Host entries are left alone.
    host = TransferRequestKVCacheTarget(tp=0, pp=0, path="host", device_kv_digest=digest)
    known.resolve(host)
    assert host.device_kv is None


def test_the_least_recently_used_description_is_forgotten_first():
    known = KnownDestinations(limit=2)
    first, second, third = _device_kv(1), _device_kv(2), _device_kv(3)
    for wire in (first, second):
        _remembered(known, wire)
    assert known.digest_of(copy.deepcopy(first)) == grants.destination_digest(first)  # hashed
    known.resolve(_entry(device_kv_digest=grants.destination_digest(second)))  # used: newest
    _remembered(known, third)
    assert len(known) == 2
    with pytest.raises(UnknownDestination):  # the least recently used one
        known.resolve(_entry(device_kv_digest=grants.destination_digest(_device_kv(1))))
    known.resolve(_entry(device_kv_digest=grants.destination_digest(second)))


def test_what_is_remembered_is_bounded_in_bytes_too():
    one = len(orjson.dumps(_device_kv(0)))
    known = KnownDestinations(limit=64, max_bytes=3 * one)
    for n in range(10):
        _remembered(known, _device_kv(n))
        assert known.bytes <= 3 * one
    assert len(known) == 3  # the three most recent
    known.resolve(_entry(device_kv_digest=grants.destination_digest(_device_kv(9))))
    with pytest.raises(UnknownDestination):
        known.resolve(_entry(device_kv_digest=grants.destination_digest(_device_kv(6))))
    # One description over the whole bound by itself is not kept at all.
    huge = {**_device_kv(99), "buffers": [{"handle": "h" * 100}] * 64}
    _remembered(known, huge)
    assert len(known) == 3 and known.bytes <= 3 * one
    known.clear()
    assert len(known) == 0 and known.bytes == 0


def _plan(sessions: SessionCache, features: list[str]) -> tuple[Plan, Callable[[str], Call]]:
    """A plan to one single-rank device target, and the transfer call `_transfer_step`
    builds from it (its destination in full, or by the digest it is given)."""
    source = SessionInfoReply(success=True, features=features, instance_id="s1")
    rank = RankSessionInfo(0, 0, 1, {}, paths={"device": _device_kv()})
    target = SessionInfoReply(success=True, ranks=[rank])
    plan = Plan("http://s", "http://t", None, source, target, [1, 2], {}, sessions=sessions)

    def transfer(digest: str) -> Call:
        body = build(TransferBody, target_per_rank=[target_entry(rank, "device", digest)])
        return Call("transfer", "http://s", "/transfer_request_kvcache", body)

    return plan, transfer


def _drive(
    plan: Plan, transfer: Callable[[str], Call], replies: list[tuple[int, dict]]
) -> tuple[list[dict], object]:
    """Run `_transfer_step`, answering its calls with `replies`; (bodies sent, result)."""
    sent: list[dict] = []
    steps = _transfer_step(plan, transfer)
    try:
        made = next(steps)
        for reply in replies:
            sent.append(orjson.loads(encode(made.body)))
            made = steps.send(reply)
    except StopIteration as done:
        return sent, done.value
    raise AssertionError(f"more calls than replies: {made}")


def test_the_client_names_by_digest_only_what_the_source_accepted_in_full():
    ok = (200, {"success": True})
    sessions = SessionCache()
    plan, call = _plan(sessions, [features.DESTINATION_DIGEST])
    device_kv = plan.target_info.ranks[0].paths["device"]
    digest = grants.destination_digest(device_kv)
    sent, _ = _drive(plan, call, [ok])
    assert "device_kv" in sent[0]["target_per_rank"][0]  # first time: in full
    sent, _ = _drive(plan, call, [ok])
    entry = sent[0]["target_per_rank"][0]
    assert entry["device_kv_digest"] == digest and "device_kv" not in entry
    assert device_kv == _device_kv()  # the cached session info is unchanged
    # A session-info read drops the digest memos (they would keep replaced infos alive);
    # what the source accepted is still known.
    sessions.put("http://t", SessionInfoReply(success=True))
    assert not sessions._digests
    sent, _ = _drive(plan, call, [ok])
    assert sent[0]["target_per_rank"][0]["device_kv_digest"] == digest
    # A source that forgot it (restart, memory resume, eviction) is sent it again once.
    forgot = (409, {"success": False, "message": "unknown", "destination_unknown": True})
    sent, reply = _drive(plan, call, [forgot, ok])
    assert [("device_kv" in b["target_per_rank"][0]) for b in sent] == [False, True]
    assert isinstance(reply, TransferReply) and reply.success
    # Any other failure is the transfer's: raised, not retried.
    refused = (403, {"success": False, "message": "write refused"})
    with pytest.raises(MigrationFailed):
        _drive(plan, call, [refused])
    # Another instance of the source at that URL knows nothing yet.
    plan.source_info.instance_id = "s2"
    sent, _ = _drive(plan, call, [ok])
    assert "device_kv" in sent[0]["target_per_rank"][0]


def test_a_source_without_the_feature_always_gets_the_description():
    ok = (200, {"success": True})
    plan, call = _plan(SessionCache(), [])
    for _ in range(2):
        sent, _ = _drive(plan, call, [ok])
        assert "device_kv" in sent[0]["target_per_rank"][0]


# --------------------------------------------------------------------------- the source


def _one_trip(ids: list[int], **entry: object) -> TransferRequestKVCacheReqInput:
    target = TransferRequestKVCacheTarget(tp=0, pp=0, path="device", **entry)
    return TransferRequestKVCacheReqInput(
        input_ids=ids,
        target_per_rank=[target],
        allocate_on_target=AllocateOnTarget("ipc:///dev/shm/x/s", "0" * 32, b"{}"),
    )


def test_what_a_source_pinned_while_its_target_allocated_is_released_on_every_end(
    side_factory,
) -> None:
    """The device path matches and pins the prefix while the target allocates: a refused
    allocation, a cache flush before the answer and an unknown destination leave no pin
    (real HiRadixCache; the copy itself needs CUDA and is not reached)."""
    from sglang_kv_migration.paths.device.path import DevicePath

    side = side_factory(page_size=16)
    h = side.harness
    ids = list(range(3000, 3064))
    h.insert_random(ids, seed=7)
    side.transfers.paths = {**side.transfers.paths, "device": DevicePath(h.cache)}
    fake = side.transfers.asks.caller = SilentTarget()
    baseline = h.snapshot()

    side.transfer_request_kvcache(_one_trip(ids, device_kv=_device_kv()))
    inflight = side.transfers.inflight[0]
    assert inflight.prepared is None  # prepared in the iteration's poll, once all asked
    side.poll()
    assert inflight.prepared is not None and inflight.tokens.count == len(ids)
    assert h.snapshot().total_lock_ref > baseline.total_lock_ref  # pinned while it waits
    refusal = {"success": False, "message": "no room", "error_kind": "unavailable"}
    fake.answers = [(b"c" * 16, orjson.dumps(refusal))]
    side.poll()
    assert "the target refused the allocate: no room" in side.replies[-1].message
    assert h.snapshot() == baseline

    side.transfer_request_kvcache(_one_trip(ids, device_kv=_device_kv()))
    side.poll()
    assert h.snapshot().total_lock_ref > baseline.total_lock_ref
    side.prepare_for_cache_flush()
    side.poll()
    assert "flushed" in side.replies[-1].message and fake.waiting == 0
    assert h.snapshot() == baseline

    unknown = grants.destination_digest(_device_kv(5))
    side.transfer_request_kvcache(_one_trip(ids, device_kv_digest=unknown))
    side.poll()
    assert side.replies[-1].destination_unknown and fake.waiting == 0  # not even asked
    assert h.snapshot() == baseline and len(side.transfers) == 0


def test_a_digest_needs_a_single_rank_source(side_factory) -> None:
    side = side_factory(page_size=16, pp_rank=0, pp_size=2)
    assert side.transfers.destinations is None
    entry = _entry(device_kv_digest=grants.destination_digest(_device_kv()))
    side.transfer_request_kvcache(
        TransferRequestKVCacheReqInput(input_ids=list(range(32)), target_per_rank=[entry])
    )
    side.poll()
    [reply] = side.replies
    assert reply.error_kind == "bad_request" and "single-rank source" in reply.message
