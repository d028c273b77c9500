"""The host path's transport interface: what moves KV bytes from this process's registered
host buffers into a peer's published ones, and the value types it speaks.

`KVTransport` is what the host path (`path.py`), the target's staging arena
(`target_staging.py`) and tests use; `mooncake.MooncakeTransport` implements it over the
Mooncake Transfer Engine (`mooncake_engine.py` is the only module that imports
`mooncake`). Nothing here needs `mooncake` or `torch`, so the server reads the config and
its defaults on machines without either.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sglang_kv_migration.errors import ErrorKind, MigrationError

# One copy: `length` bytes from local `src_addr` to peer `dst_addr`. Planned by the
# layout module (pure math), sent by the transport: one type for both.
from sglang_kv_migration.paths.host.layout import HostPoolLayout, plan_writes
from sglang_kv_migration.paths.host.layout import Write as WriteOp

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
        flight is bounded by the engine's own timeout (see `mooncake_engine.py`).
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


def logged(error: _E) -> _E:
    """Log a refused or failed write (the caller's reply carries the same message) and
    return the error to raise."""
    logger.warning(error.message)
    return error
