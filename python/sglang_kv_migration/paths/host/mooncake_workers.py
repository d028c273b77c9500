"""A Mooncake transport's per-peer workers: the threads that run its writes.

`workers_per_peer` daemon worker threads per peer (started by the first write to it)
take that peer's jobs from one queue, each running one job at a time, so several writes
to one peer progress together and a stalled peer holds up only its own jobs, never
writes to other peers. Jobs to one peer may finish out of call order. A `write_pages` job
is planned and checked here, in the worker (`staging.plan_pages`), and its entries leave
through `mooncake_batches.BatchSender`. Before the first write to a peer (and after a
failed one) the worker waits for the peer to answer a handshake probe.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.host import staging
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.mooncake_batches import BatchSender, Context, Entries
from sglang_kv_migration.paths.host.mooncake_engine import (
    MooncakeEngine,
    RegionIndex,
    Registrations,
)
from sglang_kv_migration.paths.host.transport import (
    MemoryRegion,
    TransferError,
    TransferHandle,
    TransferStats,
    TransportConfig,
    WriteOp,
    logged,
)

logger = logging.getLogger(__name__)

# How long close() waits for the worker beyond the configured transfer timeout.
_CLOSE_GRACE_S = 5.0
# Least time a write waits for a new peer to answer the handshake probe (~1 ms when up).
_PROBE_MIN_WAIT_S = 0.5


@dataclass
class Job:
    """One `write()` call, checked and flattened into the engine's three lists."""

    peer: str
    srcs: list[int]
    dsts: list[int]
    lengths: list[int]
    total_bytes: int
    future: Future[TransferStats]

    @classmethod
    def build(
        cls, peer: str, ops: Sequence[WriteOp], local: RegionIndex, remote: RegionIndex
    ) -> Job:
        if not peer:
            raise TransferError("peer_session_id is empty")
        srcs, dsts, lengths = [], [], []
        for index, op in enumerate(ops):
            problem = None
            if op.length <= 0:
                problem = "length must be positive"
            elif not local.covers(op.src_addr, op.length):
                problem = "source is outside the locally registered regions"
            elif not remote.covers(op.dst_addr, op.length):
                problem = "destination is outside the peer's published regions"
            if problem is not None:
                raise TransferError(
                    f"refused write to peer {peer}: op {index} (src=0x{op.src_addr:x}, "
                    f"dst=0x{op.dst_addr:x}, length={op.length}): {problem}; nothing was sent"
                )
            srcs.append(op.src_addr)
            dsts.append(op.dst_addr)
            lengths.append(op.length)
        return cls(peer, srcs, dsts, lengths, sum(lengths), Future())


@dataclass
class PagesJob:
    """One `write_pages()` call; planned and checked in the worker."""

    peer: str
    src: HostPoolLayout
    src_indices: Any
    dst: HostPoolLayout
    dst_indices: Any
    remote: RegionIndex
    dst_staging: MemoryRegion | None
    future: Future[TransferStats]
    start_by: float | None = None  # time.monotonic(); see `KVTransport.write_pages`
    write_until: float | None = None
    enqueued: float = field(default_factory=time.monotonic)


class PeerWorkers:
    """The worker threads of one transport, per peer, and the jobs they run."""

    def __init__(
        self,
        engine: MooncakeEngine,
        registrations: Registrations,
        config: TransportConfig,
        name: str,
    ):
        self._engine = engine
        self._registrations = registrations
        self._config = config
        self._session_id = name  # the transport's, for messages and thread names
        self.per_peer = min(config.workers_per_peer, config.max_entries_per_batch)
        self._lock = threading.Lock()  # guards the fields below
        # peer session id -> (its worker threads, their job queue)
        self._workers: dict[str, tuple[list[threading.Thread], queue.SimpleQueue]] = {}
        self._closed = False
        # Peers that answered a handshake probe since their last failed write, and the
        # probe in flight per peer (see `_ensure_reachable`).
        self._reachable: set[str] = set()
        self._probes: dict[str, Future[int]] = {}
        self.sender = BatchSender(
            engine, registrations, config, self.per_peer, lambda: self._closed, name
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def threads(self, peer: str) -> list[threading.Thread]:
        """The worker threads of `peer` (none before the first write to it)."""
        with self._lock:
            entry = self._workers.get(peer)
        return list(entry[0]) if entry is not None else []

    def all_threads(self) -> list[threading.Thread]:
        with self._lock:
            return [t for threads, _jobs in self._workers.values() for t in threads]

    def stop(self) -> bool:
        """Fail the jobs not yet started and wait for those in flight (up to the transfer
        timeout and a grace). False when it stopped before, or a worker still runs: then
        the engine must stay up."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            workers = list(self._workers.values())
            for threads, jobs in workers:
                for _ in threads:
                    jobs.put(None)
        deadline = time.monotonic() + self._config.transfer_timeout_s + _CLOSE_GRACE_S
        for thread in (t for threads, _jobs in workers for t in threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                # Releasing the engine under a running batch would free memory it still
                # uses; leak it instead (the thread is a daemon).
                logger.warning(
                    "transfer worker of %s did not stop; engine left running", self._session_id
                )
                return False
        return True

    def enqueue(self, job: Job | PagesJob) -> TransferHandle:
        with self._lock:
            # IMPORTANT: check `_closed` and enqueue under one lock, so close() never leaves
            # a job behind its stop marker.
            if self._closed:
                raise TransferError(f"transport {self._session_id} is closed")
            worker = self._workers.get(job.peer)
            if worker is None:
                jobs: queue.SimpleQueue[Job | PagesJob | None] = queue.SimpleQueue()
                threads = [
                    threading.Thread(
                        target=self._run_worker,
                        args=(jobs,),
                        name=f"kv-migration-transfer-{job.peer}-{i}",
                        daemon=True,
                    )
                    for i in range(self.per_peer)
                ]
                worker = self._workers[job.peer] = (threads, jobs)
                for thread in threads:
                    thread.start()
            worker[1].put(job)
        return TransferHandle(job.future)

    def _run_worker(self, jobs: queue.SimpleQueue) -> None:
        _single_threaded_torch()
        self.sender.start_worker()
        while True:
            job = jobs.get()
            if job is None:
                return
            if self._closed:
                job.future.set_exception(
                    TransferError(
                        f"transport {self._session_id} closed before the write to "
                        f"{job.peer} started"
                    )
                )
                continue
            try:
                if isinstance(job, Job):
                    stats = self._run_job(job)
                else:
                    stats = self._run_pages(job)
            except MigrationError as exc:  # TransferError, or BAD_REQUEST from planning
                with self._lock:
                    self._reachable.discard(job.peer)  # probe again before the next write
                job.future.set_exception(exc)
            except Exception as exc:  # a bug: report it on the handle, don't kill the worker
                logger.exception("transfer worker failed on a write to %s", job.peer)
                error = TransferError(f"unexpected error writing to {job.peer}: {exc!r}")
                error.__cause__ = exc
                job.future.set_exception(error)
            else:
                job.future.set_result(stats)

    def _run_job(self, job: Job) -> TransferStats:
        start = time.monotonic()
        self._ensure_reachable(job.peer, start + self._config.transfer_timeout_s)
        ctx = Context(job.peer, job.total_bytes, len(job.lengths))
        entries = Entries(job.srcs, job.dsts, job.lengths)
        batches = self.sender.send(ctx, entries, start + self._config.transfer_timeout_s)
        return TransferStats(
            entries=len(job.lengths),
            bytes=job.total_bytes,
            seconds=time.monotonic() - start,
            batches=batches,
        )

    def _run_pages(self, job: PagesJob) -> TransferStats:
        start = time.monotonic()
        if job.start_by is not None and start > job.start_by:
            # Queued behind other writes to this peer past the grant's deadline: the
            # target may already have freed these slots.
            message = (
                f"refused write to peer {job.peer}: the grant's start deadline passed "
                f"{start - job.start_by:.2f} s before the write could start; nothing was sent"
            )
            raise logged(MigrationError(ErrorKind.FORBIDDEN, message))
        deadline = start + self._config.transfer_timeout_s
        if job.write_until is not None:
            deadline = min(deadline, job.write_until)
        self._ensure_reachable(job.peer, deadline)
        probed = time.monotonic()
        staged = job.dst_staging
        try:
            plan = staging.plan_pages(
                job.src,
                job.src_indices,
                job.dst,
                job.dst_indices,
                chunk_bytes=self._config.staging_chunk_bytes,
                dst_staging_addr=None if staged is None else staged.addr,
                dst_staging_length=0 if staged is None else staged.length,
            )
        except ValueError as exc:
            message = f"refused write to peer {job.peer}: {exc}; nothing was sent"
            raise logged(MigrationError(ErrorKind.BAD_REQUEST, message)) from None
        self._check_pool_regions(job, plan)
        planned = time.monotonic()
        ctx = Context(job.peer, plan.total_bytes, plan.entries)
        if plan.kind == "direct":
            assert plan.srcs is not None and plan.dsts is not None and plan.lengths is not None
            batches = self.sender.send(ctx, Entries(plan.srcs, plan.dsts, plan.lengths), deadline)
        else:
            marker = None
            if plan.kind == "staged" and staged is not None:
                # Room past the data for the progress marker (the target reserves it).
                if staged.length - plan.total_bytes >= 8:
                    marker = staged.addr + staged.length - 8
            batches = self.sender.send_chunks(ctx, job.src, plan, deadline, marker)
        end = time.monotonic()
        steps = {
            "queued": start - job.enqueued,
            "probe": probed - start,
            "plan": planned - probed,
            "wire": end - planned,
        }
        if ctx.batch_seconds:
            steps["first_batch"] = ctx.batch_seconds[0]
            steps["max_batch"] = max(ctx.batch_seconds)
        return TransferStats(
            entries=plan.entries,
            bytes=plan.total_bytes,
            seconds=end - start,
            batches=batches,
            plan=plan.kind,
            steps=steps,
        )

    def _ensure_reachable(self, peer: str, deadline: float) -> None:
        """Before the first write to a peer (and after a failed one), wait until the peer
        answers a handshake probe, at most until `deadline`; raise `TransferError` if not.

        IMPORTANT: Mooncake's Python binding (0.3.13) opens a peer's segment — the first
        handshake, a network round trip — while holding one engine-wide mutex that every
        write to every peer takes. A peer that accepts the connection but never answers
        (a stopped process) would stall all writes of this process for the handshake
        socket timeout (~60 s). `send_probe` takes no such lock and releases the GIL: it
        runs on a helper thread, so a peer that does not answer holds up only its own
        worker, and its write fails at its deadline with nothing sent. A peer that stops
        between the probe and the handshake a moment later can still stall everyone.
        """
        with self._lock:
            if peer in self._reachable:
                return
            probe = self._probes.get(peer)
            if probe is None or (probe.done() and probe.result() != 0):
                probe = self._probes[peer] = Future()
                threading.Thread(
                    target=self._probe,
                    args=(peer, probe),
                    name=f"kv-migration-probe-{peer}",
                    daemon=True,
                ).start()
        # A probe sends no KV: waiting for it a little past the deadline writes nothing
        # late (the batches check the deadline themselves).
        wait = max(_PROBE_MIN_WAIT_S, deadline - time.monotonic())
        try:
            code = probe.result(timeout=wait)
        except TimeoutError:
            message = (
                f"peer {peer} did not answer the transfer engine's handshake probe within "
                f"{wait:.1f} s (the write's deadline); nothing was sent"
            )
            raise logged(TransferError(message)) from None
        if code != 0:
            message = (
                f"peer {peer} failed the transfer engine's handshake probe (send_probe "
                f"returned {code}); nothing was sent"
            )
            raise logged(TransferError(message))
        with self._lock:
            self._reachable.add(peer)

    def _probe(self, peer: str, result: Future[int]) -> None:
        try:
            result.set_result(self._engine.probe(peer))
        except Exception as exc:  # a binding error: the write reports it
            logger.warning("handshake probe of %s failed: %r", peer, exc)
            result.set_result(-1)

    def _check_pool_regions(self, job: PagesJob, plan: staging.PagePlan) -> None:
        """Whole buffers inside registered / published regions: then every entry is."""
        local = self._registrations.index
        problem = None
        for i, buf in enumerate(job.src.buffers):
            if not local.covers(buf.ptr, buf.length):
                problem = f"source buffer {i} is outside the locally registered regions"
        if plan.kind != "staged":
            for i, buf in enumerate(job.dst.buffers):
                if not job.remote.covers(buf.ptr, buf.length):
                    problem = f"target buffer {i} is outside the peer's published regions"
        if problem is not None:
            message = f"refused write to peer {job.peer}: {problem}; nothing was sent"
            raise logged(TransferError(message))

    # -- private: moving entries --------------------------------------------


def _single_threaded_torch() -> None:
    """Run this thread's torch copies (gather, planning) on this thread alone.

    With OpenMP (torch's CPU backend) the thread count is per calling thread, so the
    scheduler's threads keep theirs. Copies are memory-bound: one thread moves 4-7 GB/s,
    and on a busy machine an OpenMP team waiting for a descheduled member made the same
    copy ten times slower.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
