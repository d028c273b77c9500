"""Target side of feature "source_commit": commits the source delivered to the mailbox.

    allocate (source_commit)  rank 0 takes a mailbox slot and names it in its grant;
                              every rank marks the migration as awaiting its source
                              (the same on all)
    each loop iteration,      rank 0 reads the slots of the marked migrations; the
    before dispatch           stage's ranks take rank 0's findings (one collective, only
                              while a marked migration is pending) and commit each
                              through `Commits` (the checks of `/commit`), with no reply
    a weight update arrives   the marked migrations still pending are dropped first: no
                              commit request carries the tokenizer's weight version here

Reading before the iteration's requests are dispatched is what makes the client's next
request see the commit: the source wrote the slot before it replied to the client.
Single-stage servers only (under PP, stages commit through the request stream).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.server.messages import CommitTransferRequestKVCacheReqInput
from sglang_kv_migration.server.same_host.mailbox import Mailbox, MailboxSlots, open_mailbox
from sglang_kv_migration.wire import binary_ids
from sglang_kv_migration.wire.moments import Moment

if TYPE_CHECKING:
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics, NullMetrics
    from sglang_kv_migration.server.rank.context import RankContext
    from sglang_kv_migration.server.target.commits import Commits
    from sglang_kv_migration.server.target.pending import PendingMigration, PendingMigrations

logger = logging.getLogger(__name__)


class SourceCommits:
    """One rank's part of the mailbox commits."""

    def __init__(
        self,
        ctx: RankContext,
        pending: PendingMigrations,
        commits: Commits,
        metrics: MigrationMetrics | NullMetrics,
        weight_update_types: tuple[type, ...],
        open_box: Callable[[], Mailbox | None] = open_mailbox,
    ):
        self.ctx = ctx
        self.pending = pending
        self.commits = commits
        self.metrics = metrics
        self.weight_update_types = weight_update_types
        own = open_box() if ctx.pp_size == 1 and ctx.tp_rank == 0 else None
        # Every rank must know whether rank 0 has one (start-up collective).
        self.enabled = bool(ctx.first_rank_value_on_world(own is not None))
        self.mailbox = own
        self.slots = MailboxSlots(own.num_slots, pending.clock) if own is not None else None
        # The pending migrations whose source hands its receipts to the mailbox, in
        # allocation order (the same on every rank); each is read until it is committed
        # or its commit was refused.
        self.awaiting: dict[str, None] = {}

    def grant_slot(self) -> tuple[tuple[int, bytes] | None, str]:
        """Rank 0: a mailbox slot (slot, nonce) armed for a migration being allocated,
        and its address for the grant's `mailbox`; (None, "") on other ranks, without a
        mailbox, or with every slot taken."""
        if self.mailbox is None or self.slots is None:
            return None, ""
        taken = self.slots.take()
        if taken is None:
            return None, ""
        self.mailbox.arm(*taken)
        return taken, self.mailbox.address(*taken)

    def give_back(self, slot: int, not_before: float | None) -> None:
        """A migration's slot, once no write can reach it after `not_before` (None: now)."""
        assert self.mailbox is not None and self.slots is not None
        self.mailbox.clear(slot)
        self.slots.give_back(slot, not_before)

    def mark(self, migration_id: str, granted: bool) -> None:
        """Every rank, after allocate's gather: rank 0 `granted` a slot (or not)."""
        by_id = self.pending.by_id
        # (those no longer pending were committed by the client, aborted or expired)
        self.awaiting = {m: None for m in self.awaiting if m in by_id}
        if granted and migration_id in by_id:
            self.awaiting[migration_id] = None

    def awaiting_source(self) -> list[PendingMigration]:
        """Pending migrations whose source commits through the mailbox (identical on
        every rank), in allocation order."""
        pending = self.pending.by_id
        return [pending[m] for m in self.awaiting if m in pending]

    def take(self, recv_reqs: list[Any]) -> None:
        """Before the iteration's requests are dispatched: commit what was delivered;
        then drop what still waits if one of the requests loads new weights."""
        if not self.commit_delivered():  # the usual case, the same on every rank
            return
        if any(isinstance(r, self.weight_update_types) for r in recv_reqs):
            ids = [p.migration_id for p in self.awaiting_source()]
            dropped = self.pending.drop_for_new_weights(ids)
            for _ in dropped:
                self.metrics.outcome("target", Moment.WEIGHTS_CHANGED)
            if dropped and self.ctx.tp_rank == 0:
                logger.warning(
                    "KV migrations %s: %s (new weights before their source's commit)",
                    Moment.WEIGHTS_CHANGED,
                    ", ".join(dropped),
                )

    def commit_delivered(self, select: Callable[[PendingMigration], bool] | None = None) -> int:
        """Commit what was delivered for the pending migrations `select` picks (all by
        default); returns how many waited for their source before. A selection is for
        single-rank servers (`builds_on`): the ranks would have to select alike."""
        awaiting = self.awaiting_source()
        if select is not None:
            assert self.ctx.tp_size == 1, "selected commits on a multi-rank server"
            awaiting = [p for p in awaiting if select(p)]
        if not awaiting:
            return 0
        found = self._read(awaiting)
        if self.ctx.tp_size > 1:
            found = self.ctx.all_gather(found)[0]  # rank 0's findings, on every rank
        for migration_id, receipts in found.items():
            self._commit(migration_id, receipts)
        return len(awaiting)

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None

    # ------------------------------------------------------------------ helpers

    def _read(self, awaiting: list[Any]) -> dict[str, list[str]]:
        """Rank 0: the receipts delivered so far, by migration id. Never raises: the
        other ranks are about to wait for this rank in a collective."""
        found: dict[str, list[str]] = {}
        if self.mailbox is None:
            return found
        for pending in awaiting:
            if pending.mailbox is None:
                continue
            try:
                receipts = self.mailbox.read(*pending.mailbox)
            except Exception:
                logger.exception("KV migration mailbox read failed")
                receipts = None
            if receipts is not None:
                found[pending.migration_id] = receipts
        return found

    def _commit(self, migration_id: str, receipts: list[str]) -> None:
        pending = self.pending.get(migration_id)
        if pending is None:  # cannot happen: found among the pending, the same iteration
            return
        request = CommitTransferRequestKVCacheReqInput(
            migration_id=migration_id,
            receipts=receipts,
            # A weight update drops these before it runs (`take`): still the allocate's.
            weight_version=pending.weight_version,
            from_mailbox=True,
        )
        output = self.commits.commit(request)
        # Read once, the same on every rank: committed; deferred (None: a rank's write
        # was staged, its commit ends in `poll` once the scatter is done); or refused,
        # every rank agreeing, and the allocation stays for an abort or the watchdog,
        # as after a refused /commit.
        self.awaiting.pop(migration_id, None)
        if output is None or output.success:
            return
        if self.ctx.tp_rank == 0:
            logger.warning(
                "KV migration %s: the receipts in the mailbox were refused: %s",
                migration_id,
                output.message,
            )


# Ids compared at each of the two places `builds_on` looks.
_WINDOW = 16


def builds_on(pending: PendingMigration, request: Any) -> bool:
    """Whether allocating `request` (an allocate not yet taken up: its ids may still be
    bytes) may match pages that `pending` will commit. Matching them needs the request's
    ids to equal the pending prefix up to the first token past what the target held
    (`matched_length`); ids that differ in the first or the last `_WINDOW` of those, or a
    request that is shorter, cannot. Otherwise: maybe (so the commit goes first)."""
    ids, namespace = sglang_adapter.key_parts(pending.key)
    if (request.extra_key or "") != (namespace or ""):
        return False
    end = min(pending.matched_length + 1, len(ids))
    for start, stop in ((0, min(_WINDOW, end)), (max(end - _WINDOW, 0), end)):
        if binary_ids.request_ids(request, start, stop) != ids[start:stop]:
            return False
    return True
