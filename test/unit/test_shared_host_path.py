"""The shared-host path on real HiRadixCaches (CPU): a source writes the granted host
slots of a target's host pool, which the target keeps in a memory file
(`sglang_adapter.shared_host_pool`), mapped by the source through ``/proc/<pid>/fd``
(`paths/shared_host/peer_pools.py`); the target commits host-only nodes and loads them
back through HiCache. Source and target are two caches of this process here (the
two-process and HTTP tests: `test/integration/test_shared_host_landing.py`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import (
    ROUTE_GPU_TO_SHARED_HOST,
    ROUTE_HOST_TO_SHARED_HOST,
    KVPoll,
    SendRange,
)
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.paths.shared_host import peer_pools
from sglang_kv_migration.paths.shared_host.path import (
    SharedHostPath,
    shared_host_unavailable_reason,
)
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.targets import SharedHostTarget
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
CASES = [(a, lay, p) for a in ("mha", "mla") for lay in LAYOUTS for p in (1, 16)]
CASE_IDS = [f"{a}-{lay}-page{p}" for a, lay, p in CASES]


def _tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _pair(harness_factory, **cfg):
    fields = {"layer_num": 2, "shared_host_pool": True, "load_back_threshold": 1, **cfg}
    src, dst = harness_factory(**fields), harness_factory(**fields)
    return src, dst, SharedHostPath(src.cache), SharedHostPath(dst.cache)


def _hold_three_ways(h, ps: int) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Prefixes of 4 pages: on the GPU, on the host tier only, and half and half."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    n = 4 * ps
    held = {}
    host = _tokens(n, 1000)
    held["host"] = (host, h.read_device_kv(h.insert_random(host, seed=1)))
    h.evict_device_all()
    mixed = _tokens(n, 5000)
    h.insert_random(mixed[: n // 2], seed=2)
    held["mixed"] = (mixed, h.read_device_kv(h.insert_random(mixed, seed=3)))
    h.write_back_all()
    h.cache.evict(EvictParams(num_tokens=n // 2))  # the mixed prefix's second half
    device = _tokens(n, 9000)
    held["device"] = (device, h.read_device_kv(h.insert_random(device, seed=4)))
    h.drain_writes()
    return held


def _entry(target: SharedHostPath, **changes) -> TransferRequestKVCacheTarget:
    described = {**target.advertise(), **changes}
    return TransferRequestKVCacheTarget(tp=0, pp=0, path="shared_host", shared_host_kv=described)


def _send(tokens, slots, entry, mid: str = "m", verify_: bool = False) -> SendRange:
    return SendRange(tokens, None, 0, len(tokens), entry, slots, mid, verify=verify_)


def _finished(job) -> KVPoll:
    """Poll until the job is over: the first send to a target maps its pool on a helper
    thread (bounded wait)."""
    deadline = time.monotonic() + 30
    while (state := job.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _pool_bytes(h) -> bytes:
    return h.host_pool.kv_buffer.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("attention", "layout", "page_size"), CASES, ids=CASE_IDS)
def test_each_tier_lands_in_the_targets_host_pool_byte_for_byte(
    harness_factory, attention, layout, page_size
):
    src, dst, source, target = _pair(
        harness_factory, attention=attention, host_layout=layout, page_size=page_size
    )
    pending = PendingMigrations(dst.cache, timeout_s=60)
    for i, (where, (tokens, kv)) in enumerate(_hold_three_ways(src, page_size).items()):
        locks = src.snapshot().total_lock_ref
        alloc = pending.allocate(f"m{i}", tokens, None, path=target)
        assert alloc.extra_length == len(tokens)
        job = source.start_send(_send(tokens, alloc.slots, _entry(target), f"m{i}", True))
        assert _finished(job) is KVPoll.SUCCESS, job.error
        # Its digest is what the target reads in the slots (the opt-in verify's check).
        assert job.stats.digest == target.content_digest(alloc.slots)
        job.release()
        assert src.snapshot().total_lock_ref == locks  # unpinned
        assert pending.commit(f"m{i}") == len(tokens)
        device_len, host_len = _held(dst, tokens)
        assert (device_len, host_len) == (0, len(tokens)), where  # host-only nodes
        assert _same(dst.read_device_kv(dst.load_back(tokens)), kv), where


def _held(h, tokens: list[int]) -> tuple[int, int]:
    m = h.match(tokens)
    return len(m.device_indices), int(m.host_hit_length)


def test_a_full_gpu_pool_lands_the_whole_prefix_in_the_host_tier(harness_factory):
    """The target's GPU pool held whole by its own work (nothing evictable): the device
    path refuses, the shared-host landing does not need it; the target serves the prefix
    as a host hit and loads it back byte for byte once it has room."""
    src, dst, source, target = _pair(harness_factory, page_size=16, device_tokens=1024)
    tokens = _tokens(512, 40_000)
    kv = src.read_device_kv(src.insert_random(tokens, seed=9))
    held = dst.allocator.alloc(dst.allocator.available_size())  # running requests' slots
    pending = PendingMigrations(dst.cache, timeout_s=60)
    with pytest.raises(MigrationError) as refused:
        pending.allocate("dev", tokens, None, path=DevicePath(dst.cache))
    assert refused.value.kind is ErrorKind.UNAVAILABLE
    assert "device KV pool is full" in refused.value.message
    alloc = pending.allocate("shm", tokens, None, path=target)
    job = source.start_send(_send(tokens, alloc.slots, _entry(target)))
    assert _finished(job) is KVPoll.SUCCESS and job.stats.bytes == len(tokens) * 2 * 2 * 2 * 16 * 2
    job.release()
    pending.commit("shm")
    assert _held(dst, tokens) == (0, len(tokens))
    dst.allocator.free(held)
    assert _same(dst.read_device_kv(dst.load_back(tokens)), kv)
    assert _held(dst, tokens) == (len(tokens), 0)  # loaded back: a device hit now


def test_each_tier_reports_its_route(harness_factory):
    src, dst, source, target = _pair(harness_factory, page_size=16)
    held = _hold_three_ways(src, 16)
    pending = PendingMigrations(dst.cache, timeout_s=60)
    routes = []
    for i, (tokens, _kv) in enumerate([held["device"], held["mixed"], held["host"]]):
        alloc = pending.allocate(f"r{i}", tokens, None, path=target)
        job = source.start_send(_send(tokens, alloc.slots, _entry(target)))
        assert _finished(job) is KVPoll.SUCCESS
        routes.append({r: n for r, (n, _s) in job.stats.routes.items()})
        job.release()
        pending.abort(f"r{i}", settled=True)
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 heads of 16 bf16
    # A tier's first launch is no rate sample (`cold_tiers`): device first, then mixed
    # (its host half is the host tier's first), then host only.
    assert routes[0] == {}
    assert routes[1] == {ROUTE_GPU_TO_SHARED_HOST: 32 * per_token}
    assert routes[2] == {ROUTE_HOST_TO_SHARED_HOST: 64 * per_token}


def test_a_host_pool_outside_shared_memory_is_not_offered(harness_factory):
    plain = harness_factory(layer_num=2)
    assert "not in a shared memory file" in shared_host_unavailable_reason(plain.cache)
    shared = harness_factory(layer_num=2, shared_host_pool=True)
    assert shared_host_unavailable_reason(shared.cache) is None
    region = sglang_adapter.shared_host_region(shared.cache)
    assert region.pid == os.getpid() and region.nbytes == shared.host_pool.kv_buffer.nbytes
    link = os.readlink(f"/proc/self/fd/{region.fd}")
    assert link.startswith(sglang_adapter.SHARED_POOL_MEMFD_LINK)
    page_head = harness_factory(
        layer_num=2, shared_host_pool=True, host_layout="page_head", io_backend="kernel"
    )
    assert "page_head" in shared_host_unavailable_reason(page_head.cache)


# --------------------------------------------------------------------------- hostile input


def _refusal(source: SharedHostPath, send: SendRange) -> MigrationError:
    """The error a send ends with: raised by `start_send`, or reported by its job (the
    target's pool is mapped on a helper thread)."""
    try:
        job = source.start_send(send)
    except MigrationError as e:
        return e
    state = _finished(job)
    job.release()
    assert state is KVPoll.FAILED, "a hostile destination was written"
    return job.error


def _other_file(nbytes: int) -> tuple[int, int]:
    """A regular file of `nbytes`, open here: (fd, inode)."""
    fd, path = tempfile.mkstemp(prefix="kvm-not-a-pool-")
    os.unlink(path)
    os.ftruncate(fd, nbytes)
    return fd, os.fstat(fd).st_ino


def test_a_destination_that_is_not_the_targets_pool_is_refused_and_nothing_written(
    harness_factory,
):
    src, dst, source, target = _pair(harness_factory, page_size=16)
    tokens = _tokens(64, 70_000)
    src.insert_random(tokens, seed=5)
    pending = PendingMigrations(dst.cache, timeout_s=60)
    alloc = pending.allocate("h", tokens, None, path=target)
    real = target.advertise()
    other_fd, other_inode = _other_file(real["nbytes"])
    locks, before, own_before = src.snapshot().total_lock_ref, _pool_bytes(dst), _pool_bytes(src)
    cases = {
        "inode": ({"inode": real["inode"] + 1}, ErrorKind.CONFLICT, "is not the target"),
        "size": ({"nbytes": real["nbytes"] + 64}, ErrorKind.BAD_REQUEST, "bytes for a pool of"),
        "regular file": ({"fd": other_fd, "inode": other_inode}, ErrorKind.CONFLICT, "is not"),
        "no such fd": ({"fd": 1_000_000}, ErrorKind.CONFLICT, "cannot open"),
        "other host": ({"host_identity": "elsewhere"}, ErrorKind.CONFLICT, "another host"),
        "layout": ({"layer_num": 3}, ErrorKind.CONFLICT, "host pool layouts differ"),
        "not an int": ({"pid": "1"}, ErrorKind.BAD_REQUEST, "non-negative integer"),
        "the source's own pool": (
            {k: source.advertise()[k] for k in ("pid", "fd", "inode")},
            ErrorKind.CONFLICT,
            "this server's own host pool",
        ),
    }
    try:
        for name, (changes, kind, words) in cases.items():
            error = _refusal(source, _send(tokens, alloc.slots, _entry(target, **changes)))
            assert error.kind is kind and words in error.message, (name, error)
        missing = dataclasses.replace(_entry(target), shared_host_kv=None)
        error = _refusal(source, _send(tokens, alloc.slots, missing))
        assert error.kind is ErrorKind.BAD_REQUEST and "no shared_host_kv" in error.message
    finally:
        os.close(other_fd)
    # Slots outside the target's pool: refused at launch, before the copy.
    beyond = torch.arange(len(tokens), dtype=torch.int64) + real["page_num"] * 16
    error = _refusal(source, _send(tokens, beyond, _entry(target)))
    assert error.kind is ErrorKind.BAD_REQUEST and "outside its buffers" in error.message
    assert _pool_bytes(dst) == before  # nothing landed anywhere in the target's pool
    assert _pool_bytes(src) == own_before  # nor in the source's
    assert src.snapshot().total_lock_ref == locks  # every pin released


def test_the_mapping_of_a_target_that_is_gone_is_dropped(harness_factory):
    """A restarted target's pool would stay allocated (and pinned) while a source maps
    it: the source drops mappings whose file is no longer where it was published."""
    src = harness_factory(layer_num=2, shared_host_pool=True)
    source = SharedHostPath(src.cache)
    described = SharedHostTarget.from_wire(source.advertise())
    nbytes = described.nbytes
    fd, _mapping = sglang_adapter.shared_host_pool.open_shared_memory(
        sglang_adapter.shared_host_pool.MEMFD_NAME, nbytes
    )
    peer = dataclasses.replace(described, fd=fd, inode=os.fstat(fd).st_ino, instance="gone")
    pools = peer_pools.PeerPools(torch.device("cpu"))
    pool = pools.open_async(peer).result(timeout=30)
    assert pools.holds(peer) and pool.resolve().page_limit == peer.page_num
    waited = []
    assert pools.drop_gone(lambda: waited.append(True)) == 0 and not waited  # still there
    os.close(fd)  # the target is gone: its descriptor with it
    del _mapping
    assert pools.drop_gone(lambda: waited.append(True)) == 1 and waited == [True]
    assert not pools.holds(peer)
    with pytest.raises(MigrationError, match="was dropped"):
        pool.resolve()
    pools.close(lambda: None)


class _CudaRecorder:
    """`torch.cuda.cudart()` of a machine whose CUDA calls succeed (here: recorded)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def test_a_peer_mapping_registered_before_a_failure_is_unregistered(harness_factory, monkeypatch):
    """With a GPU the source registers the target's pool once mapped; a failure after that
    (the pointer table on the GPU) unregisters it before the mapping goes, or CUDA would
    refuse a later mapping at the same address as registered already."""
    import contextlib

    dst = harness_factory(layer_num=2, shared_host_pool=True)
    peer = SharedHostTarget.from_wire(SharedHostPath(dst.cache).advertise())
    cuda = _CudaRecorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    def no_memory(addresses, device):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(peer_pools, "pointer_table", no_memory)
    gpu = type("Device", (), {"type": "cuda"})()
    with pytest.raises(RuntimeError, match="out of memory"):
        peer_pools.map_pool(peer, gpu)
    (_, ptr, nbytes, flags), unregistered = cuda.calls
    assert (nbytes, flags) == (peer.nbytes, peer_pools.CUDA_HOST_REGISTER_PORTABLE)
    assert unregistered == ("unregister", ptr)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_sglang_pins_the_pool_in_shared_memory_as_it_pins_its_own(
    harness_factory, monkeypatch, attention
):
    """SGLang registers a host pool's buffer with CUDA right after its allocator made it
    (`alloc_with_host_register`): the pool in a memory file is registered by the same
    one call, of the same flags and size, at the file's own mapping (so HiCache's
    write-back and load-back read and write it as they do their own), and nothing
    registers it again."""
    import functools
    import os as os_

    import sglang.srt.mem_cache.memory_pool_host as mph
    from sglang_kv_migration.server.scheduler import hooks

    device_pool = harness_factory(attention=attention, layer_num=2).device_pool
    host_class = {"mha": mph.MHATokenToKVPoolHost, "mla": mph.MLATokenToKVPoolHost}[attention]
    cuda = _CudaRecorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cuda)
    original = mph.get_allocator_from_storage
    monkeypatch.setattr(
        mph,
        "get_allocator_from_storage",
        functools.partial(hooks.around_get_allocator_from_storage, original),
    )

    def build():
        return host_class(device_pool, 2.0, 0, 16, "layer_first", pin_memory=True, device="cpu")

    own = build()
    with sglang_adapter.host_pool_in_shared_memory():
        shared = build()
    region = shared.allocator.region
    nbytes = shared.kv_buffer.numel() * shared.kv_buffer.element_size()
    assert cuda.calls == [
        ("register", own.kv_buffer.data_ptr(), nbytes, 0),
        ("register", shared.kv_buffer.data_ptr(), nbytes, 0),
    ]
    assert region is not None and region.nbytes == nbytes
    assert os_.readlink(f"/proc/self/fd/{region.fd}").startswith(
        sglang_adapter.SHARED_POOL_MEMFD_LINK
    )
    # What was registered is the file's memory: bytes written there are the file's.
    shared.kv_buffer.view(-1).view(torch.uint8)[:4] = torch.tensor([1, 2, 3, 4])
    assert os_.pread(region.fd, 4, 0) == bytes([1, 2, 3, 4])


# --------------------------------------------------------------------------- the hooks


@pytest.mark.parametrize(
    ("enable", "paths", "shared"),
    [
        (True, "device,shared_host,host", True),
        (True, "shared_host", True),
        (True, "device,host", False),
        (False, "device,shared_host,host", False),
    ],
)
def test_the_plugin_builds_the_host_pool_in_shared_memory_when_the_path_is_offered(
    enable, paths, shared
):
    """The AROUND hooks on `Scheduler.init_cache_with_memory_pool` and on the host pool's
    allocator (`server/scheduler/hooks.py`): SGLang's default allocator is replaced inside the
    cache's construction only, and only for a server that offers the path."""
    import cpu_harness
    from sglang.srt.mem_cache.memory_pool_host import HostTensorAllocator
    from sglang_kv_migration.server.scheduler import hooks
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=enable,
        kv_migration_paths=paths,
    )
    plain = HostTensorAllocator()

    def default_allocator(allocator_type):
        return plain

    def build_cache(scheduler):
        return [
            hooks.around_get_allocator_from_storage(default_allocator, kind)
            for kind in (None, "mooncake")
        ]

    scheduler = type("Scheduler", (), {"server_args": args})()
    during, with_backend = hooks.around_init_cache_with_memory_pool(build_cache, scheduler)
    assert (during is not plain) is shared
    assert with_backend is plain  # a storage backend's allocator stays its own
    assert hooks.around_get_allocator_from_storage(default_allocator, None) is plain  # after


def test_a_pool_of_several_buffers_allocates_each_in_shared_memory_and_is_not_offered():
    """Hybrid models' host pools allocate several buffers through one allocator: each
    gets its memory file (nothing fails), and no single region is published."""
    with sglang_adapter.host_pool_in_shared_memory():
        allocator = sglang_adapter.host_tensor_allocator(None)
    assert sglang_adapter.host_tensor_allocator(None) is None  # outside: SGLang's own
    first = allocator.allocate((4, 8), torch.bfloat16, "cpu")
    assert allocator.region is not None and allocator.region.nbytes == 64
    second = allocator.allocate((2, 3), torch.float32, "cpu")
    assert allocator.region is None and len(allocator.regions) == 2
    first.fill_(1.0)
    second.fill_(2.0)
    assert float(first.sum()) == 32.0 and float(second.sum()) == 12.0
