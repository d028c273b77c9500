"""The data paths behind one interface (`base.DataPath`): `host/` (host pool -> host pool
through Mooncake), `device/` (into the target's GPU through CUDA IPC, from the source's
GPU or pinned host pool) and `shared_host/` (into the target's host pool, which a
same-host source maps). Paths import nothing from `server/`.

The server reaches them through `base` (the interfaces), `factory` (what opens and builds
them) and the names exported here: the host path's transport settings and defaults, and
the type of the host pool's layout."""

from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.transport import (
    DEFAULT_WORKERS_PER_PEER,
    MC_DEFAULT_TRANSFER_TIMEOUT_S,
    MC_TRANSFER_TIMEOUT_ENV,
    KVTransport,
    TransportConfig,
)

__all__ = [
    "DEFAULT_WORKERS_PER_PEER",
    "MC_DEFAULT_TRANSFER_TIMEOUT_S",
    "MC_TRANSFER_TIMEOUT_ENV",
    "HostPoolLayout",
    "KVTransport",
    "TransportConfig",
]
