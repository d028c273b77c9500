"""The copies of a tiered source: every page of a plan (`tiers.TierPlan`) from where it
lies on this server — its GPU pool, or its pinned host pool read in place by its GPU —
into a destination laid out by a page geometry, one launch per tier on a side stream.

Destinations (`CopyDestination`): the target's GPU pool or landing arena opened through
CUDA IPC (the device path; contiguous pages), or the target's host pool mapped from
shared memory and registered with this GPU (the host landing; the host layout's
strided pages). The kernel (`page_copy.py`) reads and writes by address: device pages,
and host pages through unified addressing, either side.

Without CUDA (a CPU server, the tests) the same plan runs with torch indexing when it
is launched, on the scheduler thread, and its events are host clock stamps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.device import page_copy, page_lists, tiers

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

logger = logging.getLogger(__name__)


@dataclass
class CopyDestination:
    """Where a launch writes: per buffer (device order) a flat uint8 tensor whose pages
    lie by `geometry` from `offsets` on (None: each buffer's pages are contiguous at its
    own row size, as in a device pool), at most `page_limit` pages each."""

    flats: list[Any]
    pointers: Any  # int64 table of the buffers' base addresses on this GPU (None: CPU)
    page_limit: int
    geometry: page_copy.PageGeometry | None = None
    offsets: tuple[int, ...] = ()
    key: int = 0  # which opened destination (sends into one may launch together)
    first_use: bool = False  # no copy went into this mapping before

    def views(self, contiguous: page_copy.PageGeometry) -> list[Any]:
        """`(page_limit, rows, row_bytes)` views (`contiguous` where `geometry` is None)."""
        geometry = self.geometry or contiguous
        offsets = self.offsets or (0,) * len(self.flats)
        return tiers.TierBuffers(
            tuple(self.flats), tuple(offsets), geometry, self.page_limit
        ).views()


class HostStamp:
    """A copy's moment on the host clock: a CUDA event's interface, done at once."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostStamp) -> float:
        return (end.at - self.at) * 1e3  # ms, as CUDA events report it


class TierCopier:
    """One source rank's copies out of its device pool `buffers` and, where it can read
    it in place, its host pool (see the module docstring)."""

    def __init__(self, cache: HiRadixCache, buffers: list[torch.Tensor], page_size: int):
        import torch

        self.cache = cache
        self.buffers = buffers
        self.page_size = page_size
        self.device = buffers[0].device
        self.row_bytes = [b[0].numel() * b.element_size() for b in buffers]
        self.bytes_per_token = sum(self.row_bytes)
        self.page_bytes = [rb * page_size for rb in self.row_bytes]
        # One fused launch moves every buffer when all have the same row size (MHA with
        # equal K/V head dims, MLA); otherwise torch launches per buffer.
        self.fused = len(set(self.row_bytes)) == 1 and self.row_bytes[0] % 8 == 0
        self.device_geometry = page_copy.PageGeometry.contiguous(page_size, self.row_bytes[0])
        self._warm_tiers: set[str] = set()  # tiers some launch copied
        self.stream: Any = None
        self._page_lists: page_lists.PageListUpload | None = None
        self._order_event: Any = None
        self.src_ptrs: Any = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            self._page_lists = page_lists.PageListUpload(self.device)
            self._order_event = torch.cuda.Event()
            self.src_ptrs = pointer_table([b.data_ptr() for b in buffers], self.device)
        self.host, self.host_refusal = host_tier_of(cache, buffers, self.device)
        self._host_ptrs: Any = None
        if self.host is not None and self.device.type == "cuda":
            self._host_ptrs = pointer_table(self.host.addresses(), self.device)

    def source_tiers(self) -> dict[str, tiers.TierBuffers]:
        """The tiers this source reads pages from, as torch-addressable buffers."""
        found = {tiers.DEVICE_TIER: tiers.TierBuffers.of_device(self.buffers, self.page_size)}
        if self.host is not None:
            found[tiers.HOST_TIER] = self.host
        return found

    def digest_pieces(self, plan: tiers.TierPlan) -> list[tuple[list[Any], Any]]:
        """(per-buffer views, pages) in prefix order, for `verify.tier_pages_digest`."""
        views = {tier: buffers.views() for tier, buffers in self.source_tiers().items()}
        return [(views[tier], pages) for tier, pages in tiers.prefix_order_pages(plan)]

    def cold_tiers(self, plan: tiers.TierPlan) -> frozenset[str]:
        """The tiers `plan` copies that no earlier launch of this copier copied (now
        warm). A copy kernel's first launch in a process compiles it, or loads it from
        Triton's cache, inside the copy's events: the first host-tier copy on a fresh
        H200 took 42 ms for 33 MB, which as a rate sample would teach the cost model
        1.6 GB/s."""
        cold = frozenset(tier for tier in plan.tiers if tier not in self._warm_tiers)
        self._warm_tiers.update(cold)
        return cold

    def synchronize(self) -> None:
        """Wait for every copy launched (before SGLang unmaps the KV pool)."""
        if self.stream is not None:
            self.stream.synchronize()

    # ------------------------------------------------------------------ launch

    def launch(
        self, plan: tiers.TierPlan, dst: CopyDestination
    ) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
        """Enqueue one copy per tier on the side stream (without CUDA: run it now);
        returns the (start, end) events of the whole copy and of each tier."""
        # The page lists in numpy, and all of them in one copy to the GPU: on a server's
        # scheduler thread each small torch op or copy costs tens of microseconds.
        lists = [(p.src_pages.numpy(), p.dst_pages.numpy()) for p in plan.tiers.values()]
        highest = max((int(pages.max()) for _, pages in lists if pages.size), default=-1)
        if highest >= dst.page_limit:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target page {highest} lies outside its buffers of {dst.page_limit} pages",
            )
        if self.stream is None:
            return self._launch_here(plan, dst)
        return self._launch_on_stream(plan, lists, dst)

    def _launch_here(
        self, plan: tiers.TierPlan, dst: CopyDestination
    ) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
        events: dict[str, tuple[Any, Any]] = {}
        for tier, pages in plan.tiers.items():
            start = HostStamp()
            self._copy_torch(tier, pages.src_pages, dst, pages.dst_pages)
            events[tier] = (start, HostStamp())
        ordered = list(events.values())
        return ordered[0][0], ordered[-1][1], events

    def _launch_on_stream(
        self, plan: tiers.TierPlan, lists: list[tuple[Any, Any]], dst: CopyDestination
    ) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
        import numpy as np
        import torch

        stream, uploads = self.stream, self._page_lists
        assert uploads is not None
        # IMPORTANT: order the copy after every stream that may still write these pages
        # (the scheduler's stream and HiCache's load-back), before reading them. (One
        # kept event: a wait takes the event's state when it is enqueued.)
        for other in (
            torch.cuda.current_stream(self.device),
            *sglang_adapter.pending_device_write_streams(self.cache),
        ):
            self._order_event.record(other)
            stream.wait_event(self._order_event)
        events: dict[str, tuple[Any, Any]] = {}
        with torch.cuda.stream(stream):
            # Through pinned memory: from pageable memory the driver may first wait for
            # the stream, which waits for the scheduler's stream (a forward pass in
            # flight) and would block this thread that long.
            on_device = uploads.upload(np.concatenate([a for pair in lists for a in pair]))
            try:
                offset = 0
                for tier, (src_pages, dst_pages) in zip(plan.tiers, lists, strict=True):
                    middle = offset + src_pages.size
                    end = middle + dst_pages.size
                    src_idx, dst_idx = on_device[offset:middle], on_device[middle:end]
                    offset = end
                    events[tier] = (_timed_event(), _timed_event())
                    events[tier][0].record(stream)
                    self._copy(tier, src_idx, dst, dst_idx)
                    events[tier][1].record(stream)
            except BaseException:
                # IMPORTANT: the kept page lists are not rewritten before whatever this
                # launch enqueued has read them, also when it failed halfway.
                failed = torch.cuda.Event()
                failed.record(stream)
                uploads.used_until(failed)
                raise
        ordered = list(events.values())
        uploads.used_until(ordered[-1][1])
        return ordered[0][0], ordered[-1][1], events

    def _copy(self, tier: str, src_idx: Any, dst: CopyDestination, dst_idx: Any) -> None:
        """One tier's pages into `dst`: the fused kernel, else (once it failed) torch."""
        if self.fused:
            src_ptrs = self._host_ptrs if tier == tiers.HOST_TIER else self.src_ptrs
            src_geometry = self._geometry_of(tier)
            try:
                page_copy.copy_pages_strided(
                    src_ptrs,
                    dst.pointers,
                    src_idx,
                    dst_idx,
                    src_geometry,
                    dst.geometry or self.device_geometry,
                )
                return
            except Exception:  # Triton cannot build the kernel here: fall back, once
                logger.exception("fused page copy unavailable; using torch copies")
                self.fused = False
        self._copy_torch(tier, src_idx, dst, dst_idx)

    def _copy_torch(self, tier: str, src_idx: Any, dst: CopyDestination, dst_idx: Any) -> None:
        import torch

        if tier == tiers.DEVICE_TIER and dst.geometry is None:
            # Pool to pool: every buffer's pages at its own row size.
            for src, flat, pb in zip(self.buffers, dst.flats, self.page_bytes, strict=True):
                page_copy.copy_pages_torch(
                    [src.view(-1).view(torch.uint8)], [flat], src_idx, dst_idx, pb
                )
            return
        source = self.source_tiers()[tier]
        dst_views = dst.views(self.device_geometry)
        page_copy.copy_pages_strided_torch(source.views(), dst_views, src_idx, dst_idx)

    def _geometry_of(self, tier: str) -> page_copy.PageGeometry:
        if tier == tiers.HOST_TIER:
            assert self.host is not None  # the source refused host pages without it
            return self.host.geometry
        return self.device_geometry

    # ------------------------------------------------------------------ warm-up

    def warm_up(self) -> None:
        """Build the copy kernel now, not in the first migration's scheduler iteration:
        copy this pool's page 0 onto itself (nothing is cached yet: no reader to race)."""
        if self.stream is None or not self.fused:
            return
        import torch

        page = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            with torch.cuda.stream(self.stream):
                page_copy.copy_pages(
                    self.src_ptrs, self.src_ptrs, page, page, self.row_bytes[0] * self.page_size
                )
            self.stream.synchronize()
        except Exception:  # Triton cannot build the kernel here: torch copies instead
            logger.exception("fused page copy unavailable; using torch copies")
            self.fused = False
        self._warm_up_host_tier()

    def _warm_up_host_tier(self) -> None:
        """Build the strided kernel with the argument values a host-tier copy will pass
        (Triton specializes on them): host page 0 into a scratch page per buffer."""
        host = self.host
        if self._host_ptrs is None or not self.fused or host is None:
            return
        if host.geometry.is_contiguous:
            return
        import torch

        into = self.device_geometry
        scratch = [
            torch.empty(into.page_bytes, dtype=torch.uint8, device=self.device)
            for _ in self.buffers
        ]
        page = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            with torch.cuda.stream(self.stream):
                page_copy.copy_pages_strided(
                    self._host_ptrs,
                    pointer_table([s.data_ptr() for s in scratch], self.device),
                    page,
                    page,
                    host.geometry,
                    into,
                )
            self.stream.synchronize()
        except Exception:  # Triton cannot build the kernel here: torch copies instead
            logger.exception("fused host page copy unavailable; using torch copies")
            self.fused = False


def host_tier_of(
    cache: HiRadixCache, buffers: list[torch.Tensor], device: Any
) -> tuple[tiers.TierBuffers | None, str]:
    """The host pool as a tier a source reads in place, or (None, why not)."""
    try:
        shape = sglang_adapter.host_pool_shape(cache)
        offsets, geometry = tiers.host_buffer_geometry(
            shape.attention,
            shape.layout,
            shape.layer_num,
            shape.page_num,
            shape.page_size,
            shape.row_bytes,
        )
    except (MigrationError, ValueError) as e:
        return None, str(e)
    row_bytes = {b[0].numel() * b.element_size() for b in buffers}
    if len(offsets) != len(buffers) or {shape.row_bytes} != row_bytes:
        return None, "host pool rows differ from the device pool's"
    if device.type == "cuda" and not shape.pinned:
        return None, "the host pool is not pinned, so the GPU cannot read it in place"
    if device.type == "cuda" and shape.row_bytes % 8:
        return None, f"host rows of {shape.row_bytes} bytes are not whole 8-byte words"
    return tiers.TierBuffers.of_host(shape.kv_buffer, offsets, geometry, shape.page_num), ""


def pointer_table(addresses: list[int], device: Any) -> torch.Tensor:
    import torch

    return torch.tensor(addresses, dtype=torch.int64, device=device)


def launch_error(error: Exception) -> MigrationError:
    """What a send reports when its copy could not be launched."""
    if isinstance(error, MigrationError):
        return error
    return MigrationError(ErrorKind.CONFLICT, f"copy not started: {error}")


def _timed_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)
