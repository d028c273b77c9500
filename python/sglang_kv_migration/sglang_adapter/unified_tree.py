"""The radix tree on SGLang 0.5.23: `UnifiedRadixCache` with HiCache attached, the same
functions `radix_tree.py` gives for 0.5.12's `HiRadixCache`, with the same contracts.

0.5.23 keeps its tree in a tree core (`unified_cache/`; the Rust extension by default,
a Python one as fallback) that hands out node ids, never node objects. So everything here
goes through the cache's public API and the tree core's interface
(`UnifiedTreeCoreInterface`), which both cores implement:

- matches: `cache.match_prefix` (its `MatchResult` holds node ids and lengths, no
  device slots), slots read with `tree_core.collect_full_device_indices`;
- a path's nodes and tiers: `tree_core.collect_path_info`; a node's host slots:
  `tree_core.build_storage_backup_spec(node).host_value` (None until backed up);
- locks: `cache.lock` / `cache.unlock` (a `TreeLock` receipt), host protection:
  `cache.inc_host_lock_ref` / `dec_host_lock_ref` (receipts again);
- the device -> host copy: `cache.backup_node_for_write_back`, which copies one node and
  waits for it, parents first; a copy the scheduler queued is flushed and waited for;
- inserts: `cache.insert` (device), `tree_core.insert_host` + the cache's
  `_apply_cache_actions` (host-only nodes: how SGLang inserts prefetched host pages;
  the one private helper this module calls).

The device -> host copy a send needs is done before `pin_host_pages` returns (so
`host_pages_ready` is at once true): 0.5.23 has no public way to start one node's copy
and poll it later. All functions run on the scheduler thread, in the same order on
every TP rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.sglang_adapter import pool_groups
from sglang_kv_migration.sglang_adapter.radix_tree import (
    DEVICE_TIER,
    HOST_TIER,
    DevicePrefix,
    HeldPrefix,
    NodeLock,
    PinnedHostPages,
    Segment,
    TieredPrefix,
    check_whole_pages,
    held_end,
)

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.radix_cache import RadixKey

Cache = Any  # sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache
NodeId = int


# --------------------------------------------------------------------------- public API


def make_key(cache: Cache, input_ids: list[int], extra_key: str | None) -> RadixKey:
    """The page-aligned radix key of `input_ids` in namespace `extra_key` (0.5.23's
    tree cores take token ids as an int64 `array`)."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", input_ids), extra_key=extra_key).page_aligned(cache.page_size)


def key_parts(key: RadixKey) -> tuple[list[int], str | None]:
    """A key's token ids (a list copy: 0.5.23 keeps an `array`) and namespace."""
    return list(key.token_ids), key.extra_key


def match_held_prefix(cache: Cache, input_ids: list[int], extra_key: str | None) -> HeldPrefix:
    """Longest page-aligned prefix of `input_ids` held on device or host; the match
    splits a node at its end, as the scheduler's own lookups do."""
    key = make_key(cache, input_ids, extra_key)
    if len(key) == 0:
        return HeldPrefix(length=0, last_node=_root(cache, extra_key), device_length=0)
    match = _match(cache, key)
    host = int(match.host_hit_length)
    # `best_match_node` is the deepest node the match accepted, device or host.
    last = match.best_match_node if host > 0 else match.last_device_node
    return HeldPrefix(
        length=int(match.device_prefix_len) + host,
        last_node=last,
        device_length=int(match.device_prefix_len),
    )


def match_device_prefix(cache: Cache, input_ids: list[int], extra_key: str | None) -> DevicePrefix:
    """Longest page-aligned prefix of `input_ids` held on device (host-only parts excluded)."""
    import torch

    key = make_key(cache, input_ids, extra_key)
    if len(key) == 0:
        return DevicePrefix(0, _root(cache, extra_key), torch.empty(0, dtype=torch.int64))
    match = _match(cache, key)
    return DevicePrefix(
        int(match.device_prefix_len),
        match.last_device_node,
        _device_slots(cache, match.last_device_node, extra_key),
    )


def match_tiered_prefix(cache: Cache, input_ids: list[int], extra_key: str | None) -> TieredPrefix:
    """Longest page-aligned prefix of `input_ids` held on device or host, node by node,
    each read from device when it is there, else from host."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    held = match_held_prefix(cache, input_ids, extra_key)
    segments: list[Segment] = []
    host_nodes: list[NodeId] = []
    last_device = _root(cache, extra_key)
    for info in _path_info(cache, held.last_node):
        if info.full_value_len is None:
            segments.append(Segment(HOST_TIER, _host_slots(cache, info.node_id)))
            host_nodes.append(info.node_id)
        else:
            value = cache.tree_core.get_component_device_value(info.node_id, ComponentType.FULL)
            segments.append(Segment(DEVICE_TIER, value))
            last_device = info.node_id
    return TieredPrefix(held.length, segments, last_device, host_nodes)


def protect_host_nodes(cache: Cache, nodes: list[NodeId]) -> list[Any]:
    """Keep the host values of `nodes` (and their ancestors) from host eviction; returns
    the receipts `release_host_nodes` needs."""
    return [(node, cache.inc_host_lock_ref(node).to_dec_params()) for node in nodes]


def release_host_nodes(cache: Cache, receipts: list[Any]) -> None:
    for node, receipt in receipts:
        cache.dec_host_lock_ref(node, receipt)


def path_from_root(cache: Cache, node: NodeId) -> list[NodeId]:
    """Node ids from the root's child down to `node` (empty for a root)."""
    return [info.node_id for info in _path_info(cache, node)]


def write_back_path(cache: Cache, nodes: list[NodeId]) -> None:
    """Make sure every node of `nodes` (a root-to-leaf path) has a completed host copy
    (blocking: the copies run before this returns)."""
    if not nodes:
        return
    # IMPORTANT: protect the path's host copies while writing: backing up a node may
    # evict unprotected host-only nodes when the host pool is full.
    receipts = protect_host_nodes(cache, nodes[-1:])
    try:
        _write_back(cache, nodes)
    finally:
        release_host_nodes(cache, receipts)


def pin_host_pages(
    cache: Cache,
    input_ids: list[int],
    extra_key: str | None,
    start: int,
    end: int,
    partial_ok: bool = False,
) -> PinnedHostPages | None:
    """Host slots of tokens [start, end) of `input_ids`, protected, their device -> host
    copy done (see the module docstring); as `radix_tree.pin_host_pages` otherwise."""
    import torch

    check_whole_pages(cache.page_size, start, end)
    held = match_held_prefix(cache, input_ids[:end], extra_key)
    end = held_end(held.length, end, partial_ok)
    if end <= start:
        return None
    nodes = path_from_root(cache, held.last_node)
    receipts = protect_host_nodes(cache, nodes[-1:])
    try:
        _write_back(cache, nodes)
        host_indices = torch.cat([_host_slots(cache, node) for node in nodes])[start:end]
    except BaseException:
        release_host_nodes(cache, receipts)
        raise
    return PinnedHostPages(
        host_indices=host_indices,
        nodes=nodes,
        start=start,
        end=end,
        copying_ids=set(),
        release=lambda: release_host_nodes(cache, receipts),
    )


def host_pages_ready(cache: Cache, pinned: PinnedHostPages) -> bool:
    """Always true once pinned: `pin_host_pages` waited for the copies."""
    return not (pinned.copying_ids & cache.ongoing_write_through.keys())


def unpin_host_pages(pinned: PinnedHostPages) -> None:
    """Release what `pin_host_pages` protected. Safe to call once per pin."""
    if pinned.release is not None:
        pinned.release()
        pinned.release = None
    pinned.nodes = []


def insert_host_pages(
    cache: Cache, anchor: NodeId, key: RadixKey, anchor_length: int, host_indices: torch.Tensor
) -> int:
    """Insert key[anchor_length:] below `anchor` as host-only nodes (the anchor locked by
    the caller). Returns how many of the new tokens were already in the tree; the caller
    frees `host_indices[:returned]`. Raises (nothing inserted, the slots still the
    caller's) when the tree drops the insert."""
    suffix = key[anchor_length:]
    result = cache.tree_core.insert_host(
        anchor, suffix, host_indices, _page_hashes(cache, key, anchor_length)
    )
    cache._apply_cache_actions(result.cache_actions)
    if result.host_insert_dropped:
        raise MigrationError(
            ErrorKind.CONFLICT,
            "the tree dropped the host insert (its anchor changed since allocate)",
        )
    return int(result.prefix_len)


def needs_page_hashes(cache: Cache) -> bool:
    """False: the host insert computes what 0.5.23's tree core needs itself
    (`_page_hashes`), and a storage backend, the other user of hashes, is refused."""
    return False


def insert_device_pages(
    cache: Cache, key: RadixKey, anchor_length: int, device_indices: torch.Tensor
) -> int:
    """Insert key[anchor_length:] as ordinary device nodes holding `device_indices`
    (the device prefix key[:anchor_length] locked by the caller). Returns how many of
    `device_indices` the caller must free: none, unlike 0.5.12. 0.5.23's insert frees
    the duplicates itself (its `FreeDeviceKV` actions, for the value past
    `prev_prefix_len`), so the locked prefix is passed as `prev_prefix_len`: its slots
    are the tree's own, never duplicates to free."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    match = _match(cache, key[:anchor_length])
    prefix = _device_slots(cache, match.last_device_node, key.extra_key)
    if int(match.device_prefix_len) != anchor_length:
        raise MigrationError(
            ErrorKind.INTERNAL,
            f"locked device prefix shrank to {match.device_prefix_len} of {anchor_length} tokens",
        )
    value = torch.cat([prefix.to(device_indices.device), device_indices])
    cache.insert(InsertParams(key=key, value=value, prev_prefix_len=anchor_length))
    return 0


def cache_generation(cache: Cache) -> object:
    """Changes whenever the tree is reset (`/flush_cache`): 0.5.23's reset replaces
    the cache's write-through table with a new one, as it clears the tree core."""
    return cache.ongoing_write_through


def lock_node(cache: Cache, node: NodeId) -> NodeLock:
    """Lock `node` and its ancestors against device eviction until `unlock_node`."""
    return NodeLock(node, cache.lock(node))


def unlock_node(cache: Cache, lock: NodeLock) -> None:
    cache.unlock(lock.receipt)


def is_hiradix_cache(cache: object) -> bool:
    return False


def cache_unsupported(cache: Cache) -> str | None:
    """Why `cache` cannot serve migrations on 0.5.23 (None when it can): a
    `UnifiedRadixCache` with HiCache's host tier, full attention only."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if not isinstance(cache, UnifiedRadixCache):
        return (
            "--enable-kv-migration needs SGLang's UnifiedRadixCache as the tree cache, got "
            f"{type(cache).__name__}"
        )
    if cache.cache_controller is None:
        return "--enable-kv-migration needs HiCache attached (--enable-hierarchical-cache)"
    others = sorted(c.name for c in cache.components if c != ComponentType.FULL)
    if others:
        return (
            "--enable-kv-migration moves full-attention KV only; this model's tree also "
            f"caches {'+'.join(others)} state"
        )
    extra = _extra_host_pools(cache)
    if extra is not None:
        return extra
    if cache.enable_storage:
        return (
            "--enable-kv-migration with a HiCache storage backend runs on SGLang 0.5.12 "
            "only (0.5.23's page hashes are not computed by the plugin)"
        )
    if cache.host_memory_mode != "cache":
        return (
            "--enable-kv-migration needs the host pool as a cache tier, not "
            f"--hicache-host-memory-mode {cache.host_memory_mode}"
        )
    return None


# --------------------------------------------------------------------------- helpers


def _extra_host_pools(cache: Cache) -> str | None:
    """Why a host pool group holding more than the KV pool is refused (None: it holds
    the KV pool alone). NSA models (DeepSeek-V3.2 class) add their indexer's pool, which
    0.5.12's host path moves at the KV's slots (`pool_groups.py`) and 0.5.23's is not
    read for; other pools have slot spaces of their own."""
    names = [str(entry.name.value) for entry in cache.cache_controller.mem_pool_host.entries]
    if names == [pool_groups.KV_POOL]:
        return None
    return (
        "--enable-kv-migration on SGLang 0.5.23 moves a host pool holding the KV cache "
        f"alone; this model's holds {'+'.join(names)} (the NSA indexer of DeepSeek-V3.2 "
        "class models migrates on SGLang 0.5.12 only)"
    )


def _match(cache: Cache, key: RadixKey) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return cache.match_prefix(MatchPrefixParams(key=key))


def _root(cache: Cache, extra_key: str | None) -> NodeId:
    return cache.root_node_handle(extra_key)


def _device_slots(cache: Cache, node: NodeId, extra_key: str | None) -> torch.Tensor:
    import torch

    slots = cache.tree_core.collect_full_device_indices(node, _root(cache, extra_key))
    return slots.to(torch.int64)


def _path_info(cache: Cache, node: NodeId) -> tuple[Any, ...]:
    return cache.tree_core.collect_path_info([node])[0]


def _host_slots(cache: Cache, node: NodeId) -> torch.Tensor:
    spec = cache.tree_core.build_storage_backup_spec(node, False)
    if spec is None:
        raise MigrationError(ErrorKind.INTERNAL, f"tree node {node} has no host copy")
    return spec.host_value


def _page_hashes(cache: Cache, key: RadixKey, anchor_length: int) -> list[str]:
    """The position-aware page hashes of key[anchor_length:], one per page, as SGLang
    chains them from the root (`mem_cache/utils.compute_node_hash_values`, node by node;
    over the whole key at once the chain is the same).

    The tree core keeps a host node's hashes beside its key and splits them with it:
    the Rust core panics splitting a list shorter than the node's pages, so a host
    insert cannot pass none (0.5.12's tree computed them itself when needed)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(key, None, page_size=cache.page_size)
    return list(hashes[anchor_length // cache.page_size :])


def _write_back(cache: Cache, nodes: list[NodeId]) -> None:
    """Back every node of a root-to-leaf path up to host, parents first, and wait for the
    copies (those the scheduler queued earlier too)."""
    if any(node in cache.ongoing_write_through for node in nodes):
        cache.flush_pending_backups()
        cache.writing_check(write_back=True)
    for node in nodes:
        if cache.tree_core.is_backuped(node):
            continue
        if not cache.backup_node_for_write_back(node):
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                "host pool is full: cannot write the prefix back to host memory",
            )
