"""Copy whole KV pages between per-layer buffers in one kernel launch (device path).

`copy_pages` moves page `src_pages[i]` of every source buffer `b` to page `dst_pages[i]`
of destination buffer `b`, for all buffers and pages at once: one Triton launch instead
of two torch launches (gather, scatter) per buffer, and no staging copy, so each byte is
read once and written once. Destination buffers may live in another process (opened
through CUDA IPC) or on a peer GPU mapped into this device's address space (NVLink).

Buffers are given as pointer tables (int64 tensors of data pointers on the launching
device); every buffer has the same page size in bytes, a multiple of 8.
`copy_pages_torch` is the same copy with torch indexing, used when Triton cannot run
(and as the reference in tests).

Strided pages (`PageGeometry`): a page of one buffer need not be one contiguous block.
HiCache's host layouts `page_first` (all layers of a token together) and
`page_first_direct` (all layers of a page together) interleave layers, so row `r` of
page `p` of one layer's buffer lies at ``base + p * page_stride + r * row_stride``. The
same kernel then reads pinned host pages (their host addresses are device addresses
through unified addressing) and writes device pages: one launch per tier, no bounce
through a device buffer. `copy_pages_strided_torch` is its torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PageGeometry:
    """Where one buffer's page lies: row `r` of page `p` starts at
    ``base + p * page_stride + r * row_stride`` and is `row_bytes` long (bytes)."""

    rows: int  # rows (token slots) per page
    row_bytes: int
    page_stride: int
    row_stride: int

    @classmethod
    def contiguous(cls, rows: int, row_bytes: int) -> PageGeometry:
        return cls(rows, row_bytes, rows * row_bytes, row_bytes)

    @property
    def page_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def is_contiguous(self) -> bool:
        return self.row_stride == self.row_bytes and self.page_stride == self.page_bytes

    def check_words(self) -> None:
        """The kernel moves int64 words: every size and stride must be a multiple of 8."""
        values = (self.row_bytes, self.page_stride, self.row_stride)
        if any(v % 8 for v in values):
            raise ValueError(f"page geometry {self} is not a whole number of 8-byte words")


# int64 words each program copies (16 KiB): large enough to keep loads wide, small
# enough that pages of any size spread over many programs.
_CHUNK_WORDS = 2048
_kernel = None
_strided_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pages_kernel(
        src_ptrs,
        dst_ptrs,
        src_pages,
        dst_pages,
        page_words,
        chunks_per_page,
        CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0)  # page * chunks_per_page + chunk
        buf = tl.program_id(1)
        page = pid // chunks_per_page
        chunk = pid % chunks_per_page
        src_base = tl.load(src_ptrs + buf).to(tl.pointer_type(tl.int64))
        dst_base = tl.load(dst_ptrs + buf).to(tl.pointer_type(tl.int64))
        sp = tl.load(src_pages + page).to(tl.int64)
        dp = tl.load(dst_pages + page).to(tl.int64)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < page_words
        values = tl.load(src_base + sp * page_words + offs, mask=mask)
        tl.store(dst_base + dp * page_words + offs, values, mask=mask)

    return copy_pages_kernel


def _build_strided_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_strided_pages_kernel(
        src_ptrs,
        dst_ptrs,
        src_pages,
        dst_pages,
        row_words,
        page_words,
        chunks_per_page,
        src_page_stride,
        src_row_stride,
        dst_page_stride,
        dst_row_stride,
        CHUNK: tl.constexpr,
    ):
        # Strides in words. Word `offs` of a page is word `col` of row `row`.
        pid = tl.program_id(0)  # page * chunks_per_page + chunk
        buf = tl.program_id(1)
        page = pid // chunks_per_page
        chunk = pid % chunks_per_page
        src_base = tl.load(src_ptrs + buf).to(tl.pointer_type(tl.int64))
        dst_base = tl.load(dst_ptrs + buf).to(tl.pointer_type(tl.int64))
        sp = tl.load(src_pages + page).to(tl.int64)
        dp = tl.load(dst_pages + page).to(tl.int64)
        offs = (chunk * CHUNK + tl.arange(0, CHUNK)).to(tl.int64)
        mask = offs < page_words
        row = offs // row_words
        col = offs - row * row_words
        src = src_base + sp * src_page_stride + row * src_row_stride + col
        dst = dst_base + dp * dst_page_stride + row * dst_row_stride + col
        tl.store(dst, tl.load(src, mask=mask), mask=mask)

    return copy_strided_pages_kernel


def copy_pages_strided(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    src: PageGeometry,
    dst: PageGeometry,
) -> None:
    """`copy_pages` for pages laid out by `src` / `dst` (same rows and row size). Source
    pointers may be pinned host addresses: the launching GPU reads them over PCIe."""
    import triton

    global _strided_kernel
    if (src.rows, src.row_bytes) != (dst.rows, dst.row_bytes):
        raise ValueError(f"page shapes differ: source {src}, destination {dst}")
    if src.is_contiguous and dst.is_contiguous:
        copy_pages(src_ptrs, dst_ptrs, src_pages, dst_pages, src.page_bytes)
        return
    src.check_words()
    dst.check_words()
    n_pages, n_buffers = int(src_pages.numel()), int(src_ptrs.numel())
    if n_pages == 0:
        return
    if _strided_kernel is None:
        _strided_kernel = _build_strided_kernel()
    page_words = src.page_bytes // 8
    chunk = min(_CHUNK_WORDS, triton.next_power_of_2(page_words))
    chunks_per_page = triton.cdiv(page_words, chunk)
    _strided_kernel[(n_pages * chunks_per_page, n_buffers)](
        src_ptrs,
        dst_ptrs,
        src_pages,
        dst_pages,
        src.row_bytes // 8,
        page_words,
        chunks_per_page,
        src.page_stride // 8,
        src.row_stride // 8,
        dst.page_stride // 8,
        dst.row_stride // 8,
        CHUNK=chunk,
        num_warps=max(1, min(8, chunk // 256)),
    )


def copy_pages(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_bytes: int,
) -> None:
    """Launch the copy on the current stream of the device that holds the tables."""
    import triton

    global _kernel
    if page_bytes % 8:
        raise ValueError(f"page_bytes={page_bytes} is not a multiple of 8")
    n_pages, n_buffers = int(src_pages.numel()), int(src_ptrs.numel())
    if n_pages == 0:
        return
    if _kernel is None:
        _kernel = _build_kernel()
    page_words = page_bytes // 8
    chunk = min(_CHUNK_WORDS, triton.next_power_of_2(page_words))
    chunks_per_page = triton.cdiv(page_words, chunk)
    grid = (n_pages * chunks_per_page, n_buffers)
    _kernel[grid](
        src_ptrs,
        dst_ptrs,
        src_pages,
        dst_pages,
        page_words,
        chunks_per_page,
        CHUNK=chunk,
        num_warps=max(1, min(8, chunk // 256)),
    )


def copy_pages_torch(
    src_buffers: list[torch.Tensor],
    dst_buffers: list[torch.Tensor],
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_bytes: int,
) -> None:
    """The same copy with torch ops, two launches per buffer (flat uint8 buffers)."""
    for src, dst in zip(src_buffers, dst_buffers, strict=True):
        gathered = src.view(-1, page_bytes).index_select(0, src_pages)
        dst.view(-1, page_bytes).index_copy_(0, dst_pages, gathered.to(dst.device))


def strided_pages(
    flat: torch.Tensor, offset: int, geometry: PageGeometry, num_pages: int
) -> torch.Tensor:
    """A `(num_pages, rows, row_bytes)` uint8 view of one buffer inside the flat uint8
    tensor `flat` (its bytes from `offset` on), laid out by `geometry`; no copy."""
    g = geometry
    return flat.as_strided(
        (num_pages, g.rows, g.row_bytes), (g.page_stride, g.row_stride, 1), offset
    )


def copy_pages_strided_torch(
    src_views: Sequence[torch.Tensor],
    dst_views: Sequence[torch.Tensor],
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """`copy_pages_strided` with torch indexing, between `strided_pages` views (one per
    buffer, same order on both sides): the reference, and the fallback without Triton."""
    for src, dst in zip(src_views, dst_views, strict=True):
        gathered = src.index_select(0, src_pages.to(src.device))
        dst.index_copy_(0, dst_pages.to(dst.device), gathered.to(dst.device))
