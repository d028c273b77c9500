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
  batch when that entry finishes. So the worker thread waits with `get_batch_transfer_status`.
- A write to a peer address the peer did not register is refused by the peer (-1); no
  memory is touched. Over TCP the local source need not be registered, over RDMA it must;
  we require it for both.
"""

from __future__ import annotations

import abc
import bisect
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sglang_kv_migration.errors import ErrorKind, MigrationError

# One copy: `length` bytes from local `src_addr` to peer `dst_addr`. Planned by the
# layout module (pure math), sent here: one type for both.
from sglang_kv_migration.layout import Write as WriteOp

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

logger = logging.getLogger(__name__)

# The TCP transport queues at most this many entries per peer by default
# (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); an oversized batch fails and keeps the queue busy.
TCP_MAX_QUEUED_ENTRIES = 1024
# Pause before the single retry of a failed batch, so a queue that is still draining (or the
# upstream "first TCP transfer after ~5 s idle fails with queue-full" issue, #4209) clears.
_RETRY_DELAY_S = 0.05
# How long close() waits for the worker beyond the configured transfer timeout.
_CLOSE_GRACE_S = 5.0


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
    protocol: "tcp" sets MC_FORCE_TCP=1 in this process's environment; "rdma" clears it.
    rdma_devices: comma-separated HCA names for "rdma"; empty lets Mooncake use every HCA it
        finds (its auto-detection), which is right on most single-NIC-per-GPU hosts.
    max_entries_per_batch: entries per engine batch; keep it at most 1024 for TCP.
    transfer_timeout_s: deadline for one `write()` job, checked between batches; a batch in
        flight is bounded by the engine's own timeout (see the module docstring).
    """

    hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    max_entries_per_batch: int = TCP_MAX_QUEUED_ENTRIES
    transfer_timeout_s: float = 30.0

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
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")


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
    """What one completed `write()` moved; `seconds` is time on the wire, not in the queue."""

    entries: int
    bytes: int
    seconds: float
    batches: int


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
        `TransferError`. Writes run one at a time in call order. The source bytes must stay
        unchanged until the handle is done. Ops of one call run concurrently, so their
        destinations must not overlap.
        """

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

    One daemon worker thread (started by the first `write`) runs the jobs in order: it
    splits a job into batches of at most `max_entries_per_batch` entries, submits each with
    `batch_transfer_async_write` and waits for it before the next, so the TCP per-peer queue
    never holds more than one batch. A failed batch is retried once.
    """

    def __init__(self, config: TransportConfig):
        self._config = config
        self._engine: TransferEngine | None = _start_engine(config)
        self._session_id = f"{config.hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()  # guards the fields below
        self._local = _RegionIndex(())
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
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
            logger.warning(message)
            raise TransferError(message)
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
        with self._lock:
            # IMPORTANT: check `_closed` and enqueue under one lock, so close() never leaves
            # a job behind its stop marker.
            if self._closed:
                raise TransferError(f"transport {self._session_id} is closed")
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run_worker, name="kv-migration-transfer", daemon=True
                )
                self._worker.start()
            self._jobs.put(job)
        return TransferHandle(job.future)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            if worker is not None:
                self._jobs.put(None)
        if worker is not None:
            worker.join(self._config.transfer_timeout_s + _CLOSE_GRACE_S)
            if worker.is_alive():
                # Releasing the engine under a running batch would free memory it still
                # uses; leak it instead (the thread is a daemon).
                logger.warning(
                    "transfer worker of %s did not stop; engine left running", self._session_id
                )
                return
        self._engine = None  # the binding's destructor closes segments and stops the engine

    # -- private ------------------------------------------------------------

    def _live_engine(self) -> TransferEngine:
        engine = self._engine
        if self._closed or engine is None:
            raise TransferError(f"transport {self._session_id} is closed")
        return engine

    def _run_worker(self) -> None:
        while True:
            job = self._jobs.get()
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
                stats = self._run_job(job)
            except TransferError as exc:
                job.future.set_exception(exc)
            except Exception as exc:  # a bug: report it on the handle, don't kill the worker
                logger.exception("transfer worker failed on a write to %s", job.peer)
                error = TransferError(f"unexpected error writing to {job.peer}: {exc!r}")
                error.__cause__ = exc
                job.future.set_exception(error)
            else:
                job.future.set_result(stats)

    def _run_job(self, job: _Job) -> TransferStats:
        size = self._config.max_entries_per_batch
        starts = range(0, len(job.lengths), size)
        start_time = time.monotonic()
        deadline = start_time + self._config.transfer_timeout_s
        for number, lo in enumerate(starts, 1):
            hi = lo + size
            label = f"batch {number}/{len(starts)}"
            if time.monotonic() > deadline:
                timeout = self._config.transfer_timeout_s
                raise self._failure(job, label, f"the {timeout} s deadline passed", lo, hi)
            self._write_batch(job, label, lo, hi, deadline)
        return TransferStats(
            entries=len(job.lengths),
            bytes=job.total_bytes,
            seconds=time.monotonic() - start_time,
            batches=len(starts),
        )

    def _write_batch(self, job: _Job, label: str, lo: int, hi: int, deadline: float) -> None:
        engine = self._engine
        assert engine is not None  # close() keeps it until the worker has stopped
        srcs, dsts, lengths = job.srcs[lo:hi], job.dsts[lo:hi], job.lengths[lo:hi]
        for attempt in (1, 2):
            batch_id = engine.batch_transfer_async_write(job.peer, srcs, dsts, lengths)
            if batch_id in _FAILED_BATCH_IDS:
                api, code = "batch_transfer_async_write", batch_id
            else:
                # Blocks this worker thread only; the binding releases the GIL.
                api, code = (
                    "get_batch_transfer_status",
                    engine.get_batch_transfer_status([batch_id]),
                )
                if code == 0:
                    return
            if attempt == 2 or time.monotonic() > deadline or self._closed:
                raise self._failure(job, label, f"{api} returned {code}", lo, hi)
            logger.warning(
                "write to %s, %s (%d bytes): %s returned %s; retrying once",
                job.peer,
                label,
                sum(lengths),
                api,
                code,
            )
            time.sleep(_RETRY_DELAY_S)

    def _failure(self, job: _Job, label: str, reason: str, lo: int, hi: int) -> TransferError:
        batch = job.lengths[lo:hi]
        message = (
            f"write of {job.total_bytes} bytes ({len(job.lengths)} entries) to peer {job.peer} "
            f"failed at {label} ({sum(batch)} bytes, {len(batch)} entries): {reason}"
        )
        logger.warning(message)
        return TransferError(message)


# ---------------------------------------------------------------------------
# Private helpers
# ---------------------------------------------------------------------------

# 0 is the documented failure id; the upstream source also returns -1 (seen as 2**64 - 1
# through the unsigned id type) when the handshake with the peer fails.
_FAILED_BATCH_IDS = frozenset({0, 2**64 - 1})


def _start_engine(config: TransportConfig) -> TransferEngine:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(
            "mooncake is not installed: install sglang-kv-migration[gpu] (or [cpu])"
        ) from exc
    # The engine ignores its protocol argument and picks RDMA whenever an HCA is visible,
    # unless MC_FORCE_TCP is set; it reads the variable while initializing.
    if config.protocol == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
    engine = TransferEngine()
    rc = engine.initialize(config.hostname, "P2PHANDSHAKE", config.protocol, config.rdma_devices)
    if rc != 0:
        message = (
            f"starting the transfer engine on {config.hostname} over {config.protocol} "
            f"(devices {config.rdma_devices or 'auto'}) failed: initialize returned {rc}"
        )
        logger.warning(message)
        raise TransferError(message)
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
