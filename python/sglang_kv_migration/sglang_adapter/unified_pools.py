"""The KV pools on SGLang 0.5.23, where they differ from 0.5.12 (`pools.py` keeps what
is the same on both: shapes, buffers, the device allocator).

0.5.23's HiCache host pool is always a `HostPoolGroup` (`mem_cache/pool_host/group.py`),
a plain model's holding the KV pool alone at its anchor; the device pool is the one its
allocator holds; its host -> device copies run on the L2 transfer engine's stream. The
tree core exposes no walk of its nodes, so what `evict_host` could free is not known
ahead: a host allocation evicts, then checks (see `alloc_host_slots`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.sglang_adapter import pool_groups

if TYPE_CHECKING:
    import torch

Cache = Any  # sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache


def host_pool(cache: Cache) -> Any:
    """The cache's `HostPoolGroup` (KV pool at its anchor: `pool_groups.kv_host_pool`)."""
    return cache.cache_controller.mem_pool_host


def device_pool(cache: Cache) -> Any:
    """The `MHATokenToKVPool` / `MLATokenToKVPool` the tree's device slots index."""
    return cache.token_to_kv_pool_allocator.get_kvcache()


def host_evictable_size(cache: Cache) -> int:
    """0 on 0.5.23: its tree core does not tell how much `evict_host` could free."""
    return 0


def host_headroom_tokens(cache: Cache) -> int:
    """Free host slots (a lower bound of what `alloc_host_slots` could claim: what host
    eviction would add is not known ahead on 0.5.23)."""
    return int(host_pool(cache).available_size())


def alloc_host_slots(cache: Cache, num_tokens: int) -> torch.Tensor:
    """Host slots for `num_tokens`, evicting unlocked host-only pages if needed. Unlike
    0.5.12, a request the pool cannot meet may have evicted host pages first."""
    pool = host_pool(cache)
    slots = pool.alloc(num_tokens)
    if slots is not None:
        return slots
    free = int(pool.available_size())
    cache.evict_host(num_tokens - free)
    slots = pool.alloc(num_tokens)
    if slots is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"host pool is full: {num_tokens} token slots needed, {free} free and "
            f"{pool.available_size()} after evicting unlocked host pages",
        )
    return slots


def take_host_slots(cache: Cache, slots: torch.Tensor) -> None:
    """Mark `slots` allocated again in the KV host pool (after a reset freed them all):
    out of its free lists and into its record of used slots (its double-free check)."""
    import torch

    pool = pool_groups.kv_host_pool(host_pool(cache))
    pool._merge_release_slots()
    taken = torch.isin(pool.free_slots, slots.to(pool.free_slots.device))
    pool.free_slots = pool.free_slots[~taken]
    pool.slot_used[slots.cpu()] = True


def pending_device_write_streams(cache: Cache) -> list[Any]:
    """Streams that may still be writing device KV pages the tree already lists (the
    L2 transfer engine's host -> device loads)."""
    return [cache.cache_controller.l2_transfer_engine.host_to_device_stream]


def host_pool_shape(cache: Cache) -> Any:
    """The device path does not read 0.5.23's host pools in place: host-only pages go by
    the host path there."""
    raise MigrationError(
        ErrorKind.UNAVAILABLE,
        "the device path does not read SGLang 0.5.23's host pools in place",
    )


def copy_device_to_host(cache: Cache, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
    """Copy every layer's KV of `device_slots` into `host_slots` of the KV host pool and
    wait for it (the host pool's own backup copy, on the calling thread's stream)."""
    import torch

    controller = cache.cache_controller
    host = pool_groups.kv_host_pool(host_pool(cache))
    device = device_pool(cache)
    device_indices = device_slots.to(device=device.device, dtype=torch.int64)
    host.backup_from_device_all_layer(device, host_slots, device_indices, controller.io_backend)
    if device_indices.is_cuda:
        torch.cuda.current_stream(device_indices.device).synchronize()
