"""Every upstream SGLang symbol this package hooks or relies on, named in one place.

`HOOK_TARGETS` are patched through SGLang's `HookRegistry` (see `plugin.py`);
`REQUIRED_SYMBOLS` are upstream attributes we call that are not hooked, including the one
private helper we cannot avoid. The calls themselves live in `sglang_adapter/`.
`test/integration/test_plugin.py` resolves each of them against the installed SGLang, so a version
bump that renames one fails loudly.
"""

from __future__ import annotations

import pkgutil

SGLANG_VERSION = "0.5.12"

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
)

# Targets in SGLang's scheduler, engine and HTTP server modules: they import only where
# `sglang_adapter.server_runtime_missing()` finds nothing missing.
SERVER_RUNTIME_TARGETS: frozenset[str] = frozenset(
    t
    for t in HOOK_TARGETS
    if t.startswith(
        ("sglang.srt.managers.scheduler.", HTTP_LAUNCH_SERVER, "sglang.srt.entrypoints.engine.")
    )
)

REQUIRED_SYMBOLS: tuple[str, ...] = (
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
)


def resolve(dotted: str) -> object:
    """Import and return an upstream symbol; raises if the installed SGLang lacks it."""
    return pkgutil.resolve_name(dotted)
