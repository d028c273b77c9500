"""The one package that reads or calls SGLang internals: the radix tree
(`radix_tree.py`), the KV pools and allocator (`pools.py`, with NSA's host pool groups
in `pool_groups.py`), and the scheduler's,
tokenizer manager's and HTTP server's attributes (`process.py`), the running requests'
slots (`running_requests.py`), what the opt-in request moments read of requests and
batches (`request_facts.py`), the host pool in shared memory (`shared_host_pool.py`);
`hook_targets.py` names
every upstream symbol the plugin hooks or relies on.

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
    SchedulerView,
    add_request_handlers,
    add_result_handlers,
    forward_to_later_stages,
    frees_kv_cache,
    generate_requests_in_flight,
    http_server_app,
    http_server_imported,
    http_tokenizer_manager,
    input_waiting_check,
    registered_hooks,
    scheduler_idle_check,
    scheduler_load,
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
# Both modules of a pair define the same names with the same contracts.
if is_unified_line():
    from sglang_kv_migration.sglang_adapter.unified_pools import (
        alloc_host_slots,
        copy_device_to_host,
        host_evictable_size,
        host_headroom_tokens,
        host_pool,
        host_pool_shape,
        pending_device_write_streams,
        take_host_slots,
    )
    from sglang_kv_migration.sglang_adapter.unified_tree import (
        cache_generation,
        cache_unsupported,
        host_pages_ready,
        insert_device_pages,
        insert_host_pages,
        is_hiradix_cache,
        key_parts,
        lock_node,
        make_key,
        match_device_prefix,
        match_held_prefix,
        match_tiered_prefix,
        needs_page_hashes,
        path_from_root,
        pin_host_pages,
        protect_host_nodes,
        release_host_nodes,
        unlock_node,
        unpin_host_pages,
        write_back_path,
    )
else:
    from sglang_kv_migration.sglang_adapter.pools import (
        alloc_host_slots,
        host_evictable_size,
        host_headroom_tokens,
        host_pool,
        host_pool_shape,
        pending_device_write_streams,
        take_host_slots,
    )
    from sglang_kv_migration.sglang_adapter.radix_tree import (
        cache_generation,
        cache_unsupported,
        host_pages_ready,
        insert_device_pages,
        insert_host_pages,
        is_hiradix_cache,
        key_parts,
        lock_node,
        make_key,
        match_device_prefix,
        match_held_prefix,
        match_tiered_prefix,
        needs_page_hashes,
        path_from_root,
        pin_host_pages,
        protect_host_nodes,
        release_host_nodes,
        unlock_node,
        unpin_host_pages,
        write_back_path,
    )
    from sglang_kv_migration.sglang_adapter.running_requests import copy_device_to_host

__all__ = [
    "NodeLock",
    "SUPPORTED_LINES",
    "cache_unsupported",
    "device_path_missing",
    "server_args_refusal",
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
    "SHARED_POOL_MEMFD_LINK",
    "SchedulerView",
    "Segment",
    "SharedHostRegion",
    "TieredPrefix",
    "WRITE_BACK_TIMEOUT_S",
    "add_request_handlers",
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
    "forward_to_later_stages",
    "free_device_slots",
    "free_host_slots",
    "frees_kv_cache",
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
    "registered_hooks",
    "release_host_nodes",
    "running_prefix",
    "scheduler_idle_check",
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
