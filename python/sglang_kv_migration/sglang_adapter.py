"""The one module that reads or calls SGLang internals: radix tree, pools, allocator,
scheduler attributes, the HTTP server's app and tokenizer manager.

Everything else in the package goes through these functions, so an SGLang upgrade is
this file's work (plus the symbol names in `upstream.py`, which `test/integration/test_plugin.py`
resolves, and `test/unit/test_sglang_adapter.py`, which runs these functions against the
real classes on CPU).

Tree operations use the cache's public API (`match_prefix`, `insert`, `write_backup`,
`writing_check`, `inc_lock_ref`/`dec_lock_ref`, `protect_host`/`release_host`, `evict`,
`evict_host`), except `HiRadixCache._insert_helper_host` (the way SGLang itself inserts
prefetched host pages) and the radix walk: `_walk` is `HiRadixCache._match_prefix_helper`
with node keys compared as whole lists, calling SGLang's `_split_node` (checked against
SGLang's own `match_prefix` on twin trees by the tests). Pools: the host pool is
`cache.cache_controller.mem_pool_host`, the device pool `cache.kv_cache` and its
allocator `cache.token_to_kv_pool_allocator`.

All functions must be called on the scheduler thread (or under the lock that guards the
tree), and in the same order on every TP rank: `write_back_path` runs collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.fingerprint import KVCacheShape

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

# Bound on how long the source waits for its own device -> host write-back.
WRITE_BACK_TIMEOUT_S = 30.0


@dataclass
class HeldPrefix:
    """The page-aligned prefix of a key that a server holds, on device or host."""

    length: int  # tokens, a multiple of page_size
    last_node: TreeNode  # deepest node of the prefix (the root when length == 0)
    device_length: int  # the part of `length` that is on device


@dataclass
class PinnedHostPages:
    """Host slots of a token range, protected from host eviction until `unpin_host_pages`.

    The slots may still be filling: read them only once `host_pages_ready()` is True.
    """

    host_indices: torch.Tensor  # int64 host token slots, one per token of the range
    nodes: list[TreeNode]  # nodes whose host values are protected
    start: int
    end: int
    copying_ids: set[int]  # ids of path nodes whose device->host copy was in flight


# --------------------------------------------------------------------------- public API


def make_key(cache: HiRadixCache, input_ids: list[int], extra_key: str | None) -> RadixKey:
    """The page-aligned radix key of `input_ids` in namespace `extra_key`."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(list(input_ids), extra_key=extra_key).page_aligned(cache.page_size)


def key_parts(key: RadixKey) -> tuple[list[int], str | None]:
    """A key's token ids (not copied: read only) and namespace."""
    return key.token_ids, key.extra_key


def match_held_prefix(
    cache: HiRadixCache, input_ids: list[int], extra_key: str | None
) -> HeldPrefix:
    """Longest page-aligned prefix of `input_ids` held on device or host.

    Like the scheduler's own lookups, this may split a node at the match boundary, so
    the returned node ends exactly at `length`.
    """
    key = make_key(cache, input_ids, extra_key)
    if len(key) == 0:
        return HeldPrefix(length=0, last_node=cache.root_node, device_length=0)
    match = _match_prefix(cache, key)
    device_length = sum(len(v) for v in match.device_values)
    length = device_length + match.host_hit_length
    # Evicted nodes only ever hang below device nodes, so the deepest matched node is the
    # deepest host node when there is a host hit, else the deepest device node.
    last_node = match.last_host_node if match.host_hit_length > 0 else match.last_device_node
    return HeldPrefix(length=length, last_node=last_node, device_length=device_length)


@dataclass
class _Match:
    """What `HiRadixCache.match_prefix` finds, its device indices still per node."""

    device_values: list[Any]  # tensors of device slots, prefix order
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


def _match_prefix(cache: HiRadixCache, key: RadixKey) -> _Match:
    """`cache.match_prefix(key)`: the same walk, splits and access times. With SGLang's
    own `HiRadixCache` matching, each node's key is compared as whole lists instead of
    SGLang's Python loop over tokens (page size 1) or pages (`RadixKey.match`): an 8K
    prefix at page 1 took 0.30-0.49 ms that way on CPU, most of a migration's prepare,
    and takes 0.05 ms this way (`benchmark/bench_radix_match.py`)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    if len(key) == 0 or not _fast_walk_applies(cache, key):
        result = cache.match_prefix(MatchPrefixParams(key=key))
        return _Match(
            [result.device_indices],
            result.last_device_node,
            result.last_host_node,
            result.host_hit_length,
        )
    values, last_node = _walk(cache, key)
    # As `HiRadixCache.match_prefix`: the host hit is the evicted tail of the path.
    host_hit_length = 0
    last_host_node = last_node
    while last_node.evicted:
        host_hit_length += len(last_node.host_value)
        last_node = last_node.parent
    while not last_host_node.backuped:
        last_host_node = last_host_node.parent
    return _Match(values, last_node, last_host_node, host_hit_length)


def _fast_walk_applies(cache: HiRadixCache, key: RadixKey) -> bool:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    kind = type(cache)
    return (
        not cache.disable
        and not getattr(cache, "is_eagle", False)
        and not key.is_bigram
        and type(key.token_ids) is list
        and kind.match_prefix is HiRadixCache.match_prefix
        and kind._match_prefix_helper is HiRadixCache._match_prefix_helper
    )


def _walk(cache: HiRadixCache, key: RadixKey) -> tuple[list[Any], TreeNode]:
    """`HiRadixCache._match_prefix_helper` (a node's dict key is its first page, namespaced
    by `extra_key`; a match ends at a page boundary), comparing each node's key in C."""
    ids, extra, page = key.token_ids, key.extra_key, cache.page_size
    node = cache.root_node
    node.last_access_time = time.monotonic()
    values: list[Any] = []
    pos = 0
    while pos < len(ids):
        first = ids[pos] if page == 1 else tuple(ids[pos : pos + page])
        child = node.children.get(first if extra is None else (extra, first))
        if child is None:
            break
        child.last_access_time = time.monotonic()
        child_ids = child.key.token_ids
        if type(child_ids) is list:
            matched = _common_prefix(child_ids, ids, pos) // page * page
        else:  # not a list (never so in 0.5.12): SGLang's own comparison
            matched = child.key.match(key[pos:], page_size=page)
        if matched < len(child_ids):
            node = cache._split_node(child.key, child, matched)
            if not node.evicted:
                values.append(node.value)
            break
        if not child.evicted:
            values.append(child.value)
        node = child
        pos += matched
    return values, node


def _common_prefix(node_ids: list[int], ids: list[int], start: int) -> int:
    """How many of `node_ids` equal `ids[start:]`, position by position: list slices
    compared in C, bisecting to the first difference."""
    low, high = 0, min(len(node_ids), len(ids) - start)
    if node_ids[:high] == ids[start : start + high]:
        return high
    # node_ids[:low] matches; the first difference lies in [low, high).
    while high - low > 1:
        middle = (low + high) // 2
        if node_ids[low:middle] == ids[start + low : start + middle]:
            low = middle
        else:
            high = middle
    return low


DEVICE_TIER = "device"  # the node's KV is in the device pool
HOST_TIER = "host"  # evicted from the device: only in the host pool


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of a prefix held in one tier: their slots in that tier's pool."""

    tier: str
    slots: torch.Tensor  # int64 token slots, one per token, prefix order


@dataclass
class DevicePrefix:
    """The page-aligned prefix of a key held on device, with its device slots."""

    length: int
    last_node: TreeNode  # deepest device node of the prefix (the root when length == 0)
    indices: torch.Tensor  # int64 device slots of tokens [0, length)

    def as_held(self) -> HeldPrefix:
        return HeldPrefix(length=self.length, last_node=self.last_node, device_length=self.length)


def match_device_prefix(
    cache: HiRadixCache, input_ids: list[int], extra_key: str | None
) -> DevicePrefix:
    """Longest page-aligned prefix of `input_ids` held on device (host-only parts excluded)."""
    import torch

    key = make_key(cache, input_ids, extra_key)
    if len(key) == 0:
        return DevicePrefix(0, cache.root_node, torch.empty(0, dtype=torch.int64))
    match = _match_prefix(cache, key)
    indices = _joined(cache, match.device_values)
    return DevicePrefix(len(indices), match.last_device_node, indices)


def _joined(cache: HiRadixCache, values: list[Any]) -> torch.Tensor:
    """One tensor of device slots, as `match_prefix` returns them."""
    import torch

    if not values:
        return cache._empty_match_result.device_indices
    return torch.cat(values)  # a copy, never a node's own tensor


@dataclass
class TieredPrefix:
    """The page-aligned prefix of a key held on device or host, node by node, with the
    tier each node's KV is read from (device when it is on device, else host)."""

    length: int
    segments: list[Segment]  # prefix order, covering [0, length)
    last_device_node: TreeNode  # deepest node still on device (the root when none)
    host_nodes: list[TreeNode]  # nodes read from the host pool (evicted from device)


def match_tiered_prefix(
    cache: HiRadixCache, input_ids: list[int], extra_key: str | None
) -> TieredPrefix:
    """Longest page-aligned prefix of `input_ids` held on device or host, by tier.

    HiCache keeps evicted nodes below device nodes only, so the device segments come
    first; the plan does not rely on it.
    """
    held = match_held_prefix(cache, input_ids, extra_key)
    segments: list[Any] = []
    host_nodes: list[TreeNode] = []
    last_device = cache.root_node
    for node in path_from_root(cache, held.last_node):
        if node.evicted:
            segments.append(Segment(HOST_TIER, node.host_value))
            host_nodes.append(node)
        else:
            segments.append(Segment(DEVICE_TIER, node.value))
            last_device = node
    return TieredPrefix(held.length, segments, last_device, host_nodes)


def protect_host_nodes(nodes: list[TreeNode]) -> None:
    """Keep the host values of `nodes` from host eviction (`evict_host` skips them)."""
    for node in nodes:
        node.protect_host()


def release_host_nodes(nodes: list[TreeNode]) -> None:
    for node in nodes:
        node.release_host()


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
    """Read a live `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`; raises ValueError for
    another pool type or a `kv_buffer` that is not one dense allocation."""
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


def kv_cache_shape(pool: Any) -> KVCacheShape:
    """What the layout fingerprint takes from a host pool and the device pool behind it;
    raises ValueError for a host pool type migration does not support."""
    attention = _host_attention(pool)
    if attention is None:
        raise ValueError(f"unsupported host pool type {type(pool).__name__} for KV migration")
    dev = pool.device_pool
    is_mha = attention == "mha"
    return KVCacheShape(
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


def path_from_root(cache: HiRadixCache, node: TreeNode) -> list[TreeNode]:
    """Nodes from the root's child down to `node` (empty for the root)."""
    path: list[TreeNode] = []
    while node is not cache.root_node:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def write_back_path(cache: HiRadixCache, nodes: list[TreeNode]) -> None:
    """Make sure every node in `nodes` (a root-to-leaf path) has a completed host copy.

    Blocking: waits for the device->host copies by polling `writing_check`, which
    all-reduces completion counts across TP ranks, so every rank leaves the loop after
    the same number of rounds. Used by commit on the target (rarely has anything to
    copy); the source's transfer path uses `pin_host_pages`, which does not wait.
    """
    # IMPORTANT: protect the path's host copies while writing: `write_backup` evicts
    # unprotected host-only nodes when the host pool is full, and a host-only node of
    # this very path (below a device-only one, as the write_back policy leaves them)
    # would otherwise be dropped from the tree with its slots handed to its ancestor.
    for node in nodes:
        node.protect_host()
    try:
        copying = _start_write_back(cache, nodes)
        deadline = time.monotonic() + WRITE_BACK_TIMEOUT_S
        while copying & cache.ongoing_write_through.keys():
            if time.monotonic() > deadline:
                raise MigrationError(
                    ErrorKind.INTERNAL,
                    f"device->host write-back did not finish within {WRITE_BACK_TIMEOUT_S}s",
                )
            cache.writing_check()
            time.sleep(0)
    finally:
        for node in nodes:
            node.release_host()


def pin_host_pages(
    cache: HiRadixCache,
    input_ids: list[int],
    extra_key: str | None,
    start: int,
    end: int,
    partial_ok: bool = False,
) -> PinnedHostPages | None:
    """Host slots of tokens [start, end) of `input_ids`, pinned, write-back started.
    With `partial_ok` a range the server holds only part of is cut where its held
    prefix ends (`PinnedHostPages.end`; None when it holds nothing past `start`).

    Device-only nodes of the path get their device->host copy queued, but this does not
    wait for it: the scheduler loop keeps running, and the caller polls
    `host_pages_ready` (calling `cache.writing_check()` in between) before reading the
    slots. Raises `MigrationError(CONFLICT)` when this server no longer holds the whole
    range. The caller must call `unpin_host_pages` on success and on failure.
    """
    import torch

    page_size = cache.page_size
    if start % page_size or end % page_size or not 0 <= start < end:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"token range [{start}, {end}) is not a non-empty range of whole pages "
            f"(page_size={page_size})",
        )
    held = match_held_prefix(cache, input_ids[:end], extra_key)
    if held.length < end and not partial_ok:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"source holds only {held.length} tokens of the prefix, {end} needed "
            "(evicted since it was measured?)",
        )
    end = min(end, held.length)
    if end <= start:
        return None
    nodes = path_from_root(cache, held.last_node)
    # Protected before any write is queued: see the note in `write_back_path`.
    for node in nodes:
        node.protect_host()
    try:
        copying = _start_write_back(cache, nodes)
    except BaseException:
        for node in nodes:
            node.release_host()
        raise
    # `write_backup` assigns host slots when it queues the copy, so they are known now.
    host_indices = torch.cat([node.host_value for node in nodes])[start:end]
    return PinnedHostPages(
        host_indices=host_indices, nodes=nodes, start=start, end=end, copying_ids=copying
    )


def host_pages_ready(cache: HiRadixCache, pinned: PinnedHostPages) -> bool:
    """True once every device->host copy the pinned range waits for has completed.

    Identical on every TP rank: `writing_check` retires copies in lockstep across ranks.
    """
    return not (pinned.copying_ids & cache.ongoing_write_through.keys())


def unpin_host_pages(pinned: PinnedHostPages) -> None:
    """Release what `pin_host_pages` protected. Safe to call once per pin."""
    for node in pinned.nodes:
        node.release_host()
    pinned.nodes = []


def page_hashes(key: RadixKey, page_size: int) -> list[str]:
    """Position-aware hash of every page of `key`, chained from the root like SGLang's."""
    hashes: list[str] = []
    prior: str | None = None
    for start in range(0, len(key), page_size):
        prior = key.hash_page(start, start + page_size, prior)
        hashes.append(prior)
    return hashes


def insert_host_pages(
    cache: HiRadixCache,
    anchor: TreeNode,
    key: RadixKey,
    anchor_length: int,
    host_indices: torch.Tensor,
) -> int:
    """Insert tokens key[anchor_length:] below `anchor` as host-only nodes.

    `anchor` must end exactly at `anchor_length` tokens of `key` and be locked by the
    caller. Returns how many of the new tokens were already in the tree (a concurrent
    insert won the race); the caller frees `host_indices[:returned]`.
    """
    suffix = key[anchor_length:]
    if needs_page_hashes(cache):
        hashes = page_hashes(key, cache.page_size)[anchor_length // cache.page_size :]
    else:
        # SGLang computes no page hashes without a storage backend or KV events either,
        # and chaining them from the root is Python work per page on the scheduler
        # thread (~30 ms at 4K pages). A list, not None: the insert slices it.
        hashes = [None] * (len(suffix) // cache.page_size)
    return cache._insert_helper_host(anchor, suffix, host_indices, hashes)


def needs_page_hashes(cache: HiRadixCache) -> bool:
    """Whether tree nodes must carry page hashes (HiCache storage or KV cache events)."""
    return bool(cache.enable_storage or cache.enable_kv_cache_events)


def insert_device_pages(
    cache: HiRadixCache, key: RadixKey, anchor_length: int, device_indices: torch.Tensor
) -> int:
    """Insert key[anchor_length:] as ordinary device nodes holding `device_indices`.

    The prefix key[:anchor_length] must be held on device and locked by the caller (its
    slots are read here and passed through unchanged). Evicted (host-only) nodes inside
    the range adopt our slots, as SGLang does when it recomputes evicted KV; write-through
    then backs the new nodes up to host as usual. Returns how many of the new tokens were
    already on device (a concurrent insert won the race); the caller frees
    `device_indices[:returned]`.
    """
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    prefix = _joined(cache, _match_prefix(cache, key[:anchor_length]).device_values)
    if len(prefix) != anchor_length:
        raise MigrationError(
            ErrorKind.INTERNAL,
            f"locked device prefix shrank to {len(prefix)} of {anchor_length} tokens",
        )
    value = torch.cat([prefix.to(device_indices.device), device_indices])
    result = cache.insert(InsertParams(key=key, value=value))
    return max(0, result.prefix_len - anchor_length)


# --------------------------------------------------------------------------- pools


def host_pool(cache: HiRadixCache) -> Any:
    """The `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` of a HiRadixCache."""
    return cache.cache_controller.mem_pool_host


def device_pool(cache: HiRadixCache) -> Any:
    """The `MHATokenToKVPool` / `MLATokenToKVPool` the tree's device slots index."""
    return cache.kv_cache


def device_kv_buffers(cache: HiRadixCache) -> list[torch.Tensor]:
    """The device pool's per-layer buffers, one row per token slot: K layers then V
    layers for MHA, the latent cache per layer for MLA."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    pool = device_pool(cache)
    if isinstance(pool, MHATokenToKVPool):
        return [*pool.k_buffer, *pool.v_buffer]
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
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


def alloc_device_slots(cache: HiRadixCache, num_tokens: int) -> torch.Tensor:
    """Device token slots for `num_tokens` (whole pages), evicting by the tree's rules.

    Feasibility (free + evictable) is decided before anything is evicted.
    """
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(num_tokens)
    if slots is not None:
        return slots
    free = int(allocator.available_size())
    evictable = int(cache.evictable_size())
    if free + evictable < num_tokens:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"device KV pool is full: {num_tokens} token slots needed, {free} free and "
            f"{evictable} evictable; nothing was evicted",
        )
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=num_tokens - free))
    slots = allocator.alloc(num_tokens)
    if slots is None:
        raise MigrationError(
            ErrorKind.UNAVAILABLE,
            f"device KV pool is full: {num_tokens} token slots needed, "
            f"{allocator.available_size()} free after evicting unlocked device pages",
        )
    return slots


def free_device_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    if len(slots):
        cache.token_to_kv_pool_allocator.free(slots)


def take_host_slots(cache: HiRadixCache, slots: torch.Tensor) -> None:
    """Remove `slots` from the host pool's free list (after a reset freed them all)."""
    import torch

    pool = host_pool(cache)
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


def cache_generation(cache: HiRadixCache) -> object:
    """Changes whenever the tree is reset (`/flush_cache` replaces the root node)."""
    return cache.root_node


# --------------------------------------------------------------------------- scheduler


@dataclass(frozen=True)
class SchedulerView:
    """What the migration side reads from SGLang's `Scheduler`, read in one place."""

    tree_cache: Any
    server_args: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_cpu_group: Any
    send_output: Any  # (output, request) -> None, a SenderWrapper.send_output
    world_cpu_group: Any = None  # every (tp, pp) rank; None without PP (= tp_cpu_group)

    @classmethod
    def of(cls, scheduler: Any) -> SchedulerView:
        pipelined = scheduler.pp_size > 1
        return cls(
            tree_cache=scheduler.tree_cache,
            server_args=scheduler.server_args,
            tp_rank=scheduler.tp_rank,
            tp_size=scheduler.tp_size,
            pp_rank=scheduler.pp_rank,
            pp_size=scheduler.pp_size,
            tp_cpu_group=scheduler.tp_cpu_group,
            # SGLang connects only stage 0 to the tokenizer manager; later stages reply
            # through the sender `stage_reply_sender` made for them.
            send_output=(
                scheduler.kv_migration_stage_reply.send_output
                if scheduler.pp_rank > 0
                else scheduler.send_to_tokenizer.send_output
            ),
            world_cpu_group=scheduler.world_group.cpu_group if pipelined else None,
        )


def stage_reply_sender(scheduler: Any, tokenizer_ipc_name: str) -> Any:
    """A `SenderWrapper` from a later PP stage to the tokenizer manager.

    SGLang opens the scheduler -> tokenizer socket on the first TP rank of stage 0 only
    (`Scheduler.init_ipc_channels`); the tokenizer manager binds a PULL socket on
    `port_args.tokenizer_ipc_name` that any number of PUSH sockets may connect to. The
    first TP rank of each later stage gets its own; the other ranks a no-op sender, as
    SGLang gives them.
    """
    from sglang.srt.managers.scheduler import SenderWrapper

    if scheduler.pp_rank == 0 or scheduler.tp_rank != 0:
        return SenderWrapper(None)
    import zmq
    from sglang.srt.utils.network import get_zmq_socket

    socket = get_zmq_socket(zmq.Context(1), zmq.PUSH, tokenizer_ipc_name, False)
    return SenderWrapper(socket)


def forward_to_later_stages(recv_reqs: list[Any], messages: list[Any]) -> None:
    """Append `messages` to the iteration's requests on a PP stage.

    `event_loop_pp` hands the list it gave `process_input_requests` to the next stage
    after that call returns (`_pp_send_pyobj_to_next_stage(recv_reqs)`), so what the
    AFTER hook appends reaches every later stage, after this iteration's requests, in
    order. Without PP the list is dropped after the iteration: appending is harmless.
    """
    recv_reqs.extend(messages)


def add_request_handlers(scheduler: Any, handlers: list[tuple[type, Any]]) -> None:
    """Append handlers to the scheduler's `TypeBasedDispatcher`."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(handlers)


def add_result_handlers(tokenizer_manager: Any, handlers: list[tuple[type, Any]]) -> None:
    """Append handlers to the tokenizer manager's reply `TypeBasedDispatcher`."""
    from sglang.utils import TypeBasedDispatcher

    tokenizer_manager._result_dispatcher += TypeBasedDispatcher(handlers)


def http_server_app() -> Any:
    """SGLang's FastAPI app (`http_server.app`), which our routes join."""
    from sglang.srt.entrypoints import http_server

    return http_server.app


def http_tokenizer_manager() -> Any:
    """The HTTP server's `TokenizerManager` (set when the server launches)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    return get_global_state().tokenizer_manager


# SGLang's scheduler and HTTP server modules import this at module level, unguarded
# (mem_cache/memory_pool_host.py): where the kernel package is absent (a CPU-only install)
# they cannot be imported at all, and only SGLang's argument parser runs.
_SERVER_RUNTIME_NATIVE_MODULE = "sgl_kernel.kvcacheio"


def server_runtime_missing() -> str | None:
    """The native module SGLang's server runtime needs and this environment lacks, or None.
    Looked up without importing anything: it runs in every SGLang process, at start-up."""
    import importlib.util
    import sys

    name = _SERVER_RUNTIME_NATIVE_MODULE
    package = name.partition(".")[0]
    if name in sys.modules or package in sys.modules:
        return None
    return name if importlib.util.find_spec(package) is None else None


def registered_hooks(target: str) -> list[object]:
    """The hook callables SGLang's `HookRegistry` holds for `target` (registered, maybe not
    applied yet). The registry has no public reader; this is its one private read."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [hook for _type, hook, _source in HookRegistry._hooks.get(target, [])]


def frees_kv_cache(memory_req: Any) -> bool:
    """True if a Release/ResumeMemoryOccupationReqInput covers the KV cache (its tags
    name it, or name nothing: SGLang then takes every kind of GPU memory)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    tags = getattr(memory_req, "tags", None)
    return not tags or GPU_MEMORY_TYPE_KV_CACHE in tags


def scheduler_idle_check(scheduler: Any) -> Callable[[], bool]:
    """A test that SGLang has nothing to run or finish on this rank: no batch running or
    waiting, no HiCache copy in flight (`Scheduler.is_fully_idle`, read-only)."""
    return scheduler.is_fully_idle


def input_waiting_check(scheduler: Any) -> Callable[[], bool]:
    """A non-blocking test that a request for SGLang waits on this rank's input sockets
    (the tokenizer manager's and the RPC socket; only the first rank of the first stage
    has them: elsewhere it is always False)."""
    import zmq

    sockets = [
        s
        for s in (
            getattr(scheduler, "recv_from_tokenizer", None),
            getattr(scheduler, "recv_from_rpc", None),
        )
        if s is not None
    ]

    def waiting() -> bool:
        return any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in sockets)

    return waiting


def wake_from_idle_sleep_on(scheduler: Any, socket: Any) -> None:
    """With `--sleep-on-idle` SGLang's loop parks in a poll on its own sockets (up to
    1 s, `IdleSleeper.maybe_sleep`): a request on `socket` (ours) wakes it too."""
    sleeper = getattr(scheduler, "idle_sleeper", None)
    if sleeper is not None:
        import zmq

        sleeper.poller.register(socket, zmq.POLLIN)


def weight_update_types() -> tuple[type, ...]:
    """The scheduler requests that load new weights (SGLang 0.5.12's io_struct): a
    pending migration the source commits through the mailbox is dropped when one
    arrives, since no commit request carries the tokenizer's weight version then."""
    from sglang.srt.managers import io_struct

    names = (
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightsFromTensorReqInput",
        "UpdateWeightsFromIPCReqInput",
    )
    return tuple(getattr(io_struct, name) for name in names)


def is_hiradix_cache(cache: object) -> bool:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    return type(cache) is HiRadixCache


# --------------------------------------------------------------------------- helpers


def _host_attention(pool: Any) -> str | None:
    """ "mha" / "mla" for the host pool classes migration supports, else None."""
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if isinstance(pool, MHATokenToKVPoolHost):
        return "mha"
    if isinstance(pool, MLATokenToKVPoolHost):
        return "mla"
    return None


def _is_pinned(t: torch.Tensor) -> bool:
    import torch

    # `is_pinned` asks the CUDA driver; without CUDA nothing is pinned (and asking may raise).
    return torch.cuda.is_available() and t.is_pinned()


def _start_write_back(cache: HiRadixCache, nodes: list[TreeNode]) -> set[int]:
    """Queue device->host copies for the device-only nodes of a root-to-leaf path.

    Returns the ids of path nodes whose copy is in flight, including copies the
    scheduler started earlier. Nodes must already be protected by the caller.
    """
    # Under write_back, SGLang's `evict` retires every in-flight write without unlocking
    # it (`writing_check(write_back=True)`), so a lock taken by an asynchronous backup
    # could leak; back up synchronously there, as `evict` itself does.
    write_back = cache.cache_controller.write_policy == "write_back"
    copying: set[int] = set()
    for node in nodes:
        if node.backuped:
            # IMPORTANT: `write_backup` sets `host_value` when it queues the copy, so a
            # node can be "backed up" while its device->host copy is still in flight
            # (e.g. a write-through started by the scheduler). Wait for those too, or
            # the transfer would read host slots the copy has not filled yet.
            if node.id in cache.ongoing_write_through:
                copying.add(node.id)
            continue
        # Top-down, so the parent is backed up first (SGLang's write-through invariant).
        if cache.write_backup(node, write_back=write_back) == 0:
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                "host pool is full: cannot write the prefix back to host memory "
                f"({len(node.key)} tokens needed)",
            )
        copying.add(node.id)
    if write_back and copying:
        cache.writing_check(write_back=True)  # waits for the copies; takes no locks
        copying = set()
    return copying
