"""What the plugin runs on SGLang 0.5.12 and not on 0.5.23 is refused at start, naming
it (`sglang_adapter/installed.py`): the flags as `KVMigrationServerArgs` checks them at
construction (what `launch_server` prints as its one-line error), the device path, and
what only the built cache shows (`cache_unsupported`). Runs only on the 0.5.23 line;
0.5.12's acceptance of the same flags is tested in `test/integration/test_plugin.py`."""

from __future__ import annotations

import cpu_harness
import pytest
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.sglang_adapter import installed

pytestmark = [
    pytest.mark.any_sglang,
    pytest.mark.skipif(
        not adapter.is_unified_line(), reason="SGLang 0.5.12 runs these (test_plugin.py)"
    ),
]


def _args(**overrides: object) -> object:
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    fields = {
        "model_path": cpu_harness.write_tiny_model_dir(),
        "skip_tokenizer_init": True,
        "device": "cpu",
        "enable_hierarchical_cache": True,
        "enable_kv_migration": True,
        **overrides,
    }
    return KVMigrationServerArgs(**fields)


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"enable_memory_saver": True}, installed.MEMORY_SAVER_MISSING),
        ({"dp_size": 2, "tp_size": 2}, installed.DATA_PARALLEL_MISSING),
        ({"attn_dp_size": 2, "tp_size": 2}, installed.DATA_PARALLEL_MISSING),
        ({"attn_cp_size": 2, "tp_size": 2}, installed.CONTEXT_PARALLEL_MISSING),
        ({"dcp_size": 2, "tp_size": 2}, installed.CONTEXT_PARALLEL_MISSING),
        ({"hicache_storage_backend": "file"}, installed.STORAGE_BACKEND_MISSING),
        ({"kv_migration_paths": "device"}, installed.DEVICE_PATH_MISSING),
    ],
)
def test_what_0_5_23_cannot_migrate_with_is_refused_by_name(overrides, refusal):
    from sglang_kv_migration.server.server_args import KVMigrationArgsError

    with pytest.raises(KVMigrationArgsError) as info:
        _args(**overrides)
    assert refusal in str(info.value)
    assert "\n" not in str(info.value)


def test_the_same_flags_without_migration_are_sglang_s_own_business():
    # The plugin refuses only what it would run with: migration off, SGLang decides.
    args = _args(enable_kv_migration=False, enable_memory_saver=True, dp_size=2, tp_size=2)
    assert args.dp_size == 2


def test_host_and_device_paths_start_with_the_device_path_left_out_by_name(harness_factory):
    from sglang_kv_migration.paths.device.path import device_path_unavailable_reason

    args = _args(kv_migration_paths="device,host")
    assert args.kv_migration_paths == "device,host"
    h = harness_factory(layer_num=2)
    assert device_path_unavailable_reason(h.cache, False) == installed.DEVICE_PATH_MISSING


def test_the_shared_host_path_is_left_out_by_name(harness_factory):
    from sglang_kv_migration.paths.shared_host.target_side import shared_host_unavailable_reason

    h = harness_factory(layer_num=2)
    assert shared_host_unavailable_reason(h.cache) == installed.SHARED_HOST_PATH_MISSING


def test_a_host_pool_group_with_more_than_the_kv_pool_is_refused_by_name(harness_factory):
    """An NSA model's group (KV + the indexer's pool) is served on 0.5.12 only."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    h = harness_factory(layer_num=2)
    assert adapter.cache_unsupported(h.cache) is None
    kv = h.host_pool.anchor_entry
    indexer = PoolEntry(
        name=PoolName.INDEXER,
        host_pool=kv.host_pool,
        device_pool=kv.device_pool,
        layer_mapper=kv.layer_mapper,
    )
    controller = h.cache.cache_controller
    controller.mem_pool_host = HostPoolGroup([kv, indexer])
    try:
        refusal = adapter.cache_unsupported(h.cache)
    finally:
        controller.mem_pool_host = h.host_pool
    assert refusal is not None and "kv+indexer" in refusal and "0.5.12 only" in refusal


def test_running_slots_are_not_offered_on_0_5_23():
    """0.5.23 keeps a request's slots in `Req.kv`, which the adapter does not read: the
    live move's feature "running_slots" is left out (clients fall back to abort,
    migrate, resume), never served wrong."""
    from types import SimpleNamespace

    scheduler = SimpleNamespace(running_batch=SimpleNamespace(reqs=[]), waiting_queue=[])
    assert adapter.running_requests_of(scheduler) is None
