"""Write plans whose entry count does not depend on how fragmented the host pools are.

Mooncake pays a fixed cost per write entry (~20 us over TCP on a 2-core box, the same
order over RDMA), so a plan of one entry per page and buffer — what `layout.plan_writes`
produces when both pools hand out scattered slots — is bound by entries, not bytes. This
module plans the same copy at *page* granularity, vectorized with torch (whose kernels
release the GIL, so a plan of a million pages does not stall the scheduler thread that
shares the interpreter), and picks one of three shapes:

``direct``
    One entry per run of pages that is consecutive in both pools, per buffer (what
    `plan_writes` does, vectorized). Chosen when the entries are already large.
``gather``
    The source copies its pages, in the order of the target's addresses, into a bounded,
    reused staging buffer registered with the engine, and writes one entry per run of
    *target* pages per buffer. Entries then depend only on the target's fragmentation.
``staged``
    The target granted a contiguous staging region (`dst_staging`): the source gathers
    every page into it, chunk by chunk, one entry per chunk, and the target scatters the
    region into its granted slots (`scatter_from_staging`) before it commits. Entries are
    ``bytes / chunk``, whatever both pools look like. Chosen only when direct entries
    would be small (`STAGE_BELOW_ENTRY_BYTES`); otherwise the region stays unused and the
    write's `TransferStats.plan` says so, so the target scatters only after "staged".

Staging region format (what the source writes and `scatter_from_staging` reads): buffer
major, pages in the order of the target's indices. For buffer ``b`` with ``pb[b] =
page_size * item_len[b]`` bytes per page and ``n`` pages, its block starts at
``sum(n * pb[:b])`` and page ``i`` of it at ``block + i * pb[b]``. Both sides derive it
from the layout and the indices alone, so nothing else crosses the wire.

Wiring a target staging region (the protocol addition; wired in `target_staging.py`):

1. Target, at start-up: a `StagingArena` per rank, its `region` registered with the
   rank's transport next to the host pool; published per rank in the session info.
2. Target, at allocate: if `count_runs` of the granted slots times the buffer count leaves
   entries under `STAGE_BELOW_ENTRY_BYTES` on average, `grant(staging_bytes(...))` an
   extent, keep it with the pending migration, return it per rank (optional field).
3. Source: pass it as ``write_pages(..., dst_staging=MemoryRegion(addr, length))`` and
   include it in the peer regions; report ``TransferStats.plan`` per rank in the transfer
   reply (the receipt), since the source may still decide to write directly.
4. Target, at commit: for ranks whose receipt says "staged", `StagingScatterer.submit`
   the scatter and answer the commit only once its Future is done (poll it from the
   scheduler loop; it is proportional to the bytes), then insert the nodes and `release`
   the extent; on abort or expiry `release` it with the slots' quarantine deadline.

As wired, the target grants only when direct writes would need at least
`target_staging.STAGE_MIN_ENTRIES` entries, the source passes ``plan`` in the receipt only
to a target that granted an extent, and the arena defaults to 256 MiB per rank
(`--kv-migration-staging-mb`): one migration larger than the free arena writes directly.

Everything here is pure planning and local copies; the engine calls are in `transfer.py`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sglang_kv_migration.paths.host.layout import HostPoolLayout, page_runs

if TYPE_CHECKING:
    import torch

# A plan's entries are "large" when they average at least this many bytes: then a gather
# (a local copy of every byte) does not pay for itself. Measured: page_first at page size
# 1 (64 KiB entries), gathering to halve the entries came out 10-15% slower.
DIRECT_ENTRY_BYTES = 32 << 10
# A gather must at least halve the entry count to be worth a local copy of every byte.
GATHER_MIN_GAIN = 2
# Use a granted staging region only when direct entries would average less than this.
# Staging costs two local copies (gather, scatter) of every byte: measured on a 2-core box
# over TCP, 1.8-2x a contiguous write, while direct writes cost ~20 us per entry on top
# of the bytes, which breaks even at about 20-25 KiB per entry (benchmark/
# bench_host_fragmentation.py; docs/benchmarks.md).
STAGE_BELOW_ENTRY_BYTES = 24 << 10

# A granted extent reserves this many bytes at its end for the progress marker: the source
# writes the number of staging bytes it has completed, as a little-endian int64 at
# ``addr + length - 8``, after each chunk lands (and only where the extent has that room
# past the data), so the target can scatter chunk k while chunk k+1 is on the wire.
MARKER_BYTES = 64

# Python lists of indices become tensors this many at a time (~0.3 ms under the GIL each).
_LIST_SLICE = 8192
_YIELD_S = 50e-6

PlanKind = Literal["direct", "gather", "staged"]


# --------------------------------------------------------------------------------------
# Plan types
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One staging chunk: gather ``groups`` into the chunk, then write ``entries`` from it.

    groups: ``(buffer_index, src_page_ids, chunk_offset)``: copy those source pages of that
        buffer, in order, to the chunk starting at ``chunk_offset``.
    entries: ``(chunk_offset, dst_addr, length)`` as three int64 tensors.
    nbytes: bytes of the chunk that are used.
    """

    groups: tuple[tuple[int, torch.Tensor, int], ...]
    entry_offsets: torch.Tensor
    entry_dsts: torch.Tensor
    entry_lengths: torch.Tensor
    nbytes: int


@dataclass(frozen=True)
class PagePlan:
    """A page-level copy plan; `kind` says which of the fields below are set.

    direct: ``srcs``, ``dsts``, ``lengths`` (int64 tensors, one entry each).
    gather / staged: ``chunks`` (each fits in ``chunk_capacity`` bytes).
    """

    kind: PlanKind
    total_bytes: int
    pages: int
    srcs: torch.Tensor | None = None
    dsts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    chunks: tuple[Chunk, ...] = ()
    chunk_capacity: int = 0

    @property
    def entries(self) -> int:
        if self.kind == "direct":
            assert self.lengths is not None
            return int(self.lengths.numel())
        return sum(int(c.entry_lengths.numel()) for c in self.chunks)


# --------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------


def check_page_args(
    src: HostPoolLayout, src_indices: Any, dst: HostPoolLayout, dst_indices: Any
) -> None:
    """The O(1) checks of `plan_pages`, cheap enough for the caller's thread."""
    if len(src.buffers) != len(dst.buffers):
        raise ValueError(
            f"buffer counts differ: source={len(src.buffers)} target={len(dst.buffers)}"
        )
    for i, (s, d) in enumerate(zip(src.buffers, dst.buffers, strict=True)):
        if s.item_len != d.item_len:
            raise ValueError(
                f"buffer {i}: item_len differs: source={s.item_len} target={d.item_len}"
            )
    if src.page_size != dst.page_size:
        raise ValueError(f"page_size differs: source={src.page_size} target={dst.page_size}")
    if len(src_indices) != len(dst_indices):
        raise ValueError(f"slot counts differ: source={len(src_indices)} target={len(dst_indices)}")
    if len(src_indices) % src.page_size:
        raise ValueError(f"{len(src_indices)} slots are not whole pages of {src.page_size} slots")


def page_ids(layout: HostPoolLayout, indices: Any, what: str) -> torch.Tensor:
    """Validate whole pages inside the pool (vectorized); return the page ids in order."""
    import torch

    ps = layout.page_size
    slots = as_int64(indices)
    if slots.numel() % ps:
        raise ValueError(f"{what}: {slots.numel()} slots are not whole pages of {ps}")
    rows = slots.reshape(-1, ps)
    first = rows[:, 0]
    bad = (first % ps != 0) | (first < 0) | (first + ps > layout.num_slots)
    if ps > 1:
        bad |= (rows != first[:, None] + torch.arange(ps)).any(dim=1)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0]) * ps
        raise ValueError(
            f"{what}: slots at position {pos} ({rows[pos // ps].tolist()}) are not one whole "
            f"page of {ps} slots inside the pool of {layout.num_slots} slots"
        )
    return first // ps


def plan_pages(
    src: HostPoolLayout,
    src_indices: Any,
    dst: HostPoolLayout,
    dst_indices: Any,
    *,
    chunk_bytes: int,
    dst_staging_addr: int | None = None,
    dst_staging_length: int = 0,
) -> PagePlan:
    """Plan copying src slot ``i`` to dst slot ``i`` (or to the staging region).

    ``chunk_bytes`` bounds one staging chunk (a chunk may exceed it by one page); 0 forbids
    gathering. With ``dst_staging_addr`` the plan is ``staged`` when direct entries would
    average under `STAGE_BELOW_ENTRY_BYTES`, and otherwise leaves the region unused (the
    plan's ``kind`` tells the target whether to scatter). Raises ValueError for
    inconsistent arguments, as `layout.plan_writes` does.
    """
    import torch

    check_page_args(src, src_indices, dst, dst_indices)
    sp = page_ids(src, src_indices, "source")
    dp = page_ids(dst, dst_indices, "target")
    pbytes = [src.page_size * b.item_len for b in src.buffers]
    n = int(sp.numel())
    total = n * sum(pbytes)
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return PagePlan("direct", 0, 0, empty, empty, empty)
    direct = _direct(src, sp, dst, dp, pbytes, total)
    can_chunk = chunk_bytes >= max(pbytes)  # else the region stays unused
    small = total // direct.entries < STAGE_BELOW_ENTRY_BYTES
    if dst_staging_addr is not None and can_chunk and small:
        if total > dst_staging_length:
            raise ValueError(
                f"staging region of {dst_staging_length} bytes is too small for {total} bytes"
            )
        pb = torch.tensor(pbytes, dtype=torch.int64)[:, None]
        block_starts = dst_staging_addr + n * (torch.cumsum(pb, 0) - pb)
        offsets = block_starts + torch.arange(n, dtype=torch.int64)[None, :] * pb
        return _chunked("staged", sp, offsets, pbytes, chunk_bytes, total)

    if not can_chunk or total // direct.entries >= DIRECT_ENTRY_BYTES:
        return direct
    # Gather: order pages by target address; entries = target runs x buffers.
    order = torch.argsort(dp, stable=True)
    dst_sorted = dp[order]
    dst_runs = 1 + int((dst_sorted[1:] != dst_sorted[:-1] + 1).sum())
    if dst_runs * len(pbytes) * GATHER_MIN_GAIN > direct.entries:
        return direct
    sp_sorted = sp[order]
    pb = torch.tensor(pbytes, dtype=torch.int64)[:, None]
    ptrs = torch.tensor([b.ptr for b in dst.buffers], dtype=torch.int64)[:, None]
    addrs = ptrs + dst_sorted[None, :] * pb
    return _chunked("gather", sp_sorted, addrs, pbytes, chunk_bytes, total)


# --------------------------------------------------------------------------------------
# Local copies
# --------------------------------------------------------------------------------------


def gather_chunk(src: HostPoolLayout, chunk: Chunk, into: torch.Tensor) -> None:
    """Copy the chunk's source pages into ``into`` (a uint8 tensor); releases the GIL."""
    import torch

    base = into.data_ptr()
    for b, pages, offset in chunk.groups:
        buf = src.buffers[b]
        pb = src.page_size * buf.item_len
        view = _pages_view(buf.ptr, buf.length, pb)
        out = _pages_view(base + offset, int(pages.numel()) * pb, pb)
        torch.index_select(view, 0, pages, out=out)


def scatter_from_staging(layout: HostPoolLayout, staging: Any, dst_indices: Any) -> None:
    """Target side of a staged transfer: copy the staging region into the granted slots.

    ``staging`` is a uint8 tensor (or anything with ``data_ptr()``/``nbytes``) holding the
    region in the format of the module docstring for ``dst_indices``. Proportional to the
    bytes moved: run it off the scheduler thread (torch releases the GIL while copying).
    """
    dp = page_ids(layout, dst_indices, "target")
    need = staged_size(layout, dp)
    if need > staging.nbytes:
        raise ValueError(f"staging holds {staging.nbytes} bytes, the pages need {need}")
    scatter_range(layout, staging.data_ptr(), dp, 0, need)


def staged_size(layout: HostPoolLayout, dst_pages: torch.Tensor) -> int:
    """Bytes of the staging region format for these target pages."""
    return int(dst_pages.numel()) * layout.page_size * sum(b.item_len for b in layout.buffers)


def scatter_range(
    layout: HostPoolLayout, base: int, dst_pages: torch.Tensor, lo: int, hi: int
) -> int:
    """Copy the pages whose staging bytes lie inside ``[lo, hi)`` (of the region at
    ``base``, module docstring format; ``lo`` on a page boundary) into ``dst_pages``
    (validated page ids, as `page_ids` returns). A page cut by ``hi`` is left for the next
    range: returns the page boundary everything below which is now copied."""
    n = int(dst_pages.numel())
    block, boundary = 0, None
    for buf in layout.buffers:
        pb = layout.page_size * buf.item_len
        first = max(0, -(-(lo - block) // pb))
        last = max(0, min(n, (hi - block) // pb))
        if first < last:
            pool = _pages_view(buf.ptr, buf.length, pb)
            rows = _pages_view(base + block + first * pb, (last - first) * pb, pb)
            pool.index_put_((dst_pages[first:last],), rows)
        if boundary is None and hi < block + n * pb:
            boundary = block + last * pb  # the last page boundary at or below hi
        block += n * pb
    return max(lo, block if boundary is None else boundary)


class StagingScatterer:
    """One daemon thread that runs `scatter_from_staging` off the scheduler thread.

    ``submit`` returns a Future the caller polls with ``done()`` (e.g. once per scheduler
    loop iteration) before it commits. Scatters run one at a time, in submission order,
    on a single torch thread (see `transfer._single_threaded_torch`).
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-migration-scatter", initializer=_one_thread
        )

    def submit(self, layout: HostPoolLayout, staging: Any, dst_indices: Any) -> Future[None]:
        return self._executor.submit(scatter_from_staging, layout, staging, dst_indices)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class StagingArena:
    """The target's staging memory: one region, granted in extents to staged migrations.

    The scheduler side registers `region` with its transport at start-up and publishes it
    (it must be in the peer regions a source checks writes against). `grant` hands out an
    extent for one migration, or None when there is no room (then grant nothing: the
    source writes into the slots directly). `release` returns an extent after commit,
    abort or expiry; an extent released while a late write could still land passes
    ``not_before`` (a `time.monotonic()` deadline) and is reused only after it, as the
    host slots of an aborted migration are quarantined. Not thread-safe: call it from
    the scheduler thread; every call is O(extents), never O(pages).
    """

    ALIGN = 4096

    def __init__(self, nbytes: int, pin: bool = False):
        import torch

        if nbytes <= 0:
            raise ValueError(f"staging arena size must be positive, got {nbytes}")
        # Pinned (page-locked) where CUDA can pin it; zeroed now so its pages are faulted
        # in at start-up, not in the middle of a transfer.
        self._memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).zero_()
        base = self._memory.data_ptr()
        self._free: list[tuple[int, int]] = [(base, nbytes)]  # (addr, length), by address
        self._quarantined: list[tuple[float, int, int]] = []  # (not_before, addr, length)

    @property
    def region(self) -> tuple[int, int]:
        """``(addr, length)`` of the whole arena, to register and publish."""
        return self._memory.data_ptr(), self._memory.numel()

    def tensor(self, addr: int, length: int) -> torch.Tensor:
        """The arena bytes of one granted extent (what `scatter_from_staging` reads)."""
        offset = addr - self._memory.data_ptr()
        if offset < 0 or offset + length > self._memory.numel():
            raise ValueError(f"extent 0x{addr:x}+{length} is not inside the arena")
        return self._memory[offset : offset + length]

    def grant(self, nbytes: int, now: float) -> tuple[int, int] | None:
        """First fit; ``(addr, length)`` or None if no free extent is large enough."""
        self._reclaim(now)
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        for i, (addr, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (addr + need, length - need)
                return addr, need
        return None

    def release(self, extent: tuple[int, int], not_before: float | None = None) -> None:
        if not_before is not None:
            self._quarantined.append((not_before, *extent))
            return
        self._insert_free(*extent)

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def _reclaim(self, now: float) -> None:
        ready = [q for q in self._quarantined if q[0] <= now]
        self._quarantined = [q for q in self._quarantined if q[0] > now]
        for _, addr, length in ready:
            self._insert_free(addr, length)

    def _insert_free(self, addr: int, length: int) -> None:
        """Insert, keeping address order, and merge with neighbours."""
        import bisect

        i = bisect.bisect_left(self._free, (addr, 0))
        self._free.insert(i, (addr, length))
        if i + 1 < len(self._free) and addr + length == self._free[i + 1][0]:
            self._free[i] = (addr, length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == addr:
            prev_addr, prev_len = self._free[i - 1]
            self._free[i - 1] = (prev_addr, prev_len + self._free.pop(i)[1])


def staging_bytes(layout: HostPoolLayout, num_slots: int) -> int:
    """Bytes a staging region needs for ``num_slots`` slots of ``layout``."""
    return num_slots * sum(b.item_len for b in layout.buffers)


def count_runs(layout: HostPoolLayout, indices: Sequence[int] | Any) -> int:
    """Runs of consecutive pages in ``indices`` (a target can grant staging only when
    this is large, and write directly otherwise)."""
    return len(page_runs(indices, layout.page_size))


# --------------------------------------------------------------------------------------
# Private helpers
# --------------------------------------------------------------------------------------


def _direct(
    src: HostPoolLayout,
    sp: torch.Tensor,
    dst: HostPoolLayout,
    dp: torch.Tensor,
    pbytes: list[int],
    total: int,
) -> PagePlan:
    import torch

    brk = torch.ones(sp.numel(), dtype=torch.bool)
    brk[1:] = (sp[1:] != sp[:-1] + 1) | (dp[1:] != dp[:-1] + 1)
    starts = brk.nonzero().reshape(-1)
    counts = torch.diff(starts, append=torch.tensor([sp.numel()]))
    s0, d0 = sp[starts], dp[starts]
    # One op per array over all buffers (buffer-major), not one per buffer: a long run of
    # small ops lets this thread keep the GIL from the scheduler loop (see `yield_gil`).
    pb = torch.tensor(pbytes, dtype=torch.int64)[:, None]
    src_ptrs = torch.tensor([b.ptr for b in src.buffers], dtype=torch.int64)[:, None]
    dst_ptrs = torch.tensor([b.ptr for b in dst.buffers], dtype=torch.int64)[:, None]
    return PagePlan(
        "direct",
        total,
        int(sp.numel()),
        (src_ptrs + s0[None, :] * pb).reshape(-1),
        (dst_ptrs + d0[None, :] * pb).reshape(-1),
        (counts[None, :] * pb).reshape(-1),
    )


def _chunked(
    kind: PlanKind,
    src_pages: torch.Tensor,
    dst_addrs: torch.Tensor,
    pbytes: list[int],
    chunk_bytes: int,
    total: int,
) -> PagePlan:
    """Items (buffer b, page i) in buffer-major order, each of ``pbytes[b]`` bytes going
    to ``dst_addrs[b, i]``; cut into chunks and into dst-contiguous entries."""
    import torch

    n = int(src_pages.numel())
    nbuf = len(pbytes)
    lengths = torch.tensor(pbytes, dtype=torch.int64).repeat_interleave(n)
    dsts = dst_addrs.reshape(-1)
    buf_of = torch.arange(nbuf).repeat_interleave(n)
    page_of = src_pages.repeat(nbuf)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    chunk_of = starts // chunk_bytes
    # Chunk k spans items whose start lies in [k * chunk_bytes, (k + 1) * chunk_bytes).
    new_chunk = torch.ones(lengths.numel(), dtype=torch.bool)
    new_chunk[1:] = chunk_of[1:] != chunk_of[:-1]
    chunk_first = new_chunk.nonzero().reshape(-1)
    local = starts - starts[chunk_first].repeat_interleave(
        torch.diff(chunk_first, append=torch.tensor([lengths.numel()]))
    )
    # Entries: break where the chunk changes or the target stops being contiguous.
    new_entry = new_chunk.clone()
    new_entry[1:] |= dsts[1:] != dsts[:-1] + lengths[:-1]
    # Gather groups: break where the chunk or the buffer changes.
    new_group = new_chunk.clone()
    new_group[1:] |= buf_of[1:] != buf_of[:-1]

    chunks = []
    bounds = chunk_first.tolist() + [lengths.numel()]
    entry_idx = new_entry.nonzero().reshape(-1)
    group_idx = new_group.nonzero().reshape(-1)
    e_cuts = torch.searchsorted(entry_idx, torch.tensor(bounds)).tolist()
    g_cuts = torch.searchsorted(group_idx, torch.tensor(bounds)).tolist()
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        yield_gil()
        e = entry_idx[e_cuts[k] : e_cuts[k + 1]]
        e_end = torch.cat([e[1:], torch.tensor([hi])]) - 1
        g = group_idx[g_cuts[k] : g_cuts[k + 1]].tolist()
        groups = tuple(
            (int(buf_of[a]), page_of[a:b], int(local[a]))
            for a, b in zip(g, g[1:] + [hi], strict=True)
        )
        chunks.append(
            Chunk(
                groups=groups,
                entry_offsets=local[e],
                entry_dsts=dsts[e],
                entry_lengths=ends[e_end] - starts[e],
                nbytes=int(ends[hi - 1] - starts[lo]),
            )
        )
    capacity = max(c.nbytes for c in chunks)
    return PagePlan(kind, total, n, chunks=tuple(chunks), chunk_capacity=capacity)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # per thread under OpenMP: the caller's threads keep theirs


def as_int64(indices: Any) -> torch.Tensor:
    """``indices`` as a flat int64 tensor; a Python list converts in slices of
    `_LIST_SLICE`, so another thread never waits long for the GIL."""
    import torch

    if isinstance(indices, torch.Tensor):
        return indices.to(torch.int64).reshape(-1)
    parts = []
    for i in range(0, len(indices), _LIST_SLICE):
        parts.append(torch.tensor(indices[i : i + _LIST_SLICE], dtype=torch.int64))
        yield_gil()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def yield_gil() -> None:
    """Let a thread waiting for the GIL (the scheduler loop) run now, instead of after
    CPython's 5 ms switch interval; called between slices of GIL-holding work.

    A zero sleep is not enough: this thread takes the GIL back before the woken waiter
    gets it. 50 us lets the waiter in; the worker pays it once per slice or chunk.
    """
    time.sleep(_YIELD_S)


def _pages_view(ptr: int, length: int, page_bytes: int) -> torch.Tensor:
    """A (pages, page_bytes) tensor over ``length`` bytes at ``ptr`` (no copy).

    Viewed as int64 words when alignment allows: torch's row copies run about twice as
    fast on 8-byte elements as on bytes.
    """
    import torch

    raw = (ctypes.c_uint8 * length).from_address(ptr)
    if ptr % 8 == 0 and page_bytes % 8 == 0:
        return torch.frombuffer(raw, dtype=torch.int64).view(-1, page_bytes // 8)
    return torch.frombuffer(raw, dtype=torch.uint8).view(-1, page_bytes)
