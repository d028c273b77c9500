"""Layout math: page runs, byte ranges, write plans; and the layout fingerprint (`fingerprint.py`).

Most tests use literal addresses. `test_plan_moves_the_right_bytes` proves the buffer table
on plain CPU tensors shaped like SGLang's host pools, and `test_from_host_pool_on_real_pools`
moves pages between two real SGLang host pools (CPU harness) and checks them with SGLang's
own ``get_data_page``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random

import pytest
import torch
from sglang_kv_migration import PROTOCOL_VERSION, sglang_adapter
from sglang_kv_migration.fingerprint import CP_REPLICATED, KVCacheShape, LayoutFingerprint
from sglang_kv_migration.paths.host.layout import (
    HostBuffer,
    HostPoolLayout,
    Write,
    buffer_byte_ranges,
    page_runs,
    plan_writes,
)

SUPPORTED = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]


def pages(*page_ids: int, page_size: int = 4) -> list[int]:
    return [p * page_size + i for p in page_ids for i in range(page_size)]


def make_layout(
    item_lens: list[int], *, base: int = 0x10000, page_size: int = 4, num_slots: int = 32
) -> HostPoolLayout:
    """Buffers laid end to end from ``base``."""
    buffers, ptr = [], base
    for item_len in item_lens:
        buffers.append(HostBuffer(ptr=ptr, length=num_slots * item_len, item_len=item_len))
        ptr += num_slots * item_len
    return HostPoolLayout(buffers=tuple(buffers), page_size=page_size, num_slots=num_slots)


# --------------------------------------------------------------------------------------
# page_runs
# --------------------------------------------------------------------------------------

as_list = list


def as_tensor(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def as_int32_tensor(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


CONVERTERS = [as_list, as_tensor, as_int32_tensor]


@pytest.mark.parametrize("conv", CONVERTERS)
@pytest.mark.parametrize(
    ("indices", "page_size", "expected"),
    [
        (pages(0, 1, 2), 4, [(0, 12)]),  # contiguous
        (pages(0, 2, 3, 7), 4, [(0, 4), (8, 8), (28, 4)]),  # gaps
        (pages(2, 3, 0, 1, 5), 4, [(8, 8), (0, 8), (20, 4)]),  # out of order
        (pages(3, 2), 4, [(12, 4), (8, 4)]),  # descending pages never coalesce
        ([5, 6, 7, 2, 3, 9], 1, [(5, 3), (2, 2), (9, 1)]),  # page_size 1
        ([], 4, []),
    ],
)
def test_page_runs(conv, indices, page_size, expected):
    assert page_runs(conv(indices), page_size) == expected


@pytest.mark.parametrize("conv", CONVERTERS)
@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (pages(0) + [4, 5], r"6 host indices is not a multiple of page_size=4"),
        (pages(0) + [5, 6, 7, 8], r"host_indices\[4\]=5 does not start a page"),
        (pages(0) + [-4, -3, -2, -1], r"host_indices\[4\]=-4 does not start a page"),
        (pages(0) + [8, 9, 11, 10], r"host_indices\[6\]=11, expected 10: .*host_indices\[4\]=8"),
        ([0, 1, 2, 3, 8, 9, 10, 12], r"host_indices\[7\]=12, expected 11"),
    ],
)
def test_page_runs_rejects_partial_pages(conv, indices, match):
    with pytest.raises(ValueError, match=match):
        page_runs(conv(indices), 4)


def test_page_runs_rejects_bad_page_size():
    with pytest.raises(ValueError, match="page_size"):
        page_runs([0], 0)


def test_page_runs_of_a_large_shuffled_tensor_match_the_list_form():
    # Speed is benchmark/'s business; this checks the vectorized branch gives the same runs.
    page_size, num_pages = 64, 4096
    order = list(range(num_pages))
    random.Random(0).shuffle(order)
    chosen = order[:256]
    idx = torch.tensor(pages(*chosen, page_size=page_size))
    runs = page_runs(idx, page_size)
    assert runs == page_runs(idx.tolist(), page_size)
    assert sum(n for _, n in runs) == 256 * page_size


# --------------------------------------------------------------------------------------
# HostPoolLayout
# --------------------------------------------------------------------------------------


def test_published_round_trip():
    layout = make_layout([16, 16, 32])
    again = HostPoolLayout.from_published(
        layout.data_ptrs, layout.data_lens, layout.item_lens, page_size=4, num_slots=32
    )
    assert again == layout
    # num_slots defaults to what the buffers hold.
    assert (
        HostPoolLayout.from_published(
            layout.data_ptrs, layout.data_lens, layout.item_lens, page_size=4
        )
        == layout
    )
    assert layout.data_ptrs == [0x10000, 0x10000 + 512, 0x10000 + 1024]
    assert layout.data_lens == [512, 512, 1024]
    assert layout.item_lens == [16, 16, 32]


@pytest.mark.parametrize(
    ("ptrs", "lens", "items", "page_size", "num_slots", "match"),
    [
        ([1, 2], [64], [2, 2], 4, 32, "differ in length"),
        ([], [], [], 4, 32, "at least one buffer"),
        ([0], [64], [2], 4, 32, r"ptr must be a positive int"),
        ([4096], [64], [0], 4, 32, r"item_len must be a positive int"),
        ([4096], [65], [2], 4, 32, r"item_len=2 does not divide length=65"),
        ([4096], [66], [2], 4, 32, r"length=66 != num_slots=32 \* item_len=2"),
        ([4096], [60], [2], 4, 30, r"num_slots=30 is not a multiple of page_size=4"),
        ([4096, 8192], [64, 96], [2, 2], 4, None, r"buffer 1: length=96 != num_slots=32"),
        ([4096], [60], [2], 4, None, r"num_slots=30 is not a multiple of page_size=4"),
        ([4096], [64], [2], 0, 32, r"page_size must be a positive int"),
    ],
)
def test_published_validation(ptrs, lens, items, page_size, num_slots, match):
    with pytest.raises(ValueError, match=match):
        HostPoolLayout.from_published(ptrs, lens, items, page_size, num_slots)


# L=2 layers, H=2 heads, D=4, itemsize 2 (MHA token = 16 B); MLA C=8, itemsize 2 (16 B);
# page_size 4, 16 slots, kv_buffer at 0x1000.
@pytest.mark.parametrize(
    ("attention", "host_layout", "nbytes", "ptr_offsets", "item_len"),
    [
        ("mha", "layer_first", 2 * 2 * 16 * 16, [0, 256, 512, 768], 16),
        ("mha", "page_first", 2 * 2 * 16 * 16, [0, 512], 32),
        ("mha", "page_first_direct", 2 * 2 * 16 * 16, [0, 512], 32),
        ("mha", "page_head", 2 * 2 * 16 * 16, [0, 512], 32),
        ("mla", "layer_first", 2 * 16 * 16, [0, 256], 16),
        ("mla", "page_first", 2 * 16 * 16, [0], 32),
        ("mla", "page_first_direct", 2 * 16 * 16, [0], 32),
    ],
)
def test_buffers_per_layout(attention, host_layout, nbytes, ptr_offsets, item_len):
    layout = HostPoolLayout.from_contiguous_buffer(
        attention=attention,
        host_layout=host_layout,
        base_ptr=0x1000,
        nbytes=nbytes,
        layer_num=2,
        page_size=4,
        num_slots=16,
    )
    assert layout.data_ptrs == [0x1000 + o for o in ptr_offsets]
    assert layout.item_lens == [item_len] * len(ptr_offsets)
    assert sum(layout.data_lens) == nbytes
    # Pages 3 then 1 (slots 12..15, 4..7): one range per buffer per page.
    assert buffer_byte_ranges(layout, pages(3, 1)) == [
        r
        for b in range(len(ptr_offsets))
        for r in ((b, 12 * item_len, 4 * item_len), (b, 4 * item_len, 4 * item_len))
    ]


def test_byte_ranges_mha_layer_first_by_hand():
    # 2 layers, token 16 B, 16 slots: K0 @0x1000, K1 @0x1100, V0 @0x1200, V1 @0x1300.
    layout = HostPoolLayout.from_contiguous_buffer(
        attention="mha",
        host_layout="layer_first",
        base_ptr=0x1000,
        nbytes=1024,
        layer_num=2,
        page_size=4,
        num_slots=16,
    )
    assert layout.data_ptrs == [0x1000, 0x1100, 0x1200, 0x1300]
    # Pages 1, 2 coalesce (slots 4..11), page 0 stands alone.
    assert buffer_byte_ranges(layout, pages(1, 2, 0)) == [
        (0, 64, 128),
        (0, 0, 64),
        (1, 64, 128),
        (1, 0, 64),
        (2, 64, 128),
        (2, 0, 64),
        (3, 64, 128),
        (3, 0, 64),
    ]


def test_byte_ranges_out_of_pool():
    layout = make_layout([16], num_slots=16)
    with pytest.raises(ValueError, match=r"host_indices slots \[16, 20\) lie outside .* 16 slots"):
        buffer_byte_ranges(layout, pages(4))


@pytest.mark.parametrize(
    ("attention", "host_layout"),
    [("mla", "page_first_kv_split"), ("mla", "page_head"), ("mha", "bogus")],
)
def test_unsupported_layout_is_named(attention, host_layout):
    with pytest.raises(ValueError, match=f"host layout '{host_layout}' is not supported"):
        HostPoolLayout.from_contiguous_buffer(
            attention=attention,
            host_layout=host_layout,
            base_ptr=0x1000,
            nbytes=1024,
            layer_num=2,
            page_size=4,
            num_slots=16,
        )


def test_unknown_attention():
    with pytest.raises(ValueError, match="unknown attention kind 'gqa'"):
        HostPoolLayout.from_contiguous_buffer(
            attention="gqa",
            host_layout="layer_first",
            base_ptr=0x1000,
            nbytes=1024,
            layer_num=2,
            page_size=4,
            num_slots=16,
        )


def test_buffer_does_not_split_evenly():
    with pytest.raises(ValueError, match="does not split into 4 buffers of 16 slots"):
        HostPoolLayout.from_contiguous_buffer(
            attention="mha",
            host_layout="layer_first",
            base_ptr=0x1000,
            nbytes=1000,
            layer_num=2,
            page_size=4,
            num_slots=16,
        )


# --------------------------------------------------------------------------------------
# plan_writes
# --------------------------------------------------------------------------------------


def test_plan_writes_only_doubly_contiguous_runs_coalesce():
    src = make_layout([16, 8], base=0x10000)  # buffer 0 @0x10000, buffer 1 @0x10200
    dst = make_layout([16, 8], base=0x90000)  # buffer 0 @0x90000, buffer 1 @0x90200
    # src pages 0,1,2,3 (one run); dst pages 5,6,2,3 (two runs) -> pieces split at dst break.
    writes = plan_writes(src, pages(0, 1, 2, 3), dst, pages(5, 6, 2, 3))
    assert writes == [
        Write(0x10000 + 0, 0x90000 + 20 * 16, 8 * 16),
        Write(0x10000 + 8 * 16, 0x90000 + 8 * 16, 8 * 16),
        Write(0x10200 + 0, 0x90200 + 20 * 8, 8 * 8),
        Write(0x10200 + 8 * 8, 0x90200 + 8 * 8, 8 * 8),
    ]


def test_plan_writes_splits_on_either_side():
    src = make_layout([16])
    dst = make_layout([16], base=0x90000)
    # src runs: page 7 | pages 0,1; dst runs: pages 2,3 | page 5. Each side breaks once,
    # at different places, giving three single-page pieces (slots 28->8, 0->12, 4->20).
    writes = plan_writes(src, pages(7, 0, 1), dst, pages(2, 3, 5))
    assert [(w.src_addr - 0x10000, w.dst_addr - 0x90000, w.length) for w in writes] == [
        (28 * 16, 8 * 16, 64),
        (0, 12 * 16, 64),
        (4 * 16, 20 * 16, 64),
    ]
    # Same dst with contiguous dst pages 2,3,4: pages 0,1 stay one piece.
    writes = plan_writes(src, pages(7, 0, 1), dst, pages(2, 3, 4))
    assert [(w.src_addr - 0x10000, w.dst_addr - 0x90000, w.length) for w in writes] == [
        (28 * 16, 8 * 16, 64),
        (0, 12 * 16, 128),
    ]


def test_plan_writes_fully_contiguous_is_one_write_per_buffer():
    src = make_layout([16, 16, 16])
    dst = make_layout([16, 16, 16], base=0x90000)
    writes = plan_writes(src, torch.tensor(pages(2, 3, 4)), dst, torch.tensor(pages(0, 1, 2)))
    assert len(writes) == 3
    assert all(w.length == 12 * 16 for w in writes)


def test_plan_writes_empty():
    assert plan_writes(make_layout([16]), [], make_layout([16], base=0x90000), []) == []


def test_write_converts_to_a_plain_tuple():
    w = Write(src_addr=1, dst_addr=2, length=3)
    assert dataclasses.astuple(w) == (1, 2, 3)
    assert [f.name for f in dataclasses.fields(w)] == ["src_addr", "dst_addr", "length"]


@pytest.mark.parametrize(
    ("dst", "dst_indices", "match"),
    [
        (
            make_layout([16, 16], page_size=8),
            pages(0, page_size=8),
            r"page_size: source=4 target=8",
        ),
        (make_layout([16]), pages(0), r"number of buffers: source=2 target=1"),
        (make_layout([16, 32]), pages(0), r"item_len of buffer 1: source=16 target=32"),
        (make_layout([16, 16]), pages(0, 1), r"slot counts differ: source=4 target=8"),
        (make_layout([16, 16], num_slots=8), pages(2), r"target slots \[8, 12\) lie outside"),
    ],
)
def test_plan_writes_rejects(dst, dst_indices, match):
    src = make_layout([16, 16])
    with pytest.raises(ValueError, match=match):
        plan_writes(src, pages(0), dst, dst_indices)


def test_plan_writes_rejects_source_out_of_range():
    src = make_layout([16], num_slots=8)
    with pytest.raises(ValueError, match=r"source slots \[8, 12\) lie outside .* 8 slots"):
        plan_writes(src, pages(2), make_layout([16]), pages(0))


# --------------------------------------------------------------------------------------
# Real tensors: the plan moves exactly the right K/V of every layer
# --------------------------------------------------------------------------------------

LAYERS, HEADS, HEAD_DIM, MLA_DIM, PAGE_SIZE, PAGE_NUM = 3, 2, 4, 6, 4, 6
SIZE = PAGE_SIZE * PAGE_NUM


def kv_dims(attention: str, host_layout: str) -> tuple[int, ...]:
    """kv_buffer dims of SGLang 0.5.12's host pools (see layout.py's table)."""
    L, H, D, C, ps, pn = LAYERS, HEADS, HEAD_DIM, MLA_DIM, PAGE_SIZE, PAGE_NUM
    return {
        ("mha", "layer_first"): (2, L, SIZE, H, D),
        ("mha", "page_first"): (2, SIZE, L, H, D),
        ("mha", "page_first_direct"): (2, pn, L, ps, H, D),
        ("mha", "page_head"): (2, pn, H, ps, L, D),
        ("mla", "layer_first"): (L, SIZE, 1, C),
        ("mla", "page_first"): (SIZE, L, 1, C),
        ("mla", "page_first_direct"): (pn, L, ps, 1, C),
    }[(attention, host_layout)]


def token_kv(kv: torch.Tensor, attention: str, host_layout: str, plane: int, layer: int, slot: int):
    """One layer's K (plane 0) / V (plane 1) / MLA latent (plane 0) at one slot, by indexing."""
    page, off = divmod(slot, PAGE_SIZE)
    t = kv[plane] if attention == "mha" else kv  # MHA has a leading K/V dim
    if host_layout == "layer_first":
        return t[layer, slot]
    if host_layout == "page_first":
        return t[slot, layer]
    if host_layout == "page_first_direct":
        return t[page, layer, off]
    assert (attention, host_layout) == ("mha", "page_head")
    return t[page, :, off, layer]


def layout_of(kv: torch.Tensor, attention: str, host_layout: str) -> HostPoolLayout:
    return HostPoolLayout.from_contiguous_buffer(
        attention=attention,
        host_layout=host_layout,
        base_ptr=kv.data_ptr(),
        nbytes=kv.nbytes,
        layer_num=LAYERS,
        page_size=PAGE_SIZE,
        num_slots=SIZE,
    )


@pytest.mark.parametrize(("attention", "host_layout"), SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_moves_the_right_bytes(attention, host_layout, dtype):
    dims = kv_dims(attention, host_layout)
    src = torch.arange(1, 1 + torch.Size(dims).numel(), dtype=torch.float32).reshape(dims)
    src = src.to(dtype) if dtype == torch.float32 else (src % 251 + 1).to(dtype)
    dst = torch.zeros(dims, dtype=dtype)
    src_pages, dst_pages = [4, 5, 0, 2], [1, 2, 3, 5]
    src_slots, dst_slots = pages(*src_pages), pages(*dst_pages)

    writes = plan_writes(
        layout_of(src, attention, host_layout),
        torch.tensor(src_slots),
        layout_of(dst, attention, host_layout),
        dst_slots,
    )
    for w in writes:
        ctypes.memmove(w.dst_addr, w.src_addr, w.length)

    planes = 2 if attention == "mha" else 1
    for plane in range(planes):
        for layer in range(LAYERS):
            for s, d in zip(src_slots, dst_slots, strict=True):
                assert torch.equal(
                    token_kv(dst, attention, host_layout, plane, layer, d),
                    token_kv(src, attention, host_layout, plane, layer, s),
                ), (plane, layer, s, d)
            for d in set(range(SIZE)) - set(dst_slots):
                assert not token_kv(dst, attention, host_layout, plane, layer, d).any(), (
                    plane,
                    layer,
                    d,
                )


@pytest.mark.parametrize(("attention", "host_layout"), SUPPORTED)
def test_byte_ranges_match_tensor_pages(attention, host_layout):
    dims = kv_dims(attention, host_layout)
    kv = torch.arange(torch.Size(dims).numel(), dtype=torch.int32).reshape(dims)
    layout = layout_of(kv, attention, host_layout)
    raw = kv.reshape(-1).view(torch.uint8)
    base = kv.data_ptr()
    slots = pages(3)
    for b, off, length in buffer_byte_ranges(layout, slots):
        start = layout.buffers[b].ptr - base + off
        got = raw[start : start + length].view(torch.int32)
        # Buffer b is one (plane, layer) for layer_first, else one plane with all layers.
        if host_layout == "layer_first":
            plane, layers = b // LAYERS, [b % LAYERS]
        else:
            plane, layers = b, range(LAYERS)
        expected = [
            token_kv(kv, attention, host_layout, plane, lyr, s) for lyr in layers for s in slots
        ]
        # Values are distinct, so equal sets of equal size mean exactly this page's data.
        got_values = set(got.tolist())
        want_values = {v for t in expected for v in t.reshape(-1).tolist()}
        assert got_values == want_values, (b, off, length)
        assert got.numel() == len(want_values)


# --------------------------------------------------------------------------------------
# LayoutFingerprint
# --------------------------------------------------------------------------------------


def fingerprint(**overrides) -> LayoutFingerprint:
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        model="tiny-llama",
        kv_dtype="bfloat16",
        attention="mha",
        start_layer=0,
        end_layer=3,
        kv_heads=2,
        head_dim=64,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        page_size=16,
        host_layout="page_first",
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
    )
    fields.update(overrides)
    return LayoutFingerprint.from_dict(fields)


def test_fingerprint_mismatch_names_the_field():
    assert fingerprint().first_mismatch(fingerprint()) is None
    assert (
        fingerprint().first_mismatch(fingerprint(page_size=64)) == "page_size: source=16 target=64"
    )
    # Declaration order: protocol_version is reported before anything else.
    other = fingerprint(protocol_version=PROTOCOL_VERSION + 1, page_size=64)
    assert fingerprint().first_mismatch(other).startswith("protocol_version: ")
    assert (
        fingerprint().first_mismatch(fingerprint(host_layout="layer_first"), self_name="here")
        == "host_layout: here=page_first target=layer_first"
    )


def test_fingerprint_dict_round_trip():
    fp = fingerprint(attention="mla", kv_heads=1, head_dim=0, kv_lora_rank=512)
    d = fp.to_dict()
    assert list(d)[0] == "protocol_version"
    assert LayoutFingerprint.from_dict(d) == fp


def test_fingerprint_from_dict_rejects_unknown_and_missing_keys():
    d = fingerprint().to_dict()
    d["foo"] = 1
    del d["page_size"]
    with pytest.raises(ValueError, match=r"unknown keys \['foo'\], missing keys \['page_size'\]"):
        LayoutFingerprint.from_dict(d)


def test_fingerprint_attn_cp_size_differs_and_defaults_to_one():
    """Servers with different attention CP layouts are refused; a fingerprint from an
    older server (no attn_cp_size) reads as CP 1, and a CP-1 fingerprint is what such a
    server publishes and reads (no new key)."""
    assert (
        fingerprint().first_mismatch(fingerprint(attn_cp_size=2))
        == "attn_cp_size: source=1 target=2"
    )
    old = fingerprint().to_dict()
    assert "attn_cp_size" not in old and "attn_cp_mode" not in old
    assert LayoutFingerprint.from_dict(old).attn_cp_size == 1
    assert LayoutFingerprint.from_dict(fingerprint(attn_cp_size=2).to_dict()).attn_cp_size == 2


def test_fingerprint_carries_the_cp_mode():
    """A CP server says how its CP ranks hold pages (SGLang 0.5.12: every rank all of
    them); a peer holding them another way (one owner per page) is refused by name."""
    shape = KVCacheShape(
        attention="mla",
        kv_dtype="bfloat16",
        start_layer=0,
        end_layer=3,
        kv_heads=1,
        head_dim=0,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        page_size=64,
        host_layout="layer_first",
    )
    place = {"model": "m", "tp_size": 2, "tp_rank": 1, "pp_size": 1, "pp_rank": 0}
    cp = LayoutFingerprint.from_shape(shape, attn_cp_size=2, **place)
    assert (cp.attn_cp_size, cp.attn_cp_mode) == (2, CP_REPLICATED)
    assert cp.to_dict()["attn_cp_mode"] == "replicated"
    assert LayoutFingerprint.from_dict(cp.to_dict()) == cp
    plain = LayoutFingerprint.from_shape(shape, **place)
    assert plain.attn_cp_mode == "" and "attn_cp_mode" not in plain.to_dict()
    sharded = dataclasses.replace(cp, attn_cp_mode="owner_per_page")
    assert cp.first_mismatch(sharded) == "attn_cp_mode: source=replicated target=owner_per_page"


@pytest.mark.parametrize(("field", "value"), [("page_size", "16"), ("tp_rank", True), ("model", 3)])
def test_fingerprint_rejects_wrong_types(field, value):
    with pytest.raises(ValueError, match=f"fingerprint field {field} must be"):
        fingerprint(**{field: value})


# --------------------------------------------------------------------------------------
# Real SGLang host pools (needs the CPU harness)
# --------------------------------------------------------------------------------------

HARNESS_CASES = [
    (attention, host_layout, page_size)
    for attention in ("mha", "mla")
    for host_layout in ("layer_first", "page_first", "page_first_direct")
    for page_size in (1, 16)
] + [("mha", "page_head", 16)]


@pytest.mark.parametrize(("attention", "host_layout", "page_size"), HARNESS_CASES)
def test_from_host_pool_on_real_pools(harness_factory, attention, host_layout, page_size):
    def make():
        return harness_factory(
            attention=attention,
            host_layout=host_layout,
            page_size=page_size,
            # page_head has no default io backend in the harness; it pairs with "kernel".
            io_backend="kernel" if host_layout == "page_head" else None,
        )

    src_h, dst_h = make(), make()
    src_pool, dst_pool = src_h.host_pool, dst_h.host_pool
    assert src_pool.layout == host_layout  # ServerArgs did not rewrite the layout

    layout = HostPoolLayout.from_host_pool(src_pool)
    planes = 2 if attention == "mha" else 1
    per_layer = src_pool.layer_num if host_layout == "layer_first" else 1
    assert len(layout.buffers) == planes * per_layer
    assert sum(layout.data_lens) == src_pool.kv_buffer.nbytes
    assert layout.data_ptrs[0] == src_pool.kv_buffer.data_ptr()
    assert (layout.num_slots, layout.page_size) == (src_pool.size, page_size)

    # Move pages with the plan and check them with SGLang's own page accessor.
    src_raw = src_pool.kv_buffer.view(-1).view(torch.uint8)
    src_raw.copy_(torch.randint(0, 256, src_raw.shape, dtype=torch.uint8))
    dst_pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    src_pages, dst_pages = [7, 8, 2, 3], [4, 9, 10, 0]
    writes = plan_writes(
        layout,
        torch.tensor(pages(*src_pages, page_size=page_size)),
        HostPoolLayout.from_host_pool(dst_pool),
        pages(*dst_pages, page_size=page_size),
    )
    for w in writes:
        ctypes.memmove(w.dst_addr, w.src_addr, w.length)
    moved_bytes = 0
    for sp, dp in zip(src_pages, dst_pages, strict=True):
        got = dst_pool.get_data_page(dp * page_size).view(torch.uint8)
        want = src_pool.get_data_page(sp * page_size).view(torch.uint8)
        assert torch.equal(got, want), (sp, dp)
        moved_bytes += got.numel()
    # Nothing outside the target pages was touched (random bytes are rarely all zero).
    assert int(dst_pool.kv_buffer.view(-1).view(torch.uint8).count_nonzero()) <= moved_bytes
    assert moved_bytes == sum(w.length for w in writes)

    fp = LayoutFingerprint.from_shape(
        sglang_adapter.kv_cache_shape(src_pool),
        model="m",
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
    )
    shape = fp.shape
    assert (shape.attention, shape.host_layout, shape.page_size) == (
        attention,
        host_layout,
        page_size,
    )
    assert fp.protocol_version == PROTOCOL_VERSION
    assert shape.kv_dtype == "bfloat16"
    assert (shape.start_layer, shape.end_layer) == (0, src_pool.layer_num - 1)
    if attention == "mha":
        assert (shape.kv_heads, shape.head_dim, shape.kv_lora_rank) == (2, 16, 0)
    else:
        assert (
            shape.kv_heads,
            shape.head_dim,
            shape.kv_lora_rank,
            shape.qk_rope_head_dim,
        ) == (1, 0, 32, 16)
    assert LayoutFingerprint.from_dict(fp.to_dict()) == fp
    assert (
        fp.first_mismatch(
            LayoutFingerprint.from_shape(
                sglang_adapter.kv_cache_shape(dst_pool),
                model="m",
                tp_size=1,
                tp_rank=0,
                pp_size=1,
                pp_rank=0,
            )
        )
        is None
    )


def test_the_fast_fingerprint_check_is_as_strict_as_the_full_one():
    from sglang_kv_migration.errors import MigrationError
    from sglang_kv_migration.server.rank.context import check_peer_fingerprint

    mine = fingerprint().with_weight_version("v1")
    assert mine is fingerprint().with_weight_version("v1")  # built once per version
    assert mine.weight_version == "v1" and mine.wire == mine.to_dict()
    check_peer_fingerprint(mine, [mine.to_dict()], role="target")
    # Equal under `==` but not the same types: refused as the full check refuses them.
    for field, value in (("pp_size", True), ("page_size", 16.0)):
        raw = {**mine.to_dict(), field: value}
        assert raw == mine.wire
        with pytest.raises(MigrationError, match=field):
            check_peer_fingerprint(mine, [raw], role="target")
    with pytest.raises(MigrationError, match="page_size: target=64"):
        check_peer_fingerprint(mine, [{**mine.to_dict(), "page_size": 64}], role="target")
