"""The host data path: host pool -> host pool through the Mooncake Transfer Engine.

Target: reserves host-pool slots (evicting unprotected host-only pages only when the
request can then be met), and on commit inserts host-only radix nodes; the next request
loads them to the GPU through HiCache's normal load-back.

Source: pins the prefix's host pages and queues device->host copies for device-only
nodes (`sglang_adapter.pin_host_pages`), WAITs until those copies have completed, then
hands the page lists to the transport (`write_pages`), whose worker thread plans the
writes (page-level, gathering scattered pages into staging chunks where that cuts the
entry count) and moves the bytes, so nothing proportional to the page count runs on the
scheduler thread; the job is done when the transport's handle is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError, detached
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.base import (
    HOST,
    ROUTE_HOST_TO_HOST,
    DataPath,
    KVPoll,
    NothingWritten,
    SendJob,
    SendRange,
    SendStats,
)
from sglang_kv_migration.paths.host.host_slots import HostSlots
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.transport import KVTransport, MemoryRegion, TransferHandle
from sglang_kv_migration.targets import HostTarget

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun
    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

logger = logging.getLogger(__name__)

# Checked target host-pool layouts kept per source rank (one per peer rank, typically).
PEER_LAYOUTS_KEPT = 64


class HostPath(DataPath):
    name: ClassVar[str] = HOST

    def __init__(
        self,
        cache: HiRadixCache,
        layout: HostPoolLayout | None = None,
        transport: KVTransport | None = None,
        transfer_timeout_s: float = 30.0,
    ):
        """Without `transport` the path plays the target role only (reserve/insert)."""
        self.cache = cache
        self.transfer_timeout_s = transfer_timeout_s
        self.layout = layout or HostPoolLayout.from_host_pool(sglang_adapter.host_pool(cache))
        self.slots = HostSlots(cache, self.layout)  # the target role
        self._transport = transport
        self._peer_layouts: dict[tuple[tuple[int, ...], ...], HostPoolLayout] = {}
        if transport is not None:
            # Registered once: peers write into these buffers for the server's lifetime.
            transport.register(regions_of(self.layout))

    @property
    def transport(self) -> KVTransport:
        if self._transport is None:
            raise MigrationError(ErrorKind.UNAVAILABLE, "this host path has no transport")
        return self._transport

    # ------------------------------------------------------------------ both roles

    def advertise(self) -> dict[str, Any]:
        return HostTarget(
            session_id=self.transport.session_id,
            host_kv_data_ptrs=self.layout.data_ptrs,
            host_kv_data_lens=self.layout.data_lens,
            host_kv_item_lens=self.layout.item_lens,
        ).to_wire()

    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        return target.host_wire()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    @property
    def late_write_margin_s(self) -> float:
        # A job stops submitting batches at its deadline, but a batch already in flight may
        # run up to the engine's own timeout: twice the transfer timeout bounds both.
        return 2 * self.transfer_timeout_s

    def open_write_streams(self) -> frozenset[int]:
        inbound = getattr(self._transport, "inbound", None)
        return inbound.open_now() if inbound is not None else frozenset()

    def close_write_streams(self, streams: frozenset[int]) -> frozenset[int]:
        inbound = getattr(self._transport, "inbound", None)
        return inbound.close(streams) if inbound is not None else frozenset()

    # ------------------------------------------------------------------ target role

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return self.slots.held_prefix(input_ids, extra_key)

    def content_digest(self, slots: torch.Tensor) -> str:
        return self.slots.content_digest(slots)

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        return self.slots.reserve(num_tokens, owners)

    def release(self, slots: torch.Tensor) -> None:
        self.slots.release(slots)

    def retake(self, slots: torch.Tensor) -> None:
        self.slots.retake(slots)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        return self.slots.insert(anchor, key, anchor_length, slots)

    # ------------------------------------------------------------------ source role

    def start_send(self, send: SendRange) -> SendJob:
        target = send.target
        peer = self._peer_layout(
            target.host_kv_data_ptrs, target.host_kv_data_lens, target.host_kv_item_lens
        )
        if not target.session_id:
            raise MigrationError(ErrorKind.BAD_REQUEST, "target has no transfer session_id")
        staging = None
        if target.staging:  # the grant check already bound it to this migration
            staging = MemoryRegion(addr=target.staging[0], length=target.staging[1])
        if send.source_slots is not None:  # feature "running_slots"
            pinned = self._copy_running_slots(send)
            return HostSendJob(self, pinned, peer, target.session_id, send, staging, scratch=True)
        pinned = sglang_adapter.pin_host_pages(
            self.cache, send.input_ids, send.extra_key, send.start, send.end, send.partial_ok
        )
        if pinned is None:
            return NothingWritten(send.start)
        if pinned.end < send.end:
            send = send.cut_to(pinned.end, "on device or host")
            # The extent is laid out for every granted page (buffer major): a cut send
            # writes its slots directly, which the target accepts (the receipt's plan).
            staging = None
        owned = send.owned_offsets(send.end - send.start, self.layout.page_size)
        if owned is not None:
            # Owner-sharded CP: this rank holds, so sends, only its own pages of the run;
            # the extent is laid out for every page, so they go to their slots directly.
            if not owned:
                sglang_adapter.unpin_host_pages(pinned)
                return NothingWritten(send.end)
            pinned = _owned_part(pinned, owned)
            send = dataclasses.replace(send, target_slots=send.target_slots[_index(owned)])
            staging = None
        return HostSendJob(self, pinned, peer, target.session_id, send, staging)

    def _copy_running_slots(self, send: SendRange) -> sglang_adapter.PinnedHostPages:
        """A running request's pages, copied into host slots of their own (freed with the
        job): the request keeps writing its row, and the tree holds none of them."""
        page_size = self.layout.page_size
        if send.start % page_size or send.end % page_size or send.end <= send.start:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"token range [{send.start}, {send.end}) is not a non-empty range of whole "
                f"pages (page_size={page_size})",
            )
        host_slots = sglang_adapter.alloc_host_slots(self.cache, send.end - send.start)
        try:
            slots = send.source_slots[send.start : send.end]
            sglang_adapter.copy_device_to_host(self.cache, slots, host_slots)
        except BaseException:
            sglang_adapter.free_host_slots(self.cache, host_slots)
            raise
        return sglang_adapter.PinnedHostPages(
            host_indices=host_slots, nodes=[], start=send.start, end=send.end, copying_ids=set()
        )

    def _peer_layout(
        self, data_ptrs: list[int], data_lens: list[int], item_lens: list[int]
    ) -> HostPoolLayout:
        """A target's published host pool, checked once per distinct publication: a peer
        publishes the same buffers for its lifetime, and checking one buffer per layer
        and K/V costs ~0.1 ms on the scheduler thread (an immutable value, so shared)."""
        key = (tuple(data_ptrs), tuple(data_lens), tuple(item_lens))
        peer = self._peer_layouts.get(key)
        if peer is None:
            try:
                peer = HostPoolLayout.from_published(
                    data_ptrs=data_ptrs,
                    data_lens=data_lens,
                    item_lens=item_lens,
                    page_size=self.layout.page_size,
                )
            except ValueError as e:
                raise MigrationError(ErrorKind.BAD_REQUEST, f"target host pool: {e}") from None
            if len(self._peer_layouts) >= PEER_LAYOUTS_KEPT:
                self._peer_layouts.pop(next(iter(self._peer_layouts)))  # the oldest
            self._peer_layouts[key] = peer
        return peer


class HostSendJob(SendJob):
    def __init__(
        self,
        path: HostPath,
        pinned: sglang_adapter.PinnedHostPages,
        peer: HostPoolLayout,
        peer_session_id: str,
        send: SendRange,
        staging: MemoryRegion | None = None,
        scratch: bool = False,
    ):
        """`scratch`: the pinned host slots are the job's own (freed on `release`)."""
        self._path = path
        self._scratch = scratch
        self._staging = staging
        self._pinned: sglang_adapter.PinnedHostPages | None = pinned
        self._peer = peer
        self._peer_session_id = peer_session_id
        self._send = send
        self.end = send.end
        self._handle: TransferHandle | None = None
        self._digest: Future[str] | None = None  # of the pages sent, when verify asked
        self._created = time.monotonic()
        self._host_copies_s = 0.0  # waiting for the device->host copies of the prefix
        self.stats = SendStats()

    @property
    def waiting(self) -> bool:
        return self._handle is None and self.error is None

    @property
    def started_writing(self) -> bool:
        return self._handle is not None

    def poll(self) -> KVPoll:
        if self.error is not None:
            return KVPoll.FAILED
        if self._handle is None:
            if not sglang_adapter.host_pages_ready(self._path.cache, self._pinned):
                return KVPoll.WAITING
            try:
                self._submit()
            except MigrationError as e:
                self.error = detached(e)
                return KVPoll.FAILED
            except ValueError as e:  # planning rejects inconsistent peer data
                self.error = MigrationError(ErrorKind.BAD_REQUEST, str(e))
                return KVPoll.FAILED
        if not self._handle.done() or (self._digest is not None and not self._digest.done()):
            return KVPoll.TRANSFERRING
        try:
            stats = self._handle.result(timeout=0)
        except MigrationError as e:
            self.error = detached(e)
            return KVPoll.FAILED
        digest = ""
        if self._digest is not None:
            try:
                digest = self._digest.result()
            except Exception as e:  # a bug; the receipt must not claim a digest
                logger.exception("digest of the sent pages failed")
                self.error = MigrationError(ErrorKind.INTERNAL, f"verify digest failed: {e!r}")
                return KVPoll.FAILED
        self.stats = SendStats(
            bytes=stats.bytes,
            seconds=stats.seconds,
            plan=stats.plan,
            entries=stats.entries,
            digest=digest,
            steps={"host_copies": self._host_copies_s, **stats.steps},
            # The wire time moved the bytes; probe, plan and queueing are fixed cost.
            routes={ROUTE_HOST_TO_HOST: (stats.bytes, stats.steps.get("wire", stats.seconds))},
        )
        return KVPoll.SUCCESS

    def release(self) -> None:
        if self._pinned is not None:
            sglang_adapter.unpin_host_pages(self._pinned)
            if self._scratch:
                sglang_adapter.free_host_slots(self._path.cache, self._pinned.host_indices)
            self._pinned = None

    def _submit(self) -> None:
        send = self._send
        self._host_copies_s = time.monotonic() - self._created
        # Grant deadlines are unix times (the target's clock, as the grant check assumes);
        # the transport counts on the monotonic clock.
        wall, mono = time.time(), time.monotonic()
        if wall > send.start_by:
            raise MigrationError(
                ErrorKind.FORBIDDEN,
                "write refused: the grant expired while the source pages were being "
                "prepared; nothing was written",
            )
        # The transport decides whether the extent is worth it (its plan says which).
        regions = regions_of(self._peer)
        if self._staging is not None:
            regions.append(self._staging)
        self._handle = self._path.transport.write_pages(
            self._peer_session_id,
            self._path.layout,
            self._pinned.host_indices,
            self._peer,
            send.target_slots,
            regions,
            dst_staging=self._staging,
            start_by=_monotonic(send.start_by, wall, mono),
            write_until=_monotonic(send.write_until, wall, mono),
        )
        if send.verify:
            # Off the scheduler thread; the pages stay pinned (unchanged) until `release`.
            layout, indices = self._path.layout, self._pinned.host_indices
            self._digest = verify.submit(lambda: verify.host_pages_digest(layout, indices))


def _index(offsets: list[int]) -> torch.Tensor:
    import torch

    return torch.tensor(offsets, dtype=torch.int64)


def _owned_part(
    pinned: sglang_adapter.PinnedHostPages, offsets: list[int]
) -> sglang_adapter.PinnedHostPages:
    """The pinned pages with only the host slots at `offsets` (from the run's start) left
    to send; the nodes stay pinned as they were (`unpin_host_pages` releases them)."""
    return dataclasses.replace(pinned, host_indices=pinned.host_indices[_index(offsets)])


def _monotonic(unix_time: float, wall: float, mono: float) -> float | None:
    return None if unix_time == float("inf") else mono + (unix_time - wall)


def regions_of(layout: HostPoolLayout) -> list[MemoryRegion]:
    """The memory regions of a host pool's buffers, for the transport."""
    return [MemoryRegion(addr=b.ptr, length=b.length) for b in layout.buffers]
