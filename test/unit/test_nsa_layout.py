"""NSA models (DeepSeek-V3.2 class) on both data paths' layout math, with SGLang's real
pools on CPU: `NSATokenToKVPool` on the device, the `HostPoolGroup` of the MLA KV host
pool and `NSAIndexerPoolHost` that HiRadixCache builds for it on the host.

Every buffer of the group moves for a page (the KV latent and the indexer's keys with
their scales), byte for byte, checked with SGLang's own page accessors; the fingerprint
names the group and the indexer, and two NSA servers that differ are refused naming the
field.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.fingerprint import LayoutFingerprint
from sglang_kv_migration.paths.host.layout import HostPoolLayout, plan_writes

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CASES = [(layout, page) for layout in LAYOUTS for page in (1, 64)]


def pages(*page_ids: int, page_size: int) -> list[int]:
    return [p * page_size + i for p in page_ids for i in range(page_size)]


def group_pools(harness):
    group = harness.host_pool
    return [entry.host_pool for entry in group.entries]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def rank_fingerprint(harness) -> LayoutFingerprint:
    return LayoutFingerprint.from_shape(
        sglang_adapter.kv_cache_shape(harness.host_pool),
        model="m",
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
    )


@pytest.mark.parametrize(("host_layout", "page_size"), CASES)
def test_host_layout_moves_kv_and_indexer_pages(harness_factory, host_layout, page_size):
    src_h = harness_factory(attention="nsa", host_layout=host_layout, page_size=page_size)
    dst_h = harness_factory(attention="nsa", host_layout=host_layout, page_size=page_size)
    group = src_h.host_pool
    assert type(group).__name__ == "HostPoolGroup"
    kv, indexer = group_pools(src_h)
    assert (type(kv).__name__, type(indexer).__name__) == (
        "MLATokenToKVPoolHost",
        "NSAIndexerPoolHost",
    )
    layout = HostPoolLayout.from_host_pool(group)
    per_layer = kv.layer_num if host_layout == "layer_first" else 1
    assert len(layout.buffers) == 2 * per_layer  # KV latent, then the indexer's keys
    assert layout.data_ptrs[per_layer] == indexer.index_k_with_scale_buffer.data_ptr()
    assert (layout.num_slots, layout.page_size) == (kv.size, page_size)

    for pool in group_pools(src_h):
        buf = pool.kv_buffer if pool is kv else pool.index_k_with_scale_buffer
        raw(buf).copy_(torch.randint(0, 256, raw(buf).shape, dtype=torch.uint8))
    dst_kv, dst_indexer = group_pools(dst_h)
    raw(dst_kv.kv_buffer).zero_()
    raw(dst_indexer.index_k_with_scale_buffer).zero_()

    src_pages, dst_pages = [7, 8, 2, 3], [4, 9, 10, 0]
    writes = plan_writes(
        layout,
        torch.tensor(pages(*src_pages, page_size=page_size)),
        HostPoolLayout.from_host_pool(dst_h.host_pool),
        pages(*dst_pages, page_size=page_size),
    )
    for w in writes:
        ctypes.memmove(w.dst_addr, w.src_addr, w.length)

    moved = 0
    for src_pool, dst_pool in zip(group_pools(src_h), group_pools(dst_h), strict=True):
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            want = src_pool.get_data_page(sp * page_size).view(torch.uint8)
            got = dst_pool.get_data_page(dp * page_size).view(torch.uint8)
            assert torch.equal(got, want), (type(src_pool).__name__, sp, dp)
            moved += got.numel()
    assert moved == sum(w.length for w in writes)
    # Nothing outside the target pages was written (random bytes are rarely zero).
    touched = int(raw(dst_kv.kv_buffer).count_nonzero()) + int(
        raw(dst_indexer.index_k_with_scale_buffer).count_nonzero()
    )
    assert touched <= moved


@pytest.mark.parametrize("page_size", [1, 64])
def test_fingerprint_names_the_nsa_layout(harness_factory, page_size):
    nsa = harness_factory(attention="nsa", host_layout="page_first", page_size=page_size)
    fp = rank_fingerprint(nsa)
    shape = fp.shape
    assert (shape.attention, shape.host_pools, shape.index_head_dim, shape.index_dtype) == (
        "mla",
        "kv+indexer",
        128,
        "uint8",
    )
    assert (shape.kv_lora_rank, shape.qk_rope_head_dim, shape.page_size) == (32, 16, page_size)
    assert LayoutFingerprint.from_dict(fp.to_dict()) == fp
    assert {"host_pools", "index_head_dim", "index_dtype"} <= set(fp.to_dict())

    # A plain MLA server with the same KV shape is refused, naming the pools.
    mla = harness_factory(attention="mla", host_layout="page_first", page_size=page_size)
    assert fp.first_mismatch(rank_fingerprint(mla)) == "host_pools: source=kv+indexer target=kv"
    # The plain server's fingerprint keeps its old keys (older peers read it unchanged).
    assert not {"host_pools", "index_head_dim", "index_dtype"} & set(
        rank_fingerprint(mla).to_dict()
    )


def test_host_pool_group_allocates_for_every_pool(harness_factory):
    """Slots from the group are the KV pool's; the indexer addresses the same pages."""
    h = harness_factory(attention="nsa", host_layout="layer_first", page_size=64)
    kv, _indexer = group_pools(h)
    before = int(kv.available_size())
    slots = sglang_adapter.alloc_host_slots(h.cache, 128)
    assert int(kv.available_size()) == before - 128
    sglang_adapter.free_host_slots(h.cache, slots)
    assert int(kv.available_size()) == before
    # take_host_slots reaches the group's allocator (the KV pool's free list).
    sglang_adapter.take_host_slots(h.cache, slots)
    assert int(kv.available_size()) == before - 128


@pytest.mark.parametrize("page_size", [1, 64])
def test_device_buffers_include_the_indexer(harness_factory, page_size):
    """The device path moves rows of `device_kv_buffers`: the MLA latent per layer, then
    the indexer's page blocks per layer as `page_size` rows each; copying the rows of a
    page moves both byte for byte (what the GPU kernel and the landing arena do)."""
    src = harness_factory(attention="nsa", host_layout="layer_first", page_size=page_size)
    dst = harness_factory(attention="nsa", host_layout="layer_first", page_size=page_size)
    buffers = sglang_adapter.device_kv_buffers(src.cache)
    layers = src.cfg.layer_num
    assert len(buffers) == 2 * layers
    assert all(b.shape[0] >= src.cfg.device_tokens for b in buffers)
    row = 128 + 128 // 128 * 4  # per token: fp8 keys, then one fp32 scale per 128
    assert {b.shape[1] * b.element_size() for b in buffers[layers:]} == {row}

    ids = list(range(1000, 1000 + 3 * max(page_size, 16)))
    held = src.insert_random(ids, seed=3)
    slots = dst.allocator.alloc(len(held))
    for s_buf, d_buf in zip(buffers, sglang_adapter.device_kv_buffers(dst.cache), strict=True):
        d_buf[slots] = s_buf[held]
    dev_pool = dst.device_pool
    for layer in range(layers):
        src_blocks = src.device_pool.index_k_with_scale_buffer[layer]
        dst_blocks = dev_pool.index_k_with_scale_buffer[layer]
        src_pages = held.reshape(-1, page_size)[:, 0] // page_size
        dst_pages = slots.reshape(-1, page_size)[:, 0] // page_size
        assert torch.equal(dst_blocks[dst_pages], src_blocks[src_pages])
        assert int(src_blocks[src_pages].count_nonzero()) > 0
        got, want = dev_pool.kv_buffer[layer][slots], src.device_pool.kv_buffer[layer][held]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bytes: NaNs too


def test_a_group_with_pools_of_their_own_slots_is_refused(harness_factory):
    """Only the NSA indexer shares the KV pool's slots; a group holding another pool (SWA
    here, built from SGLang's own entry type) is refused naming its pools."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup

    h = harness_factory(attention="nsa", host_layout="layer_first", page_size=64)
    kv_entry, indexer_entry = h.host_pool.entries
    other = HostPoolGroup([kv_entry, dataclasses.replace(indexer_entry, name=PoolName.SWA)])
    with pytest.raises(ValueError, match=r"pools \['kv', 'swa'\]"):
        HostPoolLayout.from_host_pool(other)
    with pytest.raises(ValueError, match=r"pools \['kv', 'swa'\]"):
        sglang_adapter.kv_cache_shape(other)
    # The group SGLang builds for NSA is described whole.
    assert len(HostPoolLayout.from_host_pool(h.host_pool).buffers) == 2 * h.cfg.layer_num


def test_device_path_reads_an_nsa_host_pool_not_in_place(harness_factory):
    """The device path's host tier reads the KV pool's layout only: an NSA server offers
    device pages only, and host-only pages go by the host path (which moves the group)."""
    from sglang_kv_migration.paths.device.path import DevicePath

    h = harness_factory(attention="nsa", host_layout="page_first_direct", page_size=64)
    path = DevicePath(h.cache)
    try:
        assert path.advertise()["tiers"] == ["device"]
        assert "kv+indexer" in path.host_tier_refusal
    finally:
        path.close()
