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
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import grants, page_ranges
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.fingerprint import LayoutFingerprint
from sglang_kv_migration.paths.base import (
    DEVICE,
    DataPath,
    KVPoll,
    PreparedSend,
    SendJob,
    SendRange,
)
from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.diag.metrics import MigrationMetrics
from sglang_kv_migration.server.diag.trace import ms, stamp
from sglang_kv_migration.server.messages import (
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext, check_peer_fingerprint, error_of
from sglang_kv_migration.server.same_host.allocate_channel import ALLOCATE_TIMEOUT_S, ChannelCaller
from sglang_kv_migration.server.same_host.mailbox import Deliverer
from sglang_kv_migration.server.source.known_destinations import (
    KnownDestinations,
    UnknownDestination,
)
from sglang_kv_migration.server.source.running_slots import RunningSlots
from sglang_kv_migration.wire.messages import (
    RankTransferResult,
    StageRefusal,
    TransferRequestKVCacheTarget,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Polls in a row that may leave their prepares while requests wait (`_defer_prepare`):
# enough for moves sent together, bounded for a scheduler whose input never runs dry.
PREPARE_DEFER_POLLS = 3


@dataclass
class RankTransferStatus:
    """One rank's view of a transfer, exchanged between ranks in `poll()`."""

    done: bool
    success: bool = False
    bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    error_kind: str = ""
    receipt: str = ""  # signed by this rank once done
    plan: str = ""  # host path: how the write was shaped (staging.PlanKind)
    entries: int = 0  # host path: transfer-engine entries
    digest: str = ""  # of the pages sent, when the grant asked for verification
    tokens: int = 0  # tokens written (fewer than granted only for a partial transfer)
    steps: dict[str, float] = dataclasses.field(default_factory=dict)  # SendStats.steps
    routes: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)  # .routes


@dataclass
class InflightTransfer:
    """One rank's part of a transfer: validated → job started → done."""

    request: TransferRequestKVCacheReqInput
    started: float
    send: SendRange | None = None  # this rank's part, once validated
    path: DataPath | None = None
    job: SendJob | None = None
    error: MigrationError | None = None  # failed before anything was sent
    result: RankTransferStatus | None = None
    slots_digest: str = ""  # of this rank's target slots, once parsed (for the receipt)
    own_slots: tuple[torch.Tensor, str] | None = None  # (slots, digest), parsed once
    first_poll: int = 0  # `SourceTransfers.polls` when it started (its reply says how many)
    handled: float = 0.0  # when its handler returned (the reply's `handler`/`waited`)
    # Feature "source_commit": where this rank hands every rank's receipts to the target
    # (its grant's `mailbox`, on rank 0 only), and until when (unix time).
    mailbox: str = ""
    mailbox_until: float = 0.0
    # Feature "source_allocate": the call on the target's allocate channel this transfer
    # waits for (b"": none), until when (monotonic), and the target's reply.
    allocating: bytes = b""
    allocate_by: float = 0.0
    allocation: dict = dataclasses.field(default_factory=dict)
    allocated: float = 0.0  # when the poll that took the target's reply up began
    # Where `replying` goes (monotonic): the answer taken up, the copy launched (or the
    # transfer failed), the copy seen done.
    answered: float = 0.0
    launched: float = 0.0
    finished: float = 0.0
    channel_error: str = ""  # why the target's channel could not be asked
    # Done while the target allocated (`SourceTransfers._prepare`): the path's part
    # (released here unless its job took it) and the digest of the request's ids.
    prepared: PreparedSend | None = None
    tokens: tuple[int, str] = (-1, "")  # (how many ids, their digest)
    destination_unknown: bool = False  # feature "destination_digest": nothing was done
    # `grants.grant_digest` of the grant this request claimed (empty: it claimed none,
    # so its receipt cannot say the grant's writes are over: another request may hold it).
    claimed_grant: str = ""
    # Feature "running_slots": why the running request's slots the copy read may no
    # longer be its own (None: they still are), asked once the copy is done.
    slots_lost: Callable[[], MigrationError | None] | None = None

    def release(self) -> None:
        """Unpin what the transfer holds; idempotent."""
        if self.job is not None:
            self.job.release()
        self.release_prepared()

    def release_prepared(self) -> None:
        """Drop what was prepared (a no-op for a part the job took over)."""
        if self.prepared is not None:
            self.prepared.release()
            self.prepared = None

    @property
    def waiting(self) -> bool:
        """Waiting for pages; identical on every TP rank."""
        return self.job is not None and self.error is None and self.job.waiting

    def local_status(self) -> RankTransferStatus:
        if self.result is not None:
            return self.result
        if self.error is None and self.job is not None:
            state = self.job.poll()
            if state is KVPoll.FAILED:
                self.error = self.job.error or MigrationError(ErrorKind.INTERNAL, "send failed")
            elif state is KVPoll.SUCCESS and self.slots_lost is not None:
                # A request that finished (or was retracted) during the copy may have
                # handed its slots to another request: what was read is not its KV.
                self.error = self.slots_lost()
                self.slots_lost = None
            if self.error is None and state is KVPoll.SUCCESS:
                stats = self.job.stats
                assert self.send is not None  # a job is started for a validated send
                self.result = RankTransferStatus(
                    done=True,
                    success=True,
                    tokens=self.job.end - self.send.start,
                    bytes=stats.bytes,
                    seconds=stats.seconds,
                    plan=stats.plan,
                    entries=stats.entries,
                    digest=stats.digest,
                    steps=stats.steps,
                    routes=stats.routes,
                )
        if self.error is not None:
            self.result = RankTransferStatus(
                done=True, message=self.error.message, error_kind=self.error.kind.value
            )
        return self.result or RankTransferStatus(done=False)


class SourceTransfers:
    """The transfers this rank is sending, from request to reply."""

    def __init__(
        self,
        ctx: RankContext,
        fingerprint: LayoutFingerprint,
        paths: Mapping[str, DataPath],
        metrics: MigrationMetrics,
        server_epoch: str = "",
        signer: grants.Signer | None = None,
        server_fingerprints: Mapping[tuple[int, int], LayoutFingerprint] | None = None,
        max_tokens: int = 1 << 62,
        deliverer: Deliverer | None = None,
        caller: ChannelCaller | None = None,
        destinations: KnownDestinations | None = None,
        log_later: DeferredLog | None = None,
        requests_waiting: Callable[[], bool] | None = None,
    ):
        self.ctx = ctx
        self.fingerprint = fingerprint
        # Every (tp, pp) rank's layout, for stage 0's checks of later stages' entries.
        self.server_fingerprints = server_fingerprints or {(ctx.tp_rank, ctx.pp_rank): fingerprint}
        self.paths = paths
        self.metrics = metrics
        # Per-move lines, written once idle (the scheduler side passes the one it flushes).
        self.log_later = log_later if log_later is not None else DeferredLog()
        self.server_epoch = server_epoch  # this server's instance id (receipts name it)
        self.epoch_suffix = ""  # set on every KV memory resume (`rank/loop.py`)
        self.signer = signer or grants.Signer(None)
        self.max_tokens = max_tokens  # the most slots one transfer can name (host pool)
        self._used_grants = grants.UsedGrants()
        self.deliverer = deliverer
        self.caller = caller  # feature "source_allocate" (single-rank servers only)
        self.destinations = destinations  # feature "destination_digest" (single-rank too)
        self.allocate_timeout_s = ALLOCATE_TIMEOUT_S
        self.inflight: list[InflightTransfer] = []  # read-only outside this class
        self._to_prepare: list[InflightTransfer] = []  # asked their target this iteration
        self.polls = 0  # `poll()` calls with transfers in flight
        self._poll_started = 0.0  # when the current `poll()` began
        # A test that requests wait on the scheduler's input (`IdleProbe.
        # requests_waiting`): a poll then leaves its prepares to a later poll, so that
        # moves sent together all ask their targets first. None: never (multi-rank).
        self.requests_waiting = requests_waiting
        self._prepare_deferred = 0  # polls in a row that left their prepares
        # Feature "running_slots": transfers naming `running_rid` read that request's
        # slots (None: the feature is off, and such transfers are refused).
        self.running_slots: RunningSlots | None = None

    def epoch_of(self, weight_version: str) -> str:
        """The epoch replies carry: instance, KV memory generation and weights."""
        return f"{self.server_epoch}{self.epoch_suffix}:{weight_version}"

    def __len__(self) -> int:
        return len(self.inflight)

    def on_helper_threads(self) -> bool:
        """Whether a transfer in flight may wait on a helper thread (the host path's
        transport workers, a verify digest, the device path's mapping of a peer's
        buffers): device-path copies run on the GPU."""
        return any(
            (t.path is None and not t.allocating)  # (asking a target's channel: no helper)
            or (t.path is not None and (t.path.name != DEVICE or t.send is None or t.send.verify))
            or (t.job is not None and t.job.waits_on_helper)
            for t in self.inflight
        )

    def awaited(self) -> Callable[[], bool] | None:
        """When every transfer in flight waits only for its target's allocate reply or
        for its copy on the GPU: a non-blocking test that one of them is ready, so the
        scheduler can wait for it (`RankLoop.wait_briefly`). None when the
        next poll has something else to do or wait for, and on multi-rank sources (a
        rank that waited would reach the ranks' gather late)."""
        caller = self.caller
        if caller is None or not self.inflight or self._to_prepare:
            return None
        events = []
        for t in self.inflight:
            if t.allocating:
                continue  # (`caller.replied` covers it)
            event = t.job.completion_event if t.job is not None and t.result is None else None
            if event is None or t.error is not None:
                return None
            events.append(event)
        if not caller.waiting:
            return lambda: any(event.query() for event in events)
        return lambda: caller.replied() or any(event.query() for event in events)

    def start(self, req: TransferRequestKVCacheReqInput) -> None:
        """Handle a transfer request; the reply is sent later by `poll()`, also when
        something here failed unexpectedly (then it says so: never two replies)."""
        inflight = InflightTransfer(request=req, started=time.monotonic(), first_poll=self.polls)
        self.inflight.append(inflight)
        error = error_of(lambda: self._resolve_destinations(req))
        if error is None and req.allocate_on_target is not None:
            error = error_of(lambda: self._ask_target(req, inflight))
        elif error is None:
            error = error_of(lambda: self._start(req, inflight))
        inflight.destination_unknown = isinstance(error, UnknownDestination)
        if error is not None and inflight.error is None:
            inflight.error = error
        inflight.handled = time.monotonic()

    def _ask_target(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        """Feature "source_allocate": ask the target's allocate channel for the slots;
        the transfer starts in the poll that finds the reply (`_take_allocations`)."""
        if self.caller is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "allocate_on_target needs a single-rank source (TP 1, PP 1); allocate on "
                "the target with /allocate_token_for_transfer",
            )
        on_target = req.allocate_on_target
        try:
            inflight.allocating = self.caller.call(
                on_target.address, on_target.secret, on_target.allocate, on_target.ids
            )
        except ValueError as e:
            inflight.channel_error = str(e)
            raise MigrationError(ErrorKind.BAD_REQUEST, str(e)) from None
        inflight.allocate_by = time.monotonic() + self.allocate_timeout_s
        # Prepared in this iteration's poll, after every transfer of the iteration asked
        # its target: moves sent at once are all being allocated while this rank works.
        self._to_prepare.append(inflight)

    def _prepare_asked(self) -> None:
        asked, self._to_prepare = self._to_prepare, []
        for inflight in asked:
            waiting = inflight.allocating and inflight.error is None and inflight.result is None
            if waiting and inflight.prepared is None and inflight in self.inflight:
                self._prepare(inflight.request, inflight)

    def _prepare(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        """While the target allocates (1-5 ms on one host): the work that does not need
        its answer, the digest of the ids and the path's radix match and pin. Best
        effort: what fails here fails again, and is reported, once the answer came."""
        count = len(req.input_ids)
        inflight.tokens = (count, grants.request_tokens_digest(req, count))
        path = self.paths.get(req.target_per_rank[0].path) if req.target_per_rank else None
        if path is None or req.running_rid:  # (running slots: no radix match to prepare)
            return
        try:
            inflight.prepared = path.prepare_send(req.input_ids, req.extra_key)
        except Exception as e:  # noqa: BLE001 - the transfer's own start says it again
            logger.debug("KV migration: nothing prepared while the target allocates: %s", e)

    def _resolve_destinations(self, req: TransferRequestKVCacheReqInput) -> None:
        """Feature "destination_digest": a device entry named by digest gets the
        description this source remembers (a full one is remembered by `_validate`,
        once its grant verified)."""
        if self.destinations is None:
            if any(t.device_kv_digest for t in req.target_per_rank):
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    "device_kv_digest needs a single-rank source (TP 1, PP 1); send device_kv",
                )
            return
        for target in req.target_per_rank:
            self.destinations.resolve(target)

    def _take_allocations(self) -> int:
        """Start the transfers whose target answered their allocate; fail those it did
        not answer in time (a late allocation is freed by the target's watchdog). The
        copies of the transfers started here launch together (`launching_together`):
        moves sent at once are answered together, and each launch costs ~1 ms. Returns
        how many started without an error."""
        with contextlib.ExitStack() as together:
            for path in self.paths.values():
                together.enter_context(path.launching_together())
            answered = self._start_answered()
        launched = time.monotonic()  # (the block's end launched their copies)
        for inflight in answered:
            inflight.launched = launched
        return sum(inflight.error is None for inflight in answered)

    def _start_answered(self) -> list[InflightTransfer]:
        answered: list[InflightTransfer] = []
        replies = dict(self.caller.replies())
        gone = set(self.caller.gone())
        now = time.monotonic()
        for inflight in self.inflight:
            if not inflight.allocating:
                continue
            reply = replies.get(inflight.allocating)
            if reply is None and now < inflight.allocate_by and inflight.allocating not in gone:
                continue
            self.caller.forget(inflight.allocating)
            inflight.allocating = b""
            if inflight.error is not None:
                # Failed while it waited (a cache flush): the failure is the reply, with
                # the target's allocation in it, so the client aborts what it holds.
                if reply is not None:
                    error_of(functools.partial(self._keep_allocation, inflight, reply))
                continue
            if reply is None:
                inflight.channel_error = (
                    "the target's process exited before it answered the allocate"
                    if now < inflight.allocate_by
                    else "the target did not answer the allocate within "
                    f"{self.allocate_timeout_s:.0f} s"
                )
                inflight.error = MigrationError(ErrorKind.UNAVAILABLE, inflight.channel_error)
                continue
            inflight.allocated = self._poll_started  # the poll that took the answer
            inflight.answered = time.monotonic()
            error = error_of(functools.partial(self._allocated, inflight, reply))
            if error is not None and inflight.error is None:
                inflight.error = error
            answered.append(inflight)
        return answered

    def _keep_allocation(self, inflight: InflightTransfer, reply: bytes) -> None:
        inflight.allocation = _allocation_of(reply)

    def _allocated(self, inflight: InflightTransfer, reply: bytes) -> None:
        """The target's allocate reply: start the transfer into what it granted."""
        req = inflight.request
        allocation = _allocation_of(reply)
        inflight.allocation = allocation
        if not allocation["success"]:
            raise MigrationError(
                _error_kind(allocation.get("error_kind")),
                f"the target refused the allocate: {allocation.get('message', '')}",
            )
        req.matched_token_size = allocation["matched_token_size"]
        req.extra_token_size = allocation["extra_token_size"]
        req.migration_id = allocation["migration_id"]
        if req.extra_token_size == 0:  # the target holds it all: nothing to send
            inflight.result = RankTransferStatus(done=True, success=True)
            return
        req.target_per_rank = [_granted_target(req.target_per_rank, allocation)]
        error = error_of(lambda: self._start(req, inflight))
        if error is not None and inflight.error is None:
            raise error

    def _start(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        # First: even a refused transfer's receipt names this rank's slots (it settles
        # nothing unless this request claimed the grant); a bad entry is reported below.
        error_of(lambda: self._parse_own_slots(req, inflight))
        if req.stage_refusal is not None:
            # An earlier PP stage refused before pinning anything: so do we (its reply
            # fails the transfer), leaving this stage's tree as that stage left its own.
            kind = ErrorKind(req.stage_refusal.error_kind or ErrorKind.INTERNAL.value)
            inflight.error = MigrationError(kind, req.stage_refusal.message)
            return
        local_error = error_of(lambda: self._validate(req, inflight))
        # IMPORTANT: agree on validity before touching the tree. A rank that pinned and
        # queued write-backs while another did not would leave the ranks' write-through
        # state different, and SGLang's `writing_check` collectives would deadlock.
        error = self.ctx.first_error_on_any_rank(local_error)
        if error is not None:
            inflight.error = error
            req.stage_refusal = StageRefusal(error.message, error.kind.value)
            return
        # Same outcome on every rank: their trees and pools are identical. (The device
        # path may still refuse on one rank only, e.g. an unopenable peer buffer; the
        # gather in `_finish_done` then fails the transfer on every rank.)
        inflight.error = error_of(lambda: self._start_job(inflight))

    def poll(self) -> None:
        """Once per scheduler loop iteration while transfers are in flight."""
        if self.inflight:
            self.polls += 1
            self._poll_started = time.monotonic()
            if self._to_prepare and not self._defer_prepare():
                self._prepare_asked()
            if self.caller is not None and self.caller.waiting:
                self._take_allocations()
            if any(t.waiting for t in self.inflight):
                # A collective: `waiting` is the same on every rank.
                self.ctx.tree_cache.writing_check()
            self._finish_done()

    def _defer_prepare(self) -> bool:
        """Whether this poll leaves the moves it would prepare to a later one: while
        requests wait for the scheduler (the rest of moves sent together: a client's
        threads, or one call's moves, which reach the scheduler ~0.1 ms apart), up to
        `PREPARE_DEFER_POLLS` polls in a row. Their handlers ask their targets at once;
        six 8K moves on the H200 were otherwise asked in two waves ~4 ms apart, the
        second after the first wave's prepares and starts. A move
        not yet prepared when its answer comes is matched by its start, as without a
        prepare."""
        waiting = self.requests_waiting
        if waiting is None or self._prepare_deferred >= PREPARE_DEFER_POLLS or not waiting():
            self._prepare_deferred = 0
            return False
        self._prepare_deferred += 1
        return True

    def fail_all(self, reason: str) -> None:
        """Fail every transfer in flight (the reply follows from `poll`), e.g. when the
        cache they read is about to be reset. Writes already submitted may still run."""
        for inflight in self.inflight:
            if inflight.result is None and inflight.error is None:
                inflight.error = MigrationError(ErrorKind.CONFLICT, reason)
            inflight.release()  # idempotent: `_finish_done` calls it again

    def abandon_all(self, reason: str) -> None:
        """Answer every transfer in flight with an INTERNAL failure now, without the
        ranks' gather (after a failed poll, which may fail again). No receipt goes out,
        so the target keeps the slots quarantined until the grant's write window closes."""
        abandoned, self.inflight = self.inflight, []
        self._to_prepare = []
        for inflight in abandoned:
            if inflight.allocating and self.caller is not None:
                self.caller.forget(inflight.allocating)
            try:
                inflight.release()
            except Exception:  # the reply below must still go out
                logger.exception("KV migration could not release a failed transfer")
            req = inflight.request
            self.metrics.outcome("source", "send_failed")
            output = TransferRequestKVCacheReqOutput(
                success=False,
                path=_path_name(req),
                server_epoch=self.epoch_of(req.weight_version),
                message=reason,
                error_kind=ErrorKind.INTERNAL.value,
                allocation=inflight.allocation,
                channel_error=inflight.channel_error,
                destination_unknown=inflight.destination_unknown,
            )
            output.rid = req.rid
            self._send(output, inflight)

    def close(self) -> None:
        for inflight in self.inflight:
            inflight.release()
        self.inflight.clear()
        self._to_prepare = []
        if self.deliverer is not None:
            self.deliverer.close()
        if self.caller is not None:
            self.caller.close()

    # ------------------------------------------------------------------ helpers

    def _deliver(self, inflight: InflightTransfer, statuses: list[RankTransferStatus]) -> bool:
        """Rank 0, after every rank succeeded: hand all receipts to the target's mailbox
        (feature "source_commit") before the reply goes out; False when not asked, too
        late (a slot may be reused once the grant's write window closed) or not possible
        (another host: the client then commits)."""
        if not inflight.mailbox or self.deliverer is None:
            return False
        if time.time() >= inflight.mailbox_until:
            return False
        reason = self.deliverer.deliver(inflight.mailbox, [s.receipt for s in statuses])
        if reason is not None:
            logger.info(
                "KV migration %s: receipts not delivered (the client commits): %s",
                inflight.request.migration_id,
                reason,
            )
        return reason is None

    def _check_size(self, req: TransferRequestKVCacheReqInput) -> None:
        """Refuse, before any per-token work, a range no pool of this server could hold
        (the host pool is larger than the device pool, and holds every page sent)."""
        end = req.matched_token_size + req.extra_token_size
        if req.extra_token_size > self.max_tokens or end > len(req.input_ids):
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"extra_token_size={req.extra_token_size} from {req.matched_token_size} is "
                f"more than this server can send ({self.max_tokens} slots) or than "
                f"input_ids holds ({len(req.input_ids)})",
            )

    def _validate(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        self._check_size(req)
        source_slots = self._running_source_slots(req, inflight)  # before the grant is claimed
        by_rank = {(t.tp, t.pp): t for t in req.target_per_rank}
        me = (self.ctx.tp_rank, self.ctx.pp_rank)
        target = by_rank.get(me)
        # One digest of the prefix for every entry checked (one pass over the tokens),
        # or the one taken while the target allocated.
        end = req.matched_token_size + req.extra_token_size
        count, tokens = inflight.tokens
        if count != end:
            tokens = grants.request_tokens_digest(req, end)
        if self.ctx.first_stage:
            # IMPORTANT: stage 0 checks every later stage's entry too (structure,
            # fingerprint, grant), so a later stage cannot refuse after this one pinned
            # and wrote: stages see the request one after the other (`pp_stages.py`).
            for position, fingerprint in sorted(self.server_fingerprints.items()):
                if position != me and position[1] != self.ctx.pp_rank:
                    self._check_target(req, by_rank.get(position), position, fingerprint, tokens)
        slots, _digest, grant = self._check_target(
            req, target, me, self.fingerprint, tokens, inflight.own_slots
        )
        self._used_grants.claim(grant)
        inflight.claimed_grant = grants.grant_digest(target.grant)
        if self.destinations is not None and DEVICE in self.paths:
            # Kept only now that a verified grant names it: a refused body keeps nothing.
            self.destinations.remember(target, grant.destination)
        if grant.mailbox and self.deliverer is not None and self.ctx.pp_size == 1:
            inflight.mailbox = grant.mailbox
            inflight.mailbox_until = grant.write_until or grant.expires_at
        start = req.matched_token_size
        inflight.path = self.paths[target.path]
        inflight.send = SendRange(
            input_ids=req.input_ids,
            extra_key=req.extra_key,
            start=start,
            end=start + req.extra_token_size,
            target=target,
            target_slots=slots,
            migration_id=req.migration_id,
            start_by=grant.expires_at,
            write_until=grant.write_until or float("inf"),
            verify=grant.verify,
            partial_ok=req.partial_ok,
            prepared=inflight.prepared,
            source_slots=source_slots,
        )

    def _running_source_slots(
        self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer
    ) -> torch.Tensor | None:
        """Feature "running_slots": the device slots of the range, read from the running
        request the body names (checked against its ids); None without `running_rid`.
        The transfer fails, once its copy is done, unless the request still holds them."""
        if not req.running_rid:
            return None
        if self.running_slots is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "running_rid needs a source with one PP stage and one DP rank (feature "
                '"running_slots"): migrate from the radix tree instead',
            )
        end = req.matched_token_size + req.extra_token_size
        running_slots = self.running_slots
        running = running_slots.check(req.running_rid, req.input_ids, end)
        slots = running_slots.slots(running, 0, end)
        inflight.slots_lost = lambda: running_slots.lost(running, end)
        return slots

    def _parse_own_slots(
        self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer
    ) -> None:
        for target in req.target_per_rank:
            if (target.tp, target.pp) == (self.ctx.tp_rank, self.ctx.pp_rank):
                self._check_size(req)
                slots = target_slots(target, self.fingerprint.shape.page_size, req.extra_token_size)
                inflight.own_slots = (slots, grants.slots_digest(slots))
                inflight.slots_digest = inflight.own_slots[1]
                return

    def _check_target(
        self,
        req: TransferRequestKVCacheReqInput,
        target: TransferRequestKVCacheTarget | None,
        position: tuple[int, int],
        fingerprint: LayoutFingerprint,
        tokens_digest: str,
        slots_and_digest: tuple[torch.Tensor, str] | None = None,
    ) -> tuple[torch.Tensor, str, grants.Grant]:
        """Check the target entry of source rank `position` (whose layout is
        `fingerprint`) against the prefix's `tokens_digest`; returns its slots, their
        digest and the checked grant."""
        tp, pp = position
        if target is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, f"target_per_rank has no entry for tp={tp} pp={pp}"
            )
        if slots_and_digest is None:
            slots = target_slots(target, fingerprint.shape.page_size, req.extra_token_size)
            slots_and_digest = (slots, grants.slots_digest(slots))
        slots, digest = slots_and_digest
        if target.path not in self.paths:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"data path {target.path!r} is not available on this source (available: "
                f"{', '.join(self.paths) or 'none'})",
            )
        mine = fingerprint.with_weight_version(req.weight_version)
        check_peer_fingerprint(mine, [target.fingerprint], role="target")
        if len(slots) != req.extra_token_size:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target rank tp={tp} pp={pp} has {len(slots)} slots for "
                f"extra_token_size={req.extra_token_size}",
            )
        # IMPORTANT: write only what the target granted, checked without trusting the
        # client: this migration, this rank, this path, exactly these slots, in time, once.
        if not target.grant:
            raise MigrationError(
                ErrorKind.FORBIDDEN,
                f"write refused: no grant for tp={tp} pp={pp} (pass the allocate "
                "reply's grant); nothing was written",
            )
        grant = self.signer.check_grant(
            target.grant,
            migration_id=req.migration_id,
            tp=tp,
            pp=pp,
            path=target.path,
            num_slots=len(slots),
            slots=digest,
            tokens=tokens_digest,
            staging=_staging_extent(target),  # a staging extent is written only if granted
            # Where the body says the bytes go must be what the target published, and
            # the grant must have been issued to this server.
            destination=self._destination_digest(target),
            source=self.server_epoch,
        )
        return slots, digest, grant

    def _destination_digest(self, target: TransferRequestKVCacheTarget) -> str:
        descriptor = self.paths[target.path].destination_of(target)
        if self.destinations is not None:
            return self.destinations.digest_of(descriptor)
        return grants.destination_digest(descriptor)

    def _start_job(self, inflight: InflightTransfer) -> None:
        try:
            inflight.job = inflight.path.start_send(inflight.send)
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
            inflight.finished = time.monotonic()
            inflight.release()
            if inflight.allocating:  # failed before its target answered: not waited for
                self.caller.forget(inflight.allocating)
            self._reply(inflight, statuses)
        self.inflight = still_running

    def _status(self, inflight: InflightTransfer) -> RankTransferStatus:
        """This rank's status, with its signed receipt once the transfer is over here."""
        status = inflight.local_status()
        if status.done and not status.receipt:
            send, job = inflight.send, inflight.job
            status.receipt = self.signer.encode(
                grants.Receipt(
                    migration_id=inflight.request.migration_id,
                    tp=self.ctx.tp_rank,
                    pp=self.ctx.pp_rank,
                    path=send.target.path if send is not None else "",
                    slots_digest=inflight.slots_digest,
                    success=status.success,
                    bytes=status.bytes,
                    # Nothing more can land once done, or if no write was ever submitted
                    # under the grant: only its claimant knows (a refused replay does not).
                    settled=bool(inflight.claimed_grant)
                    and (status.success or job is None or not job.started_writing),
                    grant=inflight.claimed_grant,
                    # Told only to a target that granted an extent: it must scatter then.
                    plan=status.plan if send is not None and send.target.staging else "",
                    digest=status.digest,
                    source=self.server_epoch,
                    tokens=_receipt_tokens(status, inflight.request),
                )
            )
        return status

    def _reply(self, inflight: InflightTransfer, statuses: list[RankTransferStatus]) -> None:
        req = inflight.request
        # `statuses` come from this stage's TP group, in tp_rank order.
        ranks = [
            RankTransferResult(
                tp_rank=i,
                pp_rank=self.ctx.pp_rank,
                success=s.success,
                bytes=s.bytes,
                seconds=s.seconds,
                message=s.message,
                receipt=s.receipt,
                plan=s.plan,
                entries=s.entries,
                steps_ms={k: round(v * 1e3, 2) for k, v in s.steps.items()},
            )
            for i, s in enumerate(statuses)
        ]
        failed = [s for s in statuses if not s.success] or _uneven_lengths(statuses)
        elapsed = time.monotonic() - inflight.started
        self.metrics.phase("transfer", elapsed)
        # Every rank of a stage builds this same reply; only the first one logs it.
        first_rank = self.ctx.tp_rank == 0
        if failed:
            output = TransferRequestKVCacheReqOutput(
                success=False,
                ranks=ranks,
                path=_path_name(req),
                server_epoch=self.epoch_of(req.weight_version),
                message=failed[0].message,
                error_kind=failed[0].error_kind,
            )
            self.metrics.outcome("source", "send_failed")
            if first_rank:
                logger.warning(
                    "KV migration %s transfer failed after %.1f ms: %s",
                    req.migration_id,
                    elapsed * 1e3,
                    failed[0].message,
                )
        else:
            total_bytes = sum(s.bytes for s in statuses)
            sent = statuses[0].tokens
            output = TransferRequestKVCacheReqOutput(
                success=True,
                transferred_token_size=sent,
                transferred_bytes=total_bytes,
                ranks=ranks,
                path=_path_name(req),
                server_epoch=self.epoch_of(req.weight_version),
            )
            self.metrics.outcome("source", "sent")
            output.delivered = self._deliver(inflight, statuses)
            # Gathers run over the stage's TP group, in tp_rank order.
            mine = statuses[self.ctx.tp_rank]
            self.metrics.moved("source", sent, mine.bytes)
            # Per route, and the rest of this rank's transfer time: the cost model's rates
            # and fixed costs. A gathered copy of this rank's own status.
            moving_s = sum(seconds for _, seconds in mine.routes.values())
            self.metrics.routes(_path_name(req), mine.routes, max(0.0, elapsed - moving_s))
        output.allocation = inflight.allocation
        output.channel_error = inflight.channel_error
        output.destination_unknown = inflight.destination_unknown
        output.rid = req.rid  # the tokenizer side matches concurrent transfers by rid
        self._send(output, inflight)
        if first_rank and output.success:
            # Written once nothing is in flight: a log line costs ~0.1-0.2 ms here.
            self.log_later.info(
                logger,
                "KV migration %s sent: %d tokens, %d bytes (%d ranks), %.1f ms%s",
                req.migration_id,
                output.transferred_token_size,
                output.transferred_bytes,
                len(statuses),
                elapsed * 1e3,
                _steps_text(statuses[self.ctx.tp_rank].steps),
            )

    def _send(self, output: TransferRequestKVCacheReqOutput, inflight: InflightTransfer) -> None:
        """Send the reply, stamped with where the scheduler's part of the trip went
        (`trace.py`), ms: the handler, the wait until the poll that found the copy done
        (`polls` loop iterations), and that poll until now (the ranks' gather, receipts,
        the mailbox delivery)."""
        now = time.monotonic()
        handled = inflight.handled or now
        polled = max(self._poll_started, handled)  # a reply sent from the handler: no wait
        extra = {}
        if inflight.allocated:  # feature "source_allocate": the target's part of `waited`
            extra["allocate"] = ms(inflight.allocated - handled)
            if inflight.answered and inflight.launched and inflight.finished:
                # After the answer: its poll up to it (`answer`), the checks, match and
                # launch (`start`), until the copy was seen done (`copy_wait`), then the
                # receipts, the mailbox and the reply (`finish`).
                extra["answer"] = ms(inflight.answered - max(inflight.allocated, handled))
                extra["start"] = ms(inflight.launched - inflight.answered)
                extra["copy_wait"] = ms(inflight.finished - inflight.launched)
                extra["finish"] = ms(now - inflight.finished)
            # ... and of it the target's own steps (`queued`: behind other work there).
            target_steps = (inflight.allocation or {}).get("steps_ms")
            if isinstance(target_steps, dict):
                extra.update(_target_steps(target_steps))
        stamp(
            output,
            inflight.request,
            self.ctx.pp_rank,
            polls=self.polls - inflight.first_poll,
            handler=ms(handled - inflight.started),
            waited=ms(polled - handled),
            replying=ms(now - polled),
            **extra,
        )
        self.ctx.send_output(output, inflight.request)


_TARGET_STEPS = ("queued", "scheduler", "match_reserve", "slots", "grant")


def _target_steps(steps: dict[str, Any]) -> dict[str, float]:
    """The target's allocate steps as `target_<step>` (only known ones, as numbers: the
    reply is the target's word)."""
    return {
        f"target_{k}": float(steps[k])
        for k in _TARGET_STEPS
        if isinstance(steps.get(k), int | float) and not isinstance(steps[k], bool)
    }


def _uneven_lengths(statuses: list[RankTransferStatus]) -> list[RankTransferStatus]:
    """A failure when the ranks wrote different lengths: identical trees cut a partial
    send alike on every rank, and no reply may name a length some rank did not write
    (the target's commit checks the receipts too)."""
    lengths = sorted({s.tokens for s in statuses})
    if len(lengths) == 1:
        return []
    message = f"ranks wrote different lengths of a partial transfer: {lengths}"
    return [
        dataclasses.replace(
            statuses[0], success=False, message=message, error_kind=ErrorKind.INTERNAL.value
        )
    ]


def _receipt_tokens(status: RankTransferStatus, req: TransferRequestKVCacheReqInput) -> int:
    """The receipt's `tokens`: how many were written when a partial transfer wrote fewer
    than granted (only a target that lists "partial_transfer" gets one), else -1."""
    if status.success and req.partial_ok and status.tokens < req.extra_token_size:
        return status.tokens
    return -1


def _steps_text(steps: Mapping[str, float]) -> str:
    """ ", this rank: host_copies 1.2 ms, probe 0.0 ms, ..." for the log line."""
    if not steps:
        return ""
    return ", this rank: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in steps.items())


def target_slots(
    target: TransferRequestKVCacheTarget, page_size: int, num_tokens: int
) -> torch.Tensor:
    """The target rank's token slots, from `kv_indices` or from whole pages: `kv_pages`,
    or `kv_page_ranges` runs (`page_ranges.py`); exactly `num_tokens` of them.

    IMPORTANT: the count is checked from the lists' lengths and the runs' counts before
    anything is expanded: a few bytes of runs can name gigabytes of slots."""

    if sum(map(bool, (target.kv_pages, target.kv_indices, target.kv_page_ranges))) > 1:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            "give one of kv_indices, kv_pages and kv_page_ranges for a target rank",
        )
    _check_slot_count(target, page_size, num_tokens)
    if target.kv_pages or target.kv_page_ranges:
        try:
            pages = (
                page_ranges.pages_from_ranges(target.kv_page_ranges)
                if target.kv_page_ranges
                else _int64_tensor(target.kv_pages, "kv_pages")
            )
        except ValueError as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, str(e)) from None
        return page_ranges.slots_from_pages(pages, page_size)
    return _int64_tensor(target.kv_indices, "kv_indices")


def _check_slot_count(
    target: TransferRequestKVCacheTarget, page_size: int, num_tokens: int
) -> None:
    """BAD_REQUEST unless the entry names exactly `num_tokens` slots, by arithmetic."""
    if target.kv_page_ranges:
        name = "kv_page_ranges"
        if not all(
            isinstance(pair, list | tuple) and len(pair) == 2 and isinstance(pair[1], int)
            for pair in target.kv_page_ranges
        ):
            raise MigrationError(ErrorKind.BAD_REQUEST, "each page range must be [first, count]")
        count = page_ranges.count_pages(target.kv_page_ranges) * page_size
    elif target.kv_pages:
        name, count = "kv_pages", len(target.kv_pages) * page_size
    else:
        name, count = "kv_indices", len(target.kv_indices)
    if count != num_tokens:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"target rank tp={target.tp} pp={target.pp}: {name} name {count} slots "
            f"(page_size={page_size}) for extra_token_size={num_tokens}",
        )


def _int64_tensor(values: list[int], name: str) -> torch.Tensor:
    """An int64 tensor of a list of ints (the HTTP layer checked they are). Through numpy:
    a third of `torch.tensor`'s time on a list, and this runs on the scheduler thread."""
    import numpy as np
    import torch

    try:
        return torch.from_numpy(np.array(values, dtype=np.int64))
    except OverflowError as e:  # a bad request, as torch.tensor's ValueError was
        raise ValueError(f"{name}: {e}") from None


def _staging_extent(target: TransferRequestKVCacheTarget) -> tuple[int, int] | None:
    """The ``(addr, length)`` staging extent a target rank entry asks to write, if any."""
    if not target.staging:
        return None
    if target.path != "host" or len(target.staging) != 2 or min(target.staging) <= 0:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"target tp={target.tp} pp={target.pp}: staging must be [addr, length] > 0 on "
            f"the host path, got {target.staging} on path {target.path!r}",
        )
    return target.staging[0], target.staging[1]


def _allocation_of(reply: bytes) -> dict:
    """The target's allocate reply, checked for the fields read here (the grant and
    slots are checked by `_check_target` as for any client-relayed allocation)."""
    import orjson

    try:
        allocation = orjson.loads(reply)
    except orjson.JSONDecodeError:
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED, "the target's allocate reply is not JSON"
        ) from None
    if not isinstance(allocation, dict) or not isinstance(allocation.get("success"), bool):
        raise MigrationError(ErrorKind.TRANSFER_FAILED, "the target's allocate reply is malformed")
    if not allocation["success"]:
        return allocation
    ok = (
        _is_count(allocation.get("matched_token_size"))
        and _is_count(allocation.get("extra_token_size"))
        and isinstance(allocation.get("migration_id"), str)
        and isinstance(allocation.get("ranks"), list)
        and len(allocation["ranks"]) == 1
        and isinstance(allocation["ranks"][0], dict)
    )
    if not ok:
        raise MigrationError(ErrorKind.TRANSFER_FAILED, "the target's allocate reply is malformed")
    return allocation


def _error_kind(value: object) -> ErrorKind:
    """The target's `error_kind`, as ours (INTERNAL for anything else)."""
    try:
        return ErrorKind(value)
    except ValueError:
        return ErrorKind.INTERNAL


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _granted_target(
    templates: list[TransferRequestKVCacheTarget], allocation: dict
) -> TransferRequestKVCacheTarget:
    """The body's one target rank with the slots, grant and staging the target's reply
    gave it (a wrong type is refused here; counts and the grant by `_check_target`)."""
    granted = allocation["ranks"][0]
    template = templates[0]
    fields: dict = {}
    for name in ("kv_indices", "kv_pages", "kv_page_ranges", "staging"):
        value = granted.get(name, [])
        if not isinstance(value, list):
            raise MigrationError(ErrorKind.TRANSFER_FAILED, f"the target's {name} is not a list")
        fields[name] = value
    grant = granted.get("grant", "")
    if not isinstance(grant, str) or (granted.get("tp_rank"), granted.get("pp_rank")) != (
        template.tp,
        template.pp,
    ):
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED, "the target's allocate reply names another rank"
        )
    _check_ints(fields["kv_indices"], "kv_indices")
    _check_ints(fields["kv_pages"], "kv_pages")
    _check_ints(fields["staging"], "staging")
    return dataclasses.replace(template, grant=grant, **fields)


def _check_ints(values: list, name: str) -> None:
    if not all(map(_is_count, values)):
        raise MigrationError(ErrorKind.TRANSFER_FAILED, f"the target's {name} are not slot ids")


def _path_name(req: TransferRequestKVCacheReqInput) -> str:
    return req.target_per_rank[0].path if req.target_per_rank else ""
