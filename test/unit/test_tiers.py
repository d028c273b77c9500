"""Same host, any tier, on CPU: which pages come from which tier, and the copy's addressing.

`tiers.plan_tiers` is checked with literal slots; `tiers.host_buffer_geometry` with
literal shapes. Then, against a real HiRadixCache with real host pools of every layout
the device path reads (layer_first, page_first, page_first_direct; MHA and MLA; pages 1,
16, 64), prefixes held (a) on device, (b) on host only (written back by SGLang's own
write-through, then evicted from device), (c) half and half: the source's tiered match
and plan, run with the torch reference copy (`tiers.copy_plan_torch`, the same
addressing as the Triton kernel's strides), must put exactly the original KV bytes into
the target slots, and the source's tiered verify digest must equal the digest the target
computes of what landed. The CUDA kernel itself runs only in test/gpu.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.base import KVPoll, NothingWritten, SendRange
from sglang_kv_migration.paths.device import tiers
from sglang_kv_migration.paths.device.page_copy import PageGeometry
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.paths.device.source_prefix import TierPin, prepare_tiered_send
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
PAGES = [1, 16, 64]
CASES = [(a, lay, p) for a in ("mha", "mla") for lay in LAYOUTS for p in PAGES]
CASE_IDS = [f"{a}-{lay}-page{p}" for a, lay, p in CASES]


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


# --------------------------------------------------------------------------- pure planning


def test_plan_tiers_splits_by_tier_in_prefix_order():
    ps = 2
    segments = [
        tiers.Segment("device", _t([10, 11, 4, 5])),  # device pages 5, 2
        tiers.Segment("host", _t([8, 9])),  # host page 4
        tiers.Segment("host", _t([0, 1, 6, 7])),  # host pages 0, 3
    ]
    target = _t([20, 21, 30, 31, 2, 3, 40, 41])  # target pages 10, 15, 1, 20
    plan = tiers.plan_tiers(segments, 2, 10, target, ps)
    assert plan.tiers["device"].src_pages.tolist() == [2]
    assert plan.tiers["device"].dst_pages.tolist() == [10]
    assert plan.tiers["host"].src_pages.tolist() == [4, 0, 3]
    assert plan.tiers["host"].dst_pages.tolist() == [15, 1, 20]
    assert plan.runs == (("device", 1), ("host", 3))
    assert (plan.tokens("device"), plan.tokens("host"), plan.num_pages) == (2, 6, 4)
    pieces = tiers.prefix_order_pages(plan)
    assert [(t, p.tolist()) for t, p in pieces] == [("device", [2]), ("host", [4, 0, 3])]


def test_an_owner_sharded_rank_keeps_its_own_pages_of_a_plan_in_prefix_order():
    ps = 2
    segments = [
        tiers.Segment("device", _t([10, 11, 4, 5])),  # device pages 5, 2
        tiers.Segment("host", _t([8, 9, 0, 1, 6, 7])),  # host pages 4, 0, 3
    ]
    plan = tiers.plan_tiers(segments, 2, 10, _t([20, 21, 30, 31, 2, 3, 40, 41]), ps)
    # The range's pages in prefix order: device 2 -> 10, host 4 -> 15, 0 -> 1, 3 -> 20.
    mine = tiers.owned_part(plan, [0, 2])
    assert mine.runs == (("device", 1), ("host", 1))
    assert mine.tiers["device"].src_pages.tolist() == [2]
    assert mine.tiers["host"].src_pages.tolist() == [0]
    assert mine.tiers["host"].dst_pages.tolist() == [1]
    theirs = tiers.owned_part(plan, [1, 3])
    assert set(theirs.tiers) == {"host"} and theirs.runs == (("host", 2),)
    assert theirs.tiers["host"].dst_pages.tolist() == [15, 20]
    assert mine.num_pages + theirs.num_pages == plan.num_pages
    assert tiers.owned_part(plan, []).num_pages == 0


def test_plan_tiers_device_only_has_no_host_part():
    plan = tiers.plan_tiers([tiers.Segment("device", _t([4, 5, 6, 7]))], 0, 4, _t([0, 1, 2, 3]), 2)
    assert set(plan.tiers) == {"device"} and plan.tokens("host") == 0
    assert plan.tiers["device"].src_pages.tolist() == [2, 3]


@pytest.mark.parametrize(
    ("segments", "start", "end", "target", "message"),
    [
        ([("device", [0, 1])], 0, 4, [0, 1, 2, 3], "cover 2 tokens, 4 needed"),
        ([("device", [0, 1, 2, 3])], 1, 3, [0, 1], "not a non-empty range"),
        ([("device", [0, 1, 2, 3])], 0, 4, [0, 1, 2], "3 target slots"),
        ([("device", [0, 1, 2, 3])], 0, 4, [0, 1, 3, 2], "not whole, aligned pages"),
        ([("device", [1, 2, 3, 4])], 0, 4, [0, 1, 2, 3], "not whole, aligned pages"),
        ([("disk", [0, 1, 2, 3])], 0, 4, [0, 1, 2, 3], "unknown tier"),
    ],
)
def test_plan_tiers_refuses_bad_input(segments, start, end, target, message):
    segs = [tiers.Segment(t, _t(s)) for t, s in segments]
    with pytest.raises(ValueError, match=message):
        tiers.plan_tiers(segs, start, end, _t(target), 2)


@pytest.mark.parametrize(
    ("attention", "layout", "offsets", "geometry"),
    [
        # L=3 layers, 4 pages of 2 slots (S=8), rows of 8 bytes.
        ("mha", "layer_first", [0, 64, 128, 192, 256, 320], PageGeometry(2, 8, 16, 8)),
        ("mha", "page_first", [0, 8, 16, 192, 200, 208], PageGeometry(2, 8, 48, 24)),
        ("mha", "page_first_direct", [0, 16, 32, 192, 208, 224], PageGeometry(2, 8, 48, 8)),
        ("mla", "page_first", [0, 8, 16], PageGeometry(2, 8, 48, 24)),
    ],
)
def test_host_buffer_geometry_literal(attention, layout, offsets, geometry):
    assert tiers.host_buffer_geometry(attention, layout, 3, 4, 2, 8) == (offsets, geometry)


def test_host_buffer_geometry_refuses_page_head():
    with pytest.raises(ValueError, match="page_head"):
        tiers.host_buffer_geometry("mha", "page_head", 3, 4, 2, 8)


# --------------------------------------------------------------------------- real HiRadixCache


def _hold_three_ways(h, ps: int) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Three prefixes of 4 pages each: (a) on device, (b) on host only, (c) the first half
    on device and the rest on host only. Returns each one's tokens and original KV."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    n = 4 * ps
    held: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    host = _tokens(n, 1000)
    held["host"] = (host, h.read_device_kv(h.insert_random(host, seed=1)))
    h.evict_device_all()
    mixed = _tokens(n, 5000)
    h.insert_random(mixed[: n // 2], seed=2)
    held["mixed"] = (mixed, h.read_device_kv(h.insert_random(mixed, seed=3)))
    h.write_back_all()
    # The only device leaf is the mixed prefix's second half: evict exactly that.
    h.cache.evict(EvictParams(num_tokens=n // 2))
    device = _tokens(n, 9000)
    held["device"] = (device, h.read_device_kv(h.insert_random(device, seed=4)))
    h.drain_writes()
    return held


def _send(tokens: list[int], start: int, target: torch.Tensor, verify_: bool = False) -> SendRange:
    return SendRange(
        input_ids=tokens,
        extra_key=None,
        start=start,
        end=len(tokens),
        target=None,  # type: ignore[arg-type] - not read before the copy
        target_slots=target,
        migration_id="m",
        verify=verify_,
    )


def _kv_slice(h, kv: list[torch.Tensor], start: int) -> list[torch.Tensor]:
    return [t[:, start:] if h.cfg.attention == "mha" else t[start:] for t in kv]


@pytest.mark.parametrize(("attention", "layout", "page_size"), CASES, ids=CASE_IDS)
def test_any_tier_copy_moves_the_exact_bytes(harness_factory, attention, layout, page_size):
    h = harness_factory(attention=attention, host_layout=layout, page_size=page_size, layer_num=2)
    path = DevicePath(h.cache)
    assert path.advertise()["tiers"] == ["device", "host"], path.host_tier_refusal
    held = _hold_three_ways(h, page_size)
    n = 4 * page_size
    expect_host = {"device": 0, "host": n, "mixed": n // 2}
    buffers = adapter.device_kv_buffers(h.cache)
    for case, (tokens, kv) in held.items():
        m = h.match(tokens)
        assert len(m.device_indices) + m.host_hit_length == n
        assert m.host_hit_length == expect_host[case], case
        start = page_size if case == "mixed" else 0  # the target already has page 0
        target = h.allocator.alloc(n - start)
        tiered = prepare_tiered_send(h.cache, _send(tokens, start, target), page_size)
        assert tiered.plan.tokens("host") == expect_host[case]
        assert tiered.plan.tokens("device") == n - start - expect_host[case]
        source_digest = verify.tier_pages_digest(path.copier.digest_pieces(tiered.plan))
        destination = tiers.TierBuffers.of_device(buffers, page_size)
        tiers.copy_plan_torch(tiered.plan, path.copier.source_tiers(), destination)
        landed = h.read_device_kv(target)
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(landed, _kv_slice(h, kv, start), strict=True)
        ), case
        # The target's verify digest of what landed equals the source's tiered digest.
        assert verify.device_rows_digest(buffers, target) == source_digest, case
        h.allocator.free(target)


def test_an_owner_sharded_rank_copies_only_its_own_pages(harness_factory):
    """The mixed prefix (device then host pages), run from its second page: the rank
    owning pages 0 and 2 of the run copies those and leaves the others' slots alone; its
    digest and the target's digest of its own slots agree."""
    page_size = 16
    h = harness_factory(attention="mha", host_layout="layer_first", page_size=page_size)
    path = DevicePath(h.cache)
    tokens, kv = _hold_three_ways(h, page_size)["mixed"]
    start, pages = page_size, 3
    target = h.allocator.alloc(pages * page_size)
    buffers = adapter.device_kv_buffers(h.cache)
    for b in buffers:
        b[target] = torch.zeros_like(b[target])
    send = dataclasses.replace(_send(tokens, start, target), owner_pattern=(0, 1, 0))
    tiered = prepare_tiered_send(h.cache, send, page_size)
    owned = send.owned_page_positions(tiered.plan.num_pages)
    assert owned == [0, 2]
    plan = tiers.owned_part(tiered.plan, owned)
    assert (plan.tokens("device"), plan.tokens("host")) == (page_size, page_size)
    source_digest = verify.tier_pages_digest(path.copier.digest_pieces(plan))
    tiers.copy_plan_torch(
        plan, path.copier.source_tiers(), tiers.TierBuffers.of_device(buffers, page_size)
    )
    landed, original = h.read_device_kv(target), _kv_slice(h, kv, start)
    for page in range(pages):
        rows = slice(page * page_size, (page + 1) * page_size)
        for a, b in zip(landed, original, strict=True):
            got, want = a[:, rows].view(torch.uint8), b[:, rows].view(torch.uint8)
            assert torch.equal(got, want) == (page in owned), page
            if page not in owned:
                assert not got.any()
    own_slots = torch.cat([target[p * page_size : (p + 1) * page_size] for p in owned])
    assert verify.device_rows_digest(buffers, own_slots) == source_digest


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_wrong_host_geometry_is_caught(harness_factory, layout):
    # Negative control: reading a page_first(_direct) pool as layer_first garbles bytes.
    h = harness_factory(host_layout=layout, page_size=16, layer_num=2)
    path = DevicePath(h.cache)
    held = _hold_three_ways(h, 16)
    tokens, kv = held["host"]
    target = h.allocator.alloc(len(tokens))
    tiered = prepare_tiered_send(h.cache, _send(tokens, 0, target), 16)
    good = path.copier.source_tiers()["host"]
    offsets, geometry = tiers.host_buffer_geometry(
        "mha", "layer_first", 2, good.num_pages, 16, good.geometry.row_bytes
    )
    wrong = tiers.TierBuffers(good.flats, tuple(offsets), geometry, good.num_pages)
    destination = tiers.TierBuffers.of_device(adapter.device_kv_buffers(h.cache), 16)
    tiers.copy_plan_torch(tiered.plan, {"host": wrong}, destination)
    landed = h.read_device_kv(target)
    assert not all(torch.equal(a, b) for a, b in zip(landed, kv, strict=True))


def test_tier_pin_holds_device_and_host_nodes_until_released(harness_factory):
    h = harness_factory(page_size=16, layer_num=2)
    held = _hold_three_ways(h, 16)
    tokens, _ = held["mixed"]
    before = h.snapshot()
    target = h.allocator.alloc(len(tokens))
    tiered = prepare_tiered_send(h.cache, _send(tokens, 0, target), 16)
    pin = TierPin.take(h.cache, tiered.prefix)
    host_nodes = tiered.prefix.host_nodes
    assert host_nodes and all(n.host_ref_counter > 0 and n.evicted for n in host_nodes)
    assert tiered.prefix.last_device_node.lock_ref > 0
    # Host eviction cannot take the pinned host pages; the evictable device count
    # lost exactly the locked device half (the evicted half is not counted twice).
    h.cache.evict_host(h.host_pool.size)
    assert h.match(tokens).host_hit_length == len(tokens) // 2
    assert h.cache.evictable_size() <= before.evictable - len(tokens) // 2
    pin.release()
    pin.release()  # idempotent
    after = h.snapshot()
    assert (after.total_lock_ref, after.total_host_ref) == (0, 0)
    h.allocator.free(target)


def test_a_send_prepared_while_the_target_allocates_plans_and_pins_as_a_fresh_one(
    harness_factory,
):
    """Feature "source_allocate": `DevicePath.prepare_send` matches and pins the whole
    request before the target says from where to send; a send of any prefix of those ids
    plans the same pages as a fresh match, and the pin lasts until released once."""
    h = harness_factory(page_size=16, layer_num=2)
    tokens, _ = _hold_three_ways(h, 16)["mixed"]
    path = DevicePath(h.cache)
    prepared = path.prepare_send(tokens, None)
    assert prepared.prefix.length == len(tokens)
    assert prepared.prefix.last_device_node.lock_ref > 0
    assert all(n.host_ref_counter > 0 for n in prepared.prefix.host_nodes)
    target = h.allocator.alloc(len(tokens) - 16)
    send = _send(tokens, 16, target)  # the target held the first page
    fresh = prepare_tiered_send(h.cache, send, 16)
    reused = prepare_tiered_send(h.cache, send, 16, prepared.prefix)
    for tier in ("device", "host"):
        assert torch.equal(fresh.plan.tiers[tier].src_pages, reused.plan.tiers[tier].src_pages)
        assert torch.equal(fresh.plan.tiers[tier].dst_pages, reused.plan.tiers[tier].dst_pages)
    assert prepared.serves(send)
    assert prepared.serves(dataclasses.replace(send, end=32, target_slots=target[:16]))
    assert not prepared.serves(dataclasses.replace(send, input_ids=list(tokens)))  # other ids
    assert not prepared.serves(dataclasses.replace(send, extra_key="other"))
    pin = prepared.take_pin()
    assert pin is not None and not prepared.serves(send)  # taken: the caller's now
    prepared.release()  # nothing left to release here
    assert h.snapshot().total_lock_ref > 0
    pin.release()
    after = h.snapshot()
    assert (after.total_lock_ref, after.total_host_ref) == (0, 0)
    # Released without being taken: unpinned once, however often it is called.
    again = path.prepare_send(tokens, None)
    again.release()
    again.release()
    after = h.snapshot()
    assert (after.total_lock_ref, after.total_host_ref) == (0, 0)
    h.allocator.free(target)


def test_prepare_refuses_a_range_the_source_no_longer_holds(harness_factory):
    h = harness_factory(page_size=16, layer_num=2)
    tokens, _ = _hold_three_ways(h, 16)["device"]
    more = tokens + _tokens(16, 20000)
    target = h.allocator.alloc(len(more))
    with pytest.raises(MigrationError) as info:
        prepare_tiered_send(h.cache, _send(more, 0, target), 16)
    assert info.value.kind is ErrorKind.CONFLICT
    with pytest.raises(MigrationError) as info:
        prepare_tiered_send(h.cache, _send(tokens, 0, target[: len(tokens)].flip(0)), 16)
    assert info.value.kind is ErrorKind.BAD_REQUEST
    h.allocator.free(target)


def test_a_partial_send_is_cut_where_the_held_prefix_ends(harness_factory):
    """Feature "partial_transfer": the source sends the whole pages it holds of the
    range, into the first target slots; holding nothing past `start` sends nothing."""
    h = harness_factory(page_size=16, layer_num=2)
    tokens, kv = _hold_three_ways(h, 16)["mixed"]  # 4 pages: 2 on device, 2 on host only
    more = tokens + _tokens(32, 20000)  # 2 pages the source never held
    target = h.allocator.alloc(len(more) - 16)
    send = dataclasses.replace(_send(more, 16, target), partial_ok=True)
    tiered = prepare_tiered_send(h.cache, send, 16)
    assert (tiered.send.start, tiered.send.end) == (16, len(tokens))
    assert torch.equal(tiered.send.target_slots, target[: len(tokens) - 16])
    assert tiered.plan.tokens("device") == 16 and tiered.plan.tokens("host") == 32
    path = DevicePath(h.cache)
    destination = tiers.TierBuffers.of_device(adapter.device_kv_buffers(h.cache), 16)
    tiers.copy_plan_torch(tiered.plan, path.copier.source_tiers(), destination)
    landed = h.read_device_kv(target[: len(tokens) - 16])
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(landed, _kv_slice(h, kv, 16), strict=True)
    )
    # Nothing held past `start`: nothing to send (the job reports 0 tokens written).
    beyond = dataclasses.replace(_send(more, len(tokens), target[:32]), partial_ok=True)
    assert prepare_tiered_send(h.cache, beyond, 16) is None
    target_rank = TransferRequestKVCacheTarget(
        tp=0, pp=0, path="device", device_kv=path.advertise()
    )
    job = path.start_send(dataclasses.replace(beyond, target=target_rank))
    assert isinstance(job, NothingWritten) and job.end == beyond.start
    assert job.poll() is KVPoll.SUCCESS and not job.started_writing
    # Without partial_ok the same send is refused, as before.
    with pytest.raises(MigrationError) as info:
        prepare_tiered_send(h.cache, dataclasses.replace(send, partial_ok=False), 16)
    assert info.value.kind is ErrorKind.CONFLICT and "holds only 64 of 96" in info.value.message
    h.allocator.free(target)


def test_page_head_host_pool_offers_the_device_tier_only(harness_factory):
    h = harness_factory(host_layout="page_head", io_backend="kernel", page_size=16, layer_num=2)
    path = DevicePath(h.cache)
    assert path.advertise()["tiers"] == ["device"]
    assert "page_head" in path.host_tier_refusal
    assert set(path.copier.source_tiers()) == {"device"}
