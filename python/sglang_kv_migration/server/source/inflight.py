"""One rank's record of a transfer it sends: its moment, and what each step left.

    CHECKING ──> SENDING ──> SENT             the request checked, the path's job started
       │  ▲         │
       │  └─┐       └─> SEND_FAILED           an error at any step; its reply says so
       ▼    │              ▲
    ALLOCATING ────────────┘                  feature "source_allocate": the target's
                                              allocate reply awaited (then CHECKING again)

The moments are `wire.moments.Moment`'s, the steps `TRANSFER_STEPS`. A transfer the
target had nothing to send for goes CHECKING -> SENT. The state moves only through the
methods below (`_move` checks each step); once it is SENT or SEND_FAILED, `result` says
this rank's status. The records of the optional features (`TargetAllocation`,
`SourceCommit`) and the timestamps the reply's trace is stamped with (`Timings`) are
data, never read as state. Every field is set here: the steps in other modules hand what
they found to a method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import (
    DEVICE,
    DataPath,
    KVPoll,
    PreparedSend,
    SendJob,
    SendRange,
)
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.wire.messages import AllocateReply
from sglang_kv_migration.wire.moments import TRANSFER_STEPS, Moment, step

if TYPE_CHECKING:
    import torch


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
    # The unix time the grant this rank's request claimed expires (0: it claimed none).
    claimed_until: float = 0.0
    steps: dict[str, float] = dataclasses.field(default_factory=dict)  # SendStats.steps
    routes: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)  # .routes


@dataclass(frozen=True)
class OwnSlots:
    """This rank's target slots, parsed once, and their digest (the receipt names it)."""

    slots: torch.Tensor
    digest: str


@dataclass(frozen=True)
class TokensDigest:
    """`grants.request_tokens_digest` of the request's first `count` ids."""

    count: int
    digest: str


@dataclass(frozen=True)
class SourceCommit:
    """Feature "source_commit": where rank 0 hands every rank's receipts to the target
    (its grant's `mailbox`), and until when (unix time)."""

    mailbox: str
    until: float


@dataclass(frozen=True)
class GrantClaim:
    """The grant a transfer claimed on this rank: what its receipt names, and what the
    reply tells the HTTP layer (`TransferReply.claims`)."""

    digest: str  # `grants.grant_digest` of the token: the receipt's `grant`
    until: float  # the grant's `expires_at` (unix time): no claim of it after that
    # This scheduler's DP rank when the grant names one (the receipt's `dp_rank`), else -1.
    dp_rank: int = -1


@dataclass
class TargetAllocation:
    """Feature "source_allocate": the call on the target's allocate channel."""

    call: bytes  # the call's id while its answer is awaited (b"": taken up or forgotten)
    answer_by: float  # monotonic
    answer: dict = dataclasses.field(default_factory=dict)  # as the target sent it
    reply: AllocateReply | None = None  # the same, checked
    channel_error: str = ""  # why the target's channel could not be asked

    def taken_up(self) -> None:
        """Its answer was taken up, or it is no longer awaited."""
        self.call = b""

    def unanswered(self, channel_error: str) -> None:
        self.channel_error = channel_error

    def answered(self, answer: dict, reply: AllocateReply) -> None:
        """The target's reply, as it answered and checked."""
        self.answer, self.reply = answer, reply


@dataclass
class Timings:
    """Monotonic times of the steps, for the reply's trace (`SourceTransfers._send`)."""

    started: float = 0.0  # taken up
    handled: float = 0.0  # its handler returned
    allocated: float = 0.0  # the poll that took the target's allocate reply up began
    answered: float = 0.0  # that reply taken up
    launched: float = 0.0  # the copy launched (or the transfer failed)
    finished: float = 0.0  # every rank seen done


@dataclass
class InflightTransfer:
    """One rank's part of a transfer."""

    request: TransferRequestKVCacheReqInput
    first_poll: int = 0  # `SourceTransfers.polls` when it started (its reply says how many)
    state: Moment = Moment.CHECKING
    timings: Timings = dataclasses.field(default_factory=Timings)
    send: SendRange | None = None  # this rank's part, once validated
    path: DataPath | None = None
    job: SendJob | None = None
    error: MigrationError | None = None  # set with SEND_FAILED
    # This rank's status: set with SENT, and once asked after SEND_FAILED.
    result: RankTransferStatus | None = None
    own_slots: OwnSlots | None = None
    tokens: TokensDigest | None = None  # taken while the target allocated
    # Done while the target allocated (`SourceTransfers._prepare`): the path's part
    # (released here unless its job took it).
    prepared: PreparedSend | None = None
    allocate: TargetAllocation | None = None
    commit: SourceCommit | None = None
    destination_unknown: bool = False  # feature "destination_digest": nothing was done
    # The grant this request claimed (None: it claimed none, so its receipt cannot say
    # the grant's writes are over: another request may hold it).
    claim: GrantClaim | None = None
    # Feature "running_slots": why the running request's slots the copy read may no
    # longer be its own (None: they still are), asked once the copy is done.
    slots_lost: Callable[[], MigrationError | None] | None = None

    # ------------------------------------------------------------------ transitions

    def _move(self, to: Moment) -> None:
        self.state = step(TRANSFER_STEPS, self.state, to)

    def ask_target(self, call: bytes, answer_by: float) -> None:
        """Feature "source_allocate": the target's channel was asked."""
        self._move(Moment.ALLOCATING)
        self.allocate = TargetAllocation(call=call, answer_by=answer_by)

    def ask_refused(self, channel_error: str) -> None:
        """Feature "source_allocate": the target's channel could not be asked."""
        self.allocate = TargetAllocation(call=b"", answer_by=0.0, channel_error=channel_error)

    def answer_taken(self, allocated: float, answered: float) -> None:
        """The target's allocate reply came (in the poll that began at `allocated`, taken
        up at `answered`): the transfer is checked against it."""
        self.timings.allocated, self.timings.answered = allocated, answered
        self._move(Moment.CHECKING)

    def sending(self, job: SendJob) -> None:
        self._move(Moment.SENDING)
        self.job = job

    def fail(self, error: MigrationError) -> None:
        """Fail the transfer, unless it failed already (the first error is the one
        told) or it was sent."""
        if self.state in (Moment.SEND_FAILED, Moment.SENT):
            return
        self._move(Moment.SEND_FAILED)
        self.error = error

    def finish(self, result: RankTransferStatus) -> None:
        """This rank's part succeeded (`result` says what it sent)."""
        self._move(Moment.SENT)
        self.result = result

    # ------------------------------------------------------------------ what steps found

    def slots_parsed(self, own_slots: OwnSlots) -> None:
        """This rank's target slots, parsed once: even a refused transfer's receipt names
        them."""
        self.own_slots = own_slots

    def tokens_digested(self, tokens: TokensDigest) -> None:
        """The digest of the request's ids, taken while the target allocated."""
        self.tokens = tokens

    def send_prepared(self, prepared: PreparedSend) -> None:
        """The path's part, done while the target allocated (released here unless the
        job takes it over)."""
        self.prepared = prepared

    def claimed(self, claim: GrantClaim) -> None:
        """The grant this request claimed: its receipt may then say the grant's writes
        are over."""
        self.claim = claim

    def checked(
        self,
        path: DataPath,
        send: SendRange,
        commit: SourceCommit | None,
        slots_lost: Callable[[], MigrationError | None] | None,
    ) -> None:
        """The request passed every check: this rank's part of the send, on `path`."""
        self.path, self.send, self.commit, self.slots_lost = path, send, commit, slots_lost

    def handled(self, at: float, destination_unknown: bool) -> None:
        """Its handler returned (at `at`, monotonic)."""
        self.timings.handled = at
        self.destination_unknown = destination_unknown

    def launched(self, at: float) -> None:
        """Its copy launched (or it failed) at `at`, monotonic."""
        self.timings.launched = at

    def seen_done(self, at: float) -> None:
        """Every rank was seen done at `at`, monotonic."""
        self.timings.finished = at

    def receipt_signed(self, receipt: str, claimed_until: float) -> RankTransferStatus:
        """This rank's status once done, with its signed receipt and until when its
        request holds the grant it claimed (0: none)."""
        assert self.result is not None, "a receipt is signed once the status is known"
        self.result = dataclasses.replace(self.result, receipt=receipt, claimed_until=claimed_until)
        return self.result

    # ------------------------------------------------------------------ reading

    @property
    def waiting(self) -> bool:
        """Waiting for pages; identical on every TP rank."""
        return self.state is Moment.SENDING and self.job.waiting

    @property
    def asking(self) -> bool:
        """Whether a call on the target's allocate channel is still awaited (also for a
        transfer that failed meanwhile: its answer is taken up and freed)."""
        return self.allocate is not None and bool(self.allocate.call)

    @property
    def slots_digest(self) -> str:
        """Of this rank's target slots, once parsed (for the receipt)."""
        return self.own_slots.digest if self.own_slots is not None else ""

    @property
    def allocation(self) -> dict:
        """The target's allocate reply as it answered (feature "source_allocate")."""
        return self.allocate.answer if self.allocate is not None else {}

    @property
    def channel_error(self) -> str:
        return self.allocate.channel_error if self.allocate is not None else ""

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

    def local_status(self) -> RankTransferStatus:
        if self.state is Moment.SENDING:
            state = self.job.poll()
            if state is KVPoll.FAILED:
                self.fail(self.job.error or MigrationError(ErrorKind.INTERNAL, "send failed"))
            elif state is KVPoll.SUCCESS and self.slots_lost is not None:
                # A request that finished (or was retracted) during the copy may have
                # handed its slots to another request: what was read is not its KV.
                lost, self.slots_lost = self.slots_lost(), None
                if lost is not None:
                    self.fail(lost)
                else:
                    self.finish(self._success())
            elif state is KVPoll.SUCCESS:
                self.finish(self._success())
        if self.state is Moment.SEND_FAILED and self.result is None:
            self.result = RankTransferStatus(
                done=True, message=self.error.message, error_kind=self.error.kind.value
            )
        return self.result or RankTransferStatus(done=False)

    def _success(self) -> RankTransferStatus:
        stats = self.job.stats
        return RankTransferStatus(
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


def gpu_copy_events(started: list[InflightTransfer]) -> list[Any]:
    """The events the copies of `started` (launched in one poll) end with, when each is
    only a copy on the GPU; else none (a host-path write or a verify digest runs on for
    longer, on helper threads)."""
    sending = [t for t in started if t.state is Moment.SENDING]
    events = [t.job.completion_event for t in sending]
    return events if all(e is not None for e in events) else []


def on_helper_threads(inflight: list[InflightTransfer]) -> bool:
    """Whether a transfer in flight may wait on a helper thread (the host path's
    transport workers, a verify digest, the device path's mapping of a peer's
    buffers): device-path copies run on the GPU."""
    return any(
        (t.path is None and not t.asking)  # (asking a target's channel: no helper)
        or (t.path is not None and (t.path.name != DEVICE or t.send is None or t.send.verify))
        or (t.job is not None and t.job.waits_on_helper)
        for t in inflight
    )
