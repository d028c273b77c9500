"""The target role of the paths that land in the host pool (the host path, through
Mooncake, and the shared-host path, from a same-host source): host slots reserved
(evicting unprotected host-only pages only when the request can then be met), and on
commit inserted as host-only radix nodes, which the next request loads to the GPU
through HiCache's normal load-back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.host.layout import HostPoolLayout

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun


class HostSlots:
    """See the module docstring: one rank's host pool as a landing."""

    def __init__(self, cache: HiRadixCache, layout: HostPoolLayout):
        self.cache = cache
        self.layout = layout

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return sglang_adapter.match_held_prefix(self.cache, input_ids, extra_key)

    def content_digest(self, slots: torch.Tensor) -> str:
        return verify.host_pages_digest(self.layout, slots)

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        # Host slots carry no owner: on an owner-sharded server the pattern stays with the
        # migration (its grant binds it), every rank reserves the whole run, and each is
        # written only at the pages it owns.
        return sglang_adapter.alloc_host_slots(self.cache, num_tokens)

    def release(self, slots: torch.Tensor) -> None:
        sglang_adapter.free_host_slots(self.cache, slots)

    def retake(self, slots: torch.Tensor) -> None:
        sglang_adapter.take_host_slots(self.cache, slots)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        # IMPORTANT: SGLang assumes every ancestor of a host-only node has a host copy
        # (device eviction of a node without one asserts it is a leaf). The matched
        # prefix, or device pages a concurrent insert added below it, may be device-only
        # (write_through_selective, write_back, a full host pool): back them up before
        # hanging host-only nodes below them. On failure nothing was inserted.
        held = sglang_adapter.match_held_prefix(self.cache, key.token_ids, key.extra_key)
        sglang_adapter.write_back_path(
            self.cache, sglang_adapter.path_from_root(self.cache, held.last_node)
        )
        return sglang_adapter.insert_host_pages(self.cache, anchor, key, anchor_length, slots)
