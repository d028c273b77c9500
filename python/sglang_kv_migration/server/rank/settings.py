"""What a rank's migration side is built from (`server/scheduler/compose.py`): the server args of
`--enable-kv-migration` read once, and what tests and benchmarks that drive a rank
directly give instead (a transport of their own, no SGLang state)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.grants import derive_key
from sglang_kv_migration.paths import KVTransport, TransportConfig
from sglang_kv_migration.paths.base import HOST, parse_path_names
from sglang_kv_migration.server.diag.metrics import MigrationMetrics
from sglang_kv_migration.server.diag.profiling import RankProfile, rank_profile


@dataclass
class RankSettings:
    watchdog_timeout_s: float
    transport_config: TransportConfig
    transport: KVTransport | None = None  # the host path's transport; None: open one
    metrics: MigrationMetrics | None = None  # None: no metrics (`NullMetrics`)
    path_names: tuple[str, ...] = (HOST,)  # in preference order
    enable_memory_saver: bool = False
    grant_key: bytes | None = None  # None: unsigned grants
    grant_ttl_s: float = 15.0
    staging_bytes: int = 0  # the host path's staging arena (0: none)
    verify: bool = False  # --kv-migration-verify: check every commit's digest
    attn_cp_size: int = 1
    landing_bytes: int = 0  # the device path's landing arena, with the memory saver
    profile: RankProfile | None = None  # SGLANG_KV_MIGRATION_PROFILE_DIR
    # SGLang's state for the brief waits and deferred prepares (`idle_probe.py`); None:
    # never wait, never defer (a rank driven without a scheduler).
    scheduler_idle: Callable[[], bool] | None = None
    input_waiting: Callable[[], bool] | None = None
    # Offer the GIL to our helper threads once per busy iteration (`loop.py`).
    yield_gil: bool = True
    # Feature "running_slots": the scheduler's running requests (None: not offered, on
    # servers with several PP stages or DP ranks, or a rank driven without a scheduler).
    running_requests: Any = None

    @property
    def host_path(self) -> bool:
        """The host path is asked for (it runs wherever it is: `paths/factory.py`)."""
        return HOST in self.path_names


def settings_from_server_args(
    args: Any,
    tp_rank: int,
    pp_rank: int,
    scheduler_idle: Callable[[], bool],
    input_waiting: Callable[[], bool],
    running_requests: Any = None,
) -> RankSettings:
    """A rank's settings from SGLang's `ServerArgs` (with our flags, `server_args.py`;
    SGLang's own fields as they are in effect: `sglang_adapter.effective_server_args`)."""

    in_effect = sglang_adapter.effective_server_args(args)
    metrics = None
    if in_effect.enable_metrics:
        metrics = MigrationMetrics(in_effect.served_model_name, tp_rank, pp_rank)
    return RankSettings(
        watchdog_timeout_s=args.kv_migration_watchdog_timeout,
        transport_config=TransportConfig(
            hostname=advertised_hostname(args.kv_migration_hostname, in_effect.host),
            protocol=args.kv_migration_protocol,
            rdma_devices=args.kv_migration_rdma_devices,
            max_entries_per_batch=args.kv_migration_max_batch_entries,
            workers_per_peer=args.kv_migration_peer_workers,
            transfer_timeout_s=args.kv_migration_transfer_timeout,
        ),
        metrics=metrics,
        path_names=parse_path_names(args.kv_migration_paths),
        enable_memory_saver=in_effect.enable_memory_saver,
        grant_key=derive_key(args.kv_migration_grant_key, in_effect.admin_api_key),
        grant_ttl_s=args.kv_migration_grant_ttl,
        staging_bytes=args.kv_migration_staging_mb << 20,
        verify=args.kv_migration_verify,
        attn_cp_size=in_effect.attn_cp_size,
        landing_bytes=args.kv_migration_landing_mb << 20,
        profile=rank_profile(in_effect.port, tp_rank, pp_rank),
        scheduler_idle=scheduler_idle,
        input_waiting=input_waiting,
        running_requests=running_requests,
    )


def advertised_hostname(configured: str | None, server_host: str) -> str:
    """The address peers should use to reach this server's transfer engine."""
    if configured:
        return configured
    if server_host and server_host not in ("0.0.0.0", "::", ""):
        return server_host
    # Wildcard bind: the address this host's name resolves to.
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
