"""The migration protocol as generators of HTTP calls: each step yields a `Call` and
receives its `CallReply`; the drivers (`migration.py`) send them, so the sync and asyncio
clients run one description of the protocol and cannot drift apart.

`migration_steps` is one migration: session info → the source's size query (skipped
under "partial_transfer") → the path (`plan.choose_path`) → `_move_with_fallback` →
`_move_in_rounds` (a small landing arena) → `_move`: allocate, transfer, commit
(`_move_in_one_trip` when the source allocates on the target; `_finish` skips the commit
when the source committed through the target's mailbox), `_abort` after any failure
once the target holds slots. `many_steps` runs several in lock step (`batch.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from sglang_kv_migration.client.batch import Move, lockstep
from sglang_kv_migration.client.call_bodies import allocate_call, one_trip_call, transfer_call
from sglang_kv_migration.client.calls import (
    ALLOCATE,
    SIZE_QUERY,
    SIZE_QUERY_ROUTE,
    Call,
    CallReply,
    parsed,
    size_query,
    step,
    trip_steps,
)
from sglang_kv_migration.client.path_choice import DEVICE, LANDING_TIERS
from sglang_kv_migration.client.plan import (
    Plan,
    check_path,
    owner_sharded,
    partial_ok,
    paths_to_try,
    source_allocates,
)
from sglang_kv_migration.client.results import MigrationFailed, MigrationResult
from sglang_kv_migration.client.sessions import (
    SessionCache,
    StaleSession,
    check_epoch,
    session_info_step,
)
from sglang_kv_migration.wire import bodies
from sglang_kv_migration.wire.convert import build, from_dict
from sglang_kv_migration.wire.features import DESTINATION_DIGEST
from sglang_kv_migration.wire.messages import (
    AllocateReply,
    CommitReply,
    ExtraTokenSizeReply,
    SessionInfoReply,
    TransferReply,
)


def migration_steps(
    source_url: str,
    target_url: str,
    input_ids: list[int],
    extra_key: str | None,
    path: str | None = None,
    sessions: SessionCache | None = None,
    verify: bool = False,
    held: ExtraTokenSizeReply | dict[str, Any] | None = None,
    running_rid: str = "",
) -> Generator[Call, CallReply, MigrationResult]:
    """The migration protocol as a generator of HTTP calls (see the module docstring).
    `held`, the caller's size query, serves the first attempt only: a retry after a
    restart asks again."""
    check_path(path)
    sessions = sessions or SessionCache()
    known = None if held is None else from_dict(ExtraTokenSizeReply, held)
    for attempt in (1, 2):
        try:
            return (
                yield from _attempt(
                    source_url,
                    target_url,
                    input_ids,
                    extra_key,
                    path,
                    sessions,
                    verify,
                    known,
                    running_rid=running_rid,
                )
            )
        except StaleSession as stale:
            sessions.drop(stale.url)
            known = None
            if attempt == 2:
                raise MigrationFailed("session_info", str(stale)) from None
    raise AssertionError("unreachable")


def many_steps(
    moves: Sequence[Move], sessions: SessionCache, path: str | None, verify: bool
) -> Generator[list[Call], list[CallReply], list[MigrationResult | MigrationFailed]]:
    """`migrate_many` as rounds of calls (`batch.py`): yields each round's calls,
    receives their replies in the same order, returns one outcome per move."""
    # Session info of every server first, once each (a failure here is met again, and
    # reported, by the moves that need that server).
    urls = list(dict.fromkeys(u for m in moves for u in (m.source_url, m.target_url)))
    infos = [session_info_step(url, sessions) for url in urls]
    yield from lockstep(infos, sessions, MigrationFailed)
    steps = [
        migration_steps(
            m.source_url, m.target_url, list(m.input_ids), m.extra_key, path, sessions, verify,
            m.held,
        )
        for m in moves
    ]  # fmt: skip
    return (yield from lockstep(steps, sessions, MigrationFailed))


def _attempt(
    source_url: str,
    target_url: str,
    input_ids: list[int],
    extra_key: str | None,
    path: str | None,
    sessions: SessionCache,
    verify: bool = False,
    held: ExtraTokenSizeReply | None = None,
    running_rid: str = "",
) -> Generator[Call, CallReply, MigrationResult]:
    timings: dict[str, float] = {}
    clock = time.perf_counter

    t0 = clock()
    source_info = yield from session_info_step(source_url, sessions)
    target_info = yield from session_info_step(target_url, sessions)
    sessions.check_compatible(source_info, target_info)
    timings["session_info"] = clock() - t0

    sharded = owner_sharded(source_info, target_info)
    if held is None and not sharded and partial_ok(path, source_info, target_info):
        # One trip fewer: the transfer finds out what the source holds of the request.
        page_size = source_info.ranks[0].page_size
        prefix = input_ids[: len(input_ids) - len(input_ids) % page_size]
        steps: dict[str, dict[str, float]] = {}
        # The path does not depend on what the source holds (`partial_ok`).
        held = ExtraTokenSizeReply(success=True)
        partial = True
    else:
        t0 = clock()
        if held is None:
            body = size_query(source_info, input_ids, extra_key)
            call = Call(SIZE_QUERY, source_url, SIZE_QUERY_ROUTE, body)
            held = yield from step(call, ExtraTokenSizeReply)
        check_epoch(source_url, source_info, held.server_epoch)
        prefix = input_ids[: held.matched_token_size]
        if sharded:
            # Only the source's device pages have known owners: that part moves.
            page_size = source_info.ranks[0].page_size
            prefix = prefix[: len(held.page_owners or ()) * page_size]
        timings[SIZE_QUERY] = clock() - t0
        steps = {SIZE_QUERY: trip_steps(held, timings[SIZE_QUERY])}
        partial = False
    plan = Plan(
        source_url,
        target_url,
        extra_key,
        source_info,
        target_info,
        prefix,
        timings,
        verify,
        steps,
        partial=partial,
        sessions=sessions,
        source_dp_rank=None if partial else held.dp_rank,
        running_rid=running_rid,
        page_owners=list(held.page_owners or ()) if sharded else None,
    )
    if not prefix:
        return _result(plan, "", AllocateReply(success=True), None, None, "", "")

    order, reason = paths_to_try(path, source_info, target_info, held)
    return (yield from _move_with_fallback(plan, order, reason))


def _move_with_fallback(
    plan: Plan, order: list[str], reason: str
) -> Generator[Call, CallReply, MigrationResult]:
    """Move on each path of `order` in turn until one succeeds (`path_choice.py`; one
    path when the caller pinned it); each failure is rolled back and said in the next
    attempt's `fallback_reason`."""
    for path in order[:-1]:
        try:
            return (yield from _move_in_rounds(plan, path, reason))
        except MigrationFailed as failure:
            failed = f"{path} path failed at {failure.phase}: {failure.message}"
            reason = f"{reason}; {failed}" if reason else failed
    return (yield from _move_in_rounds(plan, order[-1], reason))


def _move(
    plan: Plan, path: str, fallback_reason: str
) -> Generator[Call, CallReply, MigrationResult]:
    """Allocate on the target, transfer from the source, commit; abort on any failure.
    One call when the source can allocate on the target itself (`source_allocates`)."""
    if source_allocates(plan, path):
        moved = yield from _move_in_one_trip(plan, path)
        if moved is not None:
            allocation, transfer = moved
            if allocation.extra_token_size == 0:
                check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
                return _result(plan, "", allocation, None, None, "", fallback_reason)
            return (yield from _finish(plan, path, allocation, transfer, fallback_reason))
        # Nothing was allocated (the channel could not be used, or the target refused):
        # the allocate trip says why, or moves it.
    clock = time.perf_counter
    timings = plan.timings
    t0 = clock()
    try:
        allocation = yield from step(allocate_call(plan, path), AllocateReply)
    except MigrationFailed as failure:
        refusal = parsed(AllocateReply, failure.reply)
        if refusal is not None:  # refused for a stale epoch ("epoch_check"): read info again
            check_epoch(plan.target_url, plan.target_info, refusal.server_epoch)
        raise
    migration_id = allocation.migration_id
    timings[ALLOCATE] = timings.get(ALLOCATE, 0.0) + clock() - t0
    plan.steps[ALLOCATE] = trip_steps(allocation, clock() - t0)
    if allocation.extra_token_size == 0:
        check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        return _result(plan, "", allocation, None, None, "", fallback_reason)

    # From here on the target holds slots: every failure must abort them.
    try:
        check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        t0 = clock()
        transfer = yield from _transfer_step(
            plan, lambda digest: transfer_call(plan, allocation, path, digest)
        )
        timings["transfer"] = clock() - t0
        plan.steps["transfer"] = trip_steps(transfer, timings["transfer"])
    except (MigrationFailed, StaleSession) as failure:
        yield from _abort(plan, migration_id, failure, None)
        raise
    return (yield from _finish(plan, path, allocation, transfer, fallback_reason))


def _move_in_one_trip(
    plan: Plan, path: str
) -> Generator[Call, CallReply, tuple[AllocateReply, TransferReply] | None]:
    """Feature "source_allocate": the transfer asks the target for the slots itself.
    Returns (the target's allocate reply, the transfer reply), or None when nothing was
    allocated (the caller allocates then); a failed transfer after an allocation is
    aborted and raised."""
    t0 = time.perf_counter()
    try:
        transfer = yield from _transfer_step(plan, lambda digest: one_trip_call(plan, path, digest))
    except MigrationFailed as failure:
        reply = parsed(TransferReply, failure.reply) or TransferReply(success=False)
        allocation = parsed(AllocateReply, reply.allocation) if reply.allocation else None
        if allocation is not None and allocation.success:
            failure.migration_id = allocation.migration_id
            yield from _abort(plan, allocation.migration_id, failure, None)
            raise
        if reply.allocation:  # the target refused; a stale epoch: read session info again
            if allocation is not None:
                check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
            return None  # its own allocate trip says why (or, new weights, moves it)
        if reply.channel_error:
            return None  # the source could not reach the target's channel
        # Any other failure is the transfer's (nothing was allocated): as with two trips.
        raise
    seconds = time.perf_counter() - t0
    plan.timings["transfer"] = plan.timings.get("transfer", 0.0) + seconds
    plan.steps["transfer"] = trip_steps(transfer, seconds)
    allocation = from_dict(AllocateReply, transfer.allocation)
    plan.steps[ALLOCATE] = dict(allocation.steps_ms or {})
    return allocation, transfer


def _finish(
    plan: Plan,
    path: str,
    allocation: AllocateReply,
    transfer: TransferReply,
    fallback_reason: str,
) -> Generator[Call, CallReply, MigrationResult]:
    """After a transfer into `allocation`: commit on the target, unless the source
    handed its receipts to the target's mailbox; abort on a failure."""
    migration_id = allocation.migration_id
    commit: CommitReply | None = None
    try:
        check_epoch(plan.target_url, plan.target_info, allocation.server_epoch)
        if allocation.source_commit and transfer.delivered:
            # The receipts are in the target's mailbox: it commits by itself, before it
            # handles anything sent from now on (feature "source_commit").
            return _result(plan, path, allocation, transfer, None, migration_id, fallback_reason)
        t0 = time.perf_counter()
        body = build(bodies.CommitBody, migration_id=migration_id, receipts=_receipts(transfer))
        if plan.verify:
            body.verify = True
        commit = yield from step(Call("commit", plan.target_url, "/commit", body), CommitReply)
        plan.timings["commit"] = time.perf_counter() - t0
        plan.steps["commit"] = trip_steps(commit, plan.timings["commit"])
    except (MigrationFailed, StaleSession) as failure:
        yield from _abort(plan, migration_id, failure, transfer)
        raise
    return _result(plan, path, allocation, transfer, commit, migration_id, fallback_reason)


def _abort(
    plan: Plan,
    migration_id: str,
    failure: MigrationFailed | StaleSession,
    transfer: TransferReply | None,
) -> Generator[Call, CallReply, None]:
    """Free the target's slots after `failure`. The source's receipts (even of a failed
    transfer) may prove no write can still land, which frees them at once instead of
    after quarantine."""
    if transfer is None and isinstance(failure, MigrationFailed):
        transfer = parsed(TransferReply, failure.reply)
    body = build(bodies.MigrationIdBody, migration_id=migration_id, receipts=_receipts(transfer))
    status, _ = yield Call("abort", plan.target_url, "/abort_transfer", body)
    if isinstance(failure, MigrationFailed):
        failure.migration_id = migration_id
        failure.rolled_back = status is not None and status < 300


def _move_in_rounds(
    plan: Plan, path: str, fallback_reason: str
) -> Generator[Call, CallReply, MigrationResult]:
    """`_move`, in rounds when the target's device-path writes land in a landing arena
    smaller than the prefix (memory saver): each round migrates a longer prefix, whose
    start the target holds from the round before, so each moves at most one arena."""
    limit = _landing_tokens(plan.target_info) if path == DEVICE else 0
    if not limit or len(plan.prefix) <= limit:
        return (yield from _move(plan, path, fallback_reason))
    results: list[MigrationResult] = []
    held = 0  # of the prefix, what the target holds after the rounds so far
    while held < len(plan.prefix):
        end = min(held + limit, len(plan.prefix))
        part = dataclasses.replace(plan, prefix=plan.prefix[:end], timings={})
        results.append((yield from _move(part, path, fallback_reason)))
        if results[-1].matched_after_commit < end:
            break  # a partial transfer: the source holds no more of the prefix
        held = end  # committed (or the target held it already: an empty round)
    timings = dict(plan.timings)
    for r in results:
        for k, v in r.timings.items():
            if k != "total":
                timings[k] = timings.get(k, 0.0) + v
    timings["total"] = sum(timings.values())
    last = results[-1]
    return dataclasses.replace(
        last,
        migration_id=",".join(r.migration_id for r in results if r.migration_id),
        target_matched_token_size=results[0].target_matched_token_size,
        migrated_token_size=sum(r.migrated_token_size for r in results),
        migrated_bytes=sum(r.migrated_bytes for r in results),
        timings=timings,
        copy_seconds=sum(r.copy_seconds for r in results),
        rounds=sum(1 for r in results if r.migration_id) or 1,
    )


def _landing_tokens(target_info: SessionInfoReply) -> int:
    """The fewest tokens a target rank's landing arena holds (0: writes go to the pool)."""
    ranks = target_info.ranks
    return min((r.paths[DEVICE].get("landing_tokens", 0) for r in ranks), default=0)


def _transfer_step(
    plan: Plan, make_call: Callable[[str], Call]
) -> Generator[Call, CallReply, TransferReply]:
    """A transfer (`make_call(digest)` builds it); its device destination named by
    digest to a source that was sent it in full (feature "destination_digest": ~26 KB
    less per body for an 8B model), and sent in full again to one that no longer knows
    it."""
    call = make_call("")
    digest = _destination_digest(plan, call.body.target_per_rank)
    if not digest:
        return (yield from step(call, TransferReply))
    source, instance = plan.source_url, plan.source_info.instance_id
    if plan.sessions.source_knows(source, instance, digest):
        try:
            return (yield from step(make_call(digest), TransferReply))
        except MigrationFailed as failure:
            refusal = parsed(TransferReply, failure.reply)
            if refusal is None or not refusal.destination_unknown:
                raise
            plan.sessions.sent(source, instance, digest, known=False)
    reply = yield from step(call, TransferReply)
    plan.sessions.sent(source, instance, digest, known=True)
    return reply


def _destination_digest(plan: Plan, entries: list[bodies.TargetRankBody]) -> str:
    """The digest of the one device entry's `device_kv`, when the source names device
    destinations by digest; "" otherwise."""
    if plan.sessions is None or len(entries) != 1 or entries[0].device_kv is None:
        return ""
    if DESTINATION_DIGEST not in plan.source_info.features:
        return ""
    return plan.sessions.digest_of(entries[0].device_kv)


def _result(
    plan: Plan,
    path: str,
    allocation: AllocateReply,
    transfer: TransferReply | None,
    commit: CommitReply | None,
    migration_id: str,
    fallback_reason: str,
) -> MigrationResult:
    timings = plan.timings
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    target_matched = allocation.matched_token_size
    ranks = transfer.ranks if transfer else []
    seconds = [r.seconds for r in ranks]
    source_held = len(plan.prefix)
    if plan.partial and transfer and transfer.transferred_token_size < len(plan.prefix):
        source_held = target_matched + transfer.transferred_token_size
    source_committed = bool(commit is None and transfer and transfer.delivered)
    if commit is not None:
        matched_after = commit.matched_after_commit
    elif source_committed:
        matched_after = target_matched + transfer.transferred_token_size
    else:
        matched_after = target_matched
    return MigrationResult(
        source_url=plan.source_url,
        target_url=plan.target_url,
        migration_id=migration_id,
        source_held_token_size=source_held,
        target_matched_token_size=target_matched,
        migrated_token_size=transfer.transferred_token_size if transfer else 0,
        migrated_bytes=transfer.transferred_bytes if transfer else 0,
        matched_after_commit=matched_after,
        timings=timings,
        path=path,
        fallback_reason=fallback_reason,
        copy_seconds=max(seconds, default=0.0),
        plans=[r.plan for r in ranks],
        entries=sum(r.entries for r in ranks),
        transfer_steps_ms=[r.steps_ms for r in ranks],
        steps_ms=plan.steps,
        source_committed=source_committed,
        target_dp_rank=allocation.dp_rank,
        landing_tier=LANDING_TIERS.get(path, ""),
    )


def _receipts(transfer_reply: TransferReply | None) -> list[str]:
    if transfer_reply is None:
        return []
    return [r.receipt for r in transfer_reply.ranks if r.receipt]
