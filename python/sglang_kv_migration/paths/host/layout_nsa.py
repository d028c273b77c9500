"""The NSA indexer's host buffers in the host path's layout math (`layout.py`).

An NSA model's host pool is a group: the MLA KV pool plus the indexer's pool, both indexed
by the KV pool's token slots (`sglang_adapter.pool_groups` has the buffer shapes). The
indexer keeps one block per page and layer instead of one item per token, but a page's
block is ``page_size`` times a per-token share, so it becomes `HostBuffer`s like any
other: the page starting at slot ``t`` is ``[t * item_len, (t + page_size) * item_len)``
of its buffer, with ``item_len = block / page_size``. That holds for whole pages only,
which is all a migration moves (`layout.page_runs`).

Each buffer is published over the slots the KV pool has (``num_slots * item_len``); the
pool allocates a page or two more at the end, which no slot reaches.
"""

from __future__ import annotations

from sglang_kv_migration import sglang_adapter

# (ptr, length, item_len) of one buffer: what `layout.HostBuffer` takes.
BufferSpan = tuple[int, int, int]


def indexer_host_buffers(pool: sglang_adapter.IndexerPoolBuffer) -> list[BufferSpan]:
    """The indexer's buffers, appended after the KV pool's in a group's layout: one per
    layer (layer_first) or one for all layers (page_first, page_first_direct)."""
    if pool.page_bytes % pool.page_size:
        raise ValueError(
            f"NSA indexer page of {pool.page_bytes} bytes does not split into "
            f"{pool.page_size} token slots"
        )
    if pool.pages_allocated * pool.page_size < pool.num_slots:
        raise ValueError(
            f"NSA indexer holds {pool.pages_allocated} pages, fewer than the "
            f"{pool.num_slots // pool.page_size} pages of the KV pool"
        )
    slot_share = pool.page_bytes // pool.page_size
    if pool.layout == "layer_first":
        layer_stride = pool.pages_allocated * pool.page_bytes
        return [
            (pool.base_ptr + layer * layer_stride, pool.num_slots * slot_share, slot_share)
            for layer in range(pool.layer_num)
        ]
    if pool.layout in ("page_first", "page_first_direct"):
        item_len = pool.layer_num * slot_share
        return [(pool.base_ptr, pool.num_slots * item_len, item_len)]
    raise ValueError(f"NSA indexer host layout {pool.layout!r} is not supported")
