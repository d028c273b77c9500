"""Target side of staged host-path writes on one rank: grant, scatter, release
(`HostStaging`, the host path's `paths.base.TargetStaging`, opened by
`paths.factory.open_staging`).

A host pool handed out page by page (SGLang's default `layer_first` layout at page size 1
after some churn) makes a direct write one Mooncake entry per page and buffer, and the
engine's cost per entry (~20 us) then dominates. So at allocate a target whose reserved
slots are that fragmented grants the source a contiguous extent of its staging arena
(`staging.StagingArena`, registered with the rank's transport next to the host pool);
the source writes every page into it in a few large entries (plan "staged",
`staging.plan_pages`) and says so in its signed receipt; at commit the target copies the
extent into the slots on a worker thread (`staging.StagingScatterer`) and inserts only
once that copy is done. Life of an extent:

    allocate ──grant──> held by the PendingMigration (bound into the signed grant)
        commit ──scatter (worker thread)──> insert ──> released
        abort / expiry / flush ──> released after the slots' write window (quarantine)

Rules kept here:
- The arena never makes an allocate fail: no room means no extent, and the source
  writes into the slots directly.
- Nothing proportional to the page count runs on the scheduler thread: deciding to stage
  is three vectorized numpy ops over the reserved slots (as the allocation itself is),
  the scatter runs on the worker and is polled once per loop iteration.
- An extent released while a granted write may still land is reused only after the
  migration's write window (the server's pending registry calls `release` with that
  deadline).

The commits that wait for a scatter are the server's (`server/target/staged_commits.py`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from sglang_kv_migration.paths.host.staging import (
    MARKER_BYTES,
    STAGE_BELOW_ENTRY_BYTES,
    StagingArena,
    staging_bytes,
)
from sglang_kv_migration.paths.host.staging_watcher import ProgressiveScatterer, marker_word
from sglang_kv_migration.paths.host.transport import KVTransport, MemoryRegion

if TYPE_CHECKING:
    import torch

    from sglang_kv_migration.paths.host.layout import HostPoolLayout

logger = logging.getLogger(__name__)

# Grant an extent only when a direct write would need at least this many entries: below
# it the engine's per-entry cost (~20 us) stays under a millisecond, and a contiguous
# allocation (one run per buffer) never pays for two local copies.
STAGE_MIN_ENTRIES = 32


class HostStaging:
    """One rank's staging arena: registered, published, granted in extents, scattered."""

    def __init__(
        self,
        layout: HostPoolLayout,
        nbytes: int,
        transport: KVTransport,
        *,
        pin: bool | None = None,
    ):
        import torch

        self.layout = layout
        # Pinned only where CUDA can pin (never on a CPU-only build: there is no driver).
        pin = torch.cuda.is_available() if pin is None else pin
        self.arena = StagingArena(nbytes, pin=pin)
        addr, length = self.arena.region
        transport.register([MemoryRegion(addr, length)])
        # Copies pages as the source's progress markers say they landed (overlapping the
        # wire), and whatever is left at commit.
        self._scatterer = ProgressiveScatterer(layout)
        self.overlap = True  # False: copy everything at commit (benchmarks compare both)
        self.granted = 0  # extents handed out (tests, logs)
        self.refused_full = 0  # fragmented allocations that got no extent: arena full

    @property
    def region(self) -> list[int]:
        """``[addr, length]`` of the whole arena, published in the session info."""
        return list(self.arena.region)

    def wants_staging(self, slots: torch.Tensor) -> bool:
        """True when a direct write into ``slots`` would need at least `STAGE_MIN_ENTRIES`
        entries (one per run of pages and buffer) averaging under
        `STAGE_BELOW_ENTRY_BYTES`."""
        import numpy as np

        ps = self.layout.page_size
        if len(slots) < ps:
            return False
        # numpy on a view of the slots: a few us per op against torch's tens (this runs
        # on the scheduler thread, in the allocate handler).
        pages = slots.cpu().numpy()[::ps] // ps
        runs = 1 + int(np.count_nonzero(np.diff(pages) != 1))
        entries = runs * len(self.layout.buffers)
        if entries < STAGE_MIN_ENTRIES:
            return False
        return staging_bytes(self.layout, len(slots)) // entries < STAGE_BELOW_ENTRY_BYTES

    def grant(self, slots: torch.Tensor, now: float) -> tuple[int, int] | None:
        """An extent for writing ``slots`` staged, or None (not fragmented, or no room)."""
        if not self.wants_staging(slots):
            return None
        # The data, then room for the source's progress marker (its last 8 bytes).
        extent = self.arena.grant(staging_bytes(self.layout, len(slots)) + MARKER_BYTES, now)
        if extent is None:
            self.refused_full += 1
            logger.info(
                "KV migration staging arena full (%d bytes free): %d slots go direct",
                self.arena.free_bytes,
                len(slots),
            )
            return None
        self.granted += 1
        marker_word(extent).value = 0  # a reused extent: no stale progress
        if self.overlap:
            self._scatterer.track(extent, slots)
        return extent

    def release(self, extent: tuple[int, int], not_before: float | None = None) -> None:
        # IMPORTANT: stop copying into the migration's slots before they can be reused.
        self._scatterer.cancel(extent)
        self.arena.release(extent, not_before)

    def scatter(self, extent: tuple[int, int], slots: torch.Tensor) -> Future[None]:
        """Copy what is not copied yet of the extent into ``slots`` (worker thread)."""
        return self._scatterer.finish(extent, slots)

    @property
    def early_bytes(self) -> int:
        """Staged bytes copied into slots before their commit asked (overlap)."""
        return self._scatterer.early_bytes

    def close(self) -> None:
        self._scatterer.close()
