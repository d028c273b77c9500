"""Content digests for the opt-in `verify`: what the source sent equals what landed.

Both sides hash the KV bytes of one migration's pages **in prefix order**, so the hash
does not depend on where the pages sit in either pool:

- host path: for each host buffer (layout order), the bytes of each page in prefix order
  (`layout.HostPoolLayout`: a page starting at slot ``t`` is
  ``[t * item_len, (t + page_size) * item_len)`` of its buffer). Source and target agree
  on the host layout (the fingerprint checks it), so their buffers match one to one.
- device path: for each device KV buffer (K layers, then V layers; MLA: one per layer),
  the rows of the slots in prefix order. A source that reads some pages from its host
  pool (`tiers.py`) hashes the same stream: per buffer, each page's rows in prefix order,
  from whichever tier holds it (`tier_pages_digest`).

The digest is xxh3_128 over that byte stream (`xxhash`), hex. It is computed only when
a grant asks for it (`Grant.verify`), off the scheduler thread on the source (`submit`),
and on the target's scheduler thread at commit (one pass over the migrated bytes,
roughly 10 GB/s; the price of asking for verification).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

    from sglang_kv_migration.paths.host.layout import HostPoolLayout

# Pages hashed per gather: bounds the temporary copy (a few MB per buffer).
_PAGES_PER_GATHER = 256

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def submit(fn: Callable[[], str]) -> Future[str]:
    """Run a digest on the shared background thread (one per process: hashing is
    memory-bound and the scheduler thread must not wait for it)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-migration-verify")
        return _executor.submit(fn)


def host_pages_digest(layout: HostPoolLayout, slots: torch.Tensor | Sequence[int]) -> str:
    """xxh3_128 of the host pages holding `slots` (whole pages, prefix order)."""
    import torch

    slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    pages = slots[:: layout.page_size] // layout.page_size
    h = xxhash.xxh3_128()
    for buf in layout.buffers:
        page_bytes = layout.page_size * buf.item_len
        raw = (ctypes.c_uint8 * buf.length).from_address(buf.ptr)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(-1, page_bytes)
        for lo in range(0, len(pages), _PAGES_PER_GATHER):
            chunk = torch.index_select(view, 0, pages[lo : lo + _PAGES_PER_GATHER])
            h.update(chunk.numpy())
    return h.hexdigest()


def device_rows_digest(buffers: Sequence[torch.Tensor], slots: torch.Tensor) -> str:
    """xxh3_128 of the rows `slots` (prefix order) of every device KV buffer."""
    import torch

    h = xxhash.xxh3_128()
    for buf in buffers:
        idx = slots.to(buf.device, torch.int64)
        rows = buf.index_select(0, idx).contiguous().view(-1).view(torch.uint8)
        h.update(rows.cpu().numpy())
    return h.hexdigest()


def tier_pages_digest(pieces: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor]]) -> str:
    """xxh3_128 of pages read from several tiers, equal to `device_rows_digest` of the
    same rows: for each buffer, for each (views, pages) piece in prefix order, the
    pages of that buffer's `(num_pages, rows, row_bytes)` view (`tiers.TierBuffers`)."""
    h = xxhash.xxh3_128()
    num_buffers = len(pieces[0][0]) if pieces else 0
    for b in range(num_buffers):
        for views, pages in pieces:
            view = views[b]
            idx = pages.to(view.device)
            for lo in range(0, len(idx), _PAGES_PER_GATHER):
                chunk = view.index_select(0, idx[lo : lo + _PAGES_PER_GATHER])
                h.update(chunk.contiguous().cpu().numpy())
    return h.hexdigest()
