"""Hooks on SGLang's `Scheduler` (registered by `plugin.py`), and the one on the host
pool's allocator that the scheduler's cache construction reaches.

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
    if not kv_migration_enabled(scheduler.server_args):
        return
    from sglang_kv_migration import sglang_adapter

    pp_rank, _tp_rank = sglang_adapter.scheduler_stage_rank(scheduler)
    if pp_rank == 0:
        return

    scheduler.kv_migration_stage_reply = sglang_adapter.stage_reply_sender(
        scheduler, port_args.tokenizer_ipc_name
    )


def after_init_request_dispatcher(_result: None, scheduler: Any) -> None:
    """Build this rank's migration side (`server/scheduler/compose.py`) and add its handlers to
    the dispatcher."""
    # Set on every scheduler so the per-iteration hook needs no attribute probing.
    scheduler.kv_migration = None
    if not kv_migration_enabled(scheduler.server_args):
        return
    from sglang_kv_migration import sglang_adapter
    from sglang_kv_migration.server.scheduler.compose import compose_for_scheduler

    side = compose_for_scheduler(scheduler)
    scheduler.kv_migration = side
    handlers = side.handlers()
    view = sglang_adapter.SchedulerView.of(scheduler)
    if view.dp_size > 1:
        from sglang_kv_migration.server.scheduler.dp_filter import for_dp_rank

        handlers = for_dp_rank(handlers, view.dp_rank, sglang_adapter.scheduler_load(scheduler))
    sglang_adapter.add_request_handlers(scheduler, handlers)
    channel = side.target.channel
    if channel is not None:
        sglang_adapter.wake_from_idle_sleep_on(scheduler, channel.channel.socket)


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
    the pool (`RankLoop.prepare_for_memory_release`); after it, drop the
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

    if sglang_adapter.frees_kv_cache(recv_req) and side.identity.memory_released:
        side.after_memory_resume()


def around_init_cache_with_memory_pool(
    original: Any, scheduler: Any, *args: Any, **kwargs: Any
) -> Any:
    """Build the host KV pool in shared memory when this server offers the shared-host
    path (`sglang_adapter.shared_host_pool`): same-host sources write it directly."""
    args_ = scheduler.server_args
    if not kv_migration_enabled(args_):
        return original(scheduler, *args, **kwargs)
    from sglang_kv_migration import sglang_adapter
    from sglang_kv_migration.paths.base import parse_path_names
    from sglang_kv_migration.paths.factory import offers_shared_host_pool

    shared = offers_shared_host_pool(parse_path_names(args_.kv_migration_paths))
    with sglang_adapter.host_pool_in_shared_memory(shared):
        return original(scheduler, *args, **kwargs)


def around_get_allocator_from_storage(
    original: Any, allocator_type: Any, *args: Any, **kwargs: Any
) -> Any:
    """The shared-memory allocator inside `around_init_cache_with_memory_pool` (SGLang's
    default allocator only), else SGLang's own choice."""
    from sglang_kv_migration import sglang_adapter

    allocator = sglang_adapter.host_tensor_allocator(allocator_type)
    return allocator if allocator is not None else original(allocator_type, *args, **kwargs)
