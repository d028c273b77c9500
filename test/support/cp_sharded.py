"""A test-only stand-in for an SGLang fork whose attention-CP ranks own disjoint pages
(docs/reliability.md, "What an owner-sharded fork provides"), on the CPU harness.

What it does to one rank's harness, and nothing more:

- its device allocator becomes a subclass that names an owner function under
  `kv_migration_cp_owner` (`round_robin:N`) and has `alloc_pages_with_owners(owners)`:
  free pages whose owners under that function are the owners asked for, in order, as
  token slots (None when the free pages cannot match the pattern). Every CP rank runs the
  same allocations, so the allocator state stays identical across them, as a fork's must;
- `keep_owned_pages` overwrites, after the preload, the bytes of every page of a prefix
  this rank does not own — on device and in its host pool — with `SOURCE_POISON`, so a
  rank that sends a page it does not own puts that marker on its twin;
- `mark_free_host` fills the free host slots of a target rank with `UNWRITTEN`, so a
  test can tell which of its pages a migration wrote.

Only MHA with the `layer_first` host layout (the shape the sharded test runs).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.cp_owners import PageOwners

SOURCE_POISON = 0xA5  # a source rank's bytes of pages it does not own
UNWRITTEN = 0x5A  # a target rank's free host slots before a migration


def make_owner_sharded(harness: Any, owner: str, cp_size: int) -> PageOwners:
    """Turn the harness's device allocator into the fork's owner-aware one."""
    owners = PageOwners.parse(owner, cp_size)
    allocator = harness.allocator
    assert allocator is harness.cache.token_to_kv_pool_allocator
    allocator.__class__ = _owner_aware(type(allocator))
    allocator.kv_migration_cp_owner = owner
    allocator.page_owners = owners
    return owners


@functools.cache
def _owner_aware(base: type) -> type:
    return type(f"OwnerAware{base.__name__}", (base, _OwnerAwareAllocation), {})


class _OwnerAwareAllocation:
    """Mixed into SGLang's paged allocator (its `free_pages`, `page_size`)."""

    page_owners: PageOwners

    def alloc_pages_with_owners(self, owners: list[int]) -> torch.Tensor | None:
        if getattr(self, "need_sort", False):
            self.merge_and_sort_free()
        free = self.free_pages.tolist()
        by_owner: dict[int, list[int]] = {}
        for page in free:
            by_owner.setdefault(self.page_owners.owner_of(page), []).append(page)
        for pages in by_owner.values():
            pages.reverse()  # pop() from the end takes the lowest free page first
        chosen = []
        for owner in owners:
            pages = by_owner.get(owner)
            if not pages:
                return None
            chosen.append(pages.pop())
        taken = set(chosen)
        self.free_pages = torch.tensor(
            [p for p in free if p not in taken], dtype=torch.int64, device=self.free_pages.device
        )
        page_ids = torch.tensor(chosen, dtype=torch.int64)
        size = self.page_size
        return (page_ids[:, None] * size + torch.arange(size)).reshape(-1)


def _check_shape(harness: Any) -> None:
    cfg = harness.cfg
    if cfg.attention != "mha" or cfg.host_layout != "layer_first":
        raise ValueError("the owner-sharded stand-in runs MHA with the layer_first layout only")


def keep_owned_pages(harness: Any, owners: PageOwners, cp_rank: int, token_ids: list[int]) -> int:
    """Overwrite the bytes of the pages of `token_ids`' cached prefix that `cp_rank` does
    not own, on device and on host (what such a rank never holds). Returns how many."""
    _check_shape(harness)
    ps = harness.cfg.page_size
    device = harness.match(token_ids).device_indices
    if not len(device):
        return 0
    pinned = sglang_adapter.pin_host_pages(harness.cache, token_ids, None, 0, len(device))
    try:
        host = pinned.host_indices
    finally:
        sglang_adapter.unpin_host_pages(pinned)
    pattern = owners.owners((device[::ps] // ps).tolist())
    foreign = [i for i, owner in enumerate(pattern) if owner != cp_rank]
    tokens = torch.tensor([p * ps + t for p in foreign for t in range(ps)], dtype=torch.int64)
    if len(tokens):
        pool = harness.device_pool
        for buf in [*pool.k_buffer, *pool.v_buffer]:
            buf[device[tokens]] = _filled(buf[device[tokens]], SOURCE_POISON)
        kv = harness.kv_host_pool.kv_buffer  # (2, layers, slots, heads, dim)
        kv[:, :, host[tokens]] = _filled(kv[:, :, host[tokens]], SOURCE_POISON)
    return len(foreign)


def mark_free_host(harness: Any) -> int:
    """Fill every free host slot with `UNWRITTEN`; returns how many."""
    _check_shape(harness)
    pool = harness.kv_host_pool
    free = pool.free_slots
    pool.kv_buffer[:, :, free] = _filled(pool.kv_buffer[:, :, free], UNWRITTEN)
    return len(free)


def host_pages(harness: Any, token_ids: list[int]) -> list[torch.Tensor]:
    """The host bytes of each page of `token_ids`' prefix (held on device or host), every
    layer's K and V, in prefix order."""
    _check_shape(harness)
    held = sglang_adapter.match_held_prefix(harness.cache, token_ids, None).length
    if not held:
        return []
    pinned = sglang_adapter.pin_host_pages(harness.cache, token_ids, None, 0, held)
    try:
        host = pinned.host_indices
    finally:
        sglang_adapter.unpin_host_pages(pinned)
    ps = harness.cfg.page_size
    kv = harness.kv_host_pool.kv_buffer
    return [
        kv[:, :, host[p * ps : (p + 1) * ps]].contiguous().view(torch.uint8).reshape(-1).clone()
        for p in range(len(host) // ps)
    ]


def _filled(like: torch.Tensor, byte: int) -> torch.Tensor:
    shape = (*like.shape[:-1], like.shape[-1] * like.element_size())
    raw = torch.full(shape, byte, dtype=torch.uint8)
    return raw.view(like.dtype)


# Test-only commands of a mini server's ranks (`mini_server._answer`): name -> (harness,
# *args) -> value.
COMMANDS = {"cp_mark_free_host": mark_free_host, "cp_host_pages": host_pages}
