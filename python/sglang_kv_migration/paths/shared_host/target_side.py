"""The shared-host path's target role: the host path's landing in the host pool
(`paths/host/host_slots.py`: host slots, quarantined like the host path's, inserted as
host-only nodes on commit) over a pool kept in a memory file, which it publishes for
same-host sources (`targets.SharedHostTarget`)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import MigrationError
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.device import cuda_ipc, tiers
from sglang_kv_migration.paths.host.host_slots import HostSlots
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.targets import SharedHostTarget

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


def shared_host_unavailable_reason(cache: HiRadixCache) -> str | None:
    """Why this server cannot offer the shared-host path, or None when it can."""
    missing = sglang_adapter.shared_host_path_missing()
    if missing is not None:
        return missing
    if sglang_adapter.shared_host_region(cache) is None:
        return (
            "the host pool is not in a shared memory file (it is, unless a storage "
            "backend brings its own allocator)"
        )
    try:
        shape = sglang_adapter.host_pool_shape(cache)
        buffers = sglang_adapter.device_kv_buffers(cache)
        offsets, _geometry = _geometry_of(shape)
    except (MigrationError, ValueError) as e:
        return str(e)
    row_bytes = {b[0].numel() * b.element_size() for b in buffers}
    if len(offsets) != len(buffers) or row_bytes != {shape.row_bytes}:
        return "host pool rows differ from the device pool's"
    if shape.row_bytes % 8:
        return f"host rows of {shape.row_bytes} bytes are not whole 8-byte words"
    return None


class SharedHostTargetSide(HostSlots):
    """See the module docstring."""

    def __init__(self, cache: HiRadixCache, layout: HostPoolLayout | None = None):
        super().__init__(
            cache, layout or HostPoolLayout.from_host_pool(sglang_adapter.host_pool(cache))
        )
        region = sglang_adapter.shared_host_region(cache)
        if region is None:
            raise RuntimeError("the shared-host path needs the host pool in a memory file")
        self.region = region
        self.shape = shape = sglang_adapter.host_pool_shape(cache)
        self.instance = uuid.uuid4().hex  # a restarted server is a new peer
        offsets, geometry = _geometry_of(shape)
        # This pool's pages per device buffer: what the verify digest reads, in the
        # order the source's `tier_pages_digest` hashes them.
        self._own_pages = tiers.TierBuffers.of_host(
            shape.kv_buffer, offsets, geometry, shape.page_num
        ).views()

    def advertise(self, source_tiers: list[str]) -> dict[str, Any]:
        """What sources write to (`source_tiers`: the tiers this rank reads as one)."""
        shape, region = self.shape, self.region
        return SharedHostTarget(
            host_identity=cuda_ipc.host_identity(),
            instance=self.instance,
            pid=region.pid,
            fd=region.fd,
            inode=region.inode,
            nbytes=region.nbytes,
            attention=shape.attention,
            layout=shape.layout,
            layer_num=shape.layer_num,
            page_num=shape.page_num,
            page_tokens=shape.page_size,
            row_bytes=shape.row_bytes,
            tiers=source_tiers,
        ).to_wire()

    def content_digest(self, slots: torch.Tensor) -> str:
        # Per device buffer, like the source's digest of what it sent (the host path's
        # digest walks the host layout's buffers instead).
        pages = tiers.pages_of(slots, self.shape.page_size)
        return verify.tier_pages_digest([(self._own_pages, pages)])


def _geometry_of(shape: sglang_adapter.HostPoolShape) -> tuple[list[int], Any]:
    """Where each device buffer's pages lie in the pool (`tiers.host_buffer_geometry`)."""
    return tiers.host_buffer_geometry(
        shape.attention,
        shape.layout,
        shape.layer_num,
        shape.page_num,
        shape.page_size,
        shape.row_bytes,
    )
