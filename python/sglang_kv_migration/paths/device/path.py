"""The device data path: into the target's GPU through CUDA IPC, servers on one host.

A `DataPath` of two roles, each in its own module:
- target (`target_side.py`): device KV slots from SGLang's allocator, inserted on commit
  as ordinary device radix nodes; with the memory saver, a landing arena (`landing.py`)
  that sources write and commit copies into the pool;
- source (`source_side.py`, over `tier_source.py`): opens the target's buffers once per
  target instance (`cuda_ipc.PeerBuffers`), pins the prefix, and copies page by page on
  a side stream that first waits for the streams that may still write those pages
  (`tier_copies.py`); the reply is sent once the copy's event has completed.

Any tier (`tiers.py`): pages the source holds only in its pinned host pool (evicted from
its GPU) are read in place by the source's GPU through unified addressing and written
into the same target slots, one launch per tier, in the same migration. Advertised as
`tiers: ["device", "host"]`; without a readable host pool (not pinned, a layout the
kernel cannot address) only `["device"]`, and such ranges are refused.

Refused (the client then tries the next path): no CUDA, another host, a GPU this
process cannot see, or host pages this server cannot read in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import MigrationError
from sglang_kv_migration.paths.base import DEVICE
from sglang_kv_migration.paths.device import cuda_ipc, tiers
from sglang_kv_migration.paths.device.source_side import DeviceSourceSide
from sglang_kv_migration.paths.device.target_side import DeviceTargetSide
from sglang_kv_migration.paths.device.tier_copies import TierCopier
from sglang_kv_migration.paths.device.tier_path import TierPath
from sglang_kv_migration.targets import DeviceTarget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget


def device_path_unavailable_reason(
    cache: HiRadixCache, enable_memory_saver: bool, landing_bytes: int = 0
) -> str | None:
    """Why this server cannot offer the device path, or None when it can (with the
    memory saver on, as a landing-arena target of `landing_bytes`: `landing.py`)."""
    import torch

    missing = sglang_adapter.device_path_missing()
    if missing is not None:
        return missing
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if enable_memory_saver and not landing_bytes:
        return (
            "--enable-memory-saver with --kv-migration-landing-mb 0: CUDA IPC cannot "
            "export the saver's KV pool and no landing arena was asked for"
        )
    try:
        buffers = sglang_adapter.device_kv_buffers(cache)
    except MigrationError as e:
        return e.message
    if not all(b.is_cuda and b.is_contiguous() for b in buffers):
        return "device KV buffers are not contiguous CUDA tensors"
    return None


class DevicePath(TierPath):
    name: ClassVar[str] = DEVICE

    def __init__(self, cache: HiRadixCache, landing_bytes: int = 0):
        self.cache = cache
        self.page_size = int(cache.page_size)
        self.buffers = sglang_adapter.device_kv_buffers(cache)
        self.copier = TierCopier(cache, self.buffers, self.page_size)
        copier = self.copier
        self.target = DeviceTargetSide(
            cache,
            self.buffers,
            self.page_size,
            landing_bytes,
            pool_ptrs=lambda: copier.src_ptrs if copier.fused else None,
        )
        self.source = DeviceSourceSide(cache, copier)
        self._gpu_uuid = ""
        if copier.device.type == "cuda":
            self._gpu_uuid = cuda_ipc.gpu_uuid(copier.device.index)
        copier.warm_up()

    # ------------------------------------------------------------------ both roles

    def advertise(self) -> dict[str, Any]:
        target = self.target
        return DeviceTarget(
            host_identity=cuda_ipc.host_identity(),
            gpu_uuid=self._gpu_uuid,
            instance_id=target.instance_id,
            row_bytes=target.row_bytes,
            num_rows=target.advertised_rows(),
            buffers=target.exported,
            # Tiers this source copies from (absent: a server that reads device pages only).
            tiers=[tiers.DEVICE_TIER] + ([tiers.HOST_TIER] if self.copier.host is not None else []),
            landing_tokens=target.advertised_landing_tokens,
        ).to_wire()

    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        # As it came: the grant binds the digest of what the target advertised.
        return target.device_kv or {}

    # ------------------------------------------------------------------ memory saver

    def quiesce(self) -> None:
        """Wait for every copy this rank launched, as a source and out of its arena:
        before SGLang unmaps the KV pool (`/release_memory_occupation`)."""
        super().quiesce()
        self.target.quiesce()

    def release_memory(self) -> None:
        self.target.release_memory()

    def resume_memory(self) -> None:
        self.target.resume_memory()

    @property
    def landing_refusal(self) -> str:
        """Why a landing-mode rank has no arena now ("" while it has one)."""
        return self.target.landing_refusal

    # ------------------------------------------------------------------ target role

    @property
    def holds_device_slots(self) -> bool:
        return True

    @property
    def late_writes_reach_slots(self) -> bool:
        # Into a landing arena, a late write reaches arena rows, never the pool.
        return self.target.landing is None

    # ------------------------------------------------------------------ source role

    @property
    def host_tier_refusal(self) -> str:
        """Why host-only pages cannot be sent by this path ("" when they can)."""
        return self.source.host_tier_refusal
