"""Commits that wait for this rank's staged scatter (the host path's staging arena,
`paths.base.TargetStaging`): which receipts name a staged write, and the deferred commits
in arrival order until every rank's scatter is done.

IMPORTANT: every TP rank keeps the same list of deferred commits in the same order
(commits are broadcast), so the collective in `StagedCommits.poll` is entered by every
rank together.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_kv_migration import grants
from sglang_kv_migration.errors import MigrationError
from sglang_kv_migration.paths.base import STAGED_PLAN

logger = logging.getLogger(__name__)

# How long a cache flush or shutdown waits for a scatter in flight (it is a local copy).
_DRAIN_WAIT_S = 60.0


class StagedMigration(Protocol):
    """What this module reads of a pending migration (`pending.PendingMigration`)."""

    migration_id: str
    staging: tuple[int, int] | None  # the granted extent, None when it writes direct


class RankGather(Protocol):
    """The rank group's all-gather (`RankContext`)."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every TP rank's `obj` in this stage, in tp_rank order."""
        ...


def receipt_plan(signer: grants.Signer, receipts: list[str], tp: int, pp: int) -> str:
    """The plan this rank's receipt reports ("" when none, or for a bad receipt, which
    `server.target.commits.Commits.receipt_refusal` has already refused)."""
    for raw in receipts:
        try:
            receipt = signer.decode_receipt(raw)
        except MigrationError:
            continue
        if (receipt.tp, receipt.pp) == (tp, pp):
            return receipt.plan
    return ""


def staged_refusal(plan: str, pending: StagedMigration | None) -> str | None:
    """Why a receipt's plan cannot be committed on this rank (None when it can)."""
    if plan == STAGED_PLAN and (pending is None or pending.staging is None):
        return "the source reports a staged write, but this rank granted no staging extent"
    return None


def done_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


@dataclass
class DeferredCommit:
    """A commit that waits for this rank's scatter (a done future on unstaged ranks)."""

    request: Any  # CommitTransferRequestKVCacheReqInput
    pending: StagedMigration
    started: float
    scatter: Future[None]


class StagedCommits:
    """Commits waiting for their scatter, in arrival order (the same on every rank)."""

    def __init__(self, ctx: RankGather):
        self.ctx = ctx
        self.waiting: list[DeferredCommit] = []  # read-only outside this class

    def __len__(self) -> int:
        return len(self.waiting)

    def in_progress(self, migration_id: str) -> bool:
        return any(c.pending.migration_id == migration_id for c in self.waiting)

    def add(self, commit: DeferredCommit) -> None:
        self.waiting.append(commit)

    def poll(self) -> list[tuple[DeferredCommit, str | None]]:
        """Commits whose scatter is done on every rank, with the first rank's error."""
        if not self.waiting:
            return []
        local = [_state(c.scatter) for c in self.waiting]
        per_rank = self.ctx.all_gather(local)  # a collective: same list on every rank
        ready, waiting = [], []
        for i, commit in enumerate(self.waiting):
            states = [rank[i] for rank in per_rank]
            if all(done for done, _ in states):
                ready.append((commit, next((e for _, e in states if e), None)))
            else:
                waiting.append(commit)
        self.waiting = waiting
        return ready

    def drain(self) -> list[DeferredCommit]:
        """Wait for every scatter in flight and hand the commits back, unanswered (before
        a cache reset or at shutdown: the pool they write is about to change)."""
        drained, self.waiting = self.waiting, []
        for commit in drained:
            try:
                commit.scatter.result(_DRAIN_WAIT_S)
            except Exception:  # its commit fails anyway; only the wait matters here
                logger.exception("staged scatter of %s failed", commit.pending.migration_id)
        return drained


def _state(future: Future[None]) -> tuple[bool, str | None]:
    if not future.done():
        return False, None
    error = future.exception()
    return True, None if error is None else f"scatter into the reserved slots failed: {error!r}"
