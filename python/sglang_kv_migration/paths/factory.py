"""The data paths by name (`--kv-migration-paths`): whether each can run on a rank and
how the server's scheduler side opens it (the one place that picks `HostPath`,
`SharedHostPath` or `DevicePath`). A new path adds one row to `PATH_FACTORIES`.

Also what the server builds of a path's parts without naming `host/` or `device/`: the
host pool's layout, the host path's staging arena (`base.TargetStaging`) and this
machine's identity (which servers share a host)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_kv_migration.paths.base import DEVICE, HOST, SHARED_HOST, DataPath, TargetStaging
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.transport import KVTransport, TransportConfig

logger = logging.getLogger(__name__)


class RankSide(Protocol):
    """What a factory reads of the rank that opens the path."""

    # The rank's context: its `tree_cache`, `tp_rank` and `merged_on_world` (a start-up
    # collective over every rank).
    ctx: Any
    layout: HostPoolLayout | None  # built where the host path is asked for
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
    from sglang_kv_migration.paths.host.mooncake import open_transport
    from sglang_kv_migration.paths.host.path import HostPath

    assert side.layout is not None, "the host path needs the host pool's layout"
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


def _shared_host_path_unavailable(side: RankSide, _enable_memory_saver: bool) -> str | None:
    from sglang_kv_migration.paths.shared_host.path import shared_host_unavailable_reason

    return shared_host_unavailable_reason(side.ctx.tree_cache)


def _open_shared_host_path(
    side: RankSide, _config: TransportConfig, _transport: KVTransport | None
) -> DataPath:
    from sglang_kv_migration.paths.shared_host.path import SharedHostPath

    return SharedHostPath(side.ctx.tree_cache, side.layout)


PATH_FACTORIES: dict[str, PathFactory] = {
    HOST: PathFactory(_always_available, _open_host_path),
    DEVICE: PathFactory(_device_path_unavailable, _open_device_path),
    SHARED_HOST: PathFactory(_shared_host_path_unavailable, _open_shared_host_path),
}


def open_paths(
    side: RankSide,
    names: tuple[str, ...],
    transport_config: TransportConfig,
    transport: KVTransport | None,
    enable_memory_saver: bool,
) -> dict[str, DataPath]:
    """The data paths a rank serves, in preference order. A path that cannot run here is
    left out (logged once, on the first rank); every rank leaves out the same ones,
    since they agree through a gather."""
    reasons: dict[str, str] = {}
    for name in names:
        reason = PATH_FACTORIES[name].unavailable(side, enable_memory_saver)
        if reason is not None:
            reasons[name] = reason
    # Offered only if every (tp, pp) rank can: the client treats a server as one peer.
    skipped = side.ctx.merged_on_world(reasons)
    paths: dict[str, DataPath] = {}
    for name in names:
        if name in skipped:
            if side.ctx.tp_rank == 0:
                logger.warning("KV migration %s path off: %s", name, skipped[name])
            continue
        paths[name] = PATH_FACTORIES[name].open(side, transport_config, transport)
    return paths


def open_staging(host_path: DataPath, layout: HostPoolLayout, nbytes: int) -> TargetStaging:
    """The host path's staging arena of `nbytes`, registered with its transport."""
    from sglang_kv_migration.paths.host.path import HostPath
    from sglang_kv_migration.paths.host.target_staging import HostStaging

    assert isinstance(host_path, HostPath), f"staging is the host path's, not {host_path.name}"
    return HostStaging(layout, nbytes, host_path.transport)


def offers_shared_host_pool(names: tuple[str, ...]) -> bool:
    """Whether a server offering the paths `names` keeps its host pool in shared memory
    (decided before the pool is allocated: `server/scheduler/hooks.py`)."""
    return SHARED_HOST in names


def host_identity() -> str:
    """Which machine this process runs on, as same-host peers compare it (the device
    path's CUDA IPC, the shared-host path and the same-host channels need one host)."""
    from sglang_kv_migration.paths.device.cuda_ipc import host_identity as identity

    return identity()
