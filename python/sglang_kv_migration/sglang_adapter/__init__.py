"""The one package that reads or calls SGLang internals: the radix tree
(`radix_tree.py`), the KV pools and allocator (`pools.py`, with NSA's host pool groups
in `pool_groups.py`), and the scheduler's,
tokenizer manager's and HTTP server's attributes (`process.py`), the running requests'
slots (`running_requests.py`), what the opt-in request moments read of requests and
batches (`request_facts.py`), the host pool in shared memory (`shared_host_pool.py`),
our requests as SGLang IPC messages (`ipc_messages.py`), `ServerArgs` as it is in effect
(`server_config.py`); `hook_targets.py` names every upstream symbol the plugin hooks or
relies on, `installed.py` which SGLang line runs (0.5.12's `HiRadixCache` or 0.5.23's
`UnifiedRadixCache`, bound below).

Everything else in the package goes through these functions, imported from here
(`sglang_adapter.match_held_prefix`), so an SGLang upgrade is this package's work:
`test/integration/test_plugin.py` resolves the names in `hook_targets.py`, and
`test/unit/test_sglang_adapter.py` runs these functions against the real classes on CPU.
"""

from __future__ import annotations

from sglang_kv_migration.sglang_adapter.cp_pages import device_prefix_owners, run_owners
from sglang_kv_migration.sglang_adapter.installed import (
    SUPPORTED_LINES,
    device_path_missing,
    is_unified_line,
    server_args_refusal,
    sglang_line,
    sglang_version,
    shared_host_path_missing,
)
from sglang_kv_migration.sglang_adapter.ipc_messages import (
    ipc_message,
    replace_message,
    send_to_scheduler,
)
from sglang_kv_migration.sglang_adapter.pool_groups import (
    IndexerPoolBuffer,
    indexer_host_pool,
    indexer_pool_buffer,
)
from sglang_kv_migration.sglang_adapter.pools import (
    HostPoolBuffer,
    HostPoolShape,
    alloc_device_slots,
    alloc_pages_with_owners,
    cp_page_owners,
    device_available_size,
    device_kv_buffers,
    device_pool,
    free_device_slots,
    free_host_slots,
    host_pool_buffer,
    kv_cache_shape,
    no_slots,
    take_device_slots,
)
from sglang_kv_migration.sglang_adapter.process import (
    SchedulerRanks,
    SchedulerView,
    add_api_key_middleware,
    add_request_handlers,
    add_result_handlers,
    dispatch_request,
    engine_loop,
    engine_tokenizer_manager,
    forward_to_later_stages,
    frees_kv_cache,
    generate_requests_in_flight,
    give_request_dispatcher,
    http_server_app,
    http_server_imported,
    http_tokenizer_manager,
    input_waiting_check,
    plugins_loading_started,
    registered_hooks,
    scheduler_idle_check,
    scheduler_load,
    scheduler_ranks,
    scheduler_stage_rank,
    server_runtime_missing,
    stage_reply_sender,
    wake_from_idle_sleep_on,
    weight_update_types,
)
from sglang_kv_migration.sglang_adapter.radix_tree import (
    DEVICE_TIER,
    HOST_TIER,
    WRITE_BACK_TIMEOUT_S,
    DevicePrefix,
    HeldPrefix,
    NodeLock,
    PinnedHostPages,
    Segment,
    TieredPrefix,
    page_hashes,
)
from sglang_kv_migration.sglang_adapter.request_facts import (
    AbortFacts,
    BatchFacts,
    abort_facts,
    batch_facts,
    generate_facts,
    request_facts,
)
from sglang_kv_migration.sglang_adapter.running_requests import (
    RunningRequest,
    RunningRequests,
    running_prefix,
    running_requests_of,
)
from sglang_kv_migration.sglang_adapter.server_config import (
    current_weight_version,
    effective_server_args,
    server_args_class,
)
from sglang_kv_migration.sglang_adapter.shared_host_pool import MEMFD_LINK as SHARED_POOL_MEMFD_LINK
from sglang_kv_migration.sglang_adapter.shared_host_pool import (
    SharedHostRegion,
    host_pool_in_shared_memory,
    host_tensor_allocator,
    shared_host_region,
)

# IMPORTANT: the one place that picks what differs between SGLang lines (installed.py):
# the tree (radix_tree.py for 0.5.12's HiRadixCache, unified_tree.py for 0.5.23's
# UnifiedRadixCache) and the pools where they differ (pools.py / unified_pools.py).
# Both modules of a pair define the same names with the same contracts, so one list
# below binds them from whichever pair runs.
if is_unified_line():
    from sglang_kv_migration.sglang_adapter import unified_pools as _line_pools
    from sglang_kv_migration.sglang_adapter import unified_tree as _line_tree
    from sglang_kv_migration.sglang_adapter.unified_pools import copy_device_to_host
else:
    from sglang_kv_migration.sglang_adapter import pools as _line_pools
    from sglang_kv_migration.sglang_adapter import radix_tree as _line_tree
    from sglang_kv_migration.sglang_adapter.running_requests import copy_device_to_host

alloc_host_slots = _line_pools.alloc_host_slots
host_evictable_size = _line_pools.host_evictable_size
host_headroom_tokens = _line_pools.host_headroom_tokens
host_pool = _line_pools.host_pool
host_pool_shape = _line_pools.host_pool_shape
pending_device_write_streams = _line_pools.pending_device_write_streams
take_host_slots = _line_pools.take_host_slots

cache_generation = _line_tree.cache_generation
cache_unsupported = _line_tree.cache_unsupported
host_pages_ready = _line_tree.host_pages_ready
insert_device_pages = _line_tree.insert_device_pages
insert_host_pages = _line_tree.insert_host_pages
is_hiradix_cache = _line_tree.is_hiradix_cache
key_parts = _line_tree.key_parts
lock_node = _line_tree.lock_node
make_key = _line_tree.make_key
match_device_prefix = _line_tree.match_device_prefix
match_held_prefix = _line_tree.match_held_prefix
match_tiered_prefix = _line_tree.match_tiered_prefix
needs_page_hashes = _line_tree.needs_page_hashes
path_from_root = _line_tree.path_from_root
pin_host_pages = _line_tree.pin_host_pages
protect_host_nodes = _line_tree.protect_host_nodes
release_host_nodes = _line_tree.release_host_nodes
unlock_node = _line_tree.unlock_node
unpin_host_pages = _line_tree.unpin_host_pages
write_back_path = _line_tree.write_back_path

__all__ = [
    "NodeLock",
    "SUPPORTED_LINES",
    "cache_unsupported",
    "device_path_missing",
    "server_args_refusal",
    "shared_host_path_missing",
    "is_unified_line",
    "lock_node",
    "sglang_line",
    "sglang_version",
    "unlock_node",
    # request_facts.py: what the opt-in request moments read
    "AbortFacts",
    "BatchFacts",
    "abort_facts",
    "batch_facts",
    "generate_facts",
    "request_facts",
    "DEVICE_TIER",
    "DevicePrefix",
    "HOST_TIER",
    "HeldPrefix",
    "HostPoolBuffer",
    "HostPoolShape",
    "IndexerPoolBuffer",
    "PinnedHostPages",
    "RunningRequest",
    "RunningRequests",
    "SchedulerRanks",
    "SHARED_POOL_MEMFD_LINK",
    "SchedulerView",
    "Segment",
    "SharedHostRegion",
    "TieredPrefix",
    "WRITE_BACK_TIMEOUT_S",
    "add_api_key_middleware",
    "add_request_handlers",
    "current_weight_version",
    "effective_server_args",
    "server_args_class",
    "add_result_handlers",
    "alloc_device_slots",
    "alloc_host_slots",
    "alloc_pages_with_owners",
    "device_prefix_owners",
    "run_owners",
    "cp_page_owners",
    "cache_generation",
    "copy_device_to_host",
    "device_available_size",
    "device_kv_buffers",
    "device_pool",
    "dispatch_request",
    "engine_loop",
    "engine_tokenizer_manager",
    "forward_to_later_stages",
    "free_device_slots",
    "free_host_slots",
    "frees_kv_cache",
    "give_request_dispatcher",
    "host_evictable_size",
    "host_headroom_tokens",
    "host_pages_ready",
    "host_pool",
    "host_pool_buffer",
    "host_pool_in_shared_memory",
    "host_pool_shape",
    "host_tensor_allocator",
    "http_server_app",
    "http_server_imported",
    "server_runtime_missing",
    "http_tokenizer_manager",
    "indexer_host_pool",
    "indexer_pool_buffer",
    "ipc_message",
    "replace_message",
    "send_to_scheduler",
    "generate_requests_in_flight",
    "input_waiting_check",
    "insert_device_pages",
    "insert_host_pages",
    "is_hiradix_cache",
    "key_parts",
    "kv_cache_shape",
    "make_key",
    "match_device_prefix",
    "match_held_prefix",
    "match_tiered_prefix",
    "needs_page_hashes",
    "no_slots",
    "page_hashes",
    "path_from_root",
    "pending_device_write_streams",
    "pin_host_pages",
    "protect_host_nodes",
    "plugins_loading_started",
    "registered_hooks",
    "release_host_nodes",
    "running_prefix",
    "running_requests_of",
    "scheduler_idle_check",
    "scheduler_ranks",
    "scheduler_stage_rank",
    "scheduler_load",
    "shared_host_region",
    "stage_reply_sender",
    "take_device_slots",
    "take_host_slots",
    "unpin_host_pages",
    "wake_from_idle_sleep_on",
    "weight_update_types",
    "write_back_path",
]
