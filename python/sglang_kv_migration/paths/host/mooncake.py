"""The data path: write KV bytes into a peer's host memory with the Mooncake Transfer Engine.

This is the only module of the package that imports `mooncake`, and it does so lazily inside
`MooncakeTransport`, so the rest of the package imports on machines without it. Every
integer return code of the engine is turned into a `TransferError` here, once, with the peer,
the byte count and the code in the message.

Reading order: `TransportConfig` and the value types, `KVTransport` (the interface the
scheduler side uses), `MooncakeTransport` (the implementation), then the private helpers.

Facts about mooncake-transfer-engine 0.3.13.post1 this module relies on (checked with two
processes over TCP on 127.0.0.1):
- `initialize(hostname, "P2PHANDSHAKE", protocol, devices)` returns 0 on success; the engine
  picks its own RPC port (`get_rpc_port()`), and ignores `protocol`: it uses RDMA whenever
  an HCA is visible unless `MC_FORCE_TCP` is set.
- `batch_register_memory` returns 0, or a negative code (-7 for an overlapping region).
- `batch_transfer_async_write` returns a batch id; 0 means it failed to submit (e.g. no
  listener at the peer address). Ids are unsigned pointers, so a negative test never fires.
- `get_batch_transfer_status([id])` waits (spinning, GIL released) until the batch completes
  (0) or one entry fails or the engine's own timeout, `MC_TRANSFER_TIMEOUT` (default 30 s)
  plus 1 ns per byte, passes (-1). It frees the batch id in both cases.
- `transfer_check_status(id)` is NOT usable for batches: it looks at the first entry only
  (it reported a 9-entry 32 MiB batch done after 5 ms; the batch took 100 ms) and frees the
  batch when that entry finishes. For a one-entry batch (`transfer_submit_write`) it is
  exact and never blocks: 1 done, 0 running, -1 failed (both free the id), -2 timed out.
- So the worker waits without spinning a core: a write of at most `_SINGLES_MAX` entries is
  submitted as one-entry batches and polled with `transfer_check_status` between short
  sleeps; a larger batch sleeps for most of the time its previous batch took, and only then
  calls the spinning `get_batch_transfer_status`.
- Over TCP one entry is in flight per lane (`MC_TCP_LANES_PER_PEER`, default 4, per peer)
  and the rest queue in the engine; -2 from `transfer_check_status` means the engine timed
  the entry out while still holding it (it may yet be sent, even from the queue on a new
  stream). So over TCP every entry goes out as a one-entry batch, at most the peer's lanes
  of them in the engine at once, each keeping its lane until the engine reports it final
  (`lanes.py`); `get_batch_transfer_status`, which frees a batch it timed out, is not used.
- The cost per entry is fixed (~20 us over TCP on a 2-core box), so `write_pages` plans at
  page granularity in the worker and gathers scattered pages into reused staging chunks
  (`staging.py`), keeping the entry count independent of how fragmented the pools are.
- A write to a peer address the peer did not register is refused by the peer (-1); no
  memory is touched. Over TCP the local source need not be registered, over RDMA it must;
  we require it for both.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.host import lanes, staging, tcp_streams

# One copy: `length` bytes from local `src_addr` to peer `dst_addr`. Planned by the
# layout module (pure math), sent here: one type for both.
from sglang_kv_migration.paths.host.layout import HostPoolLayout, plan_writes
from sglang_kv_migration.paths.host.layout import Write as WriteOp

if TYPE_CHECKING:
    import torch
    from mooncake.engine import TransferEngine

logger = logging.getLogger(__name__)
_E = TypeVar("_E", bound=MigrationError)

# The engine's own batch timeout: read from this variable, in seconds, else the default.
# A batch submitted just before a grant's `write_until` may run this long (see
# `server_args.check_mooncake_timeout`).
MC_TRANSFER_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
MC_DEFAULT_TRANSFER_TIMEOUT_S = 30.0

# The TCP transport queues at most this many entries per peer by default
# (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); an oversized batch fails and keeps the queue busy.
TCP_MAX_QUEUED_ENTRIES = 1024
# Pause before the single retry of a failed batch, so a queue that is still draining (or the
# upstream "first TCP transfer after ~5 s idle fails with queue-full" issue, #4209) clears.
_RETRY_DELAY_S = 0.05
# How long close() waits for the worker beyond the configured transfer timeout.
_CLOSE_GRACE_S = 5.0
# Least time a write waits for a new peer to answer the handshake probe (~1 ms when up).
_PROBE_MIN_WAIT_S = 0.5
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
# Default bytes per staging chunk (two chunks are kept per transport, reused), and the
# largest entry a chunk leaves as.
DEFAULT_STAGING_CHUNK_BYTES = 16 << 20
DEFAULT_STAGING_ENTRY_BYTES = 0  # measured no gain on the 2-core box; see docs
# Jobs to one peer in flight at once (with one worker, concurrent moves to one target
# queue behind each other).
DEFAULT_WORKERS_PER_PEER = 2


class TransferError(MigrationError):
    """The transport could not move bytes to (or set itself up for) a peer."""

    def __init__(self, message: str):
        super().__init__(ErrorKind.TRANSFER_FAILED, message)

    def __reduce__(self):
        return (TransferError, (self.message,))


# ---------------------------------------------------------------------------
# Configuration and value types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportConfig:
    """How this process's transfer engine starts.

    hostname: the address peers use to reach this process, without a port (the engine
        binds its own RPC port; `session_id` carries it).
    protocol: "tcp" sets MC_FORCE_TCP=1 while the engine initializes; "rdma" clears it
        then (the process's environment is restored afterwards).
    rdma_devices: comma-separated HCA names for "rdma"; empty lets Mooncake use every HCA it
        finds (its auto-detection), which is right on most single-NIC-per-GPU hosts.
    max_entries_per_batch: entries per engine batch; keep it at most 1024 for TCP.
    transfer_timeout_s: deadline for one `write()` job, checked between batches; a batch in
        flight is bounded by the engine's own timeout (see the module docstring).
    staging_chunk_bytes: size of each of the two registered staging chunks `write_pages`
        gathers scattered pages into; 0 never gathers (every page run is its own entry).
    staging_entry_bytes: a chunk leaves as entries of at most this size, which the engine
        moves concurrently (over TCP one entry is one stream); 0 sends whole runs.
    workers_per_peer: worker threads per peer, each running one job at a time: several
        migrations to one target move side by side instead of queueing. The per-peer
        entry budget (`max_entries_per_batch`) is split between them (so there are at
        most that many).
    """

    hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    max_entries_per_batch: int = TCP_MAX_QUEUED_ENTRIES
    transfer_timeout_s: float = 30.0
    staging_chunk_bytes: int = DEFAULT_STAGING_CHUNK_BYTES
    staging_entry_bytes: int = DEFAULT_STAGING_ENTRY_BYTES
    workers_per_peer: int = DEFAULT_WORKERS_PER_PEER

    def __post_init__(self) -> None:
        if not self.hostname or ":" in self.hostname:
            raise ValueError(
                f"hostname must be a bare host or IPv4 address without a port, got "
                f"{self.hostname!r} (the engine picks its RPC port itself)"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("rdma_devices is only used with protocol='rdma'")
        if self.max_entries_per_batch < 1:
            raise ValueError(
                f"max_entries_per_batch must be >= 1, got {self.max_entries_per_batch}"
            )
        if self.protocol == "tcp" and self.max_entries_per_batch > TCP_MAX_QUEUED_ENTRIES:
            raise ValueError(
                f"max_entries_per_batch must be <= {TCP_MAX_QUEUED_ENTRIES} over TCP (the "
                f"engine's per-peer queue), got {self.max_entries_per_batch}"
            )
        if self.workers_per_peer < 1:
            raise ValueError(f"workers_per_peer must be >= 1, got {self.workers_per_peer}")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.staging_chunk_bytes < 0 or self.staging_entry_bytes < 0:
            raise ValueError(
                f"staging_chunk_bytes and staging_entry_bytes must be >= 0, got "
                f"{self.staging_chunk_bytes} and {self.staging_entry_bytes}"
            )


@dataclass(frozen=True)
class MemoryRegion:
    """A registered buffer: absolute virtual address and length in its owner's process."""

    addr: int
    length: int

    def __post_init__(self) -> None:
        if self.addr <= 0 or self.length <= 0:
            raise ValueError(f"region needs addr > 0 and length > 0, got {self!r}")

    @property
    def end(self) -> int:
        return self.addr + self.length


@dataclass(frozen=True)
class TransferStats:
    """What one completed write moved; `seconds` is time on the wire, not in the queue.

    `plan` says how `write_pages` shaped it (see `staging.py`); `write` is always "direct".
    """

    entries: int
    bytes: int
    seconds: float
    batches: int
    plan: str = "direct"
    # Where a `write_pages` call's time went, seconds: "queued" (behind earlier writes to
    # the same peer), "probe" (first contact), "plan", "wire" (all batches or chunks),
    # "first_batch" and "max_batch" (direct plans). For logs and benchmarks only.
    steps: dict[str, float] = field(default_factory=dict)


class TransferHandle:
    """The pending result of one `KVTransport.write` call."""

    def __init__(self, future: Future[TransferStats]):
        self._future = future

    def done(self) -> bool:
        """True once the write finished, successfully or not. Never blocks."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> TransferStats:
        """Wait up to `timeout` seconds (None: until done) for the write.

        Raises `TransferError` if the write failed, and the builtin `TimeoutError` if it is
        still running after `timeout` (it keeps running; call again or poll `done()`).
        """
        return self._future.result(timeout)


# ---------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------


class KVTransport(abc.ABC):
    """Moves bytes from this process's registered buffers into a peer's published buffers.

    One instance per process (per TP/PP rank). Methods may be called from any thread.
    """

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """The id peers pass as `peer_session_id` to write into this process."""

    @abc.abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register local buffers as sources and as destinations peers may write into.

        Called once at startup with the host KV pool's buffers, before the first `write`.
        The caller keeps the memory alive until `close()`. Raises `TransferError`.
        """

    @abc.abstractmethod
    def write(
        self,
        peer_session_id: str,
        ops: Sequence[WriteOp],
        peer_regions: Sequence[MemoryRegion],
    ) -> TransferHandle:
        """Start copying every op's local source into the peer's memory.

        `peer_regions` are the buffers the peer published; every destination range must lie
        inside one of them and every source range inside a registered local region, or this
        raises `TransferError` before any byte moves. Otherwise it returns at once: the
        bytes move on a background thread, and the handle reports completion or a
        `TransferError`. Writes to one peer may run side by side and finish in any order
        (`TransportConfig.workers_per_peer`; one worker: one at a time, in call order), so
        concurrent writes must not target the same bytes. The source bytes must stay
        unchanged until the handle is done. Ops of one call run concurrently, so their
        destinations must not overlap.
        """

    def write_pages(
        self,
        peer_session_id: str,
        src_layout: HostPoolLayout,
        src_indices: Any,
        dst_layout: HostPoolLayout,
        dst_indices: Any,
        peer_regions: Sequence[MemoryRegion],
        *,
        dst_staging: MemoryRegion | None = None,
        start_by: float | None = None,
        write_until: float | None = None,
    ) -> TransferHandle:
        """Start copying local slot ``src_indices[i]`` to the peer's ``dst_indices[i]``.

        Returns at once, without work proportional to the number of pages on the calling
        thread: planning, checking and moving bytes happen in the transport's worker.
        Checks that need no pass over the indices raise ValueError here (as
        `layout.plan_writes` would); a bad index fails the handle with a `MigrationError`
        of kind BAD_REQUEST before any byte moves. With ``dst_staging`` (a region inside
        ``peer_regions`` that the target granted) every page goes into that region in the
        format of `staging.py`, and the target must `staging.scatter_from_staging` it
        before it commits. The indices (a list or an int64 tensor) and the source pages
        must stay unchanged until the handle is done. ``start_by`` and ``write_until``
        (`time.monotonic()` values, from the target's grant) bound the job: it fails with
        nothing sent if it would start after ``start_by``, and submits no batch after
        ``write_until`` (nor after its own transfer timeout).

        The default plans with `layout.plan_writes` on the calling thread and calls
        `write` (enough for test doubles); `MooncakeTransport` overrides it.
        """
        if dst_staging is not None:
            raise TransferError(f"{type(self).__name__} cannot write into a staging region")
        ops = plan_writes(src_layout, src_indices, dst_layout, dst_indices)
        return self.write(peer_session_id, ops, peer_regions)

    @abc.abstractmethod
    def close(self) -> None:
        """Fail the writes not yet started, wait for the one in flight, release the engine.

        Idempotent. After it, `register` and `write` raise `TransferError`.
        """

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_transport(config: TransportConfig) -> KVTransport:
    """Start the transport `config` describes (today always Mooncake)."""
    return MooncakeTransport(config)


def coalesce(ops: Iterable[WriteOp]) -> list[WriteOp]:
    """Merge ops that continue each other in both source and destination.

    The result is ordered by source address; entries of one batch run concurrently, so the
    order carries no meaning.
    """
    merged: list[WriteOp] = []
    for op in sorted(ops, key=lambda o: (o.src_addr, o.dst_addr)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src_addr + last.length == op.src_addr
            and last.dst_addr + last.length == op.dst_addr
        ):
            merged[-1] = WriteOp(last.src_addr, last.dst_addr, last.length + op.length)
        else:
            merged.append(op)
    return merged


# ---------------------------------------------------------------------------
# Mooncake implementation
# ---------------------------------------------------------------------------


class MooncakeTransport(KVTransport):
    """`KVTransport` over the Mooncake Transfer Engine in P2P-handshake mode (no etcd).

    `workers_per_peer` daemon worker threads per peer (started by the first write to it)
    take that peer's jobs from one queue, each running one job at a time, so several
    writes to one peer progress together and a stalled peer holds up only its own jobs,
    never writes to other peers. Jobs to one peer may finish out of call order. A job's
    entries go out in batches of at most `max_entries_per_batch / workers_per_peer`, one
    batch in flight per worker; over TCP the entries of every worker to one peer share its
    lanes (`lanes.py`), so the engine never queues one. A failed batch or entry is
    retried once (a timed-out TCP entry is not: the engine may still send it).
    `write_pages` jobs are planned in the worker (`staging.plan_pages`); gathered and staged
    plans alternate between two registered staging chunks, gathering the next chunk while
    the previous one is on the wire. No wait spins a core for long (module docstring).
    """

    def __init__(self, config: TransportConfig):
        self._config = config
        listening = tcp_streams.listening_ports()
        self._engine: TransferEngine | None = _start_engine(config)
        rpc_port = self._engine.get_rpc_port()
        self._session_id = f"{config.hostname}:{rpc_port}"
        # The engine's TCP data listener: the ports it opened besides its RPC port.
        data_ports = tcp_streams.listening_ports() - listening - {rpc_port}
        self.inbound = tcp_streams.InboundStreams(
            data_ports if config.protocol == "tcp" else frozenset()
        )
        self._workers_per_peer = min(config.workers_per_peer, config.max_entries_per_batch)
        # Over TCP: no more entries in the engine per peer than it has lanes (`lanes.py`).
        self._budget = (
            lanes.LaneBudget(lanes.tcp_lanes_per_peer()) if config.protocol == "tcp" else None
        )
        self._reaper = lanes.Reaper(self._budget or lanes.LaneBudget(1), self._status_check)
        self._lock = threading.Lock()  # guards the fields below
        self._local = _RegionIndex(())
        # peer session id -> (its worker threads, their job queue)
        self._workers: dict[str, tuple[list[threading.Thread], queue.SimpleQueue]] = {}
        self._closed = False
        # Per worker thread: its two staging chunks and the timing of its last large batch.
        self._tls = threading.local()
        self._all_staging: list[torch.Tensor] = []  # every worker's, freed on close
        # Peers that answered a handshake probe since their last failed write, and the
        # probe in flight per peer (see `_ensure_reachable`).
        self._reachable: set[str] = set()
        self._probes: dict[str, Future[int]] = {}
        logger.info("transfer engine up: session %s over %s", self._session_id, config.protocol)

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        engine = self._live_engine()
        if not regions:
            return
        rc = engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            total = sum(r.length for r in regions)
            message = (
                f"registering {len(regions)} regions ({total} bytes) on {self._session_id} "
                f"failed: batch_register_memory returned {rc}"
            )
            raise _logged(TransferError(message))
        with self._lock:
            self._local = _RegionIndex((*self._local.regions, *regions))

    def write(
        self,
        peer_session_id: str,
        ops: Sequence[WriteOp],
        peer_regions: Sequence[MemoryRegion],
    ) -> TransferHandle:
        self._live_engine()
        with self._lock:
            local = self._local
        job = _Job.build(peer_session_id, ops, local, _RegionIndex(peer_regions))
        if not job.lengths:
            done: Future[TransferStats] = Future()
            done.set_result(TransferStats(entries=0, bytes=0, seconds=0.0, batches=0))
            return TransferHandle(done)
        return self._enqueue(job)

    def write_pages(
        self,
        peer_session_id: str,
        src_layout: HostPoolLayout,
        src_indices: Any,
        dst_layout: HostPoolLayout,
        dst_indices: Any,
        peer_regions: Sequence[MemoryRegion],
        *,
        dst_staging: MemoryRegion | None = None,
        start_by: float | None = None,
        write_until: float | None = None,
    ) -> TransferHandle:
        self._live_engine()
        if not peer_session_id:
            raise TransferError("peer_session_id is empty")
        staging.check_page_args(src_layout, src_indices, dst_layout, dst_indices)
        remote = _RegionIndex(peer_regions)
        if dst_staging is not None and not remote.covers(dst_staging.addr, dst_staging.length):
            raise TransferError(
                f"refused write to peer {peer_session_id}: staging region {dst_staging} is "
                f"outside the peer's published regions; nothing was sent"
            )
        job = _PagesJob(
            peer=peer_session_id,
            src=src_layout,
            src_indices=src_indices,
            dst=dst_layout,
            dst_indices=dst_indices,
            remote=remote,
            dst_staging=dst_staging,
            future=Future(),
            start_by=start_by,
            write_until=write_until,
        )
        return self._enqueue(job)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
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
                return
        self._engine = None  # the binding's destructor closes segments and stops the engine
        self._all_staging.clear()  # after the engine: they were registered there

    def _status_check(self) -> Callable[[int], int] | None:
        engine = self._engine
        return None if engine is None else engine.transfer_check_status

    # -- private: jobs ------------------------------------------------------

    def _live_engine(self) -> TransferEngine:
        engine = self._engine
        if self._closed or engine is None:
            raise TransferError(f"transport {self._session_id} is closed")
        return engine

    def _enqueue(self, job: _Job | _PagesJob) -> TransferHandle:
        with self._lock:
            # IMPORTANT: check `_closed` and enqueue under one lock, so close() never leaves
            # a job behind its stop marker.
            if self._closed:
                raise TransferError(f"transport {self._session_id} is closed")
            worker = self._workers.get(job.peer)
            if worker is None:
                jobs: queue.SimpleQueue[_Job | _PagesJob | None] = queue.SimpleQueue()
                threads = [
                    threading.Thread(
                        target=self._run_worker,
                        args=(jobs,),
                        name=f"kv-migration-transfer-{job.peer}-{i}",
                        daemon=True,
                    )
                    for i in range(self._workers_per_peer)
                ]
                worker = self._workers[job.peer] = (threads, jobs)
                for thread in threads:
                    thread.start()
            worker[1].put(job)
        return TransferHandle(job.future)

    def _run_worker(self, jobs: queue.SimpleQueue) -> None:
        _single_threaded_torch()
        self._tls.staging = None
        self._tls.marker = None
        self._tls.last_batch = None
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
                if isinstance(job, _Job):
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

    def _run_job(self, job: _Job) -> TransferStats:
        start = time.monotonic()
        self._ensure_reachable(job.peer, start + self._config.transfer_timeout_s)
        ctx = _Context(job.peer, job.total_bytes, len(job.lengths))
        entries = _Entries(job.srcs, job.dsts, job.lengths)
        batches = self._send(ctx, entries, start + self._config.transfer_timeout_s)
        return TransferStats(
            entries=len(job.lengths),
            bytes=job.total_bytes,
            seconds=time.monotonic() - start,
            batches=batches,
        )

    def _run_pages(self, job: _PagesJob) -> TransferStats:
        start = time.monotonic()
        if job.start_by is not None and start > job.start_by:
            # Queued behind other writes to this peer past the grant's deadline: the
            # target may already have freed these slots.
            message = (
                f"refused write to peer {job.peer}: the grant's start deadline passed "
                f"{start - job.start_by:.2f} s before the write could start; nothing was sent"
            )
            raise _logged(MigrationError(ErrorKind.FORBIDDEN, message))
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
            raise _logged(MigrationError(ErrorKind.BAD_REQUEST, message)) from None
        self._check_pool_regions(job, plan)
        planned = time.monotonic()
        ctx = _Context(job.peer, plan.total_bytes, plan.entries)
        if plan.kind == "direct":
            assert plan.srcs is not None and plan.dsts is not None and plan.lengths is not None
            batches = self._send(ctx, _Entries(plan.srcs, plan.dsts, plan.lengths), deadline)
        else:
            marker = None
            if plan.kind == "staged" and staged is not None:
                # Room past the data for the progress marker (the target reserves it).
                if staged.length - plan.total_bytes >= 8:
                    marker = staged.addr + staged.length - 8
            batches = self._send_chunks(ctx, job.src, plan, deadline, marker)
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
            raise _logged(TransferError(message)) from None
        if code != 0:
            message = (
                f"peer {peer} failed the transfer engine's handshake probe (send_probe "
                f"returned {code}); nothing was sent"
            )
            raise _logged(TransferError(message))
        with self._lock:
            self._reachable.add(peer)

    def _probe(self, peer: str, result: Future[int]) -> None:
        engine = self._engine
        try:
            result.set_result(-1 if engine is None else int(engine.send_probe(peer)))
        except Exception as exc:  # a binding error: the write reports it
            logger.warning("handshake probe of %s failed: %r", peer, exc)
            result.set_result(-1)

    def _check_pool_regions(self, job: _PagesJob, plan: staging.PagePlan) -> None:
        """Whole buffers inside registered / published regions: then every entry is."""
        with self._lock:
            local = self._local
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
            raise _logged(TransferError(message))

    # -- private: moving entries --------------------------------------------

    def _send(self, ctx: _Context, entries: _Entries, deadline: float) -> int:
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
                raise self._failure(ctx, label, f"the {timeout} s deadline passed", lengths)
            began = time.monotonic()
            if len(lengths) <= _SINGLES_MAX or self._budget is not None:
                _Singles(self, ctx, label, srcs, dsts, lengths, deadline).submit().wait()
            else:
                self._write_batch(ctx, label, srcs, dsts, lengths, deadline, previous)
                previous = _BatchTiming(time.monotonic() - began, len(lengths), sum(lengths))
                self._tls.last_batch = previous
            ctx.batch_seconds.append(time.monotonic() - began)
        return len(starts)

    def _send_chunks(
        self,
        ctx: _Context,
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
                    raise self._failure(ctx, label, f"the {timeout} s deadline passed", lengths)
                half = halves[number % 2]
                staging.gather_chunk(src, chunk, half)
                if in_flight is not None:
                    in_flight.wait()
                    in_flight = None
                srcs, dsts, lengths = _split_entries(
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
                    self._send(ctx, _Entries(srcs, dsts, lengths), deadline)
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
            self.register([MemoryRegion(word.data_ptr(), 8)])
            with self._lock:
                self._all_staging.append(word)  # freed after the engine, on close
            self._tls.marker = word
        return word

    def _staging_halves(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two registered staging chunks of at least `capacity` bytes, reused across jobs."""
        import torch

        engine = self._engine
        assert engine is not None
        current = self._tls.staging
        if current is None or current.numel() < 2 * capacity:
            size = max(capacity, self._config.staging_chunk_bytes)
            fresh = torch.zeros(2 * size, dtype=torch.uint8)  # pages faulted in now
            self.register([MemoryRegion(fresh.data_ptr(), fresh.numel())])
            if current is not None:
                # No transfer uses it between jobs (this is the worker thread).
                engine.unregister_memory(current.data_ptr())
                with self._lock:
                    kept = [r for r in self._local.regions if r.addr != current.data_ptr()]
                    self._local = _RegionIndex(kept)
            with self._lock:
                self._all_staging = [t for t in self._all_staging if t is not current]
                self._all_staging.append(fresh)
            self._tls.staging = current = fresh
        half = current.numel() // 2
        return current[:half], current[half:]

    def _write_batch(
        self,
        ctx: _Context,
        label: str,
        srcs: list[int],
        dsts: list[int],
        lengths: list[int],
        deadline: float,
        previous: _BatchTiming | None,
    ) -> None:
        engine = self._engine
        assert engine is not None  # close() keeps it until the worker has stopped
        nbytes = sum(lengths)
        for attempt in (1, 2):
            batch_id = engine.batch_transfer_async_write(ctx.peer, srcs, dsts, lengths)
            if batch_id in _FAILED_BATCH_IDS:
                api, code = "batch_transfer_async_write", _signed(batch_id)
            else:
                if previous is not None:
                    # Sleep through most of the expected time; the spinning wait below
                    # then covers only the tail. Scaling by the smaller of the two ratios
                    # underestimates rather than oversleeps.
                    expected = previous.seconds * min(
                        len(lengths) / previous.entries, nbytes / previous.bytes
                    )
                    time.sleep(max(0.0, min(_SLEEP_SHARE * expected, deadline - time.monotonic())))
                # Blocks this worker thread only; the binding releases the GIL.
                api, code = (
                    "get_batch_transfer_status",
                    engine.get_batch_transfer_status([batch_id]),
                )
                if code == 0:
                    return
            if attempt == 2 or time.monotonic() > deadline or self._closed:
                raise self._failure(ctx, label, f"{api} returned {code}", lengths)
            logger.warning(
                "write to %s, %s (%d bytes): %s returned %s; retrying once",
                ctx.peer,
                label,
                nbytes,
                api,
                code,
            )
            time.sleep(_RETRY_DELAY_S)

    def _failure(
        self, ctx: _Context, label: str, reason: str, lengths: Sequence[int]
    ) -> TransferError:
        message = (
            f"write of {ctx.total_bytes} bytes ({ctx.total_entries} entries) to peer "
            f"{ctx.peer} failed at {label} ({sum(lengths)} bytes, {len(lengths)} entries): "
            f"{reason}"
        )
        return _logged(TransferError(message))


# ---------------------------------------------------------------------------
# Private helpers


def _logged(error: _E) -> _E:
    """Log a refused or failed write (the caller's reply carries the same message) and
    return the error to raise."""
    logger.warning(error.message)
    return error


# ---------------------------------------------------------------------------

# 0 is the documented failure id; the upstream source also returns -1 (seen as 2**64 - 1
# through the unsigned id type) when the handshake with the peer fails.
_FAILED_BATCH_IDS = frozenset({0, 2**64 - 1})


@contextlib.contextmanager
def _force_tcp(tcp: bool) -> Iterator[None]:
    """MC_FORCE_TCP set (tcp) or unset (rdma) while the engine initializes, then as it was.

    The engine ignores its protocol argument and picks RDMA whenever an HCA is visible,
    unless MC_FORCE_TCP is set; it reads the variable only while initializing, so the
    rest of the process (and another engine started later) keeps its own environment."""
    before = os.environ.get("MC_FORCE_TCP")
    if tcp:
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MC_FORCE_TCP", None)
        else:
            os.environ["MC_FORCE_TCP"] = before


def _start_engine(config: TransportConfig) -> TransferEngine:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(
            "mooncake is not installed: install sglang-kv-migration[gpu] (or [cpu])"
        ) from exc
    engine = TransferEngine()
    with _force_tcp(config.protocol == "tcp"):
        rc = engine.initialize(
            config.hostname, "P2PHANDSHAKE", config.protocol, config.rdma_devices
        )
    if rc != 0:
        message = (
            f"starting the transfer engine on {config.hostname} over {config.protocol} "
            f"(devices {config.rdma_devices or 'auto'}) failed: initialize returned {rc}"
        )
        raise _logged(TransferError(message))
    return engine


class _RegionIndex:
    """Answers "is [addr, addr + length) inside one region?" in O(log regions)."""

    def __init__(self, regions: Iterable[MemoryRegion]):
        self.regions: tuple[MemoryRegion, ...] = tuple(sorted(regions, key=lambda r: r.addr))
        self._starts = [r.addr for r in self.regions]
        # Largest end among regions starting at or before index i, so overlaps are handled.
        self._max_ends = list(itertools.accumulate((r.end for r in self.regions), max))

    def covers(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and self._max_ends[i] >= addr + length


@dataclass
class _Job:
    """One `write()` call, checked and flattened into the engine's three lists."""

    peer: str
    srcs: list[int]
    dsts: list[int]
    lengths: list[int]
    total_bytes: int
    future: Future[TransferStats]

    @classmethod
    def build(
        cls, peer: str, ops: Sequence[WriteOp], local: _RegionIndex, remote: _RegionIndex
    ) -> _Job:
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
class _PagesJob:
    """One `write_pages()` call; planned and checked in the worker."""

    peer: str
    src: HostPoolLayout
    src_indices: Any
    dst: HostPoolLayout
    dst_indices: Any
    remote: _RegionIndex
    dst_staging: MemoryRegion | None
    future: Future[TransferStats]
    start_by: float | None = None  # time.monotonic(); see `KVTransport.write_pages`
    write_until: float | None = None
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Context:
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
class _Entries:
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


class _Singles:
    """Entries sent as one-entry batches and polled with `transfer_check_status` between
    short sleeps (exact for one-entry batches, and it never blocks).

    Over TCP (`transport._budget`) an entry enters the engine only with one of the peer's
    lane permits and returns it once the engine reports it final (`lanes.py`); one the
    write gives up on (timed out) is left to the reaper with its permit, and is not
    retried: the engine may still send it.
    """

    def __init__(
        self,
        transport: MooncakeTransport,
        ctx: _Context,
        label: str,
        srcs: list[int],
        dsts: list[int],
        lengths: list[int],
        deadline: float,
    ):
        self._transport = transport
        self._budget = transport._budget
        self._ctx = ctx
        self._label = label
        self._srcs, self._dsts, self._lengths = srcs, dsts, lengths
        self._deadline = deadline
        self._todo: list[int] = []  # entry indices not yet submitted
        self._submitted: list[tuple[int, int]] = []  # (entry index, batch id)
        self._failed: list[int] = []
        self._reason = ""
        self._attempt = 1
        self._gave_up = False  # entries left in the engine: no retry

    def submit(self) -> _Singles:
        self._todo = list(range(len(self._lengths)))
        self._fill()
        return self

    def wait(self) -> None:
        """Wait for every entry; retry the failed ones once; raise `TransferError`."""
        while True:
            self._poll()
            if not self._failed:
                return
            failed_lengths = [self._lengths[i] for i in self._failed]
            transport = self._transport
            if (
                self._attempt == 2
                or self._gave_up
                or time.monotonic() > self._deadline
                or transport._closed
            ):
                raise transport._failure(self._ctx, self._label, self._reason, failed_lengths)
            logger.warning(
                "write to %s, %s (%d bytes in %d entries): %s; retrying once",
                self._ctx.peer,
                self._label,
                sum(failed_lengths),
                len(failed_lengths),
                self._reason,
            )
            time.sleep(_RETRY_DELAY_S)
            self._attempt = 2
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
        if time.monotonic() > self._deadline or self._transport._closed:
            self._fail_todo(f"the deadline passed before {len(self._todo)} entries were sent")
            return
        count = len(self._todo)
        if self._budget is not None:
            count = self._budget.take(self._ctx.peer, count)
        todo, self._todo = self._todo[:count], self._todo[count:]
        engine = self._transport._engine
        assert engine is not None  # close() keeps it until the worker has stopped
        for n, i in enumerate(todo):
            batch_id = engine.transfer_submit_write(
                self._ctx.peer, self._srcs[i], self._dsts[i], self._lengths[i]
            )
            if batch_id in _FAILED_BATCH_IDS:
                if self._budget is not None:
                    self._budget.give_back(self._ctx.peer, len(todo) - n)
                self._failed.extend(todo[n:])
                self._reason = f"transfer_submit_write returned {_signed(batch_id)}"
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
        transport = self._transport
        give_up = max(self._deadline, time.monotonic()) + transport._config.transfer_timeout_s
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
        engine = self._transport._engine
        assert engine is not None
        pending: list[tuple[int, int]] = []
        timed_out = False
        for index, batch_id in self._submitted:
            code = engine.transfer_check_status(batch_id)
            if code == 0 or (code == -2 and self._budget is not None):
                # Over TCP a timed-out entry is still in the engine: it keeps its lane.
                timed_out = timed_out or code == -2
                pending.append((index, batch_id))
                continue
            if code == -2:
                # Timed out and not freed: the batch wait frees it, bounded by the
                # engine's own timeout; 0 there means it did complete.
                code = 1 if engine.get_batch_transfer_status([batch_id]) == 0 else -2
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
        engine = self._transport._engine
        assert engine is not None
        if self._budget is not None:
            self._transport._reaper.adopt(self._ctx.peer, [b for _i, b in entries])
            self._failed.extend(i for i, _b in entries)
            self._reason = reason
            self._fail_todo(reason)
            self._gave_up = True
        else:
            for index, batch_id in entries:
                if engine.get_batch_transfer_status([batch_id]) != 0:
                    self._failed.append(index)
                    self._reason = reason
        self._submitted = []


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


def _split_entries(
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


def _signed(batch_id: int) -> int:
    """Batch ids are unsigned; show the binding's -1 as -1."""
    return batch_id - 2**64 if batch_id >= 2**63 else batch_id


def _as_list(values: list[int] | torch.Tensor) -> list[int]:
    """A `write()` job's list slice as is, or a planned tensor slice converted."""
    if isinstance(values, list):
        return values
    return values.tolist()
