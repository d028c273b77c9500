"""Source side of `/transfer_request_kvcache` on one rank, without stalling the scheduler.

Life of a transfer on every (tp, pp) rank (each PP stage moves its own layers to the
stage with the same pp_rank on the target, and replies for its own TP ranks):

    start():  ranks agree the request is valid (collective) → the data path pins the
              range and starts its `SendJob` (no waiting)
    poll():   jobs WAITING for pages (host path: device->host copies) advance once the
              copies completed; the path moves the bytes off the scheduler thread
    poll():   every rank done (collective) → release the pins, reply once, success only
              if every rank succeeded

IMPORTANT: the collectives here depend only on state that is identical across ranks
(the list of transfers, which of them wait for pages), never on one rank's clock or
one rank's error, so every rank enters them together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import DEVICE, DataPath
from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.diag.metrics import MigrationMetrics
from sglang_kv_migration.server.diag.trace import ms, stamp
from sglang_kv_migration.server.messages import (
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext, error_of
from sglang_kv_migration.server.same_host.mailbox import Deliverer
from sglang_kv_migration.server.source.inflight import (
    InflightTransfer,
    RankTransferStatus,
    Timings,
    gpu_copy_events,
    on_helper_threads,
)
from sglang_kv_migration.server.source.known_destinations import (
    UnknownDestination,
    resolve_destinations,
)
from sglang_kv_migration.server.source.replies import (
    allocate_steps,
    path_name,
    signed_receipt,
    steps_text,
    transfer_output,
    uneven_lengths,
)
from sglang_kv_migration.server.source.target_asks import TargetAsks, keep_allocation
from sglang_kv_migration.server.source.validation import (
    TransferChecks,
    granted_target,
    refusal_of,
)
from sglang_kv_migration.wire import features
from sglang_kv_migration.wire.messages import StageRefusal
from sglang_kv_migration.wire.moments import Moment, Phase

# Kept importable from here: the record and status of a transfer (`inflight.py`).
__all__ = ["InflightTransfer", "RankTransferStatus", "SourceTransfers"]

logger = logging.getLogger(__name__)


class SourceTransfers:
    """The transfers this rank is sending, from request to reply."""

    def __init__(
        self,
        ctx: RankContext,
        checks: TransferChecks,
        metrics: MigrationMetrics,
        deliverer: Deliverer | None = None,
        asks: TargetAsks | None = None,
        log_later: DeferredLog | None = None,
    ):
        self.ctx = ctx
        self.checks = checks  # what a request must pass before any byte moves
        self.metrics = metrics
        # Per-move lines, written once idle (the scheduler side passes the one it flushes).
        self.log_later = log_later if log_later is not None else DeferredLog()
        self.server_epoch = checks.server_epoch  # this server's instance id (receipts name it)
        self.epoch_suffix = ""  # changed on every KV memory resume (`memory_resumed`)
        self.signer = checks.signer
        self.deliverer = deliverer  # feature "source_commit": the target's mailbox
        self.asks = asks  # feature "source_allocate" (single-rank servers only)
        self.destinations = checks.destinations  # feature "destination_digest" (single-rank)
        self.inflight: list[InflightTransfer] = []  # read-only outside this class
        self.polls = 0  # `poll()` calls with transfers in flight
        self._poll_started = 0.0  # when the current `poll()` began
        # Feature "running_slots": transfers naming `running_rid` read that request's
        # slots (None: the feature is off, and such transfers are refused).
        self.running_slots = checks.running_slots

    @property
    def paths(self) -> Mapping[str, DataPath]:
        return self.checks.paths

    @paths.setter
    def paths(self, paths: Mapping[str, DataPath]) -> None:
        self.checks.paths = paths

    def epoch_of(self, weight_version: str) -> str:
        """The epoch replies carry: instance, KV memory generation and weights."""
        return f"{self.server_epoch}{self.epoch_suffix}:{weight_version}"

    def memory_resumed(self, generation: int) -> None:
        """The KV memory was resumed (`generation`: how many times): a new epoch."""
        self.epoch_suffix = f".m{generation}"

    def __len__(self) -> int:
        return len(self.inflight)

    def features(self) -> list[str]:
        """The optional features this role offers (session info lists them)."""
        offered = []
        if self.destinations is not None and DEVICE in self.paths:
            offered.append(features.DESTINATION_DIGEST)
        if self.running_slots is not None:
            offered.append(features.RUNNING_SLOTS)
        return offered

    def on_helper_threads(self) -> bool:
        """Whether a transfer in flight may wait on a helper thread (`inflight.py`)."""
        return on_helper_threads(self.inflight)

    def awaited(self) -> Callable[[], bool] | None:
        """When every transfer in flight waits only for its target's allocate reply or
        for its copy on the GPU: a non-blocking test that one of them is ready, so the
        scheduler can wait for it (`RankLoop.wait_briefly`). None when the
        next poll has something else to do or wait for, and on multi-rank sources (a
        rank that waited would reach the ranks' gather late)."""
        answered = self.asks.ready_test() if self.asks is not None and self.inflight else None
        if answered is None:
            return None
        events = []
        for t in self.inflight:
            if t.asking:
                continue  # (`answered` covers it)
            event = t.job.completion_event if t.state is Moment.SENDING else None
            if event is None:
                return None
            events.append(event)
        return lambda: answered() or any(event.query() for event in events)

    def start(self, req: TransferRequestKVCacheReqInput) -> None:
        """Handle a transfer request; the reply is sent later by `poll()`, also when
        something here failed unexpectedly (then it says so: never two replies)."""
        inflight = InflightTransfer(
            request=req, first_poll=self.polls, timings=Timings(started=time.monotonic())
        )
        self.inflight.append(inflight)
        error = error_of(functools.partial(resolve_destinations, self.destinations, req))
        if error is None and req.allocate_on_target is not None:
            error = error_of(functools.partial(self._ask_target, req, inflight))
        elif error is None:
            error = error_of(functools.partial(self._start, req, inflight))
        if error is not None:
            inflight.fail(error)
        inflight.handled(time.monotonic(), isinstance(error, UnknownDestination))

    def _ask_target(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        """Feature "source_allocate": the target's allocate (`target_asks.py`); the
        transfer starts in the poll that takes its answer (`_take_allocations`)."""
        if self.asks is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "allocate_on_target needs a single-rank source (TP 1, PP 1); allocate on "
                "the target with /allocate_token_for_transfer",
            )
        self.asks.ask(req, inflight)

    def _take_allocations(self) -> list[InflightTransfer]:
        """Start the transfers whose target answered their allocate; fail those it did
        not answer in time (a late allocation is freed by the target's watchdog). The
        copies of the transfers started here launch together (`launching_together`):
        moves sent at once are answered together, and each launch costs ~1 ms. Returns
        the ones that started without an error."""
        with contextlib.ExitStack() as together:
            for path in self.paths.values():
                together.enter_context(path.launching_together())
            answered = self.asks.take(self.inflight, self._poll_started, self._allocated)
        launched = time.monotonic()  # (the block's end launched their copies)
        for inflight in answered:
            inflight.launched(launched)
        return [inflight for inflight in answered if inflight.error is None]

    def _allocated(self, inflight: InflightTransfer, reply: bytes) -> None:
        """The target's allocate reply: start the transfer into what it granted."""
        req = inflight.request
        keep_allocation(inflight.allocate, reply)
        allocation = inflight.allocate.reply
        if not allocation.success:
            raise refusal_of(allocation)
        req.matched_token_size = allocation.matched_token_size
        req.extra_token_size = allocation.extra_token_size
        req.migration_id = allocation.migration_id
        if req.extra_token_size == 0:  # the target holds it all: nothing to send
            inflight.finish(RankTransferStatus(done=True, success=True))
            return
        req.target_per_rank = [granted_target(req.target_per_rank[0], allocation)]
        self._start(req, inflight)

    def _start(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        # First: even a refused transfer's receipt names this rank's slots (it settles
        # nothing unless this request claimed the grant); a bad entry is reported below.
        error_of(functools.partial(self.checks.parse_own_slots, req, inflight))
        if req.stage_refusal is not None:
            # An earlier PP stage refused before pinning anything: so do we (its reply
            # fails the transfer), leaving this stage's tree as that stage left its own.
            kind = ErrorKind(req.stage_refusal.error_kind or ErrorKind.INTERNAL.value)
            inflight.fail(MigrationError(kind, req.stage_refusal.message))
            return
        local_error = error_of(functools.partial(self.checks.validate, req, inflight))
        # IMPORTANT: agree on validity before touching the tree. A rank that pinned and
        # queued write-backs while another did not would leave the ranks' write-through
        # state different, and SGLang's `writing_check` collectives would deadlock.
        error = self.ctx.first_error_on_any_rank(local_error)
        if error is not None:
            inflight.fail(error)
            req.stage_refusal = StageRefusal(error.message, error.kind.value)
            return
        # Same outcome on every rank: their trees and pools are identical. (The device
        # path may still refuse on one rank only, e.g. an unopenable peer buffer; the
        # gather in `_finish_done` then fails the transfer on every rank.) Its error is
        # the caller's to record (`start`, `TargetAsks.take`).
        self._start_job(inflight)

    def poll(self, wait_for_copies: Callable[[list[Any]], None] | None = None) -> None:
        """Once per scheduler loop iteration while transfers are in flight.
        `wait_for_copies(events)`: may wait for the copies this poll launched, when each
        is a copy on the GPU that ends with one of `events` (`RankLoop.wait_for_copies`),
        so that their replies go out in this iteration."""
        if self.inflight:
            self.polls += 1
            self._poll_started = time.monotonic()
            asks = self.asks
            if asks is not None:
                asks.prepare(self.inflight)
                events = gpu_copy_events(self._take_allocations() if asks.waiting else [])
                if events and wait_for_copies is not None:
                    wait_for_copies(events)
            if any(t.waiting for t in self.inflight):
                # A collective: `waiting` is the same on every rank.
                self.ctx.tree_cache.writing_check()
            self._finish_done()

    def fail_all(self, reason: str) -> None:
        """Fail every transfer in flight (the reply follows from `poll`), e.g. when the
        cache they read is about to be reset. Writes already submitted may still run."""
        for inflight in self.inflight:
            inflight.fail(MigrationError(ErrorKind.CONFLICT, reason))
            inflight.release()  # idempotent: `_finish_done` calls it again

    def abandon_all(self, reason: str) -> None:
        """Answer every transfer in flight with an INTERNAL failure now, without the
        ranks' gather (after a failed poll, which may fail again). No receipt goes out,
        so the target keeps the slots quarantined until the grant's write window closes."""
        abandoned, self.inflight = self.inflight, []
        if self.asks is not None:
            self.asks.clear()
        for inflight in abandoned:
            if self.asks is not None:
                self.asks.forget(inflight)
            try:
                inflight.release()
            except Exception:  # the reply below must still go out
                logger.exception("KV migration could not release a failed transfer")
            req = inflight.request
            self.metrics.outcome("source", Moment.SEND_FAILED)
            output = TransferRequestKVCacheReqOutput(
                success=False,
                path=path_name(req),
                server_epoch=self.epoch_of(req.weight_version),
                message=reason,
                error_kind=ErrorKind.INTERNAL.value,
                allocation=inflight.allocation,
                channel_error=inflight.channel_error,
                destination_unknown=inflight.destination_unknown,
                rid=req.rid,
            )
            self._send(output, inflight)

    def close(self) -> None:
        for inflight in self.inflight:
            inflight.release()
        self.inflight.clear()
        if self.deliverer is not None:
            self.deliverer.close()
        if self.asks is not None:
            self.asks.close()

    # ------------------------------------------------------------------ helpers

    def _deliver(self, inflight: InflightTransfer, statuses: list[RankTransferStatus]) -> bool:
        """Rank 0, after every rank succeeded: hand all receipts to the target's mailbox
        (feature "source_commit") before the reply goes out; False when not asked, too
        late (a slot may be reused once the grant's write window closed) or not possible
        (another host: the client then commits)."""
        commit = inflight.commit
        if commit is None or self.deliverer is None:
            return False
        if time.time() >= commit.until:
            return False
        reason = self.deliverer.deliver(commit.mailbox, [s.receipt for s in statuses])
        if reason is not None:
            logger.info(
                "KV migration %s: receipts not delivered (the client commits): %s",
                inflight.request.migration_id,
                reason,
            )
        return reason is None

    def _start_job(self, inflight: InflightTransfer) -> None:
        try:
            inflight.sending(inflight.path.start_send(inflight.send))
        finally:
            inflight.release_prepared()  # the job took it over, or it was not used

    def _finish_done(self) -> None:
        per_rank = self.ctx.all_gather([self._status(t) for t in self.inflight])
        still_running: list[InflightTransfer] = []
        for i, inflight in enumerate(self.inflight):
            statuses = [rank_statuses[i] for rank_statuses in per_rank]
            if not all(s.done for s in statuses):
                still_running.append(inflight)
                continue
            inflight.seen_done(time.monotonic())
            inflight.release()
            if inflight.asking:  # failed before its target answered: not waited for
                self.asks.forget(inflight)
            self._reply(inflight, statuses)
        self.inflight = still_running

    def _status(self, inflight: InflightTransfer) -> RankTransferStatus:
        """This rank's status, with its signed receipt once the transfer is over here."""
        status = inflight.local_status()
        if status.done and not status.receipt:
            claim = inflight.claim
            receipt = signed_receipt(
                inflight, status, self.signer, self.ctx.tp_rank, self.ctx.pp_rank, self.server_epoch
            )
            status = inflight.receipt_signed(receipt, claim.until if claim is not None else 0.0)
        return status

    def _reply(self, inflight: InflightTransfer, statuses: list[RankTransferStatus]) -> None:
        req = inflight.request
        # `statuses` come from this stage's TP group, in tp_rank order.
        failed = [s for s in statuses if not s.success] or uneven_lengths(statuses)
        elapsed = time.monotonic() - inflight.timings.started
        self.metrics.phase(Phase.TRANSFER, elapsed)
        # Every rank of a stage builds this same reply; only the first one logs it.
        first_rank = self.ctx.tp_rank == 0
        delivered = False
        if failed:
            self.metrics.outcome("source", Moment.SEND_FAILED)
            if first_rank:
                logger.warning(
                    "KV migration %s %s after %.1f ms: %s",
                    req.migration_id,
                    Moment.SEND_FAILED,
                    elapsed * 1e3,
                    failed[0].message,
                )
        else:
            self.metrics.outcome("source", Moment.SENT)
            delivered = self._deliver(inflight, statuses)
            # Gathers run over the stage's TP group, in tp_rank order.
            mine = statuses[self.ctx.tp_rank]
            self.metrics.moved("source", statuses[0].tokens, mine.bytes)
            # Per route, and the rest of this rank's transfer time: the cost model's rates
            # and fixed costs. A gathered copy of this rank's own status.
            moving_s = sum(seconds for _, seconds in mine.routes.values())
            self.metrics.routes(path_name(req), mine.routes, max(0.0, elapsed - moving_s))
        output = transfer_output(
            inflight,
            statuses,
            failed[0] if failed else None,
            self.ctx.pp_rank,
            self.epoch_of(req.weight_version),
            delivered,
        )
        self._send(output, inflight)
        if first_rank and output.success:
            # Written once nothing is in flight: a log line costs ~0.1-0.2 ms here.
            self.log_later.info(
                logger,
                "KV migration %s %s: %d tokens, %d bytes (%d ranks), %.1f ms%s",
                req.migration_id,
                Moment.SENT,
                output.transferred_token_size,
                output.transferred_bytes,
                len(statuses),
                elapsed * 1e3,
                steps_text(statuses[self.ctx.tp_rank].steps),
            )

    def _send(self, output: TransferRequestKVCacheReqOutput, inflight: InflightTransfer) -> None:
        """Send the reply, stamped with where the scheduler's part of the trip went
        (`trace.py`), ms: the handler, the wait until the poll that found the copy done
        (`polls` loop iterations; `first_poll`, the count when it was taken up, is the
        same for the moves of one iteration), and that poll until now (the ranks'
        gather, receipts, the mailbox delivery)."""
        now = time.monotonic()
        times = inflight.timings
        handled = times.handled or now
        polled = max(self._poll_started, handled)  # a reply sent from the handler: no wait
        extra = allocate_steps(inflight, handled, now)
        stamp(
            output,
            inflight.request,
            self.ctx.pp_rank,
            polls=self.polls - inflight.first_poll,
            first_poll=inflight.first_poll,
            handler=ms(handled - times.started),
            waited=ms(polled - handled),
            replying=ms(now - polled),
            **extra,
        )
        self.ctx.send_output(output, inflight.request)
