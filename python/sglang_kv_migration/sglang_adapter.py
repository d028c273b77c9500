"""Functions over SGLang's `HiRadixCache` radix tree used by both migration sides.

Everything goes through the cache's public API (`match_prefix`, `write_backup`,
`writing_check`, `inc_lock_ref`/`dec_lock_ref`, `protect_host`/`release_host`), except
`HiRadixCache._insert_helper_host` (the way SGLang itself inserts prefetched host pages),
which is named in `upstream.py` and covered by the hook-existence test.

All functions must be called on the scheduler thread (or under the lock that guards the
tree), and in the same order on every TP rank: `write_back_path` runs collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_kv_migration.errors import ErrorKind, MigrationError

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


def match_held_prefix(
    cache: HiRadixCache, input_ids: list[int], extra_key: str | None
) -> HeldPrefix:
    """Longest page-aligned prefix of `input_ids` held on device or host.

    Like the scheduler's own lookups, this may split a node at the match boundary, so
    the returned node ends exactly at `length`.
    """
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    key = make_key(cache, input_ids, extra_key)
    if len(key) == 0:
        return HeldPrefix(length=0, last_node=cache.root_node, device_length=0)
    result = cache.match_prefix(MatchPrefixParams(key=key))
    device_length = len(result.device_indices)
    length = device_length + result.host_hit_length
    # Evicted nodes only ever hang below device nodes, so the deepest matched node is the
    # deepest host node when there is a host hit, else the deepest device node.
    last_node = result.last_host_node if result.host_hit_length > 0 else result.last_device_node
    return HeldPrefix(length=length, last_node=last_node, device_length=device_length)


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
) -> PinnedHostPages:
    """Host slots of tokens [start, end) of `input_ids`, pinned, write-back started.

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
    if held.length < end:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"source holds only {held.length} tokens of the prefix, {end} needed "
            "(evicted since it was measured?)",
        )
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
    from sglang_kv_migration import upstream

    suffix = key[anchor_length:]
    hashes = page_hashes(key, cache.page_size)[anchor_length // cache.page_size :]
    return upstream.insert_host_value(cache, anchor, suffix, host_indices, hashes)


# --------------------------------------------------------------------------- helpers


def _start_write_back(cache: HiRadixCache, nodes: list[TreeNode]) -> set[int]:
    """Queue device->host copies for the device-only nodes of a root-to-leaf path.

    Returns the ids of path nodes whose copy is in flight, including copies the
    scheduler started earlier. Nodes must already be protected by the caller.
    """
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
        if cache.write_backup(node) == 0:
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                "host pool is full: cannot write the prefix back to host memory "
                f"({len(node.key)} tokens needed)",
            )
        copying.add(node.id)
    return copying
