"""The shared-host path's source role: a send's pages from where they lie on this server
(its GPU, or its host pool) into the granted host slots of a same-host target's host
pool, which it maps (`peer_pools.py`). The copy is `TierSource`'s: on a GPU server one
launch per tier writes the target's host pages by address (GPU -> host over PCIe, and
host -> host through this GPU, which reads its pinned pool in place); without CUDA the
same plan runs with torch at launch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import (
    ROUTE_GPU_TO_SHARED_HOST,
    ROUTE_HOST_TO_SHARED_HOST,
    SendRange,
)
from sglang_kv_migration.paths.device import cuda_ipc, tiers
from sglang_kv_migration.paths.device.tier_copies import TierCopier
from sglang_kv_migration.paths.device.tier_source import Opening, TierSource
from sglang_kv_migration.paths.shared_host.peer_pools import MappedPool, PeerPools
from sglang_kv_migration.targets import SharedHostTarget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

# The route a source tier's pages take into the target's host pool (`SendStats.routes`).
SHARED_HOST_TIER_ROUTES = {
    tiers.DEVICE_TIER: ROUTE_GPU_TO_SHARED_HOST,
    tiers.HOST_TIER: ROUTE_HOST_TO_SHARED_HOST,
}


class SharedHostSourceSide(TierSource):
    """See the module docstring. `layout`: this server's host pool layout, which a
    target's must equal (`HostPoolShape` fields) but for its size."""

    def __init__(self, cache: HiRadixCache, layout: sglang_adapter.HostPoolShape):
        buffers = sglang_adapter.device_kv_buffers(cache)
        copier = TierCopier(cache, buffers, int(cache.page_size))
        super().__init__(cache, copier, SHARED_HOST_TIER_ROUTES)
        self.layout = layout
        self.pools = PeerPools(copier.device)

    def tiers(self) -> list[str]:
        """The tiers this rank sends from (the host tier where it reads it in place)."""
        return [tiers.DEVICE_TIER] + ([tiers.HOST_TIER] if self.copier.host else [])

    def close(self) -> None:
        self.pools.close(self.copier.synchronize)

    def check_destination(self, send: SendRange) -> SharedHostTarget:
        """The target's description (`shared_host_kv`), parsed."""
        described = send.target.shared_host_kv
        if not described:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "target_per_rank has no shared_host_kv for the shared_host path",
            )
        try:
            return SharedHostTarget.from_wire(described)
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, f"bad shared_host_kv description: {e}"
            ) from None

    def open_destination(self, destination: Any) -> Opening:
        """Check the target's description against this server (one host, the same host
        pool layout but for its size), then map its pool off this thread (at once when
        it is mapped)."""
        peer: SharedHostTarget = destination
        if peer.host_identity != cuda_ipc.host_identity():
            raise MigrationError(
                ErrorKind.CONFLICT, "target is on another host: the shared_host path needs one"
            )
        mine = self.layout
        theirs = (peer.attention, peer.layout, peer.layer_num, peer.page_tokens, peer.row_bytes)
        ours = (mine.attention, mine.layout, mine.layer_num, mine.page_size, mine.row_bytes)
        if theirs != ours:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"host pool layouts differ: target (attention, layout, layers, page, row "
                f"bytes) {theirs}, source {ours}",
            )
        own = sglang_adapter.shared_host_region(self.cache)
        if own is not None and (peer.pid, peer.inode) == (own.pid, own.inode):
            raise MigrationError(
                ErrorKind.CONFLICT, "the destination is this server's own host pool"
            )
        if self._together is None and not self.pools.holds(peer):
            # A new target (a restarted one, maybe), between launches: mappings of
            # targets that are gone go now (each keeps a whole host pool allocated).
            self.pools.drop_gone(self.copier.synchronize)
        return Opening(self.pools.open_async(peer), MappedPool.resolve)
