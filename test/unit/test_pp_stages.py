"""Unit tests: merging one reply per PP stage, and the tokenizer side's wait for them.

The integration tests with real stage processes are in `test_pp2_migration.py`; these
pin down the merge rules and the communicator's bookkeeping with literal replies.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sglang_kv_migration.server.http.communicators import KVMigrationCommunicators, RidCommunicator
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AbortTransferReqOutput,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqOutput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.rank.pp_stages import merge_stage_replies, needs_rollback
from sglang_kv_migration.wire.messages import AllocatedRank, RankSessionInfo, RankTransferResult


def session_rank(tp: int, pp: int) -> RankSessionInfo:
    return RankSessionInfo(
        tp_rank=tp, pp_rank=pp, session_id=f"s{tp}{pp}", page_size=16, fingerprint={}
    )


def test_session_info_lists_every_rank_in_pp_then_tp_order() -> None:
    stage1 = GetTransferSessionInfoReqOutput(
        success=True, ranks=[session_rank(0, 1), session_rank(1, 1)], server_epoch="e"
    )
    stage0 = GetTransferSessionInfoReqOutput(
        success=True, ranks=[session_rank(0, 0), session_rank(1, 0)], server_epoch="e"
    )
    merged = merge_stage_replies([stage1, stage0])  # arrival order does not matter
    assert [(r.tp_rank, r.pp_rank) for r in merged.ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert merged.success and merged.server_epoch == "e"


def test_session_info_with_different_epochs_fails() -> None:
    replies = [
        GetTransferSessionInfoReqOutput(success=True, ranks=[session_rank(0, p)], server_epoch=e)
        for p, e in ((0, "a"), (1, "b"))
    ]
    merged = merge_stage_replies(replies)
    assert not merged.success and "different server epochs" in merged.message


def test_extra_size_takes_the_smallest_match() -> None:
    replies = [
        GetRequestExtraTokenSizeReqOutput(
            success=True,
            matched_token_size=m,
            extra_token_size=64 - m,
            total_token_size=64,
            device_token_size=d,
        )
        for m, d in ((32, 32), (16, 16))
    ]
    merged = merge_stage_replies(replies)
    assert (merged.matched_token_size, merged.extra_token_size) == (16, 48)
    assert merged.device_token_size == 16


def allocated(pp: int, *, success: bool = True, matched: int = 0) -> Any:
    if not success:
        return AllocateTokenForTransferReqOutput(
            success=False, migration_id="m", message="host pool is full", error_kind="unavailable"
        )
    return AllocateTokenForTransferReqOutput(
        success=True,
        migration_id="m",
        matched_token_size=matched,
        extra_token_size=32,
        ranks=[AllocatedRank(0, pp, [pp, pp + 1])],
        path="host",
        page_size=16,
    )


def test_allocate_merges_ranks_or_fails_as_a_whole() -> None:
    merged = merge_stage_replies([allocated(1), allocated(0)])
    assert merged.success and [r.pp_rank for r in merged.ranks] == [0, 1]
    assert not needs_rollback([allocated(1), allocated(0)], merged)

    replies = [allocated(0), allocated(1, success=False)]
    merged = merge_stage_replies(replies)
    assert not merged.success and merged.error_kind == "unavailable"
    assert needs_rollback(replies, merged)  # stage 0 holds its part

    replies = [allocated(0, success=False), allocated(1, success=False)]
    assert not needs_rollback(replies, merge_stage_replies(replies))


def test_allocate_with_stages_disagreeing_on_the_range_fails_and_rolls_back() -> None:
    replies = [allocated(0, matched=0), allocated(1, matched=16)]
    merged = merge_stage_replies(replies)
    assert not merged.success and merged.error_kind == "conflict"
    assert "different ranges" in merged.message
    assert needs_rollback(replies, merged)


def test_transfer_keeps_every_receipt_and_fails_if_one_stage_failed() -> None:
    def sent(pp: int, ok: bool) -> TransferRequestKVCacheReqOutput:
        return TransferRequestKVCacheReqOutput(
            success=ok,
            transferred_token_size=32 if ok else 0,
            transferred_bytes=100 if ok else 0,
            ranks=[RankTransferResult(0, pp, ok, 100 if ok else 0, receipt=f"r{pp}")],
            message="" if ok else "injected failure",
            error_kind="" if ok else "transfer_failed",
        )

    merged = merge_stage_replies([sent(1, True), sent(0, True)])
    assert merged.success and merged.transferred_bytes == 200
    assert [r.receipt for r in merged.ranks] == ["r0", "r1"]

    merged = merge_stage_replies([sent(0, True), sent(1, False)])
    assert not merged.success and merged.message == "injected failure"
    assert [r.receipt for r in merged.ranks] == ["r0", "r1"]  # for /abort_transfer


def test_commit_and_abort() -> None:
    ok = [
        CommitTransferRequestKVCacheReqOutput(success=True, matched_after_commit=n)
        for n in (64, 48)
    ]
    assert merge_stage_replies(ok).matched_after_commit == 48
    refused = CommitTransferRequestKVCacheReqOutput(
        success=False, message="no receipt", error_kind="forbidden"
    )
    assert merge_stage_replies([ok[0], refused]) is refused
    aborted = [AbortTransferReqOutput(success=True), AbortTransferReqOutput(success=True)]
    assert merge_stage_replies(aborted).success


def test_merge_refuses_mixed_or_no_replies() -> None:
    with pytest.raises(ValueError):
        merge_stage_replies([])
    with pytest.raises(ValueError):
        merge_stage_replies([AbortTransferReqOutput(success=True), allocated(0)])


# --------------------------------------------------------------------------- communicator


class Scheduler:
    """Records what the tokenizer side sends; the test plays the stages' replies."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_pyobj(self, obj: Any) -> None:
        self.sent.append(obj)


def test_rid_communicator_waits_for_one_reply_per_stage() -> None:
    async def run() -> None:
        scheduler = Scheduler()
        comm = RidCommunicator(scheduler, replies=2)
        call = asyncio.ensure_future(comm(GetTransferSessionInfoReqInput()))
        await asyncio.sleep(0)
        rid = scheduler.sent[0].rid
        comm.handle_recv(GetTransferSessionInfoReqOutput(success=True, rid=rid))
        comm.handle_recv(GetTransferSessionInfoReqOutput(success=True, rid="someone-else"))
        await asyncio.sleep(0.05)
        assert not call.done(), "returned before the second stage replied"
        comm.handle_recv(GetTransferSessionInfoReqOutput(success=False, rid=rid))
        replies = await asyncio.wait_for(call, 5)
        assert [r.success for r in replies] == [True, False]
        assert comm._waiting == {}

    asyncio.run(run())


def test_failed_allocation_is_aborted_on_every_stage_before_the_answer() -> None:
    async def run() -> None:
        scheduler = Scheduler()
        comms = KVMigrationCommunicators(scheduler, pp_size=2)
        handlers = dict(comms.result_handlers)
        call = asyncio.ensure_future(
            comms.call(AllocateTokenForTransferReqInput(input_ids=[1] * 32, migration_id="m"))
        )
        await asyncio.sleep(0)
        rid = scheduler.sent[0].rid
        for reply in (allocated(0), allocated(1, success=False)):
            reply.rid = rid
            handlers[AllocateTokenForTransferReqOutput](reply)
        await asyncio.sleep(0.05)
        assert not call.done(), "answered before the rollback finished"
        abort = scheduler.sent[1]
        assert isinstance(abort, AbortTransferReqInput) and abort.migration_id == "m"
        # Stage 1 allocated nothing: "unknown id" is not a rollback failure.
        for reply in (
            AbortTransferReqOutput(success=True),
            AbortTransferReqOutput(success=False, message="unknown", error_kind="not_found"),
        ):
            reply.rid = abort.rid
            handlers[AbortTransferReqOutput](reply)
        merged = await asyncio.wait_for(call, 5)
        assert not merged.success and merged.message == "host pool is full"

    asyncio.run(run())


# --------------------------------------------------------------------------- one stage
# A real one-rank scheduler side on a CPU harness, playing one stage of a PP=2 server.


def _stage_allocate(side: Any, mid: str, start: int, **fields: Any) -> Any:
    fields.setdefault("source_fingerprints", [side.identity.fingerprint.to_dict()])
    req = AllocateTokenForTransferReqInput(
        input_ids=list(range(start, start + 64)), migration_id=mid, **fields
    )
    req.rid = f"rid-{mid}"
    return req


def test_later_stage_follows_an_earlier_stages_refusal(side_factory) -> None:
    """Stage 1 refuses what stage 0 refused without touching its pool, and replies
    through its own sender (SGLang sends nothing for later stages)."""
    from sglang_kv_migration.wire.messages import StageRefusal

    side = side_factory(pp_rank=1, pp_size=2, watchdog_timeout_s=60.0, page_size=16)
    handlers = dict(side.handlers())
    free_before = side.harness.snapshot().host_available
    refusal = StageRefusal("host pool is full", "unavailable")
    req = _stage_allocate(side, "refused", 1000, stage_refusal=refusal)
    assert handlers[AllocateTokenForTransferReqInput](req) is None  # sent, not returned
    (reply,) = side.replies
    assert not reply.success and reply.error_kind == "unavailable" and reply.rid == req.rid
    assert len(side.target.pending) == 0 and side.harness.snapshot().host_available == free_before

    # Without a refusal it allocates, and replies through its sender too.
    side.replies.clear()
    assert handlers[AllocateTokenForTransferReqInput](_stage_allocate(side, "ok", 2000)) is None
    assert side.replies[0].success and len(side.target.pending) == 1


def test_earlier_stage_refusal_of_a_commit(side_factory) -> None:
    """A forbidden commit leaves this stage's allocation pending (the client may retry);
    a commit stage 0 answered "gone" for (weights changed) drops it here too."""
    from sglang_kv_migration.server.messages import CommitTransferRequestKVCacheReqInput
    from sglang_kv_migration.wire.messages import StageRefusal

    side = side_factory(pp_rank=1, pp_size=2, watchdog_timeout_s=60.0, page_size=16)
    assert side.allocate_token_for_transfer(_stage_allocate(side, "m", 3000)).success
    forbidden = CommitTransferRequestKVCacheReqInput(
        migration_id="m", stage_refusal=StageRefusal("no receipt", "forbidden")
    )
    reply = side.commit_transfer_request_kvcache(forbidden)
    assert not reply.success and reply.error_kind == "forbidden"
    assert side.target.pending.get("m") is not None
    gone = CommitTransferRequestKVCacheReqInput(
        migration_id="m", stage_refusal=StageRefusal("weight_version changed", "gone")
    )
    reply = side.commit_transfer_request_kvcache(gone)
    assert not reply.success and reply.error_kind == "gone"
    assert side.target.pending.get("m") is None


def test_stage_0_refusal_marks_the_request_for_later_stages(side_factory) -> None:
    side = side_factory(pp_rank=0, pp_size=2, watchdog_timeout_s=60.0, page_size=16)
    req = _stage_allocate(side, "x", 4000, source_fingerprints=[])
    reply = side.allocate_token_for_transfer(req)
    assert not reply.success
    assert req.stage_refusal is not None and req.stage_refusal.message == reply.message


def test_only_stage_0_runs_the_watchdog_and_later_stages_follow_it(side_factory) -> None:
    import time

    from sglang_kv_migration.server.messages import StageSyncReqInput

    first = side_factory(pp_rank=0, pp_size=2, watchdog_timeout_s=0.05, page_size=16)
    later = side_factory(pp_rank=1, pp_size=2, watchdog_timeout_s=0.05, page_size=16)
    for side in (first, later):
        assert side.allocate_token_for_transfer(_stage_allocate(side, "w", 5000)).success
    time.sleep(0.1)
    forwarded: list[Any] = []
    for _ in range(200):  # the watchdog runs every 64 iterations
        assert later.poll() == []
        forwarded += first.poll()
        if forwarded:
            break
    assert len(later.target.pending) == 1, "a later stage must not expire on its own clock"
    assert len(first.target.pending) == 0
    (sync,) = forwarded
    assert isinstance(sync, StageSyncReqInput) and "w" in sync.expired_ids
    assert dict(later.handlers())[StageSyncReqInput](sync) is None
    assert len(later.target.pending) == 0
