"""Host pool groups: what SGLang 0.5.12 gives NSA models (DeepSeek-V3.2 class) as their
HiCache host pool, and the NSA indexer's own pools on host and device.

An NSA server's `HiRadixCache` holds a `HostPoolGroup` (`hybrid_pool_assembler.
attach_hybrid_nsa_pool_to_hiradix_cache`): the MLA KV host pool as the group's index
anchor, plus an `NSAIndexerPoolHost` holding the indexer's quantized keys and their
scales. Both are addressed by the same host slot indices (the indexer converts a page's
first slot to its page number), so a page of the tree lives at the same place in both, and
a migration that moves every pool of the group at the same slots moves the page whole.

Groups whose other pools have their own index space (SWA, Mamba, DeepSeek-V4) are refused
here, naming what they hold: moving them needs their own slot allocation.

The indexer buffers, as `NSAIndexerPoolHost.init_kv_buffer` and `NSATokenToKVPool` lay
them out (``P`` pages allocated, ``L`` layers, ``B`` bytes of one page of one layer:
``page_size * (index_head_dim + index_head_dim // quant_block * 4)`` uint8):

==================  ===================  ====================================
pool                layout               buffer dims (uint8)
==================  ===================  ====================================
host                layer_first          (L, P, B)
host                page_first(_direct)  (P, L, 1, B)
device              (any)                L tensors of (P, B)
==================  ===================  ====================================

A page's bytes in one layer are one block of ``B``; the block of the page starting at
slot ``t`` is block ``t // page_size``. Whole pages only move, so a block can be described
as ``page_size`` token rows of ``B / page_size`` bytes each (the layout math's unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.sglang_adapter.installed import host_pool_classes

# The pool names a group may hold for migration (SGLang's `PoolName` values).
KV_POOL = "kv"
INDEXER_POOL = "indexer"


@dataclass(frozen=True)
class IndexerPoolBuffer:
    """An `NSAIndexerPoolHost`'s buffer, as the host path's layout math splits it."""

    layout: str  # hicache_mem_layout
    base_ptr: int
    layer_num: int
    page_size: int
    num_slots: int  # token slots of the anchor KV pool (the group's index space)
    page_bytes: int  # one page of one layer
    pages_allocated: int  # pages the buffer holds (a few more than num_slots / page_size)


@dataclass(frozen=True)
class IndexerShape:
    """What the layout fingerprint takes from an NSA indexer pool."""

    index_head_dim: int
    index_dtype: str  # storage dtype of the indexer keys with their scales
    index_page_bytes: int  # one page of one layer


def is_pool_group(pool: Any) -> bool:
    """Whether `pool` is a `HostPoolGroup` (on 0.5.23 every HiCache host pool is one,
    a plain model's holding the KV pool alone)."""
    return isinstance(pool, host_pool_classes().group)


def kv_host_pool(pool: Any) -> Any:
    """The KV host pool: `pool` itself, or a group's index anchor."""
    return pool.anchor_entry.host_pool if is_pool_group(pool) else pool


def kv_device_pool(pool: Any) -> Any:
    """The device pool behind the KV host pool of `pool` (a group's anchor entry)."""
    return pool.anchor_entry.device_pool if is_pool_group(pool) else pool.device_pool


def pool_names(pool: Any) -> tuple[str, ...]:
    """The pools a migration moves for one page, anchor first: ``("kv",)`` for a plain
    host pool, ``("kv", "indexer")`` for an NSA group; raises ValueError for a group
    holding a pool with its own index space."""
    if not is_pool_group(pool):
        return (KV_POOL,)
    names = [_entry_name(entry) for entry in pool.entries]
    anchor = _entry_name(pool.anchor_entry)
    unsupported = [n for n in names if n not in (KV_POOL, INDEXER_POOL)]
    if anchor != KV_POOL or unsupported or len(set(names)) != len(names):
        raise ValueError(
            f"unsupported host pool group for KV migration: pools {names} (anchor {anchor!r}); "
            f"only KV plus the NSA indexer ({KV_POOL!r}, {INDEXER_POOL!r}) share one slot space"
        )
    return (KV_POOL, *sorted(n for n in names if n != KV_POOL))


def indexer_host_pool(pool: Any) -> Any | None:
    """A group's `NSAIndexerPoolHost`, or None (no group, or none in it)."""
    if not is_pool_group(pool) or INDEXER_POOL not in pool_names(pool):
        return None
    for entry in pool.entries:
        if _entry_name(entry) == INDEXER_POOL:
            return entry.host_pool
    return None


def indexer_pool_buffer(pool: Any) -> IndexerPoolBuffer:
    """Read a live `NSAIndexerPoolHost`; raises ValueError for another type, a layout
    it does not lay out as documented above, or a buffer that is not one allocation."""
    indexer_class = host_pool_classes().nsa_indexer
    if indexer_class is None or not isinstance(pool, indexer_class):
        raise ValueError(f"{type(pool).__name__} is not an NSA indexer host pool")
    buf = pool.index_k_with_scale_buffer
    if not buf.is_contiguous():
        raise ValueError(f"NSA indexer host buffer is not contiguous (shape {tuple(buf.shape)})")
    page_bytes = int(pool.indexer_page_stride_size) * buf.element_size()
    if pool.layout == "layer_first":
        expected = (pool.layer_num, pool.indexer_page_num, pool.indexer_page_stride_size)
    elif pool.layout in ("page_first", "page_first_direct"):
        expected = (pool.indexer_page_num, pool.layer_num, 1, pool.indexer_page_stride_size)
    else:
        raise ValueError(f"NSA indexer host layout {pool.layout!r} is not supported")
    if tuple(buf.shape) != tuple(int(d) for d in expected):
        raise ValueError(
            f"NSA indexer host buffer has shape {tuple(buf.shape)}, expected {expected} "
            f"for layout {pool.layout}"
        )
    return IndexerPoolBuffer(
        layout=str(pool.layout),
        base_ptr=int(buf.data_ptr()),
        layer_num=int(pool.layer_num),
        page_size=int(pool.page_size),
        num_slots=int(pool.size),
        page_bytes=page_bytes,
        pages_allocated=int(pool.indexer_page_num),
    )


def indexer_shape(pool: Any) -> IndexerShape | None:
    """The indexer's part of the fingerprint for a host pool (None without an indexer)."""
    indexer = indexer_host_pool(pool)
    if indexer is None:
        return None
    return IndexerShape(
        index_head_dim=int(indexer.index_head_dim),
        index_dtype=str(indexer.indexer_dtype).removeprefix("torch."),
        index_page_bytes=int(indexer.indexer_page_stride_size) * indexer.indexer_dtype.itemsize,
    )


def device_indexer_rows(device_pool: Any) -> list[Any]:
    """An `NSATokenToKVPool`'s indexer buffers, one per layer, viewed as one row per
    token slot (``page_size`` rows make the page's block: whole pages only move), or []
    for a pool without an indexer."""
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    if not isinstance(device_pool, NSATokenToKVPool):
        return []
    page_size = int(device_pool.page_size)
    rows = []
    for buf in device_pool.index_k_with_scale_buffer:
        block = int(buf.shape[1]) * buf.element_size()
        if block % page_size or not buf.is_contiguous():
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                f"NSA indexer device buffer of shape {tuple(buf.shape)} does not split into "
                f"{page_size} rows per page",
            )
        rows.append(buf.view(-1, int(buf.shape[1]) // page_size))
    return rows


def _entry_name(entry: Any) -> str:
    return str(entry.name.value)  # `PoolName` is a str Enum
