"""The data paths by name (`--kv-migration-paths`): whether each can run on a rank and
how the server's scheduler side opens it (the one place that picks `HostPath` or
`DevicePath`). A new path adds one row to `PATH_FACTORIES`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_kv_migration.paths.base import DEVICE, HOST, DataPath
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.mooncake import KVTransport, TransportConfig, open_transport


class RankSide(Protocol):
    """What a factory reads of the rank's scheduler side that opens the path."""

    ctx: Any  # the rank's context: its `tree_cache`
    layout: HostPoolLayout
    landing_bytes: int


@dataclass(frozen=True)
class PathFactory:
    """How the scheduler side opens one data path on its rank."""

    # Why the path cannot run on this rank (side, enable_memory_saver), None when it can.
    unavailable: Callable[[RankSide, bool], str | None]
    # Open it (side, transport config, transport given by a test or None).
    open: Callable[[RankSide, TransportConfig, KVTransport | None], DataPath]


def _always_available(_side: RankSide, _enable_memory_saver: bool) -> str | None:
    return None


def _open_host_path(
    side: RankSide, config: TransportConfig, transport: KVTransport | None
) -> DataPath:
    from sglang_kv_migration.paths.host.path import HostPath

    return HostPath(
        side.ctx.tree_cache,
        side.layout,
        transport or open_transport(config),
        transfer_timeout_s=config.transfer_timeout_s,
    )


def _device_path_unavailable(side: RankSide, enable_memory_saver: bool) -> str | None:
    from sglang_kv_migration.paths.device.path import device_path_unavailable_reason

    return device_path_unavailable_reason(
        side.ctx.tree_cache, enable_memory_saver, side.landing_bytes
    )


def _open_device_path(
    side: RankSide, _config: TransportConfig, _transport: KVTransport | None
) -> DataPath:
    from sglang_kv_migration.paths.device.path import DevicePath

    return DevicePath(side.ctx.tree_cache, landing_bytes=side.landing_bytes)


PATH_FACTORIES: dict[str, PathFactory] = {
    HOST: PathFactory(_always_available, _open_host_path),
    DEVICE: PathFactory(_device_path_unavailable, _open_device_path),
}
