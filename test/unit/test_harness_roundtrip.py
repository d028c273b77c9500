"""The CPU harness moves KV through the real HiCache path byte for byte.

insert (device) -> write back (host) -> evict (host only) -> match_prefix sees a host hit
-> load back (device) -> every layer's K and V equal the original bytes.
"""

from __future__ import annotations

import pytest
import torch
from cpu_harness import Harness

CASES = [
    # attention, host layout, io backend (None: the layout's default), page size
    ("mha", "layer_first", None, 16),
    ("mha", "page_first", None, 16),
    ("mha", "page_first_direct", None, 16),
    ("mla", "layer_first", None, 16),
    ("mla", "page_first", None, 16),
    ("mla", "page_first_direct", None, 16),
    ("mha", "layer_first", "kernel", 16),
    ("mla", "layer_first", "kernel", 16),
    ("mha", "layer_first", None, 1),
    ("mha", "page_first", None, 1),
    ("mla", "page_first", None, 1),
    ("mla", "page_first_direct", None, 4),
]


def _same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _roundtrip(h: Harness, tokens: list[int], extra_key: str | None = None, seed: int = 0):
    dev = h.insert_random(tokens, extra_key=extra_key, seed=seed)
    before = h.read_device_kv(dev)
    h.write_back_all()
    h.evict_device_all()
    m = h.match(tokens, extra_key)
    assert len(m.device_indices) == 0
    assert m.host_hit_length == len(dev)
    loaded = h.load_back(tokens, extra_key)
    assert len(loaded) == len(dev)
    return before, h.read_device_kv(loaded)


@pytest.mark.parametrize(("attention", "layout", "io_backend", "page_size"), CASES)
def test_roundtrip_is_byte_exact(harness_factory, attention, layout, io_backend, page_size):
    h = harness_factory(
        attention=attention, host_layout=layout, io_backend=io_backend, page_size=page_size
    )
    assert h.server_args.hicache_mem_layout == layout
    assert h.host_pool.layout == layout
    assert h.controller.io_backend == h.cfg.effective_io_backend()
    start = h.snapshot()

    before, after = _roundtrip(h, _tokens(96), seed=7)

    assert _same_bytes(before, after)
    # The load lock is released and nothing else is held.
    snap = h.snapshot()
    assert snap.total_lock_ref == 0 and snap.protected == 0
    assert snap.device_available == start.device_available - 96
    assert snap.host_available == start.host_available - 96


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_roundtrip_other_write_policies(harness_factory, policy):
    h = harness_factory(write_policy=policy, host_layout="page_first")
    before, after = _roundtrip(h, _tokens(64), seed=3)
    assert _same_bytes(before, after)


def test_unaligned_tail_is_dropped_and_freed(harness_factory):
    h = harness_factory(page_size=16)
    start = h.snapshot()
    dev = h.insert_random(_tokens(40), seed=1)
    assert len(dev) == 32
    h.write_back_all()
    assert h.snapshot().device_available == start.device_available - 32


def test_extra_key_keeps_sequences_apart(harness_factory):
    h = harness_factory(attention="mla", host_layout="page_first")
    tokens = _tokens(48)
    dev_a = h.insert_random(tokens, extra_key="a", seed=1)
    dev_b = h.insert_random(tokens, extra_key="b", seed=2)
    kv_a, kv_b = h.read_device_kv(dev_a), h.read_device_kv(dev_b)
    assert not _same_bytes(kv_a, kv_b)
    h.evict_device_all()
    assert h.match(tokens, "a").host_hit_length == 48
    assert h.match(tokens, "c").host_hit_length == 0
    assert _same_bytes(kv_b, h.read_device_kv(h.load_back(tokens, "b")))
    assert _same_bytes(kv_a, h.read_device_kv(h.load_back(tokens, "a")))


def test_short_host_hit_needs_lower_load_back_threshold(harness_factory):
    # SGLang keeps host hits under 10 tokens on host; the harness can lower that.
    tokens = _tokens(8)
    stock = harness_factory(page_size=4)
    stock.insert_random(tokens)
    stock.evict_device_all()
    assert len(stock.load_back(tokens)) == 0

    lowered = harness_factory(page_size=4, load_back_threshold=1)
    before = lowered.read_device_kv(lowered.insert_random(tokens, seed=5))
    lowered.evict_device_all()
    assert _same_bytes(before, lowered.read_device_kv(lowered.load_back(tokens)))


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_negative_control_corrupted_host_byte_is_detected(harness_factory, attention):
    h = harness_factory(attention=attention, host_layout="layer_first")
    tokens = _tokens(32)
    before = h.read_device_kv(h.insert_random(tokens, seed=11))
    h.evict_device_all()
    host_idx = int(h.match(tokens).last_host_node.host_value[0])
    # layer_first host buffers: MHA [2, layer, token, head, dim], MLA [layer, token, 1, dim].
    if attention == "mha":
        token_row = h.host_pool.kv_buffer[0, 0, host_idx]
    else:
        token_row = h.host_pool.kv_buffer[0, host_idx]
    raw = token_row.view(torch.uint8).view(-1)
    raw[0] = raw[0] ^ 0xFF
    after = h.read_device_kv(h.load_back(tokens))
    assert not _same_bytes(before, after)
    # Only that one byte differs.
    diff = sum(
        int((x.contiguous().view(torch.uint8) != y.contiguous().view(torch.uint8)).sum())
        for x, y in zip(before, after, strict=True)
    )
    assert diff == 1


def test_kernel_shim_skips_negative_indices():
    from sgl_kernel.kvcacheio import transfer_kv_per_layer_mla

    src = torch.arange(8 * 4, dtype=torch.int64).view(8, 4)
    dst = torch.zeros_like(src)
    transfer_kv_per_layer_mla(
        src,
        dst,
        torch.tensor([1, -1, 5]),
        torch.tensor([0, 3, -2]),
        item_size=4 * 8,
    )
    expected = torch.zeros_like(src)
    expected[0] = src[1]
    assert torch.equal(dst, expected)
    with pytest.raises(ValueError):
        transfer_kv_per_layer_mla(src, dst, torch.tensor([1]), torch.tensor([0]), item_size=12)
