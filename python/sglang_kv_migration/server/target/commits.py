"""Target side: the commit of a pending migration, in one place.

    receipts checked (every rank) ──> staged scatter awaited (staged writes only)
        ──> verify (opt-in) ──> insert (every rank) ──> reply

Each arrow is a step every TP rank of the stage agrees on through a collective before
the next begins, so no rank inserts while another refuses. A commit whose receipts name
a staged write on any rank replies later, from `poll()`, once every rank copied its
staging extent into its slots (`staged_commits.StagedCommits`).

IMPORTANT: the collectives here are entered in broadcast order (commits) and once per
loop iteration while a staged commit waits (`poll`), the same on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import STAGED_PLAN, TargetStaging
from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.messages import (
    AbortTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    CommitTransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext, guarded
from sglang_kv_migration.server.rank.pp_stages import refusal_of, refused_output
from sglang_kv_migration.server.target.staged_commits import (
    DeferredCommit,
    StagedCommits,
    done_future,
    receipt_plan,
    staged_refusal,
)
from sglang_kv_migration.wire.moments import Moment, Phase

if TYPE_CHECKING:
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics, NullMetrics
    from sglang_kv_migration.server.target.pending import PendingMigration, PendingMigrations

logger = logging.getLogger(__name__)


class Commits:
    """One rank's commits: checked, deferred while a staged scatter runs, answered."""

    def __init__(
        self,
        ctx: RankContext,
        pending: PendingMigrations,
        signer: grants.Signer,
        metrics: MigrationMetrics | NullMetrics,
        staging: TargetStaging | None,
        bytes_per_token: int,
        reply_later: Callable[[Any, Any], None],
        log_later: DeferredLog | None = None,
    ):
        self.ctx = ctx
        self.pending = pending
        self.signer = signer
        self.metrics = metrics
        # Per-commit lines, written once idle (the scheduler side passes the one it flushes).
        self.log_later = log_later if log_later is not None else DeferredLog()
        self.staging = staging
        self.bytes_per_token = bytes_per_token  # on this rank
        self._reply_later = reply_later
        self.staged = StagedCommits(ctx)

    def __len__(self) -> int:
        """Commits waiting for their staged scatter."""
        return len(self.staged)

    @property
    def waiting(self) -> bool:
        return bool(self.staged.waiting)

    def in_progress(self, migration_id: str) -> bool:
        """True while the migration's commit waits for a scatter (it owns its slots)."""
        return self.staged.in_progress(migration_id)

    # ------------------------------------------------------------------ entry points

    def commit(
        self, req: CommitTransferRequestKVCacheReqInput
    ) -> CommitTransferRequestKVCacheReqOutput | None:
        """Insert the written pages; with a staged write on any rank, reply later (from
        `poll()`), once every rank copied its staging extent into its slots."""
        if req.stage_refusal is not None:  # an earlier PP stage did not insert: nor do we
            if req.stage_refusal.error_kind == ErrorKind.GONE.value:
                # It dropped the allocation (weights changed since allocate): so do we.
                self.pending.expire([req.migration_id])
            return refused_output(CommitTransferRequestKVCacheReqOutput, req.stage_refusal)
        if self.in_progress(req.migration_id):
            return in_progress_output(req.migration_id)
        pending = self.pending.get(req.migration_id)  # None for a repeated commit
        started = time.monotonic()
        # Every rank needs the source's success receipt for its slots; agree first, so no
        # rank inserts while another refuses.
        refusal, plan = None, ""
        if self.pending.committable(req.migration_id, req.weight_version):
            refusal = self.receipt_refusal(req.receipts, pending)
            if refusal is None and self.ctx.first_stage:
                refusal = self._later_stage_receipts_refusal(req.receipts, req.migration_id)
            plan = receipt_plan(self.signer, req.receipts, self.ctx.tp_rank, self.ctx.pp_rank)
            refusal = refusal or staged_refusal(plan, pending)
            if refusal is None:
                refusal = self._written(req.receipts, pending)[1]
        first_refusal, staged_anywhere = self.ctx.first_error_and_any_flag(
            refusal, plan == STAGED_PLAN
        )
        if first_refusal is not None:
            self.metrics.outcome("target", Moment.COMMIT_FAILED)
            output = CommitTransferRequestKVCacheReqOutput(
                success=False, message=first_refusal, error_kind=ErrorKind.FORBIDDEN.value
            )
            req.stage_refusal = refusal_of(output)
            return output
        if staged_anywhere:
            assert pending is not None  # committable
            if plan == STAGED_PLAN:
                assert self.staging is not None  # it granted the extent
                scatter = self.staging.scatter(pending.staging, pending.slots)
            else:
                scatter = done_future()
            self.staged.add(DeferredCommit(req, pending, started, scatter))
            return None
        return self._insert(req, pending, started)

    def poll(self) -> None:
        """Once per loop iteration: answer the commits whose scatter is done on every rank."""
        for commit, error in self.staged.poll():
            if error is not None:  # the migration stays pending: abort or the watchdog frees it
                self.metrics.outcome("target", Moment.COMMIT_FAILED)
                output = CommitTransferRequestKVCacheReqOutput(
                    success=False, message=error, error_kind=ErrorKind.INTERNAL.value
                )
            else:
                output = self._insert(commit.request, commit.pending, commit.started)
            self._reply_later(commit.request, output)

    def fail_waiting(self, message: str, kind: ErrorKind = ErrorKind.GONE) -> None:
        """Wait for every scatter in flight, then answer its commit with a failure (GONE
        before a cache flush: the pool the scatter wrote is about to be reset; INTERNAL
        after a failed poll). The migration stays pending: abort or the watchdog frees it."""
        for commit in self.staged.drain():
            self._reply_later(
                commit.request,
                CommitTransferRequestKVCacheReqOutput(
                    success=False, message=message, error_kind=kind.value
                ),
            )

    def close(self) -> None:
        self.staged.drain()  # no scatter may run into pools being released

    # ------------------------------------------------------------------ receipts

    def receipt_refusal(
        self,
        receipts: list[str],
        pending: PendingMigration | None,
        need_success: bool = True,
        migration_id: str | None = None,
    ) -> str | None:
        """Why `receipts` do not prove this rank's transfer (None when they do): a success
        receipt for commit, a settled one (no write can still land) for abort."""
        where = f"tp={self.ctx.tp_rank} pp={self.ctx.pp_rank}"
        mid = pending.migration_id if pending is not None else migration_id
        for raw in receipts:
            try:
                receipt = self.signer.decode_receipt(raw)
            except MigrationError as e:
                return f"bad receipt: {e.message}"
            if (receipt.tp, receipt.pp) != (self.ctx.tp_rank, self.ctx.pp_rank):
                continue
            if receipt.migration_id != mid:
                return f"receipt for {where} is for migration {receipt.migration_id!r}"
            if pending is not None and receipt.slots_digest != grants.slots_digest(pending.slots):
                return f"receipt for {where} names other slots"
            if pending is not None and receipt.source != pending.source:
                return f"receipt for {where} is from another source than the grant's"
            if pending is not None and pending.grant and receipt.grant != pending.grant:
                # (A request the source refused, e.g. a retry seen as a replay, claimed
                # no grant: it cannot speak for the writes of the one that did.)
                return f"receipt for {where} is not from the transfer that used its grant"
            if pending is not None and pending.source_dp_rank not in (-1, receipt.dp_rank):
                # One grant, one claim: a receipt from any other scheduler of the source
                # (a second DP rank that claimed the grant too) speaks for none of the
                # writes under it, so it neither settles nor commits these slots.
                return (
                    f"receipt for {where} is from DP rank {receipt.dp_rank} of the source, "
                    f"not DP rank {pending.source_dp_rank}, the one its grant names"
                )
            if need_success and not receipt.success:
                return f"the source reported the transfer to {where} as failed"
            if not need_success and not receipt.settled:
                return f"the source's writes to {where} may still land"
            return None
        return f"no receipt from the source for {where} (pass the transfer reply's receipts)"

    def _later_stage_receipts_refusal(self, receipts: list[str], migration_id: str) -> str | None:
        """Stage 0 checks that later PP stages hold success receipts too (signature, id,
        outcome; each stage checks its own slots), so a later stage cannot refuse a
        commit stage 0 already inserted."""
        proven = set()
        for raw in receipts:
            try:
                receipt = self.signer.decode_receipt(raw)
            except MigrationError as e:
                return f"bad receipt: {e.message}"
            if receipt.migration_id == migration_id and receipt.success:
                proven.add((receipt.tp, receipt.pp))
        for pp in range(1, self.ctx.pp_size):
            for tp in range(self.ctx.tp_size):
                if (tp, pp) not in proven:
                    return (
                        f"no success receipt from the source for tp={tp} pp={pp} "
                        "(pass the transfer reply's receipts)"
                    )
        return None

    # ------------------------------------------------------------------ verify, insert

    def _written(self, receipts: list[str], pending: PendingMigration) -> tuple[int, str | None]:
        """(tokens the source wrote from the first slot, why the receipts do not say one
        length: None when they do). Every rank reads the same receipts, so all agree.
        Runs after `receipt_refusal` accepted this rank's receipt."""
        lengths = set()
        for raw in receipts:
            try:
                receipt = self.signer.decode_receipt(raw)
            except MigrationError as e:
                return 0, f"bad receipt: {e.message}"
            if receipt.migration_id == pending.migration_id and receipt.success:
                lengths.add(pending.extra_length if receipt.tokens == -1 else receipt.tokens)
        if len(lengths) != 1:
            return 0, f"the receipts name different written lengths {sorted(lengths)}"
        (written,) = lengths
        page_size = self.pending.cache.page_size
        if not 0 <= written <= pending.extra_length or written % page_size:
            return 0, (
                f"receipt says {written} tokens were written: not whole pages "
                f"(page_size={page_size}) of the {pending.extra_length} granted"
            )
        return written, None

    def _verify_refusal(
        self, receipts: list[str], pending: PendingMigration, written: int
    ) -> str | None:
        """Why what landed in this rank's slots is not what the source sent (None when
        it is). Runs after `receipt_refusal` accepted the receipts."""
        where = f"tp={self.ctx.tp_rank} pp={self.ctx.pp_rank}"
        for raw in receipts:
            receipt = self.signer.decode_receipt(raw)
            if (receipt.tp, receipt.pp) != (self.ctx.tp_rank, self.ctx.pp_rank):
                continue
            if not receipt.digest:
                return (
                    f"receipt hash missing for {where}: the transfer was not granted with "
                    "verify (allocate with verify: true, or start the target with "
                    "--kv-migration-verify)"
                )
            landed = pending.path.content_digest(pending.written_slots(written))
            if landed != receipt.digest:
                return f"receipt hash does not match the bytes that landed in {where}"
            return None
        return f"no receipt for {where}"

    def _insert(
        self, req: CommitTransferRequestKVCacheReqInput, pending: Any, started: float
    ) -> CommitTransferRequestKVCacheReqOutput:
        """Verify (opt-in), insert on every rank (the receipts were agreed on) and build
        the reply."""

        written = self._written(req.receipts, pending)[0] if pending is not None else 0

        def run_local() -> CommitTransferRequestKVCacheReqOutput:
            matched_after = self.pending.commit(req.migration_id, req.weight_version, written)
            return CommitTransferRequestKVCacheReqOutput(
                success=True, matched_after_commit=matched_after
            )

        # Opt-in verify: every rank hashes what landed in its slots (after a staged
        # write's scatter); any mismatch fails the commit on every rank and the slots go
        # back as for an abort.
        mismatch = None
        committable = self.pending.committable(req.migration_id, req.weight_version)
        if committable and (pending.verify or req.verify):
            mismatch = guarded_refusal(lambda: self._verify_refusal(req.receipts, pending, written))
        first_mismatch = self.ctx.first_error_on_any_rank(mismatch)
        if first_mismatch is not None:
            self.pending.abort(req.migration_id, settled=True)
            self.metrics.outcome("target", Moment.VERIFY_FAILED)
            if self.ctx.tp_rank == 0:
                logger.warning(
                    "KV migration %s %s: %s", req.migration_id, Moment.VERIFY_FAILED, first_mismatch
                )
            output = CommitTransferRequestKVCacheReqOutput(
                success=False,
                message=f"{first_mismatch}; nothing was inserted, the slots were freed",
                error_kind=ErrorKind.CONFLICT.value,
            )
            req.stage_refusal = refusal_of(output)
            return output
        local = guarded(run_local, CommitTransferRequestKVCacheReqOutput)
        outputs, failed = self.ctx.first_failure_on_any_rank(local)
        if failed is not None:
            self.metrics.outcome("target", Moment.COMMIT_FAILED)
            req.stage_refusal = refusal_of(failed)
            return failed
        matched_after = min(o.matched_after_commit for o in outputs)
        if pending is not None:
            self._record_committed(
                req.migration_id, pending, started, len(outputs), matched_after, written
            )
        return CommitTransferRequestKVCacheReqOutput(
            success=True, matched_after_commit=matched_after
        )

    def _record_committed(
        self,
        migration_id: str,
        pending: Any,
        started: float,
        ranks: int,
        matched_after: int,
        written: int,
    ) -> None:
        nbytes = written * self.bytes_per_token
        now = time.monotonic()
        self.metrics.outcome("target", Moment.COMMITTED)
        self.metrics.moved("target", written, nbytes)
        self.metrics.phase(Phase.COMMIT, now - started)
        self.metrics.phase(Phase.PENDING, now - pending.created_at)
        if self.ctx.tp_rank == 0:
            self.log_later.info(
                logger,
                "KV migration %s %s: %d tokens, %d bytes (%d ranks), %.1f ms after "
                "allocate; prefix now %d tokens",
                migration_id,
                Moment.COMMITTED,
                written,
                nbytes * ranks,
                ranks,
                (now - pending.created_at) * 1e3,
                matched_after,
            )


def in_progress_output(
    migration_id: str, action: str = "commit"
) -> CommitTransferRequestKVCacheReqOutput | AbortTransferReqOutput:
    """The CONFLICT reply to a commit or abort of a migration whose commit is in progress."""
    output_type = (
        CommitTransferRequestKVCacheReqOutput if action == "commit" else AbortTransferReqOutput
    )
    return output_type(
        success=False,
        message=f"cannot {action} migration {migration_id!r}: its commit is in progress",
        error_kind=ErrorKind.CONFLICT.value,
    )


def guarded_refusal(check: Callable[[], str | None]) -> str | None:
    """`check()`, with an unexpected error turned into a refusal (handlers never raise;
    the ranks' collectives must still be entered)."""
    try:
        return check()
    except Exception as e:
        logger.exception("KV migration verify failed")
        return f"verify failed: {e!r}"
