"""The moments of one migration, named once.

A migration passes through these on its target and on each source rank. The same
member is what a record's state holds (the target's `PendingMigration.state`, the
source's `InflightTransfer.state`), what its state machine steps through (the tables
below), the `outcome` label of `sglang:kv_migration_total` and the word its log line
uses. The values are what users scrape and read in logs: they do not change.

    target   allocate ──> ALLOCATED ──commit──> COMMITTED
               │              ├──abort───> ABORTED
               ▼              ├──watchdog─> EXPIRED
         ALLOCATE_FAILED      └──> FLUSHED / WEIGHTS_CHANGED / RELEASED (the cache or
                                   the weights changed under it, or its memory went)
             (COMMIT_FAILED, VERIFY_FAILED: a commit refused; a refused verify frees
             the slots as an abort does)

    source   CHECKING ──> SENDING ──> SENT          taken up, the copy launched, done
    (a rank)    │  ▲         │
                │  └─┐       └──> SEND_FAILED        an error at any step
                ▼    │               ▲
             ALLOCATING ─────────────┘              feature "source_allocate": the
                                                    target's allocate reply awaited

A transfer the target had nothing to send for goes CHECKING -> SENT. What a trip's
`steps_ms` splits out between these moments keeps its own step names
(`server/diag/trace.py`, docs/protocol.md).
"""

from __future__ import annotations

from enum import StrEnum


class Moment(StrEnum):
    # The target's allocation (`server/target/pending.py`, `allocations.py`, `commits.py`)
    ALLOCATED = "allocated"  # slots reserved and granted, the matched prefix locked
    ALLOCATE_FAILED = "allocate_failed"  # refused; nothing kept on any rank
    COMMITTED = "committed"  # the written pages are in the tree
    COMMIT_FAILED = "commit_failed"  # a commit refused; the allocation stays
    VERIFY_FAILED = "verify_failed"  # a `verify` digest mismatch; the slots freed
    ABORTED = "aborted"
    EXPIRED = "expired"  # the watchdog freed it
    FLUSHED = "flushed"  # the radix cache was reset (e.g. /flush_cache after new weights)
    WEIGHTS_CHANGED = "weights_changed"  # the target's weight version moved before commit
    RELEASED = "released"  # the target released its KV cache memory (memory saver)
    # A source rank's transfer (`server/source/inflight.py`, `transfers.py`)
    CHECKING = "checking"  # taken up: the request is being checked, nothing pinned yet
    ALLOCATING = "allocating"  # feature "source_allocate": waiting for the target
    SENDING = "sending"  # the data path's copy launched
    SEND_FAILED = "send_failed"  # an error; the rank's status says it once asked
    SENT = "sent"  # the copy is done (or there was nothing to send)


class Phase(StrEnum):
    """What `sglang:kv_migration_phase_seconds{phase}` times: the span between two
    moments (the cost model reads them back: `rollout/cost_model.py`)."""

    ALLOCATE = "allocate"  # target: an allocate's handler, until ALLOCATED
    TRANSFER = "transfer"  # source: taken up (CHECKING) until SENT or SEND_FAILED everywhere
    COMMIT = "commit"  # target: a commit's handler, until COMMITTED
    PENDING = "pending"  # target: ALLOCATED until COMMITTED


# Each record's state machine: moment -> the moments it may go to next.
Steps = dict[Moment, frozenset[Moment]]

ALLOCATION_STEPS: Steps = {
    Moment.ALLOCATED: frozenset(
        {
            Moment.COMMITTED,
            Moment.ABORTED,
            Moment.EXPIRED,
            Moment.FLUSHED,
            Moment.WEIGHTS_CHANGED,
            Moment.RELEASED,
        }
    ),
    Moment.COMMITTED: frozenset(),
    Moment.ABORTED: frozenset(),
    Moment.EXPIRED: frozenset(),
    Moment.FLUSHED: frozenset(),
    Moment.WEIGHTS_CHANGED: frozenset(),
    Moment.RELEASED: frozenset(),
}

TRANSFER_STEPS: Steps = {
    Moment.CHECKING: frozenset(
        {Moment.ALLOCATING, Moment.SENDING, Moment.SEND_FAILED, Moment.SENT}
    ),
    Moment.ALLOCATING: frozenset({Moment.CHECKING, Moment.SEND_FAILED}),
    Moment.SENDING: frozenset({Moment.SEND_FAILED, Moment.SENT}),
    Moment.SEND_FAILED: frozenset(),
    Moment.SENT: frozenset(),
}


def step(steps: Steps, now: Moment, to: Moment) -> Moment:
    """`to`, when the record in moment `now` may go there; RuntimeError otherwise."""
    if to not in steps[now]:
        raise RuntimeError(f"a migration cannot go from {now.name} to {to.name}")
    return to
