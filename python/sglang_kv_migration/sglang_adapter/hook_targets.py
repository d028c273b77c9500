"""Every upstream SGLang symbol this package hooks or relies on, named in one place.

`HOOK_TARGETS` are patched through SGLang's `HookRegistry` (see `plugin.py`);
`REQUIRED_SYMBOLS` are upstream attributes we call that are not hooked, including the one
private helper we cannot avoid. The calls themselves live in `sglang_adapter/`.
`test/integration/test_plugin.py` resolves each of them against the installed SGLang, so a version
bump that renames one fails loudly.
"""

from __future__ import annotations

import pkgutil

from sglang_kv_migration.sglang_adapter.installed import (
    SUPPORTED_LINES,
    UNIFIED_LINE,
    is_unified_line,
)

SGLANG_VERSION = " or ".join(SUPPORTED_LINES)  # what start-up names when a hook is missing

SERVER_ARGS_CLASS = "sglang.srt.server_args.ServerArgs"
SCHEDULER_INIT_DISPATCHER = "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher"
# Runs before init_request_dispatcher; the only place a scheduler sees the tokenizer
# manager's socket name (later PP stages reply through a socket of their own).
SCHEDULER_INIT_IPC = "sglang.srt.managers.scheduler.Scheduler.init_ipc_channels"
SCHEDULER_PROCESS_INPUT = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"
SCHEDULER_FLUSH_CACHE = "sglang.srt.managers.scheduler.Scheduler.flush_cache"
TOKENIZER_INIT_COMMUNICATORS = (
    "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.init_communicators"
)
HTTP_LAUNCH_SERVER = "sglang.srt.entrypoints.http_server.launch_server"
# What `launch_server` and `Engine` call to start the tokenizer manager and schedulers; RL
# frameworks that serve SGLang's `app` with their own uvicorn (verl) call it directly and
# never reach `launch_server`.
ENGINE_LAUNCH_SUBPROCESSES = "sglang.srt.entrypoints.engine.Engine._launch_subprocesses"
# The class `Engine(**kwargs)` builds its ServerArgs with, bound when the class was
# defined: the REPLACE of `ServerArgs` rebinds module attributes, not this one.
ENGINE_SERVER_ARGS_CLASS = "sglang.srt.entrypoints.engine.Engine.server_args_class"
# The idle/busy memory-leak checks count these tokens as held outside the tree: pending
# device-slot allocations are added here, so SGLang's pool invariant keeps holding.
SCHEDULER_SESSION_HELD_TOKENS = "sglang.srt.managers.scheduler.Scheduler._session_held_tokens"
# With --sleep-on-idle an idle loop blocks up to 1 s on its sockets: not while a
# migration of ours waits for its reply to be sent from the per-iteration poll.
SCHEDULER_SLEEP_ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle"
# --enable-memory-saver: the KV pool is unmapped and mapped again around training steps;
# copies in flight must finish first, and the device path's landing arena follows it.
SCHEDULER_RELEASE_MEMORY = "sglang.srt.managers.scheduler.Scheduler.release_memory_occupation"
SCHEDULER_RESUME_MEMORY = "sglang.srt.managers.scheduler.Scheduler.resume_memory_occupation"
# The shared-host path: a server that offers it builds its host KV pool in shared memory
# (`shared_host_pool.py`), through the allocator SGLang asks for while the scheduler
# builds its cache.
SCHEDULER_INIT_CACHE = "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool"
HOST_POOL_ALLOCATOR = "sglang.srt.mem_cache.memory_pool_host.get_allocator_from_storage"

HOOK_TARGETS: tuple[str, ...] = (
    SERVER_ARGS_CLASS,
    SCHEDULER_INIT_IPC,
    SCHEDULER_INIT_DISPATCHER,
    SCHEDULER_PROCESS_INPUT,
    SCHEDULER_FLUSH_CACHE,
    TOKENIZER_INIT_COMMUNICATORS,
    HTTP_LAUNCH_SERVER,
    ENGINE_LAUNCH_SUBPROCESSES,
    ENGINE_SERVER_ARGS_CLASS,
    SCHEDULER_SESSION_HELD_TOKENS,
    SCHEDULER_SLEEP_ON_IDLE,
    SCHEDULER_RELEASE_MEMORY,
    SCHEDULER_RESUME_MEMORY,
    SCHEDULER_INIT_CACHE,
    HOST_POOL_ALLOCATOR,
)

# Opt-in diagnosis (`server/diag/request_moments.py`, hooked only with
# SGLANG_KV_MIGRATION_MOMENTS_DIR set): the moments of a request through a server. Each
# is a method SGLang calls through its instance (the dispatcher binds `abort_request` and
# `handle_generate_request` when the scheduler is built, after the hooks are applied), and
# `cache_finished_req` is `RadixCache`'s, which `HiRadixCache` inherits.
TOKENIZER_ABORT_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request"
SCHEDULER_ABORT_REQUEST = "sglang.srt.managers.scheduler.Scheduler.abort_request"
SCHEDULER_HANDLE_GENERATE = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
SCHEDULER_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
SCHEDULER_PROCESS_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
RADIX_CACHE_FINISHED_REQ = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"

MOMENT_HOOK_TARGETS: tuple[str, ...] = (
    TOKENIZER_ABORT_REQUEST,
    SCHEDULER_ABORT_REQUEST,
    SCHEDULER_HANDLE_GENERATE,
    SCHEDULER_RUN_BATCH,
    SCHEDULER_PROCESS_RESULT,
    RADIX_CACHE_FINISHED_REQ,
)

# Targets in SGLang's scheduler, engine and HTTP server modules: they import only where
# `sglang_adapter.server_runtime_missing()` finds nothing missing.
SERVER_RUNTIME_TARGETS: frozenset[str] = frozenset(
    t
    for t in HOOK_TARGETS + MOMENT_HOOK_TARGETS
    if t.startswith(
        (
            "sglang.srt.managers.scheduler.",
            "sglang.srt.managers.tokenizer_manager.",
            HTTP_LAUNCH_SERVER,
            # Engine's _launch_subprocesses and its server_args_class.
            "sglang.srt.entrypoints.engine.",
            # The host pool module imports the native KV copy kernels.
            HOST_POOL_ALLOCATOR,
        )
    )
)

# Hook targets the 0.5.23 line lacks; what hooks them is refused there at start
# (`installed.device_path_missing`, `installed.shared_host_path_missing`,
# `installed.server_args_refusal`).
ABSENT_ON_UNIFIED_LINE: frozenset[str] = frozenset(
    {
        SCHEDULER_INIT_CACHE,
        SCHEDULER_SESSION_HELD_TOKENS,
        SCHEDULER_RELEASE_MEMORY,
        SCHEDULER_RESUME_MEMORY,
        HOST_POOL_ALLOCATOR,
    }
)

# Symbols both lines have.
_COMMON_SYMBOLS: tuple[str, ...] = (
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.managers.io_struct.BaseReq",
    "sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE",
    "sglang.srt.managers.communicator.FanOutCommunicator",
    "sglang.srt.managers.scheduler.Scheduler.is_fully_idle",
    "sglang.srt.utils.network.get_zmq_socket",
    "sglang.utils.TypeBasedDispatcher",
    "sglang.srt.entrypoints.http_server.app",
    "sglang.srt.entrypoints.http_server.get_global_state",
    "sglang.srt.utils.auth.auth_level",
    "sglang.srt.utils.auth.AuthLevel",
    "sglang.srt.mem_cache.base_prefix_cache.MatchPrefixParams",
    "sglang.srt.mem_cache.base_prefix_cache.InsertParams",
    "sglang.srt.mem_cache.base_prefix_cache.EvictParams",
    "sglang.srt.mem_cache.radix_cache.RadixKey",
    "sglang.srt.mem_cache.allocator.TokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.PagedTokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.get_kvcache",
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool",
)

# What `unified_tree.py` and `unified_pools.py` call on 0.5.23.
_UNIFIED_SYMBOLS: tuple[str, ...] = (
    "sglang.srt.managers.scheduler_components.output_sender.SenderWrapper.send_output",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.lock",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.unlock",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.inc_host_lock_ref",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.dec_host_lock_ref",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.backup_node_for_write_back",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.flush_pending_backups",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.writing_check",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_host",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evictable_size",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.root_node_handle",
    # Private: how SGLang applies a tree core walk's actions after a host insert.
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._apply_cache_actions",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface."
    "UnifiedTreeCoreInterface.insert_host",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface."
    "UnifiedTreeCoreInterface.collect_path_info",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface."
    "UnifiedTreeCoreInterface.collect_full_device_indices",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface."
    "UnifiedTreeCoreInterface.build_storage_backup_spec",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface."
    "UnifiedTreeCoreInterface.is_backuped",
    "sglang.srt.mem_cache.pool_host.HostPoolGroup",
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.alloc",
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.free",
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.available_size",
)

# What `radix_tree.py` and `pools.py` call on 0.5.12.
REQUIRED_SYMBOLS_0_5_12: tuple[str, ...] = (
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.managers.io_struct.BaseReq",
    "sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE",
    "sglang.srt.managers.communicator.FanOutCommunicator",
    "sglang.srt.managers.scheduler.Scheduler.is_fully_idle",
    "sglang.srt.managers.scheduler.SenderWrapper.send_output",
    "sglang.srt.utils.network.get_zmq_socket",
    "sglang.utils.TypeBasedDispatcher",
    "sglang.srt.entrypoints.http_server.app",
    "sglang.srt.entrypoints.http_server.get_global_state",
    "sglang.srt.utils.auth.auth_level",
    "sglang.srt.utils.auth.AuthLevel",
    "sglang.srt.mem_cache.base_prefix_cache.MatchPrefixParams",
    "sglang.srt.mem_cache.radix_cache.RadixKey",
    "sglang.srt.mem_cache.radix_cache.RadixKey.hash_page",
    "sglang.srt.mem_cache.radix_cache.TreeNode.protect_host",
    "sglang.srt.mem_cache.radix_cache.TreeNode.release_host",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.match_prefix",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.write_backup",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.writing_check",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.inc_lock_ref",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.dec_lock_ref",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.evict_host",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.evict",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.insert",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.evictable_size",
    "sglang.srt.mem_cache.base_prefix_cache.InsertParams",
    "sglang.srt.mem_cache.base_prefix_cache.EvictParams",
    "sglang.srt.mem_cache.allocator.TokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.PagedTokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool",
    # NSA models: the device pool with the indexer's keys, and the host pool group
    # HiRadixCache builds for it (`pool_groups.py`).
    "sglang.srt.mem_cache.memory_pool.NSATokenToKVPool",
    "sglang.srt.mem_cache.memory_pool_host.HostPoolGroup",
    "sglang.srt.mem_cache.memory_pool_host.NSAIndexerPoolHost",
    "sglang.srt.mem_cache.hicache_storage.PoolName",
    # Private: the only way to add host-only nodes, used by SGLang for storage prefetch.
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache._insert_helper_host",
    # Private: the walk `radix_tree._walk` mirrors (compared against it on twin trees
    # by test_sglang_adapter.py), and the node split it calls.
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache._match_prefix_helper",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache._split_node",
    "sglang.srt.mem_cache.memory_pool_host.HostKVCache.alloc",
    "sglang.srt.mem_cache.memory_pool_host.HostKVCache.free",
    "sglang.srt.mem_cache.memory_pool_host.HostKVCache.available_size",
    # The shared-host path's allocator derives from it (`shared_host_pool.py`).
    "sglang.srt.mem_cache.memory_pool_host.HostTensorAllocator",
)


def moment_hook_targets(line: str | None = None) -> tuple[str, ...]:
    """The opt-in request moments' targets on an SGLang line (default: the installed
    one): 0.5.12's only (`request_facts.py` reads 0.5.12's requests and batches)."""
    unified = is_unified_line() if line is None else line == UNIFIED_LINE
    return () if unified else MOMENT_HOOK_TARGETS


def hook_targets(line: str | None = None) -> tuple[str, ...]:
    """The hook targets of an SGLang line (default: the installed one)."""
    unified = is_unified_line() if line is None else line == UNIFIED_LINE
    if unified:
        return tuple(t for t in HOOK_TARGETS if t not in ABSENT_ON_UNIFIED_LINE)
    return HOOK_TARGETS


def required_symbols(line: str | None = None) -> tuple[str, ...]:
    """The upstream symbols an SGLang line must have (default: the installed one)."""
    unified = is_unified_line() if line is None else line == UNIFIED_LINE
    return (*_COMMON_SYMBOLS, *(_UNIFIED_SYMBOLS if unified else REQUIRED_SYMBOLS_0_5_12))


def resolve(dotted: str) -> object:
    """Import and return an upstream symbol; raises if the installed SGLang lacks it."""
    return pkgutil.resolve_name(dotted)
