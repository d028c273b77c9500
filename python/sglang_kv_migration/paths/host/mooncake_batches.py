"""How one write's entries leave through the engine, on the worker thread that runs it.

A direct plan goes out in batches of at most the peer's share of `max_entries_per_batch`,
one batch in flight per worker; a gathered or staged plan (`staging.py`) alternates
between two registered staging chunks, gathering the next while the previous is on the
wire. No wait spins a core for long (see `mooncake_engine.py`): a few entries go out as
one-entry batches polled between short sleeps (`_Singles`), a larger batch sleeps through
most of its predicted time before the engine's spinning wait. Over TCP every entry goes
out as a one-entry batch, within the peer's lanes (`lanes.py`). A failed batch or entry is
retried once, over TCP once more per lane (`_Singles`); a timed-out TCP entry is not
retried: the engine may still send it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_kv_migration.paths.host import lanes, staging
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.mooncake_engine import (
    EngineCallFailed,
    MooncakeEngine,
    Registrations,
)
from sglang_kv_migration.paths.host.transport import (
    MemoryRegion,
    TransferError,
    TransportConfig,
    logged,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Pause before the single retry of a failed batch, so a queue that is still draining (or the
# upstream "first TCP transfer after ~5 s idle fails with queue-full" issue, #4209) clears.
_RETRY_DELAY_S = 0.05
# Writes of at most this many entries go out as one-entry batches, polled without spinning.
# Kept small: on the H200 host one-entry batches took ~20 ms each (the host path's 1K-token
# migration, 64 entries, went from 74 ms to 1.45 s with 64 here); a handful is still worth
# it so a tiny write does not spin a core.
_SINGLES_MAX = 8
# Poll interval for one-entry batches: starts short, doubles while nothing completes.
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.002
# A large batch sleeps this share of its predicted time before the spinning wait.
_SLEEP_SHARE = 0.8


@dataclass(frozen=True)
class Context:
    """What a failure message says about the whole write."""

    peer: str
    total_bytes: int
    total_entries: int
    # Seconds each engine batch of a direct plan took, appended as they complete.
    batch_seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _BatchTiming:
    seconds: float
    entries: int
    bytes: int


@dataclass(frozen=True)
class Entries:
    """A write's entries as lists or int64 tensors; tensors become lists one batch at a
    time, so no single call holds the GIL for long."""

    srcs: list[int] | torch.Tensor
    dsts: list[int] | torch.Tensor
    lengths: list[int] | torch.Tensor

    def __len__(self) -> int:
        return len(self.lengths)

    def slice(self, lo: int, hi: int) -> tuple[list[int], list[int], list[int]]:
        staging.yield_gil()
        return _as_list(self.srcs[lo:hi]), _as_list(self.dsts[lo:hi]), _as_list(self.lengths[lo:hi])


class BatchSender:
    """Sends the entries of the writes its transport's workers run. Per worker thread
    (`start_worker`): two registered staging chunks, the progress-marker word and the
    timing of its last large batch."""

    def __init__(
        self,
        engine: MooncakeEngine,
        registrations: Registrations,
        config: TransportConfig,
        per_peer: int,
        closed: Callable[[], bool],
        name: str,
    ):
        self._engine = engine
        self._registrations = registrations
        self._config = config
        self._workers_per_peer = per_peer
        self._closed = closed  # whether the transport is closing: no retries, no new chunks
        self._name = name  # the transport's session id, for messages
        # Over TCP: no more entries in the engine per peer than it has lanes (`lanes.py`).
        self.budget = (
            lanes.LaneBudget(lanes.tcp_lanes_per_peer()) if config.protocol == "tcp" else None
        )
        self._reaper = lanes.Reaper(self.budget or lanes.LaneBudget(1), engine.status_check)
        self._lock = threading.Lock()  # guards `_all_staging`
        self._tls = threading.local()
        self._all_staging: list[torch.Tensor] = []  # every worker's, freed on close

    def start_worker(self) -> None:
        """On a new worker thread, before its first job."""
        self._tls.staging = None
        self._tls.marker = None
        self._tls.last_batch = None

    def free_staging(self) -> None:
        """After the engine is released: the chunks were registered there."""
        with self._lock:
            self._all_staging.clear()

    def _register(self, region: MemoryRegion) -> None:
        if self._closed():
            raise TransferError(f"transport {self._name} is closed")
        self._registrations.add([region])

    def send(self, ctx: Context, entries: Entries, deadline: float) -> int:
        """Send entries in batches, one at a time; returns the number of batches."""
        # The peer's entry budget, shared by its workers.
        size = self._config.max_entries_per_batch // self._workers_per_peer
        starts = range(0, len(entries), size)
        # The last batch of an earlier job predicts this job's first (scaled down).
        previous = self._tls.last_batch
        for number, lo in enumerate(starts, 1):
            hi = min(lo + size, len(entries))
            label = f"batch {number}/{len(starts)}"
            srcs, dsts, lengths = entries.slice(lo, hi)
            if time.monotonic() > deadline:
                timeout = self._config.transfer_timeout_s
                raise self.failure(ctx, label, f"the {timeout} s deadline passed", lengths)
            began = time.monotonic()
            if len(lengths) <= _SINGLES_MAX or self.budget is not None:
                _Singles(self, ctx, label, srcs, dsts, lengths, deadline).submit().wait()
            else:
                self._write_batch(ctx, label, srcs, dsts, lengths, deadline, previous)
                previous = _BatchTiming(time.monotonic() - began, len(lengths), sum(lengths))
                self._tls.last_batch = previous
            ctx.batch_seconds.append(time.monotonic() - began)
        return len(starts)

    def send_chunks(
        self,
        ctx: Context,
        src: HostPoolLayout,
        plan: staging.PagePlan,
        deadline: float,
        marker_addr: int | None = None,
    ) -> int:
        """Gather chunk k+1 into one staging half while chunk k leaves from the other.

        With ``marker_addr`` (staged plans), each submission also writes how many staging
        bytes have landed so far (the chunks before it, all completed) to that peer
        address, and a last write says all of them did: the target scatters as they come.
        """
        halves = self._staging_halves(plan.chunk_capacity)
        marker = self._marker_word() if marker_addr is not None else None
        landed = 0
        in_flight: _Singles | None = None
        try:
            for number, chunk in enumerate(plan.chunks, 1):
                label = f"chunk {number}/{len(plan.chunks)}"
                if time.monotonic() > deadline:
                    timeout = self._config.transfer_timeout_s
                    lengths = chunk.entry_lengths.tolist()
                    raise self.failure(ctx, label, f"the {timeout} s deadline passed", lengths)
                half = halves[number % 2]
                staging.gather_chunk(src, chunk, half)
                if in_flight is not None:
                    in_flight.wait()
                    in_flight = None
                srcs, dsts, lengths = split_entries(
                    (chunk.entry_offsets + half.data_ptr()).tolist(),
                    chunk.entry_dsts.tolist(),
                    chunk.entry_lengths.tolist(),
                    self._config.staging_entry_bytes,
                )
                if marker is not None and landed and len(lengths) < _SINGLES_MAX:
                    # IMPORTANT: only after the chunks it counts completed (waited above).
                    marker[0] = landed
                    srcs, dsts, lengths = (
                        [*srcs, marker.data_ptr()],
                        [*dsts, marker_addr],
                        [*lengths, 8],
                    )
                if len(lengths) <= _SINGLES_MAX:
                    in_flight = _Singles(self, ctx, label, srcs, dsts, lengths, deadline)
                    in_flight.submit()
                else:  # gathered towards a fragmented target: many entries per chunk
                    self.send(ctx, Entries(srcs, dsts, lengths), deadline)
                landed += chunk.nbytes
            if in_flight is not None:
                in_flight.wait()
                in_flight = None
            if marker is not None:
                marker[0] = landed
                label = "progress marker"
                in_flight = _Singles(
                    self, ctx, label, [marker.data_ptr()], [marker_addr], [8], deadline
                )
                in_flight.submit().wait()
                in_flight = None
        finally:
            if in_flight is not None:  # failing: the staging half must not be reused early
                in_flight.drain()
        return len(plan.chunks)

    def _marker_word(self) -> torch.Tensor:
        """This worker's registered int64 the progress markers leave from (reused: every
        marker write completes before the next one is set)."""
        import torch

        word = self._tls.marker
        if word is None:
            word = torch.zeros(1, dtype=torch.int64)
            self._register(MemoryRegion(word.data_ptr(), 8))
            with self._lock:
                self._all_staging.append(word)  # freed after the engine, on close
            self._tls.marker = word
        return word

    def _staging_halves(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two registered staging chunks of at least `capacity` bytes, reused across jobs."""
        import torch

        current = self._tls.staging
        if current is None or current.numel() < 2 * capacity:
            size = max(capacity, self._config.staging_chunk_bytes)
            fresh = torch.zeros(2 * size, dtype=torch.uint8)  # pages faulted in now
            self._register(MemoryRegion(fresh.data_ptr(), fresh.numel()))
            if current is not None:
                # No transfer uses it between jobs (this is the worker thread).
                self._registrations.remove(current.data_ptr())
            with self._lock:
                self._all_staging = [t for t in self._all_staging if t is not current]
                self._all_staging.append(fresh)
            self._tls.staging = current = fresh
        half = current.numel() // 2
        return current[:half], current[half:]

    def _write_batch(
        self,
        ctx: Context,
        label: str,
        srcs: list[int],
        dsts: list[int],
        lengths: list[int],
        deadline: float,
        previous: _BatchTiming | None,
    ) -> None:
        engine = self._engine
        nbytes = sum(lengths)
        for attempt in (1, 2):
            try:
                batch_id = engine.submit_batch(ctx.peer, srcs, dsts, lengths)
                if previous is not None:
                    # Sleep through most of the expected time; the spinning wait below
                    # then covers only the tail. Scaling by the smaller of the two ratios
                    # underestimates rather than oversleeps.
                    expected = previous.seconds * min(
                        len(lengths) / previous.entries, nbytes / previous.bytes
                    )
                    time.sleep(max(0.0, min(_SLEEP_SHARE * expected, deadline - time.monotonic())))
                engine.wait_batch(batch_id)
                return
            except EngineCallFailed as exc:
                reason = str(exc)
            if attempt == 2 or time.monotonic() > deadline or self._closed():
                raise self.failure(ctx, label, reason, lengths)
            logger.warning(
                "write to %s, %s (%d bytes): %s; retrying once",
                ctx.peer,
                label,
                nbytes,
                reason,
            )
            time.sleep(_RETRY_DELAY_S)

    def failure(
        self, ctx: Context, label: str, reason: str, lengths: Sequence[int]
    ) -> TransferError:
        message = (
            f"write of {ctx.total_bytes} bytes ({ctx.total_entries} entries) to peer "
            f"{ctx.peer} failed at {label} ({sum(lengths)} bytes, {len(lengths)} entries): "
            f"{reason}"
        )
        return logged(TransferError(message))


class _Singles:
    """Entries sent as one-entry batches and polled with `transfer_check_status` between
    short sleeps (exact for one-entry batches, and it never blocks).

    Over TCP (`BatchSender.budget`) an entry enters the engine only with one of the peer's
    lane permits and returns it once the engine reports it final (`lanes.py`); one the
    write gives up on (timed out) is left to the reaper with its permit, and is not
    retried: the engine may still send it.

    Failed entries are retried once, and over TCP once more per lane: a target shuts every
    inbound stream when slots leave quarantine without a settled receipt (`tcp_streams.py`),
    and Mooncake keeps such a stream's lane idle until a write on it fails, then takes the
    next idle lane, which may be shut too. Each failure retires one lane, so at most the
    peer's lanes of retries reach a fresh stream.
    """

    def __init__(
        self,
        sender: BatchSender,
        ctx: Context,
        label: str,
        srcs: list[int],
        dsts: list[int],
        lengths: list[int],
        deadline: float,
    ):
        self._sender = sender
        self._budget = sender.budget
        self._ctx = ctx
        self._label = label
        self._srcs, self._dsts, self._lengths = srcs, dsts, lengths
        self._deadline = deadline
        self._todo: list[int] = []  # entry indices not yet submitted
        self._submitted: list[tuple[int, int]] = []  # (entry index, batch id)
        self._failed: list[int] = []
        self._reason = ""
        self._attempt = 1
        self._attempts = 2 + (self._budget.lanes if self._budget is not None else 0)
        self._gave_up = False  # entries left in the engine: no retry

    def submit(self) -> _Singles:
        self._todo = list(range(len(self._lengths)))
        self._fill()
        return self

    def wait(self) -> None:
        """Wait for every entry; retry the failed ones (once, over TCP once more per lane);
        raise `TransferError`."""
        while True:
            self._poll()
            if not self._failed:
                return
            failed_lengths = [self._lengths[i] for i in self._failed]
            sender = self._sender
            if (
                self._attempt >= self._attempts
                or self._gave_up
                or time.monotonic() > self._deadline
                or sender._closed()
            ):
                raise sender.failure(self._ctx, self._label, self._reason, failed_lengths)
            logger.warning(
                "write to %s, %s (%d bytes in %d entries): %s; retrying (attempt %d of %d)",
                self._ctx.peer,
                self._label,
                sum(failed_lengths),
                len(failed_lengths),
                self._reason,
                self._attempt + 1,
                self._attempts,
            )
            time.sleep(_RETRY_DELAY_S)
            self._attempt += 1
            self._todo, self._failed = sorted(self._failed), []
            self._fill()

    def drain(self) -> None:
        """Wait for what is in flight, ignoring the outcome (on a failure path); send
        nothing more."""
        self._fail_todo("the write failed before they were sent")
        self._poll()

    def _fill(self) -> None:
        """Submit waiting entries, as many as the peer's lanes have room for."""
        if not self._todo:
            return
        if time.monotonic() > self._deadline or self._sender._closed():
            self._fail_todo(f"the deadline passed before {len(self._todo)} entries were sent")
            return
        count = len(self._todo)
        if self._budget is not None:
            count = self._budget.take(self._ctx.peer, count)
        todo, self._todo = self._todo[:count], self._todo[count:]
        engine = self._sender._engine
        for n, i in enumerate(todo):
            try:
                batch_id = engine.submit_single(
                    self._ctx.peer, self._srcs[i], self._dsts[i], self._lengths[i]
                )
            except EngineCallFailed as exc:
                if self._budget is not None:
                    self._budget.give_back(self._ctx.peer, len(todo) - n)
                self._failed.extend(todo[n:])
                self._reason = str(exc)
                return
            self._submitted.append((i, batch_id))

    def _fail_todo(self, reason: str) -> None:
        if self._todo:
            self._failed.extend(self._todo)
            self._todo = []
            self._reason = reason
            self._gave_up = True

    def _poll(self) -> None:
        """Until every entry finished or was given up: poll those in flight, submit the
        waiting ones as lanes free up; record failures."""
        give_up = max(self._deadline, time.monotonic()) + self._sender._config.transfer_timeout_s
        pause = _POLL_MIN_S
        while self._submitted or self._todo:
            before = len(self._submitted) + len(self._todo)
            self._settle_finished()
            if self._submitted and time.monotonic() >= give_up:
                self._give_up(self._submitted, "the write's time ran out")
            self._fill()
            if len(self._submitted) + len(self._todo) < before:
                pause = _POLL_MIN_S
            elif self._submitted:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
            elif self._todo and self._budget is not None:  # every lane busy with others'
                self._budget.wait_for_change(_POLL_MAX_S)

    def _settle_finished(self) -> None:
        """Record the entries the engine reports final; give up on all once one timed out."""
        engine = self._sender._engine
        pending: list[tuple[int, int]] = []
        timed_out = False
        for index, batch_id in self._submitted:
            code = engine.check_single(batch_id)
            if code == 0 or (code == -2 and self._budget is not None):
                # Over TCP a timed-out entry is still in the engine: it keeps its lane.
                timed_out = timed_out or code == -2
                pending.append((index, batch_id))
                continue
            if code == -2:
                # Timed out and not freed: the batch wait frees it, bounded by the
                # engine's own timeout; 0 there means it did complete.
                code = 1 if engine.batch_completed(batch_id) else -2
            if self._budget is not None:
                self._budget.give_back(self._ctx.peer)
            if code != 1:
                self._failed.append(index)
                self._reason = f"transfer_check_status returned {code}"
        self._submitted = pending
        if timed_out:
            self._give_up(pending, "transfer_check_status returned -2")

    def _give_up(self, entries: list[tuple[int, int]], reason: str) -> None:
        """Stop waiting for `entries` (all those in flight); the write fails. Over TCP the
        reaper keeps their permits until the engine is done with them, and nothing more
        of the write is sent; otherwise the batch wait frees them, bounded by the engine's
        own timeout (0 there: it did complete)."""
        engine = self._sender._engine
        if self._budget is not None:
            self._sender._reaper.adopt(self._ctx.peer, [b for _i, b in entries])
            self._failed.extend(i for i, _b in entries)
            self._reason = reason
            self._fail_todo(reason)
            self._gave_up = True
        else:
            for index, batch_id in entries:
                if not engine.batch_completed(batch_id):
                    self._failed.append(index)
                    self._reason = reason
        self._submitted = []


def split_entries(
    srcs: list[int], dsts: list[int], lengths: list[int], limit: int
) -> tuple[list[int], list[int], list[int]]:
    """Cut entries longer than ``limit`` into pieces: the engine moves the entries of a
    batch concurrently, one TCP stream each, and one long entry is one stream."""
    if limit <= 0 or max(lengths, default=0) <= limit:
        return srcs, dsts, lengths
    out_s, out_d, out_n = [], [], []
    for s, d, n in zip(srcs, dsts, lengths, strict=True):
        for off in range(0, n, limit):
            out_s.append(s + off)
            out_d.append(d + off)
            out_n.append(min(limit, n - off))
    return out_s, out_d, out_n


def _as_list(values: list[int] | torch.Tensor) -> list[int]:
    """A `write()` job's list slice as is, or a planned tensor slice converted."""
    if isinstance(values, list):
        return values
    return values.tolist()
