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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# int64 words each program copies (16 KiB): large enough to keep loads wide, small
# enough that pages of any size spread over many programs.
_CHUNK_WORDS = 2048
_kernel = None


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
