"""The radix tree, through `HiRadixCache`: prefix matches (held, on device, by tier),
inserts of migrated pages, host protection, and the device -> host write-back a send
waits for.

Tree operations use the cache's public API (`match_prefix`, `insert`, `write_backup`,
`writing_check`, `inc_lock_ref`/`dec_lock_ref`, `protect_host`/`release_host`, `evict`,
`evict_host`), except `HiRadixCache._insert_helper_host` (the way SGLang itself inserts
prefetched host pages) and the radix walk: `_walk` is `HiRadixCache._match_prefix_helper`
with node keys compared as whole lists, calling SGLang's `_split_node` (checked against
SGLang's own `match_prefix` on twin trees by the tests).

All functions must be called on the scheduler thread (or under the lock that guards the
tree), and in the same order on every TP rank: `write_back_path` runs collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    from collections.abc import Callable

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
    # What releases the protection where the tree hands out receipts for it (0.5.23's
    # host locks: `unified_tree.pin_host_pages`); None where the nodes themselves do.
    release: Callable[[], None] | None = None


@dataclass
class NodeLock:
    """A lock on a tree node and every ancestor (device eviction skips them), as
    `lock_node` took it: `receipt` is what the tree needs to release it (0.5.23's
    `TreeLock`; None on 0.5.12, whose nodes count their own locks)."""

    node: Any  # the locked node: a TreeNode (0.5.12) or a node id (0.5.23)
    receipt: Any = None


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


def protect_host_nodes(cache: HiRadixCache, nodes: list[TreeNode]) -> list[Any]:
    """Keep the host values of `nodes` from host eviction (`evict_host` skips them);
    returns what `release_host_nodes` takes (here the nodes themselves)."""
    for node in nodes:
        node.protect_host()
    return list(nodes)


def release_host_nodes(cache: HiRadixCache, protected: list[Any]) -> None:
    for node in protected:
        node.release_host()


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


def check_whole_pages(page_size: int, start: int, end: int) -> None:
    """Refuse (BAD_REQUEST) a token range [start, end) that is empty or not whole pages."""
    if start % page_size or end % page_size or not 0 <= start < end:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"token range [{start}, {end}) is not a non-empty range of whole pages "
            f"(page_size={page_size})",
        )


def held_end(held_length: int, end: int, partial_ok: bool) -> int:
    """Where a range that should end at `end` ends in a held prefix of `held_length`
    tokens: cut there with `partial_ok`, else refused (CONFLICT) when it is short."""
    if held_length < end and not partial_ok:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"source holds only {held_length} tokens of the prefix, {end} needed "
            "(evicted since it was measured?)",
        )
    return min(end, held_length)


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

    check_whole_pages(cache.page_size, start, end)
    held = match_held_prefix(cache, input_ids[:end], extra_key)
    end = held_end(held.length, end, partial_ok)
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


def lock_node(cache: HiRadixCache, node: TreeNode) -> NodeLock:
    """Lock `node` and its ancestors against device eviction until `unlock_node`."""
    cache.inc_lock_ref(node)
    return NodeLock(node)


def unlock_node(cache: HiRadixCache, lock: NodeLock) -> None:
    cache.dec_lock_ref(lock.node)


def cache_unsupported(cache: object) -> str | None:
    """Why `cache` cannot serve migrations (None when it can): 0.5.12 migrates through
    `HiRadixCache` only."""
    if is_hiradix_cache(cache):
        return None
    return (
        "--enable-kv-migration needs SGLang's HiRadixCache as the tree cache, got "
        f"{type(cache).__name__}; other hierarchical caches are not supported yet"
    )


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


def cache_generation(cache: HiRadixCache) -> object:
    """Changes whenever the tree is reset (`/flush_cache` replaces the root node)."""
    return cache.root_node


def is_hiradix_cache(cache: object) -> bool:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    return type(cache) is HiRadixCache


# --------------------------------------------------------------------------- helpers


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
