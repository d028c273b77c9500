"""Seconds-long self-check of the page-copy kernels on a GPU, no server: run this first.

    python3 -m pytest -m gpu -q -p no:cacheprovider test/gpu/test_gpu_page_copy.py

For every host layout the device path reads (layer_first, page_first, page_first_direct),
MHA and MLA shapes, pages 1/16/64: a host tensor of SGLang's `init_kv_buffer` dims,
page-locked the two ways SGLang does it (`pin_memory=True` and `cudaHostRegister` of a
plain tensor), is read in place by `page_copy.copy_pages_strided` (pinned host pointers
through unified addressing) into device buffers, and must equal the torch reference
(`tiers.copy_plan_torch`); the GPU -> GPU contiguous kernel is checked the same way.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from sglang_kv_migration.paths.device import page_copy, tiers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYER_NUM, PAGE_NUM = 3, 40


def _host_dims(attention: str, layout: str, page_size: int, width: int) -> tuple[int, ...]:
    """SGLang 0.5.12 `init_kv_buffer` dims, last dim = bytes of one row (uint8)."""
    planes = (2,) if attention == "mha" else ()
    size = PAGE_NUM * page_size
    return {
        "layer_first": (*planes, LAYER_NUM, size, width),
        "page_first": (*planes, size, LAYER_NUM, width),
        "page_first_direct": (*planes, PAGE_NUM, LAYER_NUM, page_size, width),
    }[layout]


def _page_locked(dims: tuple[int, ...], how: str) -> torch.Tensor:
    if how == "pin_memory":
        t = torch.empty(dims, dtype=torch.uint8, pin_memory=True)
    else:
        t = torch.empty(dims, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
    t.copy_(torch.randint(0, 256, dims, dtype=torch.uint8))
    return t


@pytest.mark.parametrize("how", ["pin_memory", "host_register"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize(("attention", "row_bytes"), [("mha", 256), ("mla", 1152)])
def test_host_pages_to_gpu_equal_the_torch_reference(attention, row_bytes, layout, page_size, how):
    host = _page_locked(_host_dims(attention, layout, page_size, row_bytes), how)
    assert host.is_pinned()
    offsets, geometry = tiers.host_buffer_geometry(
        attention, layout, LAYER_NUM, PAGE_NUM, page_size, row_bytes
    )
    source = tiers.TierBuffers.of_host(host, offsets, geometry, PAGE_NUM)
    n_buf = len(offsets)
    dev = [torch.zeros(PAGE_NUM * page_size, row_bytes, dtype=torch.uint8, device="cuda")]
    dev += [torch.zeros_like(dev[0]) for _ in range(n_buf - 1)]
    ref = [torch.zeros_like(d) for d in dev]
    src_pages = torch.tensor([5, 0, 39, 17, 2, 3], dtype=torch.int64)
    dst_pages = torch.tensor([1, 30, 2, 3, 38, 0], dtype=torch.int64)
    plan = tiers.TierPlan(
        page_size, {"host": tiers.TierPages(src_pages, dst_pages)}, (("host", 6),)
    )
    tiers.copy_plan_torch(plan, {"host": source}, tiers.TierBuffers.of_device(ref, page_size))

    ptrs = torch.tensor(source.addresses(), dtype=torch.int64, device="cuda")
    dst_ptrs = torch.tensor([d.data_ptr() for d in dev], dtype=torch.int64, device="cuda")
    into = page_copy.PageGeometry.contiguous(page_size, row_bytes)
    page_copy.copy_pages_strided(ptrs, dst_ptrs, src_pages.cuda(), dst_pages.cuda(), geometry, into)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(dev, ref, strict=True))
    assert any(bool(r.any()) for r in ref)  # the reference moved something
    if how == "host_register":
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def _table(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_pages_to_gpu_equal_the_torch_reference(page_size):
    rows, row_bytes = 40 * page_size, 512
    src = [
        torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(4)
    ]
    dst = [torch.zeros_like(s) for s in src]
    ref = [torch.zeros_like(s) for s in src]
    sp = torch.tensor([3, 9, 0, 39], dtype=torch.int64, device="cuda")
    dp = torch.tensor([0, 1, 20, 7], dtype=torch.int64, device="cuda")
    page_copy.copy_pages(_table(src), _table(dst), sp, dp, page_size * row_bytes)
    page_copy.copy_pages_torch(
        [s.view(-1) for s in src], [r.view(-1) for r in ref], sp, dp, page_size * row_bytes
    )
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))


def test_host_to_gpu_bandwidth_is_reported():
    # No timed assertion: prints GB/s for the lead's notes; checks the bytes of two buffers.
    page_size, row_bytes, layers, pages = 16, 2048, 32, 512  # Llama-3-8B rows, 8K tokens
    host = _page_locked((2, layers, pages * page_size, row_bytes), "pin_memory")
    offsets, geometry = tiers.host_buffer_geometry(
        "mha", "layer_first", layers, pages, page_size, row_bytes
    )
    source = tiers.TierBuffers.of_host(host, offsets, geometry, pages)
    dev = [torch.empty(pages * page_size, row_bytes, dtype=torch.uint8, device="cuda")]
    dev += [torch.empty_like(dev[0]) for _ in offsets[1:]]
    ptrs = torch.tensor(source.addresses(), dtype=torch.int64, device="cuda")
    dst_ptrs = torch.tensor([d.data_ptr() for d in dev], dtype=torch.int64, device="cuda")
    idx = torch.randperm(pages, device="cuda")
    into = page_copy.PageGeometry.contiguous(page_size, row_bytes)
    page_copy.copy_pages_strided(ptrs, dst_ptrs, idx, idx, geometry, into)  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    page_copy.copy_pages_strided(ptrs, dst_ptrs, idx, idx, geometry, into)
    end.record()
    torch.cuda.synchronize()
    nbytes = len(offsets) * pages * page_size * row_bytes
    gbps = nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    print(f"\nhost->GPU page copy: {nbytes / 1e9:.2f} GB at {gbps:.1f} GB/s")
    views = source.views()
    for b in (0, len(offsets) - 1):
        assert torch.equal(dev[b].cpu().view(pages, page_size, row_bytes), views[b])


def test_page_lists_reuse_kept_buffers_only_once_the_last_launch_is_done():
    import numpy as np
    from sglang_kv_migration.paths.device.page_lists import PageListUpload

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device=device)
    upload = PageListUpload(device)
    values = np.arange(10, dtype=np.int64)
    with torch.cuda.stream(stream):
        first = upload.upload(values)
        done = torch.cuda.Event()
        done.record(stream)
    upload.used_until(done)
    done.synchronize()
    assert first.tolist() == list(range(10)) and upload.kept_uses == 1
    # A launch still running (the stream held up by a long kernel on it): a fresh pair.
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        second = upload.upload(values + 100)
        busy = torch.cuda.Event()
        busy.record(stream)
    upload.used_until(busy)
    with torch.cuda.stream(stream):
        third = upload.upload(values + 200)
    stream.synchronize()
    assert second.tolist() == [v + 100 for v in range(10)]
    assert third.tolist() == [v + 200 for v in range(10)]
    assert upload.kept_uses == 2 and third.data_ptr() != first.data_ptr()
    # Done: the kept pair again, grown for a longer list.
    upload.used_until(None)
    with torch.cuda.stream(stream):
        longer = upload.upload(np.arange(20_000, dtype=np.int64))
    stream.synchronize()
    assert upload.kept_uses == 3 and longer.tolist() == list(range(20_000))


def test_segments_on_host_copies_the_device_slots_once_in_order():
    from sglang_kv_migration.sglang_adapter import DEVICE_TIER, HOST_TIER, Segment

    device_a = torch.arange(0, 5, device="cuda")
    host = torch.arange(100, 103)
    device_b = torch.arange(50, 58, device="cuda").view(2, 4)
    on_host = tiers.segments_on_host(
        [Segment(DEVICE_TIER, device_a), Segment(HOST_TIER, host), Segment(DEVICE_TIER, device_b)]
    )
    assert [s.tier for s in on_host] == [DEVICE_TIER, HOST_TIER, DEVICE_TIER]
    assert all(s.slots.device.type == "cpu" for s in on_host)
    assert on_host[0].slots.tolist() == list(range(5))
    assert on_host[1].slots is host
    assert on_host[2].slots.tolist() == list(range(50, 58))
