"""Page-level write plans (staging.py), executed locally with memmove in place of the wire.

Every plan is checked byte for byte against `layout.plan_writes` run the same way, for
each host layout (MHA and MLA), page size, plan shape and pool state; entry counts are
checked to be independent of fragmentation where the design promises it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from sglang_kv_migration.paths.host import staging
from sglang_kv_migration.paths.host.layout import HostPoolLayout, plan_writes

LAYERS = 3
SLOTS = 1024
ITEM = 64  # bytes per slot per buffer


def make_layout(arr: np.ndarray, attention: str, host_layout: str, page_size: int):
    return HostPoolLayout.from_contiguous_buffer(
        attention=attention,
        host_layout=host_layout,
        base_ptr=arr.ctypes.data,
        nbytes=arr.nbytes,
        layer_num=LAYERS,
        page_size=page_size,
        num_slots=SLOTS,
    )


def pool_bytes(attention: str) -> int:
    return SLOTS * ITEM * LAYERS * (2 if attention == "mha" else 1)


def slots_of(pages: np.ndarray, page_size: int) -> list[int]:
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).tolist()


def pick_pages(rng: np.random.Generator, page_size: int, n: int, fragmented: bool, offset: int):
    if fragmented:
        return rng.permutation(SLOTS // page_size)[:n]
    return np.arange(n) + offset


def execute(plan: staging.PagePlan, src_layout: HostPoolLayout) -> None:
    """What the transport does, with memmove as the wire."""
    if plan.kind == "direct":
        for s, d, n in zip(
            plan.srcs.tolist(), plan.dsts.tolist(), plan.lengths.tolist(), strict=True
        ):
            ctypes.memmove(d, s, n)
        return
    chunk = torch.empty(plan.chunk_capacity, dtype=torch.uint8)
    for c in plan.chunks:
        assert c.nbytes <= plan.chunk_capacity
        staging.gather_chunk(src_layout, c, chunk)
        for o, d, n in zip(
            c.entry_offsets.tolist(), c.entry_dsts.tolist(), c.entry_lengths.tolist(), strict=True
        ):
            ctypes.memmove(d, chunk.data_ptr() + o, n)


def reference(src_layout, src_slots, attention, host_layout, page_size, dst_slots) -> np.ndarray:
    ref = np.zeros(pool_bytes(attention), np.uint8)
    ref_layout = make_layout(ref, attention, host_layout, page_size)
    for w in plan_writes(src_layout, src_slots, ref_layout, dst_slots):
        ctypes.memmove(w.dst_addr, w.src_addr, w.length)
    assert ref.any()
    return ref


CASES = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
]


@pytest.mark.parametrize(("attention", "host_layout"), CASES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(
    ("src_fragmented", "dst_fragmented", "staged", "kind"),
    [
        (False, False, False, "direct"),
        (True, False, False, "gather"),
        (False, True, False, "direct"),  # only a target staging region helps here
        (True, True, False, "direct"),
        (False, False, True, "staged"),  # runs of only ~6 KiB per buffer: still staged
        (True, True, True, "staged"),
        (False, True, True, "staged"),
    ],
)
def test_plans_copy_the_same_bytes_as_plan_writes(
    attention, host_layout, page_size, src_fragmented, dst_fragmented, staged, kind
):
    rng = np.random.default_rng(page_size)
    src = rng.integers(0, 256, pool_bytes(attention), dtype=np.uint8)
    dst = np.zeros_like(src)
    src_layout = make_layout(src, attention, host_layout, page_size)
    dst_layout = make_layout(dst, attention, host_layout, page_size)
    n = 48 // page_size * 2  # pages
    src_slots = slots_of(pick_pages(rng, page_size, n, src_fragmented, 5), page_size)
    dst_slots = slots_of(pick_pages(rng, page_size, n, dst_fragmented, 2), page_size)
    region = np.zeros(staging.staging_bytes(dst_layout, len(dst_slots)), np.uint8)
    plan = staging.plan_pages(
        src_layout,
        torch.tensor(src_slots),  # the source passes a tensor, the target's list arrives
        dst_layout,
        dst_slots,
        chunk_bytes=8192,  # several chunks, each more than one page
        dst_staging_addr=region.ctypes.data if staged else None,
        dst_staging_length=region.nbytes if staged else 0,
    )
    assert plan.kind == kind
    assert plan.total_bytes == len(src_slots) * sum(b.item_len for b in src_layout.buffers)
    execute(plan, src_layout)
    if plan.kind == "staged":
        assert not dst.any()  # nothing reached the pool yet
        staging.scatter_from_staging(dst_layout, torch.from_numpy(region), dst_slots)
    want = reference(src_layout, src_slots, attention, host_layout, page_size, dst_slots)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_entries_with_a_staging_region_do_not_depend_on_fragmentation(host_layout):
    for fragmented in (False, True):
        rng = np.random.default_rng(3)
        src = np.zeros(pool_bytes("mha"), np.uint8)
        dst = np.zeros_like(src)
        sl = make_layout(src, "mha", host_layout, 1)
        dl = make_layout(dst, "mha", host_layout, 1)
        src_slots = slots_of(pick_pages(rng, 1, 512, fragmented, 0), 1)
        dst_slots = slots_of(pick_pages(rng, 1, 512, fragmented, 0), 1)
        region = staging.staging_bytes(dl, 512)
        plan = staging.plan_pages(
            sl,
            src_slots,
            dl,
            dst_slots,
            chunk_bytes=64 << 10,
            dst_staging_addr=4096,
            dst_staging_length=region,
        )
        if fragmented:
            # 512 slots x 64 bytes x all buffers in 64 KiB chunks: one entry per chunk.
            assert plan.kind == "staged"
            assert plan.entries == len(plan.chunks) == -(-region // (64 << 10))
        else:  # one run per buffer: direct, the region unused
            assert plan.kind == "direct" and plan.entries == len(sl.buffers)


def test_gather_entries_follow_only_the_target_runs():
    rng = np.random.default_rng(4)
    src = np.zeros(pool_bytes("mha"), np.uint8)
    sl = make_layout(src, "mha", "layer_first", 1)
    dl = make_layout(np.zeros_like(src), "mha", "layer_first", 1)
    src_slots = slots_of(pick_pages(rng, 1, 600, True, 0), 1)
    direct = staging.plan_pages(sl, src_slots, dl, list(range(600)), chunk_bytes=0)
    assert direct.kind == "direct" and direct.entries > 500 * 2 * LAYERS  # ~one per page
    gather = staging.plan_pages(sl, src_slots, dl, list(range(600)), chunk_bytes=1 << 20)
    # One target run per buffer; a chunk never splits a buffer's run here (all fit).
    assert gather.kind == "gather" and gather.entries == 2 * LAYERS


def test_fresh_pools_stay_direct_with_one_entry_per_buffer():
    src = np.zeros(pool_bytes("mha"), np.uint8)
    sl = make_layout(src, "mha", "layer_first", 16)
    dl = make_layout(np.zeros_like(src), "mha", "layer_first", 16)
    plan = staging.plan_pages(
        sl, list(range(0, 512)), dl, list(range(256, 768)), chunk_bytes=1 << 20
    )
    assert plan.kind == "direct" and plan.entries == 2 * LAYERS
    assert plan.lengths.tolist() == [512 * ITEM] * (2 * LAYERS)


@pytest.mark.parametrize(
    ("src_slots", "dst_slots", "kwargs", "message"),
    [
        ([0, 1, 2, 3], [4, 5, 6], {}, "slot counts differ"),
        ([0, 1, 2], [4, 5, 6], {}, "not whole pages"),
        ([0, 1, 2, 4], [4, 5, 6, 7], {}, "position 0"),  # 4 breaks the first page
        ([4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], {}, "slot counts differ"),
        ([SLOTS, SLOTS + 1, SLOTS + 2, SLOTS + 3], [0, 1, 2, 3], {}, "inside the pool"),
        ([0, 1, 2, 3], [-4, -3, -2, -1], {}, "target"),
        (
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            {"dst_staging_addr": 4096, "dst_staging_length": 100},
            "too small",
        ),
    ],
)
def test_bad_arguments_are_value_errors(src_slots, dst_slots, kwargs, message):
    arr = np.zeros(pool_bytes("mha"), np.uint8)
    layout = make_layout(arr, "mha", "page_first", 4)
    with pytest.raises(ValueError, match=message):
        staging.plan_pages(layout, src_slots, layout, dst_slots, chunk_bytes=1 << 20, **kwargs)


def test_incompatible_layouts_are_refused_before_any_pass_over_indices():
    a = np.zeros(pool_bytes("mha"), np.uint8)
    first = make_layout(a, "mha", "layer_first", 4)
    other = make_layout(a, "mha", "page_first", 4)
    with pytest.raises(ValueError, match="buffer counts differ"):
        staging.check_page_args(first, [0] * 4, other, [0] * 4)


def test_list_indices_convert_in_slices():
    values = list(range(3 * 8192 + 5))
    out = staging.as_int64(values)
    assert out.dtype == torch.int64 and out.tolist() == values
    assert staging.as_int64([]).numel() == 0
    tensor = torch.arange(7, dtype=torch.int32)
    assert staging.as_int64(tensor).dtype == torch.int64


def test_scatter_refuses_a_short_staging_region():
    arr = np.zeros(pool_bytes("mha"), np.uint8)
    layout = make_layout(arr, "mha", "layer_first", 1)
    with pytest.raises(ValueError, match="staging holds"):
        staging.scatter_from_staging(layout, torch.zeros(10, dtype=torch.uint8), [0, 1])


def test_arena_grants_releases_merges_and_quarantines():
    arena = staging.StagingArena(64 * 4096)
    base, size = arena.region
    a = arena.grant(10_000, now=0.0)  # rounded up to 3 pages
    b = arena.grant(4096, now=0.0)
    assert a == (base, 3 * 4096) and b == (base + 3 * 4096, 4096)
    assert arena.grant(61 * 4096, now=0.0) is None  # 60 pages left
    arena.release(a)
    arena.release(b, not_before=5.0)  # a late write may still land until t=5
    assert arena.grant(61 * 4096, now=1.0) is None  # b is still quarantined
    assert arena.free_bytes == 63 * 4096
    whole = arena.grant(64 * 4096, now=5.0)  # b reclaimed and merged with its neighbours
    assert whole == (base, size) and arena.free_bytes == 0
    view = arena.tensor(base + 4096, 100)
    assert view.numel() == 100 and view.data_ptr() == base + 4096
    with pytest.raises(ValueError, match="not inside"):
        arena.tensor(base + size - 10, 100)


def test_no_chunk_room_means_direct_even_with_a_staging_region():
    arr = np.zeros(pool_bytes("mha"), np.uint8)
    layout = make_layout(arr, "mha", "layer_first", 4)
    rng = np.random.default_rng(9)
    src_slots = slots_of(rng.permutation(SLOTS // 4)[:50], 4)
    dst_slots = slots_of(rng.permutation(SLOTS // 4)[:50], 4)
    plan = staging.plan_pages(
        layout,
        src_slots,
        layout,
        dst_slots,
        chunk_bytes=0,  # gathering disabled by the config
        dst_staging_addr=4096,
        dst_staging_length=1 << 20,
    )
    assert plan.kind == "direct" and plan.entries > 50  # the target must not scatter


@pytest.mark.parametrize(("host_layout", "page_size"), [("layer_first", 1), ("page_first", 16)])
def test_scatter_in_ranges_equals_one_scatter(host_layout, page_size):
    # What the staging watcher does as markers arrive: ranges of any size (cutting pages
    # and buffers) copy each page once, and the returned boundary never skips a page.
    rng = np.random.default_rng(5)
    pages = rng.permutation(SLOTS // page_size)[: 96 // page_size]
    slots = slots_of(pages, page_size)
    whole = np.zeros(pool_bytes("mha"), np.uint8)
    parts = np.zeros_like(whole)
    whole_layout = make_layout(whole, "mha", host_layout, page_size)
    parts_layout = make_layout(parts, "mha", host_layout, page_size)
    region = rng.integers(0, 256, staging.staging_bytes(whole_layout, len(slots)), np.uint8)
    staging.scatter_from_staging(whole_layout, torch.from_numpy(region), slots)

    dst_pages = staging.page_ids(parts_layout, slots, "target")
    total = staging.staged_size(parts_layout, dst_pages)
    page_bytes = max(page_size * b.item_len for b in parts_layout.buffers)
    done, steps = 0, 0
    while done < total:  # steps below one page copy nothing and make no progress
        hi = min(total, done + int(rng.integers(1, 3 * page_bytes)))
        covered = staging.scatter_range(parts_layout, region.ctypes.data, dst_pages, done, hi)
        assert done <= covered <= hi
        done, steps = covered, steps + 1
        assert steps < 100_000
    assert steps > 10
    np.testing.assert_array_equal(parts, whole)
    assert whole.any()
