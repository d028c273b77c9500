"""SGLang plugin entry point (`sglang.srt.plugins` group): registers hooks, nothing else.

`load_plugins()` calls `register()` early in every SGLang process (launcher, scheduler
ranks, Engine) and then applies the hooks. Each hook returns at once when
`--enable-kv-migration` is off, so a server without the flag runs upstream code only.

Hooks (targets are named in `sglang_adapter/hook_targets.py`):
- REPLACE `ServerArgs` with `KVMigrationServerArgs`: our CLI flags and their checks;
  the same for `Engine.server_args_class`, which `sglang.Engine(**kwargs)` builds its
  args with (bound when the class was defined, so the first REPLACE misses it);
- AFTER `Scheduler.init_ipc_channels`: later PP stages get a socket to the tokenizer;
- AFTER `Scheduler.init_request_dispatcher`: add the six handlers on every rank;
- BEFORE `Scheduler.process_input_requests`: commit what sources delivered to the
  mailbox (feature "source_commit"), before the iteration's requests are dispatched;
- AFTER `Scheduler.process_input_requests`: finish transfers, run the watchdog;
- AROUND `Scheduler.flush_cache`: drop pending allocations before the tree is reset, and
  refuse the flush while a transfer still reads pinned pages;
- AROUND `Scheduler._session_held_tokens`: count device slots of pending migrations, so
  SGLang's idle memory-leak check holds;
- AROUND `Scheduler.maybe_sleep_on_idle`: with `--sleep-on-idle`, keep the loop awake
  while a migration is in flight or pending (its replies come from the poll);
- AROUND `Scheduler.init_cache_with_memory_pool` and AROUND
  `memory_pool_host.get_allocator_from_storage`: a server that offers the shared-host
  path builds its host KV pool in shared memory;
- AFTER `TokenizerControlMixin.init_communicators`: one communicator per operation;
- BEFORE `http_server.launch_server`: check that every hook above is installed, then add
  the HTTP routes to SGLang's FastAPI app;
- BEFORE `Engine._launch_subprocesses`: the same, in a process that imported SGLang's HTTP
  server but starts the engine without `launch_server` (verl serves SGLang's `app` with
  its own uvicorn; `integrations/verl_plugin.py` loads the plugins there in time);
- only with `SGLANG_KV_MIGRATION_MOMENTS_DIR` set, AROUND the methods a request passes
  through (`server/diag/request_moments.py`): a diagnosis record, flag or no flag.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.sglang_adapter import hook_targets as upstream

logger = logging.getLogger(__name__)

_SERVER_ARGS_MODULE = "sglang_kv_migration.server.server_args"


def register() -> None:
    """Register every hook. Idempotent: a second call registers nothing more.

    Where SGLang's server runtime cannot be imported (a CPU-only install without
    `sgl_kernel`), its targets are left out: the registry would log one traceback per
    target before `launch_server --help`, and no server can start there anyway (a
    launch fails on SGLang's own import error)."""
    runtime_missing = sglang_adapter.server_runtime_missing()
    for target, hook, hook_type in _hook_table():
        if runtime_missing is not None and target in upstream.SERVER_RUNTIME_TARGETS:
            continue
        if not any(h is hook for h in sglang_adapter.registered_hooks(target)):
            HookRegistry.register(target, hook, hook_type)
    if runtime_missing is not None:
        logger.debug(
            "SGLang's server runtime cannot import here (no %s): KV-migration hooks on the "
            "scheduler and HTTP server not registered",
            runtime_missing,
        )


def take_server_args() -> None:
    """Make SGLang's `ServerArgs` ours now: the one hook a process needs before it builds
    `ServerArgs(enable_kv_migration=True)` itself, ahead of SGLang's `load_plugins()`
    (`sglang_flags.py` calls this once SGLang's `server_args` is imported). Does
    nothing once `load_plugins()` has started: that registers every hook itself, or was
    told by `SGLANG_PLUGINS` to leave this plugin out. Idempotent."""
    if sglang_adapter.plugins_loading_started():
        return
    ours = sys.modules.get(_SERVER_ARGS_MODULE)
    if ours is not None and "KVMigrationServerArgs" not in vars(ours):
        return  # it is importing SGLang's module right now: it is the class itself
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    target = upstream.SERVER_ARGS_CLASS
    if not any(h is KVMigrationServerArgs for h in sglang_adapter.registered_hooks(target)):
        HookRegistry.register(target, KVMigrationServerArgs, HookType.REPLACE)
    HookRegistry.apply_hooks()


def missing_hooks() -> list[str]:
    """Hook targets whose installed object does not (yet) carry our hook.

    The registry logs and carries on when a target cannot be patched; this lets start-up
    fail loudly instead (`before_launch_server`, the last hook to run).
    """
    missing = []
    for target, hook, _hook_type in _hook_table():
        try:
            installed = upstream.resolve(target)
        except (ImportError, AttributeError):
            missing.append(target)
            continue
        if installed is not hook and not _wraps_hook(installed, hook):
            missing.append(target)
    return missing


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Hook: refuse to serve with a hook missing, then add the routes to SGLang's app."""
    from sglang_kv_migration.server.http import routes as http_api
    from sglang_kv_migration.server.server_args import kv_migration_enabled

    if kv_migration_enabled(server_args):
        missing = missing_hooks()
        if missing:
            raise RuntimeError(
                "sglang-kv-migration could not hook into this SGLang (expected "
                f"sglang=={upstream.SGLANG_VERSION}); not installed on: {', '.join(missing)}"
            )
    http_api.add_routes_to_sglang_app()


def before_launch_subprocesses(engine_cls: Any, *args: Any, **kwargs: Any) -> None:
    """Hook: as `before_launch_server`, where the engine starts without `launch_server`.

    An offline `Engine` (no HTTP server imported in this process) has no app to add the
    routes to. Under `launch_server` this runs after `before_launch_server`: the check
    repeats and the routes are already there."""
    if not sglang_adapter.http_server_imported():
        return
    server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
    before_launch_server(server_args)


# ------------------------------------------------------------------ helpers


def _hook_table() -> list[tuple[str, object, HookType]]:
    """(target, hook, type) for every hook, in registration order: the one list both
    `register` and `missing_hooks` read. Imported here, not at module level: SGLang loads
    this module in every process before it parses arguments."""
    from sglang_kv_migration.server.http import communicators
    from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    table = [
        (upstream.SERVER_ARGS_CLASS, KVMigrationServerArgs, HookType.REPLACE),
        (upstream.ENGINE_SERVER_ARGS_CLASS, KVMigrationServerArgs, HookType.REPLACE),
        (upstream.SCHEDULER_INIT_IPC, scheduler_hooks.after_init_ipc_channels, HookType.AFTER),
        (
            upstream.SCHEDULER_INIT_DISPATCHER,
            scheduler_hooks.after_init_request_dispatcher,
            HookType.AFTER,
        ),
        (
            upstream.SCHEDULER_PROCESS_INPUT,
            scheduler_hooks.before_process_input_requests,
            HookType.BEFORE,
        ),
        (
            upstream.SCHEDULER_PROCESS_INPUT,
            scheduler_hooks.after_process_input_requests,
            HookType.AFTER,
        ),
        (upstream.SCHEDULER_FLUSH_CACHE, scheduler_hooks.around_flush_cache, HookType.AROUND),
        (
            upstream.SCHEDULER_SESSION_HELD_TOKENS,
            scheduler_hooks.around_session_held_tokens,
            HookType.AROUND,
        ),
        (upstream.SCHEDULER_SLEEP_ON_IDLE, scheduler_hooks.around_sleep_on_idle, HookType.AROUND),
        (
            upstream.SCHEDULER_RELEASE_MEMORY,
            scheduler_hooks.around_release_memory_occupation,
            HookType.AROUND,
        ),
        (
            upstream.SCHEDULER_RESUME_MEMORY,
            scheduler_hooks.after_resume_memory_occupation,
            HookType.AFTER,
        ),
        (
            upstream.SCHEDULER_INIT_CACHE,
            scheduler_hooks.around_init_cache_with_memory_pool,
            HookType.AROUND,
        ),
        (
            upstream.HOST_POOL_ALLOCATOR,
            scheduler_hooks.around_get_allocator_from_storage,
            HookType.AROUND,
        ),
        (
            upstream.TOKENIZER_INIT_COMMUNICATORS,
            communicators.after_init_communicators,
            HookType.AFTER,
        ),
        (upstream.HTTP_LAUNCH_SERVER, before_launch_server, HookType.BEFORE),
        (upstream.ENGINE_LAUNCH_SUBPROCESSES, before_launch_subprocesses, HookType.BEFORE),
    ]
    # Targets the installed SGLang line lacks are left out; what needs them is refused
    # at start (sglang_adapter.installed).
    targets = set(upstream.hook_targets())
    return [row for row in table if row[0] in targets] + _moment_hooks()


def _moment_hooks() -> list[tuple[str, object, HookType]]:
    """The opt-in request moments' hooks, where asked for and the installed line has
    their targets (`hook_targets.moment_hook_targets`)."""
    from sglang_kv_migration.server.diag import request_moments

    if not request_moments.enabled():
        return []
    targets = set(upstream.moment_hook_targets())
    return [(t, h, HookType.AROUND) for t, h in request_moments.hook_table() if t in targets]


def _wraps_hook(fn: object, hook: object) -> bool:
    """True if a registry wrapper chain around `fn` closes over `hook`."""
    seen = 0
    while fn is not None and seen < 32:  # bounded: chains are a few wrappers deep
        fn = getattr(fn, "__func__", fn)  # unwrap classmethod/staticmethod objects
        for cell in getattr(fn, "__closure__", None) or ():
            if cell.cell_contents is hook:
                return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False
