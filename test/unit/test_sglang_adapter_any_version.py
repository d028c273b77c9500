"""The adapter's host-path functions against the real caches of the installed SGLang,
whichever supported line it is (0.5.12's HiRadixCache, 0.5.23's UnifiedRadixCache): CI
runs this module on both (marker `any_sglang`)."""

from __future__ import annotations

import pytest
import torch
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.errors import MigrationError

pytestmark = pytest.mark.any_sglang

TOKENS = list(range(700, 700 + 64))  # 4 pages of 16


def _bytes(layers: list[torch.Tensor]) -> list[bytes]:
    return [layer.contiguous().view(torch.uint8).numpy().tobytes() for layer in layers]


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_the_cache_is_one_migration_supports(harness_factory, attention):
    h = harness_factory(attention=attention, layer_num=2)
    assert adapter.cache_unsupported(h.cache) is None
    assert adapter.cache_unsupported(object()) is not None


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_held_prefix_counts_device_then_host(harness_factory, layout):
    h = harness_factory(host_layout=layout, layer_num=2)
    h.insert_random(TOKENS, seed=1)
    held = adapter.match_held_prefix(h.cache, TOKENS + [1, 2], None)
    assert (held.length, held.device_length) == (64, 64)
    h.evict_device_all()
    held = adapter.match_held_prefix(h.cache, TOKENS, None)
    assert (held.length, held.device_length) == (64, 0)
    assert adapter.match_device_prefix(h.cache, TOKENS, None).length == 0
    assert len(adapter.path_from_root(h.cache, held.last_node)) >= 1


def test_pinned_host_pages_hold_the_device_kv(harness_factory):
    h = harness_factory(layer_num=2, load_back_threshold=1)
    device = h.insert_random(TOKENS, seed=3)
    want = _bytes(h.read_device_kv(device[16:48]))
    pinned = adapter.pin_host_pages(h.cache, TOKENS, None, 16, 48)
    try:
        while not adapter.host_pages_ready(h.cache, pinned):
            h.cache.writing_check()
        assert len(pinned.host_indices) == 32
        pool = adapter.host_pool(h.cache)
        layout = adapter.host_pool_buffer(pool)
        assert layout.num_slots >= int(pinned.host_indices.max()) + 1
    finally:
        adapter.unpin_host_pages(pinned)
    # What the pin read is the prefix's KV: evict the device copy, load it back.
    h.evict_device_all()
    assert _bytes(h.read_device_kv(h.load_back(TOKENS)[16:48])) == want
    with pytest.raises(MigrationError):
        adapter.pin_host_pages(h.cache, TOKENS, None, 8, 48)  # not whole pages


def test_host_insert_under_a_locked_anchor_is_served_as_a_cache_hit(harness_factory):
    src = harness_factory(layer_num=2)
    dst = harness_factory(layer_num=2, load_back_threshold=1)
    want = _bytes(src.read_device_kv(src.insert_random(TOKENS, seed=5)[16:]))
    dst.insert_random(TOKENS[:16], seed=6)  # the first page, held by the target already
    held = adapter.match_held_prefix(dst.cache, TOKENS, None)
    assert held.length == 16
    lock = adapter.lock_node(dst.cache, held.last_node)
    free_before = int(adapter.host_pool(dst.cache).available_size())
    slots = adapter.alloc_host_slots(dst.cache, 48)
    assert int(adapter.host_pool(dst.cache).available_size()) == free_before - 48
    # Fill the slots as a transfer would: the source's host bytes, slot for slot.
    pinned = adapter.pin_host_pages(src.cache, TOKENS, None, 16, 64)
    try:
        _copy_host_slots(src, pinned.host_indices, dst, slots)
    finally:
        adapter.unpin_host_pages(pinned)
    key = adapter.make_key(dst.cache, TOKENS, None)
    assert adapter.insert_host_pages(dst.cache, held.last_node, key, 16, slots) == 0
    adapter.unlock_node(dst.cache, lock)
    after = adapter.match_held_prefix(dst.cache, TOKENS, None)
    assert (after.length, after.device_length) == (64, 16)
    assert _bytes(dst.read_device_kv(dst.load_back(TOKENS)[16:])) == want


def test_kv_cache_shape_reads_the_pools(harness_factory):
    h = harness_factory(attention="mla", layer_num=2, page_size=16)
    shape = adapter.kv_cache_shape(adapter.host_pool(h.cache))
    assert (shape.attention, shape.page_size, shape.host_pools) == ("mla", 16, "kv")
    assert (shape.start_layer, shape.end_layer) == (0, 1)  # the last layer, inclusive


def test_cache_generation_changes_on_reset(harness_factory):
    h = harness_factory(layer_num=2)
    before = adapter.cache_generation(h.cache)
    h.cache.reset()
    assert adapter.cache_generation(h.cache) is not before


def _copy_host_slots(src, src_slots, dst, dst_slots) -> None:
    """Copy host slots between two harnesses' KV host pools through the host path's own
    layout math (what a Mooncake write does, in one process)."""
    import ctypes

    from sglang_kv_migration.paths.host.layout import HostPoolLayout, plan_writes

    src_layout = HostPoolLayout.from_host_pool(adapter.host_pool(src.cache))
    dst_layout = HostPoolLayout.from_host_pool(adapter.host_pool(dst.cache))
    for write in plan_writes(src_layout, src_slots, dst_layout, dst_slots):
        ctypes.memmove(write.dst_addr, write.src_addr, write.length)


def test_host_inserts_that_split_each_other_are_served_byte_exact(harness_factory):
    """Two host-only inserts from the root that share a two-page stem: the second splits
    the first's node (0.5.23's tree core splits the page hashes with it), and the slots
    of the stem it brought again are the caller's to free."""
    src = harness_factory(layer_num=2)
    dst = harness_factory(layer_num=2, load_back_threshold=1)
    stem = TOKENS[:32]
    seqs = [stem + list(range(9000, 9032)), stem + list(range(9100, 9148))]
    want = {}
    for seed, seq in enumerate(seqs):
        device = src.insert_random(seq, seed=20 + seed)
        want[len(seq)] = _bytes(src.read_device_kv(device))
    free_before = int(adapter.host_pool(dst.cache).available_size())
    kept = 0
    for seq in seqs:
        root = adapter.match_held_prefix(dst.cache, [], None).last_node
        lock = adapter.lock_node(dst.cache, root)
        slots = adapter.alloc_host_slots(dst.cache, len(seq))
        pinned = adapter.pin_host_pages(src.cache, seq, None, 0, len(seq))
        try:
            _copy_host_slots(src, pinned.host_indices, dst, slots)
        finally:
            adapter.unpin_host_pages(pinned)
        key = adapter.make_key(dst.cache, seq, None)
        present = adapter.insert_host_pages(dst.cache, root, key, 0, slots)
        adapter.unlock_node(dst.cache, lock)
        if present:
            adapter.free_host_slots(dst.cache, slots[:present])
        kept += len(seq) - present
    assert kept == 32 + 32 + 48  # the stem once
    assert int(adapter.host_pool(dst.cache).available_size()) == free_before - kept
    for seq in seqs:
        assert adapter.match_held_prefix(dst.cache, seq, None).length == len(seq)
        assert _bytes(dst.read_device_kv(dst.load_back(seq))) == want[len(seq)]


def test_device_insert_under_a_locked_prefix_leaves_the_allocator_exact(harness_factory):
    """`insert_device_pages` with a concurrent insert of the same pages: the caller frees
    what the function says, the tree frees nothing of the locked prefix, and every
    device slot is owned once (no slot freed twice, none lost)."""
    h = harness_factory(layer_num=2)
    h.insert_random(TOKENS[:16], seed=7)
    prefix_bytes = _bytes(h.read_device_kv(h.device_prefix(TOKENS[:16])))
    held = adapter.match_device_prefix(h.cache, TOKENS, None)
    assert held.length == 16
    lock = adapter.lock_node(h.cache, held.last_node)
    slots = adapter.alloc_device_slots(h.cache, 48)
    h.insert_random(TOKENS, seed=8)  # a concurrent insert brings the same 48 tokens
    available = int(adapter.device_available_size(h.cache))
    key = adapter.make_key(h.cache, TOKENS, None)
    present = adapter.insert_device_pages(h.cache, key, 16, slots)
    adapter.unlock_node(h.cache, lock)
    if present:
        adapter.free_device_slots(h.cache, slots[:present])
    # All 48 were duplicates: whoever frees them, they are free exactly once.
    assert int(adapter.device_available_size(h.cache)) == available + 48
    assert adapter.match_device_prefix(h.cache, TOKENS, None).length == 64
    assert _bytes(h.read_device_kv(h.device_prefix(TOKENS[:16]))) == prefix_bytes
    everything = adapter.alloc_device_slots(h.cache, int(adapter.device_available_size(h.cache)))
    tree_slots = set(h.device_prefix(TOKENS).tolist())
    assert len(set(everything.tolist())) == len(everything)
    assert not tree_slots & set(everything.tolist())


def test_cache_generation_stays_through_ordinary_work(harness_factory):
    """Only a reset changes the generation: inserts, write-through, eviction and load
    back (what runs between an allocate and its commit) leave it as it was, or every
    pending migration would be refused as flushed."""
    h = harness_factory(layer_num=2, load_back_threshold=1)
    before = adapter.cache_generation(h.cache)
    h.insert_random(TOKENS, seed=9)
    h.write_back_all()
    h.evict_device_all()
    h.load_back(TOKENS)
    h.insert_random(TOKENS[:32] + list(range(5000, 5032)), seed=10)
    assert adapter.cache_generation(h.cache) is before


def _filled_messages() -> list:
    """One of every server message, with the nested wire values set."""
    from sglang_kv_migration.server import messages as m
    from sglang_kv_migration.wire import messages as wire

    rank = wire.RankSessionInfo(
        tp_rank=0, pp_rank=0, page_size=16, fingerprint={"page_size": 16}, paths={"host": {}}
    )
    target = wire.TransferRequestKVCacheTarget(tp=0, pp=0, kv_page_ranges=[[2, 3]], grant="g")
    return [
        m.GetTransferSessionInfoReqInput(weight_version="w", dp_rank=None),
        m.GetTransferSessionInfoReqOutput(success=True, ranks=[rank], instance_id="i"),
        m.GetRequestExtraTokenSizeReqInput(input_ids=[1, 2], input_ids_u32=b"\x01\0\0\0"),
        m.GetRequestExtraTokenSizeReqOutput(success=True, matched_token_size=16, page_owners=[0]),
        m.AllocateTokenForTransferReqInput(
            input_ids=[1], stage_refusal=wire.StageRefusal("no", "conflict")
        ),
        m.AllocateTokenForTransferReqOutput(
            success=True, ranks=[wire.AllocatedRank(tp_rank=0, pp_rank=0, kv_indices=[5])]
        ),
        m.TransferRequestKVCacheReqInput(
            input_ids=[1],
            target_per_rank=[target],
            allocate_on_target=wire.AllocateOnTarget(address="a", secret="s", allocate=b"{}"),
        ),
        m.TransferRequestKVCacheReqOutput(
            success=False,
            ranks=[wire.RankTransferResult(tp_rank=0, pp_rank=0, success=False, seconds=0.5)],
            steps_ms={"wire": 1.5},
            trace={"received": 1.0},
        ),
        m.CommitTransferRequestKVCacheReqInput(migration_id="x", receipts=["r"]),
        m.CommitTransferRequestKVCacheReqOutput(success=True, matched_after_commit=32),
        m.AbortTransferReqInput(migration_id="x"),
        m.AbortTransferReqOutput(success=True),
        m.StageSyncReqInput(expired_ids=["x"]),
    ]


def test_every_message_crosses_sglang_s_ipc_and_answers_as_its_wire_model():
    """Pickled (both lines' default), and on 0.5.23 also msgpack-encoded as SGLang's
    `sock_send` does with SGLANG_USE_PICKLE_IPC=0 (decoded into the same type by the
    decoder `hook_custom_types` extended); `rid` survives, and a reply's JSON is its wire
    model's fields."""
    import pickle

    from sglang_kv_migration.server.messages import replace_message
    from sglang_kv_migration.wire.messages import Reply, reply_content, wire_order

    for message in _filled_messages():
        message.rid = "rid-1"
        copies = [pickle.loads(pickle.dumps(message))]
        if adapter.is_unified_line():
            from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

            copies.append(msgpack_decode(msgpack_encode(message)))
        for copy in copies:
            assert type(copy) is type(message) and copy == message and copy.rid == "rid-1"
        model = type(message).WIRE_MODEL
        if issubclass(model, Reply):
            assert list(reply_content(message)) == list(wire_order(model))
            changed = replace_message(message, success=False)
            assert (changed.success, changed.rid, type(changed)) == (False, "rid-1", type(message))
