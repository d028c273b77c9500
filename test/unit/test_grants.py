"""Nothing is written where it was not granted, and nothing is inserted without a receipt.

A real one-rank scheduler side on a CPU harness with a signing key, migrating into its
own host slots over real Mooncake TCP (loopback): every forged, replayed, expired or
mismatched grant is refused with 403 before a byte moves (the host pool's bytes are
compared before and after), `/commit` needs the source's success receipt, and slots of an
abort without a settled receipt stay quarantined until their write window closes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import time

import pytest
from sglang_kv_migration import grants
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
)
from side_helpers import receipts_for, transfer_to_self

KEY = hashlib.sha256(b"test grant key").digest()


@pytest.fixture
def signed_side(side_factory) -> object:
    return side_factory(grant_key=KEY, watchdog_timeout_s=60.0, page_size=16)


def _prefix(side, start: int) -> list[int]:
    ids = list(range(start, start + 64))
    side.harness.insert_random(ids, seed=start)
    side.harness.write_back_all()
    return ids


def _allocate(side, mid: str, start: int):
    out = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=list(range(start, start + 64)),
            migration_id=mid,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            source_instance=side.identity.server_epoch,
        )
    )
    assert out.success, out.message
    return out


def _send(side, request):
    side.replies.clear()
    assert side.transfer_request_kvcache(request) is None
    deadline = time.monotonic() + 30  # bounded: loopback TCP finishes in milliseconds
    while time.monotonic() < deadline:
        side.poll()
        if side.replies:
            return side.replies[0]
        time.sleep(0.001)
    raise AssertionError("no reply")


def _host_digest(side) -> str:
    return hashlib.sha256(
        side.identity.host_pool.kv_buffer.view(-1).view(dtype=_u8()).numpy()
    ).hexdigest()


def _u8():
    import torch

    return torch.uint8


def _refused(reply, fragment: str) -> None:
    assert not reply.success
    assert reply.error_kind == "forbidden", reply.message
    assert fragment in reply.message
    assert reply.transferred_bytes == 0


def test_a_valid_grant_moves_the_bytes_and_its_receipt_commits(signed_side) -> None:
    side = signed_side
    ids = _prefix(side, 1000)
    alloc = _allocate(side, "ok", 5000)
    reply = _send(
        side,
        transfer_to_self(
            side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="ok"
        ),
    )
    assert reply.success, reply.message
    receipt = side.identity.signer.decode_receipt(reply.ranks[0].receipt)
    assert receipt.success and receipt.settled and receipt.migration_id == "ok"
    commit = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="ok", receipts=[reply.ranks[0].receipt])
    )
    assert commit.success, commit.message


def test_forged_grant_is_refused_and_nothing_is_written(signed_side) -> None:
    side = signed_side
    ids = _prefix(side, 1100)
    alloc = _allocate(side, "forged", 5100)
    before = _host_digest(side)
    issued = side.identity.signer.decode_grant(alloc.ranks[0].grant)
    forger = grants.Signer(hashlib.sha256(b"not the key").digest())
    forged = forger.encode(
        dataclasses.replace(
            issued, tokens_digest=grants.tokens_digest(ids, None), migration_id="forged"
        )
    )
    request = transfer_to_self(side, ids, alloc.ranks[0].kv_indices, migration_id="forged")
    request.target_per_rank[0].grant = forged
    _refused(_send(side, request), "signature does not verify")
    assert _host_digest(side) == before


def test_missing_grant_is_refused(signed_side) -> None:
    side = signed_side
    ids = _prefix(side, 1200)
    alloc = _allocate(side, "none", 5200)
    before = _host_digest(side)
    request = transfer_to_self(side, ids, alloc.ranks[0].kv_indices, migration_id="none")
    _refused(_send(side, request), "no grant")
    assert _host_digest(side) == before


def test_replayed_grant_is_refused(signed_side) -> None:
    side = signed_side
    ids = _prefix(side, 1300)
    alloc = _allocate(side, "replay", 5300)
    request = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="replay"
    )
    assert _send(side, request).success
    before = _host_digest(side)
    _refused(_send(side, request), "already used")
    assert _host_digest(side) == before


def test_expired_grant_is_refused(signed_side) -> None:
    side = signed_side
    ids = _prefix(side, 1400)
    alloc = _allocate(side, "late", 5400)
    before = _host_digest(side)
    request = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="late"
    )
    side.transfers.signer.clock = lambda: 4e9  # long after the grant's deadline
    _refused(_send(side, request), "expired")
    assert _host_digest(side) == before


def test_grant_for_other_slots_is_refused(signed_side) -> None:
    """A client mixing up two allocations: slots of one, grant of the other."""
    side = signed_side
    ids = _prefix(side, 1500)
    first = _allocate(side, "first", 5500)
    second = _allocate(side, "second", 5600)
    before = _host_digest(side)
    request = transfer_to_self(
        side, ids, second.ranks[0].kv_indices, first.ranks[0].grant, migration_id="first"
    )
    _refused(_send(side, request), "does not name these target slots")
    assert _host_digest(side) == before


def test_commit_without_a_receipt_is_refused_and_inserts_nothing(signed_side) -> None:
    side = signed_side
    alloc = _allocate(side, "bare", 5700)
    ids = list(range(5700, 5764))
    out = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="bare")
    )
    assert not out.success and out.error_kind == "forbidden"
    assert "no receipt" in out.message
    assert side.harness.match(ids).host_hit_length == 0
    # A receipt signed with another key, or one that reports failure, does not do either.
    forger = grants.Signer(hashlib.sha256(b"not the key").digest())
    forged = [
        forger.encode(side.identity.signer.decode_receipt(r)) for r in receipts_for(side, alloc)
    ]
    out = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="bare", receipts=forged)
    )
    assert not out.success and "signature does not verify" in out.message
    failed = receipts_for(side, alloc, success=False)
    out = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="bare", receipts=failed)
    )
    assert not out.success and "reported the transfer" in out.message
    assert side.harness.match(ids).host_hit_length == 0
    assert side.target.pending.get("bare") is not None  # still abortable


def test_abort_quarantines_until_the_window_closes_unless_settled(signed_side) -> None:
    side = signed_side
    base = side.harness.snapshot()
    alloc = _allocate(side, "q", 5800)
    assert side.abort_transfer(AbortTransferReqInput(migration_id="q")).success
    held = side.harness.snapshot()
    assert held.host_available == base.host_available - 64  # quarantined
    assert held.total_lock_ref == base.total_lock_ref
    assert set(alloc.ranks[0].kv_indices).isdisjoint(side.identity.host_pool.free_slots.tolist())
    assert side.target.pending.release_quarantine() == []  # the window is still open
    # A settled receipt (the source says nothing more can land) frees them at once.
    receipts = receipts_for(side, alloc)
    assert side.abort_transfer(AbortTransferReqInput(migration_id="q", receipts=receipts)).success
    assert side.harness.snapshot() == base

    alloc = _allocate(side, "q2", 5900)
    assert side.abort_transfer(AbortTransferReqInput(migration_id="q2")).success
    assert side.harness.snapshot().host_available == base.host_available - 64
    side.target.pending.clock = lambda: float("inf")  # the window has closed
    assert side.target.pending.release_quarantine() == ["q2"]
    assert side.harness.snapshot() == base


def test_tokens_digest_bytes_are_those_of_older_servers() -> None:
    # int64 little-endian ids, a NUL, the namespace: what numpy's int64 view gave before
    # the struct packing, so grants stay checkable between old and new servers.
    assert grants.tokens_digest([1, 2, 70000, (1 << 63) - 1], "ns") == "cdb8828510c5dc60"
    assert grants.tokens_digest(list(range(300000, 300000 + 32768)), None) == "08faf38f30a01207"


def test_the_digest_of_ids_sent_as_bytes_is_that_of_their_list() -> None:
    from sglang_kv_migration.server.messages import GetRequestExtraTokenSizeReqInput
    from sglang_kv_migration.wire import binary_ids

    ids = [0, 1, 70000, (1 << 32) - 1, *range(300000, 300000 + 8192)]
    raw = binary_ids.to_bytes(ids)
    assert grants.tokens_digest_u32(raw, "ns") == grants.tokens_digest(ids, "ns")
    # A request whose ids came as bytes: any prefix hashes as its list's prefix would.
    req = GetRequestExtraTokenSizeReqInput(input_ids=[], extra_key="ns")
    setattr(req, binary_ids.FIELD, raw)
    binary_ids.unpack_request(req)
    assert req.input_ids == ids and binary_ids.raw_of(req) == raw
    for end in (1, 3, len(ids)):
        assert grants.request_tokens_digest(req, end) == grants.tokens_digest(ids[:end], "ns")
    listed = GetRequestExtraTokenSizeReqInput(input_ids=ids, extra_key=None)
    assert grants.request_tokens_digest(listed, 5) == grants.tokens_digest(ids[:5], None)


# --------------------------------------------------------------------------- issue 17


def _token(payload: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(payload).decode() + "."


@pytest.mark.parametrize(
    "raw",
    [
        _token(b"1"),
        _token(b"null"),
        _token(b"[]"),
        _token(b'{"kind": "Receipt", "migration_id": 3}'),
        _token(
            b'{"kind": "Receipt", "migration_id": "m", "tp": "0", "pp": 0, "path": "host", '
            b'"slots_digest": "", "success": 1, "bytes": 0, "settled": true}'
        ),
        "\u00e9.",
        "a.b.c",
    ],
)
def test_a_token_that_is_not_a_token_object_is_forbidden(raw: str) -> None:
    """Payloads that decode to a number, null, a list, wrong field types or non-ASCII
    raise FORBIDDEN (they raised AttributeError / TypeError and killed the scheduler)."""
    signer = grants.Signer(None)
    for decode in (signer.decode_receipt, signer.decode_grant):
        with pytest.raises(grants.MigrationError) as info:
            decode(raw)
        assert info.value.kind.value == "forbidden"


def _bound_grant(**changes) -> grants.Grant:
    fields = {
        "migration_id": "m",
        "tp": 0,
        "pp": 0,
        "path": "host",
        "slots_digest": "s",
        "num_tokens": 16,
        "expires_at": time.time() + 60,
        "tokens_digest": "t",
        "destination": "d",
        "source": "src",
    }
    return grants.Grant(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"source": ""}, "names no source"),
        ({"source": "other"}, "another source"),
        ({"destination": ""}, "names no destination"),
        ({"destination": "elsewhere"}, "another destination"),
    ],
)
def test_check_grant_binds_the_destination_and_the_source(changes, fragment) -> None:
    signer = grants.Signer(KEY)
    check = dict(migration_id="m", tp=0, pp=0, path="host", num_slots=16, slots="s", tokens="t")
    good = signer.encode(_bound_grant())
    assert signer.check_grant(good, **check, destination="d", source="src").source == "src"
    with pytest.raises(grants.MigrationError, match=fragment) as info:
        signer.check_grant(
            signer.encode(_bound_grant(**changes)), **check, destination="d", source="src"
        )
    assert info.value.kind.value == "forbidden"


def test_destination_digest_is_canonical() -> None:
    a = {"session_id": "h:1", "host_kv_data_ptrs": [1, 2]}
    b = {"host_kv_data_ptrs": [1, 2], "session_id": "h:1"}
    assert grants.destination_digest(a) == grants.destination_digest(b)
    assert grants.destination_digest(a) != grants.destination_digest({**a, "session_id": "h:2"})


# --------------------------------------------------------------------------- source DP rank


def test_a_grant_naming_a_dp_rank_is_claimed_by_that_dp_rank_only() -> None:
    """Feature "source_dp_rank": a grant naming DP rank 1 of the source verifies only on
    that DP rank's scheduler; one naming none (left out of the token: a token of a server
    that predates the field) on any."""
    signer = grants.Signer(KEY)
    check = dict(migration_id="m", tp=0, pp=0, path="host", num_slots=16, slots="s", tokens="t")
    bound = signer.encode(_bound_grant(source_dp_rank=1))
    assert signer.check_grant(bound, **check, destination="d", source="src", dp_rank=1)
    with pytest.raises(grants.MigrationError, match="for DP rank 1 of the source") as info:
        signer.check_grant(bound, **check, destination="d", source="src", dp_rank=0)
    assert info.value.kind.value == "forbidden"
    free = signer.encode(_bound_grant())
    assert signer.decode_grant(free).source_dp_rank == -1
    assert b"source_dp_rank" not in base64.urlsafe_b64decode(free.split(".")[0])
    for dp_rank in (0, 1, 7):
        assert signer.check_grant(free, **check, destination="d", source="src", dp_rank=dp_rank)


def test_the_target_takes_receipts_of_a_dp_rank_bound_grant_only_from_that_dp_rank(
    signed_side,
) -> None:
    """A one-rank source is DP rank 0: a grant naming DP rank 1 moves nothing there; one
    naming DP rank 0 moves, and its receipt names DP rank 0. A receipt that names the
    grant but comes from DP rank 1 (what a second claimant would sign) neither settles
    an abort nor commits."""
    side = signed_side
    ids = _prefix(side, 2000)
    elsewhere = _allocate_for_dp_rank(side, "dp1", 6000, 1)
    before = _host_digest(side)
    request = transfer_to_self(
        side, ids, elsewhere.ranks[0].kv_indices, elsewhere.ranks[0].grant, migration_id="dp1"
    )
    _refused(_send(side, request), "for DP rank 1 of the source, not DP rank 0")
    assert _host_digest(side) == before

    alloc = _allocate_for_dp_rank(side, "dp0", 6100, 0)
    request = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="dp0"
    )
    reply = _send(side, request)
    assert reply.success, reply.message
    mine = side.identity.signer.decode_receipt(reply.ranks[0].receipt)
    assert (mine.dp_rank, mine.settled) == (0, True)
    other = side.identity.signer.encode(dataclasses.replace(mine, dp_rank=1))
    out = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="dp0", receipts=[other])
    )
    assert not out.success and out.error_kind == "forbidden"
    assert "from DP rank 1 of the source, not DP rank 0" in out.message
    base = side.harness.snapshot().host_available
    assert side.abort_transfer(AbortTransferReqInput(migration_id="dp0", receipts=[other])).success
    # Quarantined, not freed: the other DP rank's word settles nothing.
    assert side.harness.snapshot().host_available == base
    assert set(alloc.ranks[0].kv_indices).isdisjoint(side.identity.host_pool.free_slots.tolist())
    # The claimant's own receipt does.
    receipt = [reply.ranks[0].receipt]
    assert side.abort_transfer(AbortTransferReqInput(migration_id="dp0", receipts=receipt)).success
    assert side.harness.snapshot().host_available == base + 64


def _allocate_for_dp_rank(side, mid: str, start: int, dp_rank: int):
    out = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=list(range(start, start + 64)),
            migration_id=mid,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            source_instance=side.identity.server_epoch,
            source_dp_rank=dp_rank,
        )
    )
    assert out.success, out.message
    assert side.identity.signer.decode_grant(out.ranks[0].grant).source_dp_rank == dp_rank
    return out
