"""Server flags of KV-cache migration, added to SGLang's `ServerArgs`.

`plugin.py` replaces `sglang.srt.server_args.ServerArgs` with `KVMigrationServerArgs`, a
subclass with our fields, of the kind SGLang's is (a dataclass on 0.5.12, a msgspec
struct on 0.5.23: `sglang_adapter.server_args_class`). Subclassing (instead of setting
attributes on an instance) keeps the fields typed, makes them fields of the record, lets
`Engine(enable_kv_migration=True)` work, and carries them into the scheduler processes,
which receive ServerArgs pickled.

The checks here read the flags as given. On 0.5.23 that is all there is at
construction (resolution runs later, `resolve_once`); what resolution may still switch
off (HiCache) is refused where the scheduler builds its side (`cache_unsupported`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from sglang.srt import server_args as _upstream

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths import DEFAULT_WORKERS_PER_PEER as DEFAULT_PEER_WORKERS
from sglang_kv_migration.paths import MC_DEFAULT_TRANSFER_TIMEOUT_S, MC_TRANSFER_TIMEOUT_ENV
from sglang_kv_migration.paths.base import HOST, parse_path_names

logger = logging.getLogger(__name__)

# IMPORTANT: never keep a module-level alias of the upstream class here. The hook registry
# rebinds every module attribute that holds the replaced class to the replacement, so an
# alias would point back at KVMigrationServerArgs and recurse; reach the parent via super().

TransportProtocol = Literal["tcp", "rdma"]

DEFAULT_WATCHDOG_TIMEOUT_S = 60.0
DEFAULT_MAX_BATCH_ENTRIES = 1024
DEFAULT_PATHS = "device,shared_host,host"
DEFAULT_GRANT_TTL_S = 15.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_STAGING_MB = 256
# Memory saver: 1 GiB holds ~8K tokens of a Llama-3-8B-shaped KV (128 KiB per token).
DEFAULT_LANDING_MB = 1024


class KVMigrationArgsError(ValueError):
    """A migration flag is invalid or conflicts with another flag."""


@sglang_adapter.server_args_class  # a dataclass or a struct, as SGLang's ServerArgs is
class KVMigrationServerArgs(_upstream.ServerArgs):
    # KV-cache migration between servers (peer to peer over Mooncake TE).
    enable_kv_migration: bool = False
    kv_migration_watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT_S
    kv_migration_hostname: str | None = None
    kv_migration_protocol: TransportProtocol = "tcp"
    kv_migration_rdma_devices: str = ""
    kv_migration_max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES
    kv_migration_peer_workers: int = DEFAULT_PEER_WORKERS
    kv_migration_paths: str = DEFAULT_PATHS
    kv_migration_grant_key: str | None = None
    kv_migration_grant_ttl: float = DEFAULT_GRANT_TTL_S
    kv_migration_transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT_S
    kv_migration_staging_mb: int = DEFAULT_STAGING_MB
    kv_migration_landing_mb: int = DEFAULT_LANDING_MB
    kv_migration_verify: bool = False

    def __post_init__(self):
        # IMPORTANT: check our flags before SGLang's own post-init, which reads the model
        # config and probes devices: a wrong flag should fail fast with our message.
        check_kv_migration_args(self)
        if self.enable_kv_migration:
            warning = check_mooncake_timeout(self)
            if warning is not None:
                logger.warning(warning)
        super().__post_init__()
        # SGLang may switch hierarchical cache off (e.g. for diffusion LLMs).
        check_kv_migration_args(self)
        # Not a field (no flag): one value per launch, pickled with these args into every
        # scheduler process, so the DP ranks of a `--dp-size N` server, which share no
        # process group, agree on the server's identity (`RankContext.launch_id`).
        self.kv_migration_launch_id = uuid.uuid4().hex

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser):
        super(KVMigrationServerArgs, KVMigrationServerArgs).add_cli_args(parser)
        add_kv_migration_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        try:
            return super().from_cli_args(args)
        except KVMigrationArgsError as e:
            # One line, like argparse's own errors, instead of a traceback.
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None


# The flags, in `--help` order: (flag, argparse keywords). Each is a field of
# `KVMigrationServerArgs` (dashes for underscores) with the same default.
CLI_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--enable-kv-migration",
        dict(
            action="store_true",
            help="Serve the KV-cache migration endpoints (/get_transfer_session_info, "
            "/allocate_token_for_transfer, ...). Requires --enable-hierarchical-cache.",
        ),
    ),
    (
        "--kv-migration-watchdog-timeout",
        dict(
            type=float,
            default=DEFAULT_WATCHDOG_TIMEOUT_S,
            help="Seconds after which an allocation that was neither committed nor aborted is "
            "freed.",
        ),
    ),
    (
        "--kv-migration-hostname",
        dict(
            type=str,
            default=None,
            help="Address this server advertises to peers for KV transfers. Defaults to "
            "--host, or this machine's outbound IP when --host is a wildcard.",
        ),
    ),
    (
        "--kv-migration-protocol",
        dict(
            choices=["tcp", "rdma"],
            default="tcp",
            help="Mooncake transport: rdma in production, tcp where there is no RDMA NIC.",
        ),
    ),
    (
        "--kv-migration-rdma-devices",
        dict(
            type=str,
            default="",
            help="Comma-separated RDMA device names for --kv-migration-protocol rdma "
            "(empty: let Mooncake pick).",
        ),
    ),
    (
        "--kv-migration-max-batch-entries",
        dict(
            type=int,
            default=DEFAULT_MAX_BATCH_ENTRIES,
            help="Most write entries submitted to one peer in one batch (Mooncake's TCP "
            "transport queues at most 1024 per peer by default).",
        ),
    ),
    (
        "--kv-migration-peer-workers",
        dict(
            type=int,
            default=DEFAULT_PEER_WORKERS,
            help="Host-path transfers to one peer that move at once (each its own worker "
            "thread; they share the peer's batch-entry budget). 1 sends one after another.",
        ),
    ),
    (
        "--kv-migration-paths",
        dict(
            type=str,
            default=DEFAULT_PATHS,
            help="Data paths this server offers, in order of preference: 'device' (into the "
            "target's GPU through CUDA IPC, servers on one host), 'shared_host' (into the "
            "target's host pool, kept in shared memory, servers on one host: the landing when "
            "the target's GPU is full) and 'host' (host pool to host pool through Mooncake). A "
            "path that cannot run here (no CUDA, --enable-memory-saver) is left out with a "
            "warning at start-up.",
        ),
    ),
    (
        "--kv-migration-grant-key",
        dict(
            type=str,
            default=None,
            help="Secret shared by every server that migrates with this one: signs the write "
            "grants and receipts that bind a source's writes to the slots the target reserved. "
            "Defaults to one derived from --admin-api-key, never from --api-key (every client "
            "holds that); without either, grants are unsigned: they stop confused clients, not "
            "a hostile client or peer, which can forge one.",
        ),
    ),
    (
        "--kv-migration-grant-ttl",
        dict(
            type=float,
            default=DEFAULT_GRANT_TTL_S,
            help="Seconds after allocate during which the source may start writing the reserved "
            "slots (at most half of --kv-migration-watchdog-timeout is used).",
        ),
    ),
    (
        "--kv-migration-transfer-timeout",
        dict(
            type=float,
            default=DEFAULT_TRANSFER_TIMEOUT_S,
            help="Longest a host-path transfer may run. Freed slots whose writes could still land "
            "stay quarantined until the grant's deadline plus twice this. Mooncake's own batch "
            "timeout (MC_TRANSFER_TIMEOUT, default 30 s) must not be longer: start-up refuses "
            "a longer MC_TRANSFER_TIMEOUT and warns when the unset default is.",
        ),
    ),
    (
        "--kv-migration-staging-mb",
        dict(
            type=int,
            default=DEFAULT_STAGING_MB,
            help="Host memory per rank (MiB, pinned where CUDA is available) that sources may "
            "write fragmented host-path migrations into as a few large entries; the target then "
            "copies it into the reserved slots before commit. 0 turns staging off.",
        ),
    ),
    (
        "--kv-migration-landing-mb",
        dict(
            type=int,
            default=DEFAULT_LANDING_MB,
            help="With --enable-memory-saver: GPU memory per rank (MiB, outside the saver's "
            "regions, released and re-created with the KV cache) that same-host sources write "
            "device-path migrations into before the target copies them into its KV pool; a "
            "longer prefix moves in rounds of this size. 0 leaves such servers the host path only.",
        ),
    ),
    (
        "--kv-migration-verify",
        dict(
            action="store_true",
            help="As a target, check every migration before inserting it: the source sends an "
            "xxh3-128 digest of the KV it wrote, this server hashes what landed in the reserved "
            "slots, and /commit answers 409 (nothing inserted) on a mismatch. Costs one pass "
            "over the migrated bytes on each side. Clients can also ask per migration "
            "(allocate or commit with verify: true).",
        ),
    ),
)


def add_kv_migration_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache migration (sglang-kv-migration)")
    for flag, keywords in CLI_FLAGS:
        group.add_argument(flag, **keywords)


def check_kv_migration_args(args: KVMigrationServerArgs) -> None:
    """Raise `KVMigrationArgsError` with a one-line message for an invalid combination."""
    if not args.enable_kv_migration:
        return
    if not args.enable_hierarchical_cache:
        raise KVMigrationArgsError(
            "--enable-kv-migration requires --enable-hierarchical-cache "
            "(migrated pages land in the hierarchical cache's host pool); add "
            "--enable-hierarchical-cache."
        )
    if not args.kv_migration_watchdog_timeout > 0:
        raise KVMigrationArgsError(
            "--kv-migration-watchdog-timeout must be a positive number of seconds, got "
            f"{args.kv_migration_watchdog_timeout}."
        )
    if not args.kv_migration_grant_ttl > 0:
        raise KVMigrationArgsError(
            "--kv-migration-grant-ttl must be a positive number of seconds, got "
            f"{args.kv_migration_grant_ttl}."
        )
    if not args.kv_migration_transfer_timeout > 0:
        raise KVMigrationArgsError(
            "--kv-migration-transfer-timeout must be a positive number of seconds, got "
            f"{args.kv_migration_transfer_timeout}."
        )
    if args.kv_migration_staging_mb < 0:
        raise KVMigrationArgsError(
            f"--kv-migration-staging-mb must be >= 0 (0 = off), got {args.kv_migration_staging_mb}."
        )
    if args.kv_migration_landing_mb < 0:
        raise KVMigrationArgsError(
            f"--kv-migration-landing-mb must be >= 0 (0 = off), got {args.kv_migration_landing_mb}."
        )
    if args.kv_migration_max_batch_entries < 1:
        raise KVMigrationArgsError(
            "--kv-migration-max-batch-entries must be at least 1, got "
            f"{args.kv_migration_max_batch_entries}."
        )
    if args.kv_migration_peer_workers < 1:
        raise KVMigrationArgsError(
            f"--kv-migration-peer-workers must be at least 1, got {args.kv_migration_peer_workers}."
        )
    if args.dp_size > 1 and args.pp_size > 1:  # (DP ranks: server/http/dp_ranks.py)
        raise KVMigrationArgsError(
            f"--enable-kv-migration with --dp-size {args.dp_size} does not support "
            f"--pp-size > 1 yet (got {args.pp_size}); use data and tensor parallelism only."
        )
    if args.tokenizer_worker_num > 1 or args.enable_http2:
        # SGLang then serves HTTP from worker processes that import its app afresh; the
        # plugin adds the migration routes to the main process's app only.
        raise KVMigrationArgsError(
            "--enable-kv-migration needs SGLang's single HTTP process: drop "
            "--tokenizer-worker-num > 1 and --enable-http2 (their HTTP workers would not "
            "serve the migration routes)."
        )
    if args.pp_size > 1 and args.nnodes > 1:
        # Later PP stages reply to the tokenizer manager over its node-local IPC socket.
        raise KVMigrationArgsError(
            f"--enable-kv-migration with --pp-size > 1 needs every stage on one node "
            f"(got --nnodes {args.nnodes}); multi-node pipeline parallelism is not supported yet."
        )
    try:
        path_names = parse_path_names(args.kv_migration_paths)
    except ValueError as e:
        raise KVMigrationArgsError(f"--kv-migration-paths: {e}.") from None
    device_missing = sglang_adapter.device_path_missing()
    if HOST not in path_names and device_missing is not None:
        # With the host path too, the device path is left out at start, with this reason.
        raise KVMigrationArgsError(
            f"--kv-migration-paths names no path this SGLang runs: {device_missing}; add host."
        )
    if args.kv_migration_protocol not in ("tcp", "rdma"):
        raise KVMigrationArgsError(
            f"--kv-migration-protocol must be tcp or rdma, got {args.kv_migration_protocol!r}."
        )
    refusal = sglang_adapter.server_args_refusal(args)
    if refusal is not None:
        raise KVMigrationArgsError(f"{refusal}.")


def check_mooncake_timeout(
    args: KVMigrationServerArgs, environ: Mapping[str, str] = os.environ
) -> str | None:
    """Refuse a Mooncake batch timeout longer than the write window leaves room for.

    A source submits no batch after its grant's `write_until` (the grant's deadline plus
    one transfer timeout), but a batch submitted just before it runs until it completes or
    Mooncake's own timeout (`MC_TRANSFER_TIMEOUT`) passes. The target keeps the slots
    quarantined for one more transfer timeout after `write_until`; a longer Mooncake timeout
    lets a stalled batch land after the slots were freed and reused. Raises
    `KVMigrationArgsError` when the variable is set too long; returns a warning when it is
    unset and Mooncake's default is too long; None when the window covers it."""
    allowed = args.kv_migration_transfer_timeout
    grant_ttl = min(args.kv_migration_grant_ttl, args.kv_migration_watchdog_timeout / 2)
    window = (
        f"the slots' write window is {grant_ttl + 2 * allowed:g} s after allocate (grant TTL "
        f"{grant_ttl:g} s + 2 x --kv-migration-transfer-timeout {allowed:g} s), and a batch "
        f"submitted at its last moment must end within {allowed:g} s"
    )
    raw = environ.get(MC_TRANSFER_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        if MC_DEFAULT_TRANSFER_TIMEOUT_S <= allowed:
            return None
        return (
            f"{MC_TRANSFER_TIMEOUT_ENV} is unset, so Mooncake lets a stalled batch run for its "
            f"default {MC_DEFAULT_TRANSFER_TIMEOUT_S:g} s, longer than "
            f"--kv-migration-transfer-timeout {allowed:g} s: {window}; a late batch can "
            f"overwrite reused slots. Set {MC_TRANSFER_TIMEOUT_ENV}={allowed:g} (or less)."
        )
    try:
        mooncake_s = float(raw)
    except ValueError:
        raise KVMigrationArgsError(
            f"{MC_TRANSFER_TIMEOUT_ENV} must be a number of seconds, got {raw!r}."
        ) from None
    if mooncake_s > allowed:
        raise KVMigrationArgsError(
            f"{MC_TRANSFER_TIMEOUT_ENV}={raw.strip()} s is longer than "
            f"--kv-migration-transfer-timeout {allowed:g} s: {window}. Set "
            f"{MC_TRANSFER_TIMEOUT_ENV} to at most {allowed:g} or raise "
            "--kv-migration-transfer-timeout."
        )
    return None


def kv_migration_enabled(server_args: object) -> bool:
    """True when these args ask for migration (False for a plain upstream ServerArgs)."""
    return isinstance(server_args, KVMigrationServerArgs) and server_args.enable_kv_migration
