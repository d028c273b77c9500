"""Hooks on SGLang's `Scheduler` (registered by `plugin.py`).

They set two attributes on every scheduler: `kv_migration` (this rank's
`MigrationSchedulerSide`, or None) and `kv_migration_stage_reply` (a later PP stage's
sender to the tokenizer manager, or None).

What they read of the scheduler goes through `sglang_adapter.SchedulerView`, so tests
drive them with stand-in objects that have the same attributes (`test/integration/test_plugin.py`,
the mini servers of `test/support/mini_server.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_kv_migration.server.server_args import kv_migration_enabled

logger = logging.getLogger(__name__)


def after_init_ipc_channels(_result: None, scheduler: Any, port_args: Any) -> None:
    """Give a later PP stage's first TP rank its own socket to the tokenizer manager
    (SGLang connects only stage 0); every stage then answers for its own ranks."""
    scheduler.kv_migration_stage_reply = None
    if not kv_migration_enabled(scheduler.server_args) or scheduler.pp_rank == 0:
        return
    from sglang_kv_migration import sglang_adapter

    scheduler.kv_migration_stage_reply = sglang_adapter.stage_reply_sender(
        scheduler, port_args.tokenizer_ipc_name
    )


def after_init_request_dispatcher(_result: None, scheduler: Any) -> None:
    """Build this rank's migration side and add its handlers to the dispatcher."""
    # Set on every scheduler so the per-iteration hook needs no attribute probing.
    scheduler.kv_migration = None
    if not kv_migration_enabled(scheduler.server_args):
        return
    from sglang_kv_migration import sglang_adapter
    from sglang_kv_migration.grants import derive_key
    from sglang_kv_migration.paths.base import parse_path_names
    from sglang_kv_migration.paths.host.mooncake import TransportConfig
    from sglang_kv_migration.server.diag.profiling import rank_profile
    from sglang_kv_migration.server.rank.context import RankContext
    from sglang_kv_migration.server.rank.scheduler_side import (
        MigrationSchedulerSide,
        advertised_hostname,
    )

    view = sglang_adapter.SchedulerView.of(scheduler)
    args = view.server_args
    if not sglang_adapter.is_hiradix_cache(view.tree_cache):
        raise RuntimeError(
            "--enable-kv-migration needs SGLang's HiRadixCache as the tree cache, got "
            f"{type(view.tree_cache).__name__}; other hierarchical caches are not supported yet"
        )
    ctx = RankContext(
        tree_cache=view.tree_cache,
        tp_rank=view.tp_rank,
        tp_size=view.tp_size,
        pp_rank=view.pp_rank,
        pp_size=view.pp_size,
        # Handlers gather over the stage's TP ranks; each stage replies for itself.
        cpu_group=view.tp_cpu_group,
        model=args.served_model_name,
        send_output=view.send_output,
        world_group=view.world_cpu_group,
        # Every DP rank of one launch shares the server's identity (`server_epoch`).
        launch_id=args.kv_migration_launch_id if view.dp_size > 1 else "",
    )
    transport_config = TransportConfig(
        hostname=advertised_hostname(args.kv_migration_hostname, args.host),
        protocol=args.kv_migration_protocol,
        rdma_devices=args.kv_migration_rdma_devices,
        max_entries_per_batch=args.kv_migration_max_batch_entries,
        workers_per_peer=args.kv_migration_peer_workers,
        transfer_timeout_s=args.kv_migration_transfer_timeout,
    )
    metrics = None
    if args.enable_metrics:
        from sglang_kv_migration.server.diag.metrics import MigrationMetrics

        metrics = MigrationMetrics(args.served_model_name, ctx.tp_rank, ctx.pp_rank)
    side = MigrationSchedulerSide(
        ctx,
        watchdog_timeout_s=args.kv_migration_watchdog_timeout,
        transport_config=transport_config,
        metrics=metrics,
        path_names=parse_path_names(args.kv_migration_paths),
        enable_memory_saver=args.enable_memory_saver,
        grant_key=derive_key(args.kv_migration_grant_key, args.admin_api_key),
        grant_ttl_s=args.kv_migration_grant_ttl,
        staging_bytes=args.kv_migration_staging_mb << 20,
        verify=args.kv_migration_verify,
        attn_cp_size=args.attn_cp_size,
        landing_bytes=args.kv_migration_landing_mb << 20,
        profile=rank_profile(args.port, ctx.tp_rank, ctx.pp_rank),
    )
    side.scheduler_idle = sglang_adapter.scheduler_idle_check(scheduler)
    side.input_waiting = sglang_adapter.input_waiting_check(scheduler)
    scheduler.kv_migration = side
    handlers = side.handlers()
    if view.dp_size > 1:
        from sglang_kv_migration.server.rank.dp_filter import for_dp_rank

        handlers = for_dp_rank(handlers, view.dp_rank, sglang_adapter.scheduler_load(scheduler))
    sglang_adapter.add_request_handlers(scheduler, handlers)
    if side.channel_allocations is not None:
        sglang_adapter.wake_from_idle_sleep_on(scheduler, side.channel_allocations.channel.socket)


def before_process_input_requests(scheduler: Any, recv_reqs: Any, *_: Any, **__: Any) -> None:
    """Once per loop iteration, before its requests are dispatched: commits the sources
    delivered to the mailbox, so the iteration's requests see them (`target/mailbox_commits.py`)."""
    side = scheduler.kv_migration
    if side is not None:
        side.before_requests(recv_reqs)


def after_process_input_requests(_result: None, scheduler: Any, recv_reqs: Any, *_: Any) -> None:
    """Once per loop iteration, after the requests of the iteration were dispatched: a
    brief wait for what the source's transfers wait for (`wait_briefly`: only while
    SGLang is idle), then the poll."""
    side = scheduler.kv_migration
    if side is not None:
        if side.transfers.inflight:  # (what an idle rank has in flight: nothing)
            side.wait_briefly()
        forward = side.poll()
        if forward:
            # Stage 0's watchdog decisions, for the later PP stages (`pp_stages.py`).
            from sglang_kv_migration import sglang_adapter

            sglang_adapter.forward_to_later_stages(recv_reqs, forward)


def around_session_held_tokens(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> int:
    """Count device slots reserved by pending migrations as held outside the tree, so
    SGLang's memory-leak checks (strict when idle) keep their invariant."""
    held = original(scheduler, *args, **kwargs)
    side = scheduler.kv_migration
    return held + side.device_tokens_held() if side is not None else held


def around_flush_cache(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep pending migrations consistent with a cache reset (e.g. after new weights)."""
    side = scheduler.kv_migration
    # Only when the flush will really happen (SGLang flushes an idle scheduler only).
    if side is None or not scheduler.is_fully_idle():
        return original(scheduler, *args, **kwargs)
    side.prepare_for_cache_flush()
    flushed = original(scheduler, *args, **kwargs)
    if flushed:
        side.after_cache_flush()
    return flushed


def around_sleep_on_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Do not let `--sleep-on-idle` park the loop (up to 1 s on its sockets) while a
    migration of ours is in flight or pending: its replies and scatters advance only in
    the per-iteration poll. SGLang sees no requests of its own then, so it would sleep."""
    side = scheduler.kv_migration
    if side is not None and side.has_work():
        return None
    return original(scheduler, *args, **kwargs)


def around_release_memory_occupation(
    original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    """Before SGLang unmaps the KV pool: let our copies finish and drop what refers to
    the pool (`MigrationSchedulerSide.prepare_for_memory_release`); after it, drop the
    device path's landing arena too."""
    side = scheduler.kv_migration
    from sglang_kv_migration import sglang_adapter

    # SGLang releases an idle scheduler only (it asserts so): otherwise change nothing.
    if side is None or not sglang_adapter.frees_kv_cache(recv_req) or not scheduler.is_fully_idle():
        return original(scheduler, recv_req, *args, **kwargs)
    side.prepare_for_memory_release()
    output = original(scheduler, recv_req, *args, **kwargs)
    side.after_memory_release()
    return output


def after_resume_memory_occupation(_result: Any, scheduler: Any, recv_req: Any, *_: Any) -> None:
    side = scheduler.kv_migration
    if side is None:
        return
    from sglang_kv_migration import sglang_adapter

    if sglang_adapter.frees_kv_cache(recv_req) and side.memory_released:
        side.after_memory_resume()
