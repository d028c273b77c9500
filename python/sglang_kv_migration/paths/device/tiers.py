"""Same host, any tier: which source pages come from which tier, into which target slots.

A source holds a prefix as a root-to-leaf path of radix nodes; each node's KV is on the
GPU (device slots) or only in the pinned host pool (host slots, the node evicted from
device). The device path copies every page from where it is into the target's reserved
device slots: device pages GPU -> GPU, host pages pinned host -> GPU read by the
source's own GPU through unified addressing (no bounce through its device pool, which
is what a pressured source has no room in). One launch per tier.

Pure parts, tested with literal values and against the real HiRadixCache on CPU:
- `plan_tiers`: segments of the path (tier, slots) + the range + the target's slots ->
  per tier the source pages and the target pages, in prefix order, plus the runs that
  give prefix order back (the verify digest hashes pages in prefix order).
- `host_buffer_geometry`: where layer `l`'s page `p` lies in a host pool of each layout,
  as (byte offset of the buffer, `page_copy.PageGeometry`), for the buffers in device
  order (MHA: K layers then V layers; MLA: one per layer).

`TierBuffers` binds a geometry to memory (torch views for the reference copy and the
digest, raw addresses for the kernel); `copy_plan_torch` runs a plan with torch ops
(the CPU path and the fallback when Triton cannot run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sglang_kv_migration.paths.device.page_copy import (
    PageGeometry,
    copy_pages_strided_torch,
    strided_pages,
)

# Where SGLang keeps a node's KV (its GPU pool or only its host pool): the adapter reads
# the tree and says so in these terms; the plan below works on them.
from sglang_kv_migration.sglang_adapter import DEVICE_TIER, HOST_TIER, Segment

if TYPE_CHECKING:
    import torch

TIERS: tuple[str, ...] = (DEVICE_TIER, HOST_TIER)

# Host layouts whose layer pages are (page-strided) blocks of rows. `page_head` puts
# heads outside tokens, so one layer's row is not contiguous: not supported here.
HOST_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct")
_PLANES = {"mha": 2, "mla": 1}


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class TierPages:
    """The pages one tier contributes: `src_pages[i]` of that tier -> target `dst_pages[i]`."""

    src_pages: torch.Tensor  # int64, CPU
    dst_pages: torch.Tensor  # int64, CPU

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.numel())


@dataclass(frozen=True)
class TierPlan:
    """A migration's pages by tier. `runs` lists (tier, count) in prefix order: reading
    that many pages of each tier in turn walks the range from its start."""

    page_size: int
    tiers: Mapping[str, TierPages]
    runs: tuple[tuple[str, int], ...]

    def tokens(self, tier: str) -> int:
        pages = self.tiers.get(tier)
        return pages.num_pages * self.page_size if pages is not None else 0

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.tiers.values())


def merge_plans(plans: Sequence[TierPlan]) -> TierPlan:
    """One plan that copies the pages of all of `plans` (sends into one target: each
    launch then moves all of them). Their pages are disjoint on the target's side (each
    send writes its own granted slots); `runs` of the result are each plan's in turn."""
    import torch

    if not plans:
        raise ValueError("nothing to merge")
    page_size = plans[0].page_size
    if any(p.page_size != page_size for p in plans):
        raise ValueError("plans of different page sizes")
    tiers: dict[str, TierPages] = {}
    for tier in TIERS:
        parts = [p.tiers[tier] for p in plans if tier in p.tiers]
        if parts:
            tiers[tier] = TierPages(
                torch.cat([part.src_pages for part in parts]),
                torch.cat([part.dst_pages for part in parts]),
            )
    runs = tuple(run for p in plans for run in p.runs)
    return TierPlan(page_size=page_size, tiers=tiers, runs=runs)


def owned_part(plan: TierPlan, positions: Sequence[int]) -> TierPlan:
    """The plan with only the pages at `positions` (counted in prefix order from the
    range's first page): what an owner-sharded CP rank sends of a range (`cp_owners.py`).
    Prefix order is kept; a tier left with no page is dropped."""
    import torch

    wanted = set(positions)
    taken = dict.fromkeys(plan.tiers, 0)
    keep: dict[str, list[int]] = {tier: [] for tier in plan.tiers}
    runs: list[tuple[str, int]] = []
    position = 0
    for tier, count in plan.runs:
        lo = taken[tier]
        kept = [i for i in range(lo, lo + count) if position + i - lo in wanted]
        keep[tier].extend(kept)
        taken[tier] = lo + count
        position += count
        if kept and runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + len(kept))
        elif kept:
            runs.append((tier, len(kept)))
    tiers = {}
    for tier, indices in keep.items():
        if indices:
            index = torch.tensor(indices, dtype=torch.int64)
            pages = plan.tiers[tier]
            tiers[tier] = TierPages(pages.src_pages[index], pages.dst_pages[index])
    return TierPlan(page_size=plan.page_size, tiers=tiers, runs=tuple(runs))


def pages_of(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of token slots that fill whole, aligned pages; raises ValueError."""
    import torch

    pages = _pages_np(_slots_np(slots), page_size)
    # At page 1 the pages are the slots' own memory: the caller gets its own copy.
    return torch.from_numpy(pages.copy() if page_size == 1 else pages)


def segments_on_host(segments: Sequence[Segment]) -> list[Segment]:
    """`segments` with their slots on the CPU (int64): the device ones in one copy, so
    one GPU sync, where planning copies each when it reads it. A source does this while
    the target allocates (`DevicePath.prepare_send`), not once the answer came. The
    nodes must be pinned: their slots then cannot change."""
    import torch

    on_device = [i for i, seg in enumerate(segments) if seg.slots.device.type != "cpu"]
    if not on_device:
        return list(segments)
    flat = [segments[i].slots.reshape(-1) for i in on_device]
    host = (torch.cat(flat) if len(flat) > 1 else flat[0]).to("cpu", torch.int64)
    result, offset = list(segments), 0
    for i, part in zip(on_device, flat, strict=True):
        n = int(part.numel())
        result[i] = Segment(segments[i].tier, host[offset : offset + n])
        offset += n
    return result


def _slots_np(slots: torch.Tensor) -> np.ndarray:
    # One copy to the host (device slots: one sync); the checks below are numpy, not a
    # dozen small torch ops (each costs microseconds on the scheduler thread).
    import torch

    return slots.to("cpu", torch.int64).reshape(-1).numpy()


def _pages_np(slots: np.ndarray, page_size: int) -> np.ndarray:
    if slots.size % page_size:
        raise ValueError(f"{slots.size} slots are not whole pages of {page_size}")
    if page_size == 1:
        return slots  # every slot is a page (a view of the slots)
    rows = slots.reshape(-1, page_size)
    first = rows[:, 0]
    if (first % page_size).any() or not np.array_equal(
        rows, first[:, None] + np.arange(page_size, dtype=np.int64)
    ):
        raise ValueError(f"slots are not whole, aligned pages of {page_size}")
    return first // page_size


def plan_tiers(
    segments: Sequence[Segment],
    start: int,
    end: int,
    target_slots: torch.Tensor,
    page_size: int,
) -> TierPlan:
    """Pages of tokens [start, end) by tier, into `target_slots` (one per token).

    `segments` cover the prefix from token 0 on, in order (at least up to `end`).
    Raises ValueError for a range or slots that are not whole pages, segments that do
    not cover the range, or an unknown tier.
    """
    import torch

    if start % page_size or end % page_size or not 0 <= start < end:
        raise ValueError(f"[{start}, {end}) is not a non-empty range of whole pages of {page_size}")
    if int(target_slots.numel()) != end - start:
        raise ValueError(f"{target_slots.numel()} target slots for {end - start} tokens")
    dst_all = _pages_np(_slots_np(target_slots), page_size)
    src: dict[str, list[np.ndarray]] = {}
    dst: dict[str, list[np.ndarray]] = {}
    runs: list[tuple[str, int]] = []
    offset = 0
    for seg in segments:
        if seg.tier not in TIERS:
            raise ValueError(f"unknown tier {seg.tier!r}")
        seg_start, n = offset, int(seg.slots.numel())
        offset += n
        lo, hi = max(seg_start, start), min(seg_start + n, end)
        if lo >= hi:
            continue
        pages = _pages_np(_slots_np(seg.slots[lo - seg_start : hi - seg_start]), page_size)
        src.setdefault(seg.tier, []).append(pages)
        dst.setdefault(seg.tier, []).append(
            dst_all[(lo - start) // page_size : (hi - start) // page_size]
        )
        if runs and runs[-1][0] == seg.tier:
            runs[-1] = (seg.tier, runs[-1][1] + len(pages))
        else:
            runs.append((seg.tier, len(pages)))
    if offset < end:
        raise ValueError(f"the source's segments cover {offset} tokens, {end} needed")
    tiers = {
        t: TierPages(
            torch.from_numpy(np.concatenate(src[t])), torch.from_numpy(np.concatenate(dst[t]))
        )
        for t in src
    }
    return TierPlan(page_size=page_size, tiers=tiers, runs=tuple(runs))


# --------------------------------------------------------------------------- host layouts


def host_buffer_geometry(
    attention: str,
    layout: str,
    layer_num: int,
    page_num: int,
    page_size: int,
    row_bytes: int,
) -> tuple[list[int], PageGeometry]:
    """Byte offsets (in the host pool's one kv_buffer) of each buffer, device order, and
    the page geometry they share. `row_bytes`: one token of one layer (one plane).

    Shapes (SGLang 0.5.12 `init_kv_buffer`, S = page_num * page_size slots):
    layer_first (planes, L, S, row); page_first (planes, S, L, row);
    page_first_direct (planes, page_num, L, page_size, row).
    """
    planes = _PLANES.get(attention)
    if planes is None:
        raise ValueError(f"unknown attention kind {attention!r}")
    size, L, row, ps = page_num * page_size, layer_num, row_bytes, page_size
    plane_bytes = L * size * row
    if layout == "layer_first":
        layer_offset, geometry = size * row, PageGeometry.contiguous(ps, row)
    elif layout == "page_first":
        layer_offset, geometry = row, PageGeometry(ps, row, ps * L * row, L * row)
    elif layout == "page_first_direct":
        layer_offset, geometry = ps * row, PageGeometry(ps, row, L * ps * row, row)
    else:
        raise ValueError(
            f"host layout {layout!r} cannot be read by the device path "
            f"(supported: {', '.join(HOST_LAYOUTS)})"
        )
    offsets = [
        kv * plane_bytes + layer * layer_offset for kv in range(planes) for layer in range(L)
    ]
    return offsets, geometry


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class TierBuffers:
    """One tier's copy of every KV buffer (device order): where each one's pages lie."""

    flats: tuple[torch.Tensor, ...]  # flat uint8 tensors, one per buffer (may repeat)
    offsets: tuple[int, ...]  # byte offset of each buffer in its flat tensor
    geometry: PageGeometry
    num_pages: int

    @classmethod
    def of_device(cls, buffers: Sequence[torch.Tensor], page_size: int) -> TierBuffers:
        """A device pool's per-layer buffers (one row per token slot, contiguous)."""
        import torch

        flats = tuple(b.view(-1).view(torch.uint8) for b in buffers)
        row_bytes = {f.numel() // int(b.shape[0]) for f, b in zip(flats, buffers, strict=True)}
        if len(row_bytes) != 1:
            raise ValueError(f"device buffers have different row sizes {sorted(row_bytes)}")
        rows = int(buffers[0].shape[0])
        return cls(
            flats,
            (0,) * len(flats),
            PageGeometry.contiguous(page_size, row_bytes.pop()),
            rows // page_size,
        )

    @classmethod
    def of_host(
        cls, kv_buffer: torch.Tensor, offsets: Sequence[int], geometry: PageGeometry, page_num: int
    ) -> TierBuffers:
        """A host pool's one contiguous kv_buffer split per `host_buffer_geometry`."""
        import torch

        flat = kv_buffer.view(-1).view(torch.uint8)
        return cls((flat,) * len(offsets), tuple(offsets), geometry, page_num)

    def views(self) -> list[torch.Tensor]:
        """`(num_pages, rows, row_bytes)` uint8 views, no copy."""
        return [
            strided_pages(f, o, self.geometry, self.num_pages)
            for f, o in zip(self.flats, self.offsets, strict=True)
        ]

    def addresses(self) -> list[int]:
        """Base address of each buffer (what the kernel's pointer table holds)."""
        return [f.data_ptr() + o for f, o in zip(self.flats, self.offsets, strict=True)]


def copy_plan_torch(
    plan: TierPlan, sources: Mapping[str, TierBuffers], destination: TierBuffers
) -> None:
    """Run `plan` with torch indexing: each tier's pages into the destination's."""
    dst_views = destination.views()
    for tier, pages in plan.tiers.items():
        copy_pages_strided_torch(sources[tier].views(), dst_views, pages.src_pages, pages.dst_pages)


def prefix_order_pages(plan: TierPlan) -> list[tuple[str, torch.Tensor]]:
    """(tier, source pages) pieces that walk the range in prefix order."""
    taken = dict.fromkeys(plan.tiers, 0)
    pieces = []
    for tier, count in plan.runs:
        lo = taken[tier]
        pieces.append((tier, plan.tiers[tier].src_pages[lo : lo + count]))
        taken[tier] = lo + count
    return pieces
