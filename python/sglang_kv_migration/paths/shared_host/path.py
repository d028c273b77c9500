"""The shared-host data path: into the target's host pool, servers on one host.

Where the device path needs room in the target's GPU pool, this one needs room in its
host pool: the landing for a target whose GPU cannot take the prefix, at memory speed
instead of through the transfer engine's TCP. The target's host pool lives in a memory
file (`sglang_adapter.shared_host_pool`, chosen at start-up when the server offers this
path), which SGLang pins as it would its own allocation.

A `DataPath` of two roles:
- target (`target_side.py`, over the host path's `paths/host/host_slots.py`): host
  slots reserved, held by the
  pending registry (quarantined on abort or expiry like the host path's), and on commit
  inserted as host-only radix nodes, which the next request loads back to the GPU
  through HiCache, as it does its own pages (`cached_tokens_details.host`);
- source (`source_side.py`): maps the target's pool once per target instance
  (`peer_pools.py`) and copies the granted pages into it from where they lie here, GPU
  or host pool, with the device path's tiered copies (`paths/device/tier_source.py`).

Whole prefixes land in the host pool: a host-only node may hang only below nodes that
have a host copy, so a part landed in the GPU would be written to the host again before
the rest could be inserted, and serving the prefix needs the whole of it in the GPU
anyway (HiCache loads it back then).

Refused (the client then tries the host path): another host or user, a host pool
that is not in a memory file (a storage backend's own allocator), a layout the copies
cannot address (page_head, an NSA pool group), or host pools of different layouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sglang_kv_migration.paths.base import SHARED_HOST
from sglang_kv_migration.paths.device.tier_path import TierPath
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.shared_host.source_side import SharedHostSourceSide
from sglang_kv_migration.paths.shared_host.target_side import (
    SharedHostTargetSide,
    shared_host_unavailable_reason,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget


class SharedHostPath(TierPath):
    name: ClassVar[str] = SHARED_HOST

    def __init__(self, cache: HiRadixCache, layout: HostPoolLayout | None = None):
        self.cache = cache
        self.target = SharedHostTargetSide(cache, layout)
        self.source = SharedHostSourceSide(cache, self.target.shape)
        self.copier = self.source.copier
        self.copier.warm_up()

    # ------------------------------------------------------------------ both roles

    def advertise(self) -> dict[str, Any]:
        return self.target.advertise(self.source.tiers())

    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        # As it came: the grant binds the digest of what the target advertised.
        return target.shared_host_kv or {}


__all__ = ["SharedHostPath", "shared_host_unavailable_reason"]
