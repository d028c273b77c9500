"""The device path's source role: into the target's GPU, whose KV buffers (or landing
arena) it maps through CUDA IPC (`cuda_ipc.PeerBuffers`, once per target instance;
a landing arena for the length of a send). The copy itself is `TierSource`'s: pages on
this GPU GPU -> GPU, pages only in the pinned host pool host -> GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import ROUTE_GPU_TO_GPU, ROUTE_HOST_TO_GPU, SendRange
from sglang_kv_migration.paths.device import cuda_ipc, tiers
from sglang_kv_migration.paths.device.tier_copies import CopyDestination, TierCopier
from sglang_kv_migration.paths.device.tier_source import Opening, TierSource
from sglang_kv_migration.targets import DeviceTarget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

# The route a source tier's pages take into the target's GPU (`SendStats.routes`).
DEVICE_TIER_ROUTES = {tiers.DEVICE_TIER: ROUTE_GPU_TO_GPU, tiers.HOST_TIER: ROUTE_HOST_TO_GPU}


class DeviceSourceSide(TierSource):
    """See the module docstring."""

    def __init__(self, cache: HiRadixCache, copier: TierCopier):
        super().__init__(cache, copier, DEVICE_TIER_ROUTES)
        self.peers = cuda_ipc.PeerBuffers()

    def close(self) -> None:
        self.peers.close()

    def check_destination(self, send: SendRange) -> DeviceTarget:
        """The target's description (`device_kv`), parsed."""
        if not send.target.device_kv:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, "target_per_rank has no device_kv for the device path"
            )
        try:
            return DeviceTarget.from_wire(send.target.device_kv)
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, f"bad device_kv description: {e}") from None

    def open_destination(self, destination: Any) -> Opening:
        """Check the target's description (one host, the same rows, a GPU this process
        sees and can reach), then open its buffers off this thread (at once when they
        are open)."""
        import torch

        peer: DeviceTarget = destination
        copier = self.copier
        if len(peer.num_rows) != len(peer.row_bytes):
            raise MigrationError(
                ErrorKind.BAD_REQUEST, "bad device_kv description: num_rows and row_bytes differ"
            )
        if peer.host_identity != cuda_ipc.host_identity():
            raise MigrationError(
                ErrorKind.CONFLICT, "target is on another host: the device path needs one host"
            )
        if peer.row_bytes != copier.row_bytes or len(peer.buffers) != len(copier.buffers):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"device KV rows differ: source {len(copier.buffers)} buffers of "
                f"{copier.row_bytes[:2]}... bytes, target {len(peer.buffers)} of "
                f"{peer.row_bytes[:2]}...",
            )
        target_index = cuda_ipc.local_device_of(peer.gpu_uuid)
        if target_index is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"target GPU {peer.gpu_uuid} is not visible to the source process",
            )
        here = copier.device.index
        if target_index != here and not torch.cuda.can_device_access_peer(here, target_index):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"this GPU ({here}) cannot access the target's GPU ({target_index}) as a peer",
            )
        # Mapped into *this* device's address space (CUDA enables peer access for a
        # mapping of a peer GPU's memory), so the copy kernel runs here and writes the
        # target's pages directly, over NVLink when the target is another GPU.
        # IMPORTANT: a landing arena is mapped per send, never kept: a mapping held here
        # would keep the arena's memory allocated on the target after it released it.
        future = self.peers.open_async(
            peer.instance_id, peer.buffers, self.copier.device.index, cached=not peer.landing_tokens
        )
        return Opening(future, lambda opened: self._checked(opened, peer), peer.landing_tokens > 0)

    def _checked(self, opened: cuda_ipc.OpenedPeer, peer: DeviceTarget) -> CopyDestination:
        """The mapped buffers have the sizes `peer` describes (checked once per mapping
        and description: a kept mapping is checked on its first send only)."""
        described = (tuple(peer.num_rows), tuple(peer.row_bytes))
        if opened.checked != described:
            for flat, rows, rb in zip(opened.buffers, peer.num_rows, peer.row_bytes, strict=True):
                if flat.numel() != rows * rb:
                    raise MigrationError(
                        ErrorKind.BAD_REQUEST,
                        f"device buffer of {flat.numel()} bytes, expected {rows} rows of {rb}",
                    )
            opened.page_limit = min(
                flat.numel() // pb
                for flat, pb in zip(opened.buffers, self.copier.page_bytes, strict=True)
            )
            opened.checked = described
        first = not opened.used
        opened.used = True
        return CopyDestination(
            flats=opened.buffers,
            pointers=opened.pointers,
            page_limit=opened.page_limit,
            key=id(opened),
            first_use=first,
        )
