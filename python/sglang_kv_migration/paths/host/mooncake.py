"""The host path's transport over the Mooncake Transfer Engine: `MooncakeTransport`.

Reading order: `transport.py` (the interface, `KVTransport`, and the value types, all
importable from here too), this module (the transport: its engine, registrations and
workers), `mooncake_engine.py` (the engine wrapper, the only importer of `mooncake`:
return codes read once), `mooncake_workers.py` (the per-peer worker threads and the jobs
they run) and `mooncake_batches.py` (how a job's entries leave).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from sglang_kv_migration.paths.host import staging, tcp_streams
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.mooncake_engine import (
    MooncakeEngine,
    RegionIndex,
    Registrations,
)
from sglang_kv_migration.paths.host.mooncake_workers import Job, PagesJob, PeerWorkers
from sglang_kv_migration.paths.host.transport import (
    DEFAULT_STAGING_CHUNK_BYTES,
    DEFAULT_STAGING_ENTRY_BYTES,
    DEFAULT_WORKERS_PER_PEER,
    MC_DEFAULT_TRANSFER_TIMEOUT_S,
    MC_TRANSFER_TIMEOUT_ENV,
    TCP_MAX_QUEUED_ENTRIES,
    KVTransport,
    MemoryRegion,
    TransferError,
    TransferHandle,
    TransferStats,
    TransportConfig,
    WriteOp,
    coalesce,
)

__all__ = [
    "DEFAULT_STAGING_CHUNK_BYTES",
    "DEFAULT_STAGING_ENTRY_BYTES",
    "DEFAULT_WORKERS_PER_PEER",
    "MC_DEFAULT_TRANSFER_TIMEOUT_S",
    "MC_TRANSFER_TIMEOUT_ENV",
    "TCP_MAX_QUEUED_ENTRIES",
    "KVTransport",
    "MemoryRegion",
    "MooncakeTransport",
    "TransferError",
    "TransferHandle",
    "TransferStats",
    "TransportConfig",
    "WriteOp",
    "coalesce",
    "open_transport",
]

logger = logging.getLogger(__name__)


def open_transport(config: TransportConfig) -> KVTransport:
    """Start the transport `config` describes (today always Mooncake)."""
    return MooncakeTransport(config)


class MooncakeTransport(KVTransport):
    """`KVTransport` over the Mooncake Transfer Engine in P2P-handshake mode (no etcd).

    `workers_per_peer` worker threads per peer run its writes (`mooncake_workers.py`),
    several writes to one peer side by side; a job's entries go out in batches of at
    most `max_entries_per_batch / workers_per_peer`, one batch in flight per worker; over
    TCP the entries of every worker to one peer share its lanes (`lanes.py`), so the
    engine never queues one. A failed batch or entry is retried once, over TCP once more
    per lane; a timed-out TCP entry is not retried: the engine may still send it
    (`mooncake_batches.py`). `write_pages` jobs
    are planned in the worker. No wait spins a core for long (`mooncake_engine.py`).
    """

    def __init__(self, config: TransportConfig):
        self._config = config
        listening = tcp_streams.listening_ports()
        self._engine = MooncakeEngine(config)
        rpc_port = self._engine.rpc_port
        self._session_id = self._engine.session_id
        # The engine's TCP data listener: the ports it opened besides its RPC port.
        data_ports = tcp_streams.listening_ports() - listening - {rpc_port}
        self.inbound = tcp_streams.InboundStreams(
            data_ports if config.protocol == "tcp" else frozenset()
        )
        self._registrations = Registrations(self._engine)
        self.workers = PeerWorkers(self._engine, self._registrations, config, self._session_id)
        logger.info("transfer engine up: session %s over %s", self._session_id, config.protocol)

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        if not regions:
            return
        self._registrations.add(regions)

    def write(
        self,
        peer_session_id: str,
        ops: Sequence[WriteOp],
        peer_regions: Sequence[MemoryRegion],
    ) -> TransferHandle:
        self._check_open()
        local = self._registrations.index
        job = Job.build(peer_session_id, ops, local, RegionIndex(peer_regions))
        if not job.lengths:
            done: Future[TransferStats] = Future()
            done.set_result(TransferStats(entries=0, bytes=0, seconds=0.0, batches=0))
            return TransferHandle(done)
        return self.workers.enqueue(job)

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
        self._check_open()
        if not peer_session_id:
            raise TransferError("peer_session_id is empty")
        staging.check_page_args(src_layout, src_indices, dst_layout, dst_indices)
        remote = RegionIndex(peer_regions)
        if dst_staging is not None and not remote.covers(dst_staging.addr, dst_staging.length):
            raise TransferError(
                f"refused write to peer {peer_session_id}: staging region {dst_staging} is "
                f"outside the peer's published regions; nothing was sent"
            )
        job = PagesJob(
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
        return self.workers.enqueue(job)

    def close(self) -> None:
        if not self.workers.stop():  # closed before, or a worker still runs a batch
            return
        self._engine.release()
        self.workers.sender.free_staging()  # after the engine: they were registered there

    def _check_open(self) -> None:
        if self.workers.closed:
            raise TransferError(f"transport {self._session_id} is closed")
