"""The target role of one rank: its allocations (`allocations.py`), the pending
migrations and their watchdog (`pending.py`), commits (`commits.py`, and those a
same-host source left in the mailbox, `mailbox_commits.py`), aborts, the host path's
staging arena, and the allocate channel a same-host source asks
(`channel_allocations.py`)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang_kv_migration.paths.base import TargetStaging
from sglang_kv_migration.server.diag.metrics import MigrationMetrics
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AbortTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    CommitTransferRequestKVCacheReqOutput,
    StageSyncReqInput,
)
from sglang_kv_migration.server.rank.context import RankContext, guarded
from sglang_kv_migration.server.target.allocations import TargetAllocations
from sglang_kv_migration.server.target.channel_allocations import ChannelAllocations
from sglang_kv_migration.server.target.commits import Commits, in_progress_output
from sglang_kv_migration.server.target.mailbox_commits import SourceCommits, builds_on
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.wire.features import SOURCE_ALLOCATE, SOURCE_COMMIT
from sglang_kv_migration.wire.moments import Moment

logger = logging.getLogger(__name__)

# Takes of the allocate channel one loop iteration serves at most (each up to
# `allocate_channel.MAX_PER_ITERATION` requests): requests that arrive while the
# iteration allocates are served in it, within a bound on the iteration's length.
CHANNEL_ROUNDS = 4


class TargetRole:
    """What one rank does as the target of migrations."""

    def __init__(
        self,
        ctx: RankContext,
        metrics: MigrationMetrics,
        pending: PendingMigrations,
        commits: Commits,
        source_commits: SourceCommits,
        allocations: TargetAllocations,
        channel: ChannelAllocations | None,
        staging: TargetStaging | None,
    ):
        self.ctx = ctx
        self.metrics = metrics
        self.pending = pending
        self.commits = commits
        self.source_commits = source_commits
        self.allocations = allocations
        self.channel = channel  # feature "source_allocate" (single-rank servers only)
        self.staging = staging  # the host path's staging arena (None: off)

    def features(self) -> list[str]:
        """The optional features this role offers (session info lists them)."""
        offered = [SOURCE_COMMIT] if self.source_commits.enabled else []
        if self.channel is not None:
            offered.append(SOURCE_ALLOCATE)
        return offered

    def allocate_channel(self) -> dict[str, str]:
        """Feature "source_allocate": where a source on this host asks for slots ({}:
        nowhere)."""
        return self.channel.channel.advertise() if self.channel is not None else {}

    def has_work(self) -> bool:
        """Commits waiting, migrations pending or slots quarantined (the same on every
        rank): a few attribute reads."""
        pending = self.pending
        return bool(self.commits.waiting or pending.by_id or pending.quarantine.by_id)

    def commit(
        self, req: CommitTransferRequestKVCacheReqInput
    ) -> CommitTransferRequestKVCacheReqOutput | None:
        """Insert the written pages (`commits.py`); None: a staged write, the reply is
        sent later, from `poll()`."""
        return self.commits.commit(req)

    def abort_transfer(self, req: AbortTransferReqInput) -> AbortTransferReqOutput:
        def run_local() -> AbortTransferReqOutput:
            self.pending.abort(req.migration_id, settled=settled)
            return AbortTransferReqOutput(success=True)

        if self.commits.in_progress(req.migration_id):
            return in_progress_output(req.migration_id, "abort")
        was_pending = self.pending.get(req.migration_id) is not None
        # Without the source's word that no write can still land, the slots stay
        # quarantined until the grant's write window closes. Agreed across ranks. A
        # repeated abort of a quarantined id checks its receipts against the same grant,
        # slots and source as the first.
        held = self.pending.held(req.migration_id)
        settled = self.ctx.all_ranks_agree(
            bool(req.receipts)
            and self.commits.receipt_refusal(
                req.receipts, held, need_success=False, migration_id=req.migration_id
            )
            is None
        )
        local = guarded(run_local, AbortTransferReqOutput)
        _, failed = self.ctx.first_failure_on_any_rank(local)
        if failed is not None:
            return failed
        if was_pending:
            self.metrics.outcome("target", Moment.ABORTED)
        return local

    def stage_sync(self, req: StageSyncReqInput) -> None:
        """Later PP stages: free what stage 0's watchdog freed (skips unknown ids)."""
        for _ in self.pending.expire(req.expired_ids):
            self.metrics.outcome("target", Moment.EXPIRED)
        return None

    def run_watchdog(self, quarantine_only: bool = False) -> list[str]:
        """Free what is due; returns the ids (pending and quarantined) it decided on."""
        # The deadline is judged on each rank's clock, then unioned so that every rank
        # frees the same ids and the trees stay identical.
        local_due = self.pending.due()
        if quarantine_only:
            local_due = [mid for mid in local_due if self.pending.get(mid) is None]
        due = self.ctx.union_on_all_ranks(local_due)
        # A commit whose scatter runs owns its slots until it answers (a local copy).
        due = [mid for mid in due if not self.commits.in_progress(mid)]
        for _ in self.pending.expire(due):
            self.metrics.outcome("target", Moment.EXPIRED)
        return due

    def before_requests(self, recv_reqs: list[Any]) -> None:
        """Allocate what sources asked for on the allocate channel and commit what they
        delivered to the mailbox (raises: the loop fails the work in flight)."""
        channel = self.channel
        if not self.pending.by_id and channel is None:
            return  # idle, and no channel to read (multi-rank servers): two reads
        if channel is not None:
            if recv_reqs:
                channel.observe(recv_reqs)
            self._allocate_asked(channel)
        if self.pending.by_id:
            self.source_commits.take(recv_reqs)

    def _allocate_asked(self, channel: ChannelAllocations) -> None:
        """Serve the channel until it is empty (at most `CHANNEL_ROUNDS` takes), each
        take before the commits it may build on and before the other commits.

        A source's next allocate may build on its last commit (the next round into a
        landing arena, a conversation's next turn): it delivered that commit before it
        asked, so reading the mailbox *after* taking the requests finds it, and it is
        committed first. Every other delivered commit waits until the channel is
        empty: commits take the target's thread too, and moves sent together were
        otherwise answered in waves (8-13 ms apart on the H200)."""
        asked = channel.due()
        for rounds in range(1, CHANNEL_ROUNDS + 1):
            if not asked:
                return
            try:
                if self.pending.by_id:
                    requests = [a.request for a in asked if a.request is not None]
                    self.source_commits.commit_delivered(functools.partial(_built_on, requests))
            finally:  # taken off the channel: answered whatever happens (else 10 s waits)
                channel.answer(asked)
            if rounds == CHANNEL_ROUNDS or not channel.readable():
                return
            asked = channel.take()

    def drop_for_cache_flush(self) -> None:
        """Before SGLang resets the radix cache: deferred commits fail, pending
        allocations are dropped (a later commit answers "gone"); slots a granted write
        may still reach stay quarantined across the reset."""
        self.commits.fail_waiting("the target's cache was flushed during the commit")
        dropped = self.pending.prepare_for_reset()
        if dropped and self.ctx.tp_rank == 0:
            logger.warning(
                "KV migrations %s: %s (the radix cache is reset)",
                Moment.FLUSHED,
                ", ".join(dropped),
            )

    def drop_for_memory_release(self) -> None:
        """Before SGLang unmaps the KV pool: deferred commits fail, pending allocations
        are dropped (a later commit answers 410)."""
        self.commits.fail_waiting("the target released its KV cache memory during the commit")
        dropped = self.pending.prepare_for_release()
        if dropped and self.ctx.tp_rank == 0:
            logger.warning(
                "KV migrations %s: %s (the KV cache memory is released)",
                Moment.RELEASED,
                ", ".join(dropped),
            )

    def close(self) -> None:
        """Before the data paths close (the staging arena closes after them)."""
        self.commits.close()  # no scatter may run into pools being released
        self.pending.abort_all()
        self.source_commits.close()
        if self.channel is not None:
            self.channel.close()

    def close_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()  # after the transport: the arena was registered there


def _built_on(requests: list[Any], pending: Any) -> bool:
    return any(builds_on(pending, r) for r in requests)
