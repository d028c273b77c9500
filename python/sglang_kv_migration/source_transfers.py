"""Source side of `/transfer_request_kvcache` on one rank, without stalling the scheduler.

Life of a transfer on every TP rank:

    start():  ranks agree the request is valid (collective) → pin the prefix's host
              pages and queue device→host copies for device-only nodes (no waiting)
    poll():   copies complete → plan and submit the writes to the target rank
    poll():   every rank done (collective) → unpin, reply once, success only if all ok

IMPORTANT: the collectives here depend only on state that is identical across ranks
(the list of transfers, whether their host copies are complete), never on one rank's
clock or one rank's error, so every rank enters them together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sglang_kv_migration import tree_helpers
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.io_types import (
    RankTransferResult,
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
    TransferRequestKVCacheTarget,
)
from sglang_kv_migration.layout import HostPoolLayout, LayoutFingerprint, plan_writes
from sglang_kv_migration.metrics import MigrationMetrics
from sglang_kv_migration.rank_context import RankContext, check_peer_fingerprint, error_of
from sglang_kv_migration.transfer import KVTransport, MemoryRegion, TransferHandle

logger = logging.getLogger(__name__)


@dataclass
class RankTransferStatus:
    """One rank's view of a transfer, exchanged between ranks in `poll()`."""

    done: bool
    success: bool = False
    bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    error_kind: str = ""


@dataclass
class InflightTransfer:
    """One rank's part of a transfer: validated → pinned (host copies filling) → sent."""

    request: TransferRequestKVCacheReqInput
    started: float
    target: TransferRequestKVCacheTarget | None = None  # this rank's peer
    pinned: tree_helpers.PinnedHostPages | None = None
    handle: TransferHandle | None = None  # set once the writes were submitted
    error: MigrationError | None = None  # failed before anything was sent
    result: RankTransferStatus | None = None

    def awaiting_host_copy(self) -> bool:
        """Pinned, waiting for device->host copies; identical on every TP rank."""
        return self.pinned is not None and self.handle is None and self.error is None

    def local_status(self) -> RankTransferStatus:
        if self.result is not None:
            return self.result
        if self.error is not None:
            self.result = RankTransferStatus(
                done=True, message=self.error.message, error_kind=self.error.kind.value
            )
        elif self.handle is not None and self.handle.done():
            try:
                stats = self.handle.result(timeout=0)
                self.result = RankTransferStatus(
                    done=True, success=True, bytes=stats.bytes, seconds=stats.seconds
                )
            except MigrationError as e:
                self.result = RankTransferStatus(
                    done=True, message=e.message, error_kind=e.kind.value
                )
        return self.result or RankTransferStatus(done=False)


class SourceTransfers:
    """The transfers this rank is sending, from request to reply."""

    def __init__(
        self,
        ctx: RankContext,
        layout: HostPoolLayout,
        fingerprint: LayoutFingerprint,
        transport: KVTransport,
        metrics: MigrationMetrics,
    ):
        self.ctx = ctx
        self.layout = layout
        self.fingerprint = fingerprint
        self.transport = transport
        self.metrics = metrics
        self._inflight: list[InflightTransfer] = []

    def __len__(self) -> int:
        return len(self._inflight)

    def start(self, req: TransferRequestKVCacheReqInput) -> None:
        """Handle a transfer request; the reply is sent later by `poll()`."""
        inflight = InflightTransfer(request=req, started=time.monotonic())
        self._inflight.append(inflight)
        local_error = error_of(lambda: self._validate(req, inflight))
        # IMPORTANT: agree on validity before touching the tree. A rank that pinned and
        # queued write-backs while another did not would leave the ranks' write-through
        # state different, and SGLang's `writing_check` collectives would deadlock.
        errors = [e for e in self.ctx.all_gather(local_error) if e is not None]
        if errors:
            inflight.error = errors[0]
            return
        # Same outcome on every rank: their trees and host pools are identical.
        inflight.error = error_of(lambda: self._pin(req, inflight))

    def poll(self) -> None:
        """Once per scheduler loop iteration while transfers are in flight."""
        if self._inflight:
            self._send_ready()
            self._finish_done()

    def close(self) -> None:
        for inflight in self._inflight:
            if inflight.pinned is not None:
                tree_helpers.unpin_host_pages(inflight.pinned)
        self._inflight.clear()

    # ------------------------------------------------------------------ helpers

    def _validate(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        for target in req.target_per_rank:
            if (target.tp, target.pp) == (self.ctx.tp_rank, self.ctx.pp_rank):
                break
        else:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target_per_rank has no entry for tp={self.ctx.tp_rank} pp={self.ctx.pp_rank}",
            )
        check_peer_fingerprint(self.fingerprint, [target.fingerprint], role="target")
        if len(target.kv_indices) != req.extra_token_size:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target rank tp={target.tp} pp={target.pp} has {len(target.kv_indices)} "
                f"kv_indices for extra_token_size={req.extra_token_size}",
            )
        inflight.target = target

    def _pin(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        start = req.matched_token_size
        inflight.pinned = tree_helpers.pin_host_pages(
            self.ctx.tree_cache, req.input_ids, req.extra_key, start, start + req.extra_token_size
        )

    def _submit(self, inflight: InflightTransfer) -> None:
        """Plan and submit this rank's writes (its host copies are complete)."""
        target = inflight.target
        peer = HostPoolLayout.from_published(
            data_ptrs=target.host_kv_data_ptrs,
            data_lens=target.host_kv_data_lens,
            item_lens=target.host_kv_item_lens,
            page_size=self.layout.page_size,
        )
        writes = plan_writes(self.layout, inflight.pinned.host_indices, peer, target.kv_indices)
        inflight.handle = self.transport.write(target.session_id, writes, regions_of(peer))

    def _send_ready(self) -> None:
        """Submit the writes of transfers whose host copies have completed."""
        waiting = [t for t in self._inflight if t.awaiting_host_copy()]
        if not waiting:
            return
        cache = self.ctx.tree_cache
        cache.writing_check()  # a collective: `waiting` is the same on every rank
        for inflight in waiting:
            if tree_helpers.host_pages_ready(cache, inflight.pinned):
                inflight.error = error_of(lambda t=inflight: self._submit(t))

    def _finish_done(self) -> None:
        per_rank = self.ctx.all_gather([t.local_status() for t in self._inflight])
        still_running: list[InflightTransfer] = []
        for i, inflight in enumerate(self._inflight):
            statuses = [rank_statuses[i] for rank_statuses in per_rank]
            if not all(s.done for s in statuses):
                still_running.append(inflight)
                continue
            if inflight.pinned is not None:
                tree_helpers.unpin_host_pages(inflight.pinned)
            self._reply(inflight, statuses)
        self._inflight = still_running

    def _reply(self, inflight: InflightTransfer, statuses: list[RankTransferStatus]) -> None:
        req = inflight.request
        ranks = [
            RankTransferResult(
                tp_rank=i % self.ctx.tp_size,
                pp_rank=i // self.ctx.tp_size,
                success=s.success,
                bytes=s.bytes,
                seconds=s.seconds,
                message=s.message,
            )
            for i, s in enumerate(statuses)
        ]
        failed = [s for s in statuses if not s.success]
        elapsed = time.monotonic() - inflight.started
        self.metrics.phase("transfer", elapsed)
        # Every rank builds this same reply; only the first one logs it.
        first_rank = self.ctx.tp_rank == 0
        if failed:
            output = TransferRequestKVCacheReqOutput(
                success=False,
                ranks=ranks,
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
            output = TransferRequestKVCacheReqOutput(
                success=True,
                transferred_token_size=req.extra_token_size,
                transferred_bytes=total_bytes,
                ranks=ranks,
            )
            self.metrics.outcome("source", "sent")
            # Gathers run over the TP group, in tp_rank order.
            self.metrics.moved("source", req.extra_token_size, statuses[self.ctx.tp_rank].bytes)
            if first_rank:
                logger.info(
                    "KV migration %s sent: %d tokens, %d bytes (%d ranks), %.1f ms",
                    req.migration_id,
                    req.extra_token_size,
                    total_bytes,
                    len(statuses),
                    elapsed * 1e3,
                )
        self.ctx.send_output(output, req)


def regions_of(layout: HostPoolLayout) -> list[MemoryRegion]:
    """The memory regions of a host pool's buffers, for the transport."""
    return [MemoryRegion(addr=b.ptr, length=b.length) for b in layout.buffers]
