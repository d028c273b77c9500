"""The KV pools behind the tree: the host pool (`cache.cache_controller.mem_pool_host`),
the device pool (`cache.kv_cache`) and its allocator (`cache.token_to_kv_pool_allocator`):
their shapes and buffers, and slots allocated (evicting by the tree's rules), freed and
taken back. Called on the scheduler thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.cp_owners import PageOwners
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.fingerprint import KVCacheShape
from sglang_kv_migration.sglang_adapter import pool_groups
from sglang_kv_migration.sglang_adapter.installed import host_pool_classes

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import TreeNode


@dataclass(frozen=True)
class HostPoolShape:
    """What the device path needs to read a host pool's pages in place."""

    attention: str  # "mha" or "mla"
    layout: str  # hicache_mem_layout
    layer_num: int
    page_num: int
    page_size: int
    row_bytes: int  # one token of one layer (one plane)
    kv_buffer: torch.Tensor  # the one contiguous host tensor every layout uses
    pinned: bool  # page-locked, so the GPU can read it through unified addressing


def host_pool_shape(cache: HiRadixCache) -> HostPoolShape:
    pool = host_pool(cache)
    if pool_groups.is_pool_group(pool):
        # The device path reads the KV pool's host pages in place; the other pools of
        # a group (the NSA indexer) it does not read, so host-only pages go by the host
        # path instead.
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"host pool group {'+'.join(pool_groups.pool_names(pool))} is not read in "
            "place by the device path",
        )
    attention = _host_attention(pool)
    if attention is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE, f"host KV pool {type(pool).__name__} is not supported"
        )
    buffer = pool.kv_buffer
    pinned = bool(pool.pin_memory) and buffer.device.type == "cpu" and _is_pinned(buffer)
    return HostPoolShape(
        attention=attention,
        layout=str(pool.layout),
        layer_num=int(pool.layer_num),
        page_num=int(pool.page_num),
        page_size=int(pool.page_size),
        row_bytes=int(pool.token_stride_size),
        kv_buffer=buffer,
        pinned=pinned,
    )


@dataclass(frozen=True)
class HostPoolBuffer:
    """A host pool's one contiguous `kv_buffer`, as the host path's layout math splits it
    (`paths/host/layout.py`)."""

    attention: str  # "mha" or "mla"
    layout: str  # hicache_mem_layout
    base_ptr: int
    nbytes: int
    layer_num: int
    page_size: int
    num_slots: int  # token slots (`pool.size`)
    slot_bytes: int  # bytes one token slot takes over every layer and plane


def host_pool_buffer(pool: Any) -> HostPoolBuffer:
    """Read a live `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` (a group's KV pool:
    `pool_groups`); raises ValueError for another pool type or a `kv_buffer` that is not
    one dense allocation."""
    pool = pool_groups.kv_host_pool(pool)
    attention = _host_attention(pool)
    if attention is None:
        raise ValueError(f"unsupported host pool type {type(pool).__name__} for KV migration")
    kv = pool.kv_buffer
    # The layout's split assumes one dense allocation, which init_kv_buffer always makes.
    if not kv.is_contiguous():
        raise ValueError(f"host pool kv_buffer is not contiguous (shape {tuple(kv.shape)})")
    if attention == "mha":
        slot_bytes = 2 * pool.layer_num * pool.head_num * pool.head_dim * kv.element_size()
    else:
        slot_bytes = pool.layer_num * pool.kv_cache_dim * kv.element_size()
    return HostPoolBuffer(
        attention=attention,
        layout=pool.layout,
        base_ptr=kv.data_ptr(),
        nbytes=kv.nbytes,
        layer_num=pool.layer_num,
        page_size=pool.page_size,
        num_slots=pool.size,
        slot_bytes=slot_bytes,
    )


# The hook a fork whose CP ranks own disjoint pages implements (docs/reliability.md, "What
# an owner-sharded fork provides"): its device allocator names its owner function, one of
# `cp_owners.KNOWN_OWNER_FUNCTIONS` (e.g. "round_robin:1"), under this attribute, and
# allocates pages with a given owner pattern through the method below. Stock SGLang has
# neither: its CP ranks replicate every page.
CP_OWNER_ATTRIBUTE = "kv_migration_cp_owner"
OWNER_AWARE_ALLOCATION = "alloc_pages_with_owners"


def cp_page_owners(cache: HiRadixCache, attn_cp_size: int) -> PageOwners | None:
    """This rank's owner function if its CP ranks own disjoint pages, else None (stock
    SGLang: replicated). ValueError naming the problem for a fork that names an unknown
    function or lacks an owner-aware allocator."""
    allocator = cache.token_to_kv_pool_allocator
    name = getattr(allocator, CP_OWNER_ATTRIBUTE, None)
    if name is None:
        return None
    if not callable(getattr(allocator, OWNER_AWARE_ALLOCATION, None)):
        raise ValueError(
            f"{type(allocator).__name__} names owner function {name!r} in "
            f"{CP_OWNER_ATTRIBUTE} but has no {OWNER_AWARE_ALLOCATION}()"
        )
    return PageOwners.parse(name, attn_cp_size)


def alloc_pages_with_owners(
    cache: HiRadixCache, owners: PageOwners, pattern: list[int]
) -> torch.Tensor:
    """Device token slots for one page per entry of `pattern` whose owners under
    `owners` are exactly `pattern` (a sharding fork's `alloc_pages_with_owners`),
    evicting by the tree's rules when the pool is short, and checked before the caller
    grants them: slots that do not reproduce the pattern are freed again and refused
    (CONFLICT naming cp_owner), so nothing is kept either way."""
    import torch

    allocator = cache.token_to_kv_pool_allocator
    allocate = getattr(allocator, OWNER_AWARE_ALLOCATION, None)
    if allocate is None:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"cp_owner={owners.describe()}: this server's allocator has no "
            f"{OWNER_AWARE_ALLOCATION}()",
        )
    num_tokens = len(pattern) * int(allocator.page_size)
    slots = _alloc_evicting(cache, num_tokens, lambda: allocate(list(pattern)))
    if slots is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"device KV pool has no pages with the owners asked for ({len(pattern)} pages, "
            f"cp_owner={owners.describe()})",
        )
    slots = slots.to(torch.int64)
    page_size = int(allocator.page_size)
    pages = (slots[::page_size] // page_size).tolist()
    whole = len(slots) == num_tokens and bool(
        (slots.view(-1, page_size)[:, 0] % page_size == 0).all()
    )
    if not whole or not owners.allocation_matches(pages, pattern):
        allocator.free(slots)
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"cp_owner={owners.describe()}: {OWNER_AWARE_ALLOCATION}() gave pages whose "
            "owners are not the page_owners asked for; nothing was kept",
        )
    return slots


def kv_cache_shape(pool: Any) -> KVCacheShape:
    """What the layout fingerprint takes from a host pool and the device pool behind it;
    raises ValueError for a host pool type migration does not support."""
    group = pool
    names = pool_groups.pool_names(pool)
    indexer = pool_groups.indexer_shape(pool)
    pool = pool_groups.kv_host_pool(pool)
    attention = _host_attention(pool)
    if attention is None:
        raise ValueError(f"unsupported host pool type {type(pool).__name__} for KV migration")
    dev = pool_groups.kv_device_pool(group)
    is_mha = attention == "mha"
    return KVCacheShape(
        host_pools="+".join(names),
        index_head_dim=indexer.index_head_dim if indexer else 0,
        index_dtype=indexer.index_dtype if indexer else "",
        attention=attention,
        # The logical dtype: fp8 e4m3 and e5m2 are both stored as uint8.
        kv_dtype=str(dev.dtype).removeprefix("torch."),
        start_layer=int(dev.start_layer),
        end_layer=int(dev.end_layer),
        kv_heads=int(dev.head_num) if is_mha else 1,
        head_dim=int(dev.head_dim) if is_mha else 0,
        kv_lora_rank=0 if is_mha else int(dev.kv_lora_rank),
        qk_rope_head_dim=0 if is_mha else int(dev.qk_rope_head_dim),
        page_size=int(pool.page_size),
        host_layout=str(pool.layout),
    )


def pending_device_write_streams(cache: HiRadixCache) -> list[Any]:
    """Streams that may still be writing device KV pages the tree already lists
    (HiCache's host->device load-back)."""
    return [cache.cache_controller.load_stream]


def host_pool(cache: HiRadixCache) -> Any:
    """The `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` of a HiRadixCache, or for NSA
    models the `HostPoolGroup` (KV + indexer, `pool_groups`) that allocates for both."""
    return cache.cache_controller.mem_pool_host


def device_pool(cache: HiRadixCache) -> Any:
    """The `MHATokenToKVPool` / `MLATokenToKVPool` the tree's device slots index (the
    one its allocator allocates in, on every SGLang line)."""
    return cache.token_to_kv_pool_allocator.get_kvcache()


def device_kv_buffers(cache: HiRadixCache) -> list[torch.Tensor]:
    """The device pool's per-layer buffers, one row per token slot: K layers then V
    layers for MHA, the latent cache per layer for MLA, then for NSA the indexer's keys
    per layer (`pool_groups.device_indexer_rows`)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    pool = device_pool(cache)
    if isinstance(pool, MHATokenToKVPool):
        return [*pool.k_buffer, *pool.v_buffer]
    if isinstance(pool, MLATokenToKVPool):
        return [*pool.kv_buffer, *pool_groups.device_indexer_rows(pool)]
    raise MigrationError(
        ErrorKind.UNAVAILABLE, f"device KV pool {type(pool).__name__} is not supported"
    )


def alloc_host_slots(cache: HiRadixCache, num_tokens: int) -> torch.Tensor:
    """Host slots for `num_tokens`, evicting unlocked host-only pages if needed.

    Feasibility is decided before anything is evicted: a request that cannot be met
    leaves the host cache as it was.
    """
    pool = host_pool(cache)
    slots = pool.alloc(num_tokens)
    if slots is not None:
        return slots
    free = int(pool.available_size())
    evictable = host_evictable_size(cache)
    if free + evictable < num_tokens:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"host pool is full: {num_tokens} token slots needed, {free} free and "
            f"{evictable} evictable; nothing was evicted",
        )
    cache.evict_host(num_tokens - free)
    slots = pool.alloc(num_tokens)
    if slots is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"host pool is full: {num_tokens} token slots needed, "
            f"{pool.available_size()} free after evicting unlocked host pages",
        )
    return slots


def no_slots() -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=torch.int64)


def free_host_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    if len(slots):
        host_pool(cache).free(slots)


def host_evictable_size(cache: HiRadixCache) -> int:
    """Host tokens `evict_host` could free: host-only subtrees nobody protects."""

    def walk(node: TreeNode) -> tuple[int, bool]:
        total, whole = 0, True
        for child in node.children.values():
            size, child_whole = walk(child)
            total += size
            whole = whole and child_whole
        if node is cache.root_node:
            return total, False
        # `evict_host` starts from evictable host leaves, which exclude locked nodes.
        if (
            whole
            and node.evicted
            and node.host_ref_counter == 0
            and node.lock_ref == 0
            and node.host_value is not None
        ):
            return total + len(node.host_value), True
        return total, False

    return walk(cache.root_node)[0]


def host_headroom_tokens(cache: HiRadixCache) -> int:
    """Host slots `alloc_host_slots` could claim now: free plus evictable."""
    return int(host_pool(cache).available_size()) + host_evictable_size(cache)


def alloc_device_slots(cache: HiRadixCache, num_tokens: int) -> torch.Tensor:
    """Device token slots for `num_tokens` (whole pages), evicting by the tree's rules.

    Feasibility (free + evictable) is decided before anything is evicted.
    """
    allocator = cache.token_to_kv_pool_allocator
    slots = _alloc_evicting(cache, num_tokens, lambda: allocator.alloc(num_tokens))
    if slots is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"device KV pool is full: {num_tokens} token slots needed, "
            f"{allocator.available_size()} free after evicting unlocked device pages",
        )
    return slots


def _alloc_evicting(
    cache: HiRadixCache, num_tokens: int, allocate: Callable[[], torch.Tensor | None]
) -> torch.Tensor | None:
    """`allocate()`, and once more after evicting unlocked device pages by the tree's
    rules when the pool is short (None when it still fails). Feasibility (free +
    evictable >= `num_tokens`) is decided before anything is evicted."""
    slots = allocate()
    if slots is not None:
        return slots
    free = int(cache.token_to_kv_pool_allocator.available_size())
    evictable = int(cache.evictable_size())
    if free + evictable < num_tokens:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"device KV pool is full: {num_tokens} token slots needed, {free} free and "
            f"{evictable} evictable; nothing was evicted",
        )
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=num_tokens - free))
    return allocate()


def free_device_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    if len(slots):
        cache.token_to_kv_pool_allocator.free(slots)


def take_host_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    """Remove `slots` from the host pool's free list (after a reset freed them all)."""
    import torch

    pool = pool_groups.kv_host_pool(host_pool(cache))  # the group's allocator
    taken = torch.isin(pool.free_slots, slots.to(pool.free_slots.device))
    pool.free_slots = pool.free_slots[~taken]


def take_device_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    """Remove the pages of `slots` from the device allocator's free lists (after a reset)."""
    import torch

    allocator = cache.token_to_kv_pool_allocator
    pages = torch.unique(slots // allocator.page_size)
    for name in ("free_pages", "release_pages"):
        free = getattr(allocator, name)
        setattr(allocator, name, free[~torch.isin(free, pages.to(free.device))])


def device_available_size(cache: HiRadixCache) -> int:
    return int(cache.token_to_kv_pool_allocator.available_size())


# --------------------------------------------------------------------------- helpers


def _host_attention(pool: Any) -> str | None:
    """ "mha" / "mla" for the host pool classes migration supports, else None (an MHA
    pool whose V rows differ in width from its K rows included: 0.5.23 allows them)."""
    classes = host_pool_classes()
    if isinstance(pool, classes.mha):
        split_v = classes.mha_has_v_head_dim and pool.v_head_dim != pool.head_dim
        return None if split_v else "mha"
    if isinstance(pool, classes.mla):
        return "mla"
    return None


def _is_pinned(t: torch.Tensor) -> bool:
    import torch

    # `is_pinned` asks the CUDA driver; without CUDA nothing is pinned (and asking may raise).
    return torch.cuda.is_available() and t.is_pinned()
