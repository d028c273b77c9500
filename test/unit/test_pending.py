"""PendingMigrations on a real HiRadixCache (CPU harness): allocate, commit, abort, expire.

The bytes a peer would write are written here straight into the host pool tensors, so a
commit followed by a load-back must hand back exactly those bytes for every layer.
"""

from __future__ import annotations

import pytest
import torch
from cpu_harness import Harness
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.host.path import HostPath
from sglang_kv_migration.server.target.pending import PendingMigrations
from timing import FakeClock

TIMEOUT_S = 5.0


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _fake_kv(h: Harness, n: int, seed: int) -> list[torch.Tensor]:
    """Per-layer random KV shaped like `Harness.read_device_kv` returns it."""
    gen = torch.Generator().manual_seed(seed)
    pool = h.device_pool
    if h.cfg.attention == "mha":
        shape = (2, n, h.cfg.head_num, h.cfg.head_dim)
        buffers = pool.k_buffer
    else:
        shape = (n, 1, h.cfg.kv_lora_rank + h.cfg.qk_rope_head_dim)
        buffers = pool.kv_buffer
    out = []
    for buf in buffers:
        raw = torch.randint(
            0, 256, (*shape[:-1], shape[-1] * buf.element_size()), generator=gen, dtype=torch.uint8
        )
        out.append(raw.view(buf.dtype))
    return out


def _write_host_kv(h: Harness, slots: list[int], kv: list[torch.Tensor]) -> None:
    """Write per-layer KV (read_device_kv format) into host token slots, via the pool tensors."""
    hp = h.host_pool
    idx = torch.tensor(slots, dtype=torch.int64)
    ps = hp.page_size
    planes = [hp.kv_buffer[0], hp.kv_buffer[1]] if h.cfg.attention == "mha" else [hp.kv_buffer]
    for layer, data in enumerate(kv):
        per_plane = [data[0], data[1]] if h.cfg.attention == "mha" else [data]
        for plane, rows in zip(planes, per_plane, strict=True):
            if hp.layout == "layer_first":  # [layer, token, ...]
                plane[layer][idx] = rows
            elif hp.layout == "page_first":  # [token, layer, ...]
                plane.select(1, layer)[idx] = rows
            elif hp.layout == "page_first_direct":  # [page, layer, in_page, ...]
                plane.select(1, layer)[idx // ps, idx % ps] = rows
            else:
                raise AssertionError(f"unknown layout {hp.layout}")


def _host_slots_in_tree(h: Harness) -> list[int]:
    return [
        int(s) for node in h.iter_nodes() if node.host_value is not None for s in node.host_value
    ]


def _assert_host_slots_accounted(h: Harness) -> None:
    """Every host slot is exactly once either free or held by a tree node."""
    in_tree = _host_slots_in_tree(h)
    free = h.host_pool.free_slots.tolist()
    assert len(set(in_tree)) == len(in_tree), "a host slot is held by two nodes"
    assert len(set(free)) == len(free), "a host slot was freed twice"
    assert not set(in_tree) & set(free), "a host slot is both free and in the tree"
    assert len(in_tree) + len(free) == h.host_pool.size, "host slots leaked"


def _prefix_locked(h: Harness, tokens: list[int], length: int) -> bool:
    held = sglang_adapter.match_held_prefix(h.cache, tokens[:length], None)
    assert held.length == length
    nodes = sglang_adapter.path_from_root(h.cache, held.last_node)
    return bool(nodes) and all(n.lock_ref > 0 for n in nodes)


def _error_kind(fn, *args, **kwargs) -> ErrorKind:
    with pytest.raises(MigrationError) as info:
        fn(*args, **kwargs)
    return info.value.kind


ROUNDTRIP_CASES = [
    ("mha", "layer_first", 16, False),
    ("mha", "page_first", 16, True),
    ("mha", "page_first_direct", 16, False),
    ("mla", "layer_first", 16, True),
    ("mla", "page_first", 16, False),
    ("mla", "page_first_direct", 16, True),
    ("mha", "page_first", 1, False),
    ("mla", "layer_first", 1, True),
]


@pytest.mark.parametrize(("attention", "layout", "page_size", "prefix_on_host"), ROUNDTRIP_CASES)
def test_allocate_write_commit_load_back(
    harness_factory, attention, layout, page_size, prefix_on_host
):
    h = harness_factory(
        attention=attention,
        host_layout=layout,
        page_size=page_size,
        layer_num=3,
        load_back_threshold=1,
    )
    ps = page_size
    held_pages, total_pages = 2, 7
    tokens = _tokens(total_pages * ps)
    prefix_kv = h.read_device_kv(h.insert_random(tokens[: held_pages * ps], seed=3))
    h.write_back_all()
    if prefix_on_host:
        h.evict_device_all()
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    assert before.total_lock_ref == 0

    # A partial last page is not migrated.
    input_ids = tokens + ([7, 8, 9] if ps > 1 else [])
    alloc = pending.allocate("m1", input_ids, None, path=HostPath(h.cache))

    extra = (total_pages - held_pages) * ps
    assert alloc.migration_id == "m1"
    assert alloc.matched_length == held_pages * ps
    assert alloc.extra_length == extra
    assert len(alloc.kv_indices) == extra
    assert len(set(alloc.kv_indices)) == extra
    during = h.snapshot()
    assert during.host_available == before.host_available - extra
    assert during.total_lock_ref > 0
    assert _prefix_locked(h, tokens, held_pages * ps)
    assert len(pending) == 1
    # Page-aligned slots, consecutive within a page (what the layouts require).
    for p in range(0, extra, ps):
        page = alloc.kv_indices[p : p + ps]
        assert page[0] % ps == 0
        assert page == list(range(page[0], page[0] + ps))

    fake = _fake_kv(h, extra, seed=99)
    _write_host_kv(h, alloc.kv_indices, fake)
    assert pending.commit("m1") == total_pages * ps

    after = h.snapshot()
    assert after.total_lock_ref == 0
    assert after.host_available == before.host_available - extra
    assert len(pending) == 0
    m = h.match(tokens)
    assert len(m.device_indices) + m.host_hit_length == total_pages * ps
    assert m.host_hit_length >= extra
    _assert_host_slots_accounted(h)

    loaded = h.load_back(tokens)
    assert len(loaded) == total_pages * ps
    got = h.read_device_kv(loaded)
    held = held_pages * ps
    assert _same_bytes([g[:, :held] if attention == "mha" else g[:held] for g in got], prefix_kv)
    assert _same_bytes([g[:, held:] if attention == "mha" else g[held:] for g in got], fake)
    assert h.snapshot().total_lock_ref == 0


def test_written_bytes_negative_control(harness_factory):
    # Writing to a wrong slot must be visible: the check above is not vacuous.
    h = harness_factory(host_layout="page_first", load_back_threshold=1)
    tokens = _tokens(4 * 16)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    fake = _fake_kv(h, len(tokens), seed=5)
    shuffled = alloc.kv_indices[16:32] + alloc.kv_indices[:16] + alloc.kv_indices[32:]
    _write_host_kv(h, shuffled, fake)
    pending.commit("m")
    assert not _same_bytes(h.read_device_kv(h.load_back(tokens)), fake)


def test_a_partial_commit_inserts_the_written_part_and_frees_the_rest(harness_factory):
    """`commit(written=)` (feature "partial_transfer"): the first written slots are
    inserted with their tokens, the others freed; an insert that fails changes nothing,
    so the same commit can run again."""
    h = harness_factory(host_layout="page_first", load_back_threshold=1)
    tokens = _tokens(6 * 16)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    path = HostPath(h.cache)
    alloc = pending.allocate("m", tokens, None, path=path)
    fake = _fake_kv(h, 2 * 16, seed=3)
    _write_host_kv(h, alloc.kv_indices[:32], fake)

    real_insert, calls = path.insert, []

    def insert_failing_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("injected insert failure")
        return real_insert(*args)

    path.insert = insert_failing_once
    with pytest.raises(RuntimeError):
        pending.commit("m", written=32)
    assert len(pending) == 1 and pending.get("m").extra_length == 6 * 16  # unchanged
    assert pending.commit("m", written=32) == 32
    assert h.snapshot().host_available == before.host_available - 32
    assert h.snapshot().total_lock_ref == 0 and len(pending) == 0
    m = h.match(tokens)
    assert len(m.device_indices) + m.host_hit_length == 32
    assert _same_bytes(h.read_device_kv(h.load_back(tokens[:32])), fake)
    _assert_host_slots_accounted(h)


@pytest.mark.parametrize("prefix_on_host", [False, True])
def test_abort_restores_pool_and_locks(harness_factory, prefix_on_host):
    h = harness_factory(host_layout="layer_first")
    tokens = _tokens(6 * 16)
    h.insert_random(tokens[:32], seed=1)
    h.write_back_all()
    if prefix_on_host:
        h.evict_device_all()
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    assert alloc.matched_length == 32
    assert h.snapshot() != before
    pending.abort("m")
    assert h.snapshot() == before
    assert len(pending) == 0
    _assert_host_slots_accounted(h)
    # A repeated abort is harmless; commit after abort is a conflict.
    pending.abort("m")
    assert h.snapshot() == before
    assert _error_kind(pending.commit, "m") is ErrorKind.CONFLICT
    assert h.snapshot() == before
    # The prefix is matchable as before and nothing beyond it.
    m = h.match(tokens)
    assert len(m.device_indices) + m.host_hit_length == 32


def test_watchdog_expires_with_injected_clock(harness_factory):
    h = harness_factory(host_layout="page_first_direct")
    tokens = _tokens(5 * 16)
    h.insert_random(tokens[:16], seed=2)
    h.write_back_all()
    clock = FakeClock()
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=clock)
    before = h.snapshot()
    pending.allocate("old", tokens, None, path=HostPath(h.cache))
    clock.now += 1.0
    pending.allocate("young", tokens[:48], None, path=HostPath(h.cache))
    assert h.snapshot().total_lock_ref > 0

    clock.now += TIMEOUT_S - 1.0 - 0.001
    assert pending.due() == []
    assert pending.expire() == []
    assert len(pending) == 2
    clock.now += 0.001
    assert pending.due() == ["old"]
    assert pending.expire() == ["old"]
    assert len(pending) == 1
    clock.now += 1.0
    # Explicit ids: unknown or finished ones are skipped.
    assert pending.expire(["young", "old", "nope"]) == ["young"]
    assert len(pending) == 0
    assert h.snapshot() == before
    assert h.snapshot().total_lock_ref == 0
    _assert_host_slots_accounted(h)

    assert _error_kind(pending.commit, "old") is ErrorKind.GONE
    assert _error_kind(pending.abort, "young") is ErrorKind.GONE
    assert h.snapshot() == before


def test_watchdog_real_clock_tiny_timeout(harness_factory):
    h = harness_factory()
    pending = PendingMigrations(h.cache, 0.01)
    before = h.snapshot()
    pending.allocate("m", _tokens(32), None, path=HostPath(h.cache))
    deadline = 200  # bounded wait: at most ~2 s
    expired: list[str] = []
    while not expired and deadline:
        expired = pending.expire()
        deadline -= 1
        if not expired:
            import time

            time.sleep(0.01)
    assert expired == ["m"]
    assert h.snapshot() == before
    assert _error_kind(pending.commit, "m") is ErrorKind.GONE


def test_timeout_must_be_positive(harness_factory):
    h = harness_factory()
    with pytest.raises(ValueError):
        PendingMigrations(h.cache, 0)


def test_state_errors(harness_factory):
    h = harness_factory(attention="mla", host_layout="page_first")
    tokens = _tokens(4 * 16)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()

    assert _error_kind(pending.abort, "unknown") is ErrorKind.NOT_FOUND
    assert _error_kind(pending.commit, "unknown") is ErrorKind.NOT_FOUND

    alloc = pending.allocate("a", tokens, None, path=HostPath(h.cache))
    # Reusing a pending id.
    assert (
        _error_kind(pending.allocate, "a", _tokens(32, start=5000), None, path=HostPath(h.cache))
        is ErrorKind.CONFLICT
    )
    assert len(pending) == 1
    first = pending.commit("a")
    assert first == len(tokens)
    committed = h.snapshot()
    assert committed.host_available == before.host_available - alloc.extra_length
    assert committed.total_lock_ref == 0
    # A second commit is harmless: same answer, no change.
    assert pending.commit("a") == first
    assert h.snapshot() == committed
    # Abort after commit, reuse of a finished id.
    assert _error_kind(pending.abort, "a") is ErrorKind.CONFLICT
    assert (
        _error_kind(pending.allocate, "a", _tokens(32, start=5000), None, path=HostPath(h.cache))
        is ErrorKind.CONFLICT
    )
    assert h.snapshot() == committed

    # The target already holds everything.
    assert (
        _error_kind(pending.allocate, "b", tokens, None, path=HostPath(h.cache))
        is ErrorKind.CONFLICT
    )
    assert (
        _error_kind(pending.allocate, "b2", tokens[:32] + [1, 2], None, path=HostPath(h.cache))
        is ErrorKind.CONFLICT
    )
    # expected_extra disagrees with what the target now needs.
    longer = tokens + _tokens(32, start=9000)
    assert (
        _error_kind(pending.allocate, "c", longer, None, expected_extra=48, path=HostPath(h.cache))
        is ErrorKind.CONFLICT
    )
    assert h.snapshot() == committed
    assert len(pending) == 0
    # ...and agrees: fine.
    assert pending.allocate(
        "d", longer, None, expected_extra=32, path=HostPath(h.cache)
    ).matched_length == len(tokens)
    pending.abort("d")
    assert h.snapshot() == committed


def test_host_pool_too_small_is_unavailable(harness_factory):
    h = harness_factory(device_tokens=512, hicache_ratio=2.0)
    host_size = h.host_pool.size
    tokens = _tokens(32)
    h.insert_random(tokens, seed=1)
    h.write_back_all()
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    too_long = tokens + _tokens(host_size, start=50_000)
    with pytest.raises(MigrationError) as info:
        pending.allocate("big", too_long, None, path=HostPath(h.cache))
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "host pool is full" in info.value.message
    assert h.snapshot() == before
    assert len(pending) == 0
    _assert_host_slots_accounted(h)
    assert pending.get("big") is None


def test_allocate_evicts_unlocked_host_pages_but_not_the_prefix(harness_factory):
    h = harness_factory(device_tokens=512, hicache_ratio=2.0, load_back_threshold=1)
    host_size = h.host_pool.size
    ps = 16
    filler = _tokens(384, start=20_000)
    # Fill the host pool with host-only pages: two sequences, evicted from device.
    h.insert_random(filler, seed=1)
    h.evict_device_all()
    filler2 = _tokens(384, start=30_000)
    h.insert_random(filler2, seed=2)
    h.evict_device_all()
    # The target's own prefix, also host-only, is what the migration extends.
    tokens = _tokens(10 * ps)
    prefix_kv = h.read_device_kv(h.insert_random(tokens[: 2 * ps], seed=3))
    h.evict_device_all()
    free_before = h.host_pool.available_size()
    extra = 8 * ps
    assert free_before < host_size
    # Leave too little room for the migration so it has to evict.
    hog = h.host_pool.alloc(free_before - extra + ps)
    assert hog is not None

    pending = PendingMigrations(h.cache, TIMEOUT_S)
    alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    assert alloc.matched_length == 2 * ps
    assert alloc.extra_length == extra
    # Some filler pages were evicted to make room, never the locked prefix.
    assert h.match(filler).host_hit_length + h.match(filler2).host_hit_length < 768
    assert h.match(tokens).host_hit_length == 2 * ps
    fake = _fake_kv(h, extra, seed=4)
    _write_host_kv(h, alloc.kv_indices, fake)
    assert pending.commit("m") == len(tokens)
    h.host_pool.free(hog)
    got = h.read_device_kv(h.load_back(tokens))
    want = [torch.cat([a, b], dim=1) for a, b in zip(prefix_kv, fake, strict=True)]
    assert _same_bytes(got, want)
    _assert_host_slots_accounted(h)
    assert h.snapshot().total_lock_ref == 0


@pytest.mark.parametrize(
    ("attention", "racer_pages", "racer_backed_up"),
    [("mha", 5, False), ("mha", 5, True), ("mla", 2, False), ("mla", 3, True)],
)
def test_concurrent_insert_before_commit_frees_surplus(
    harness_factory, attention, racer_pages, racer_backed_up
):
    """A request inserted (some of) the same tokens on device while the migration was
    pending: commit keeps the tree's nodes and frees our surplus slots."""
    ps = 16
    # write_back: the racer's device pages stay device-only until evicted.
    h = harness_factory(
        attention=attention,
        host_layout="page_first",
        load_back_threshold=1,
        write_policy="write_through" if racer_backed_up else "write_back",
    )
    tokens = _tokens(6 * ps)
    prefix_kv = h.read_device_kv(h.insert_random(tokens[:ps], seed=1))
    h.write_back_all()
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    assert alloc.matched_length == ps
    fake = _fake_kv(h, 5 * ps, seed=2)
    _write_host_kv(h, alloc.kv_indices, fake)

    # The concurrent insert (a request that prefilled the same tokens).
    racer_tokens = tokens[: (1 + racer_pages) * ps]
    racer_kv = h.read_device_kv(h.insert_random(racer_tokens, seed=3))
    if racer_backed_up:
        h.write_back_all()
    else:
        h.drain_writes()

    assert pending.commit("m") == len(tokens)
    after = h.snapshot()
    assert after.total_lock_ref == 0
    _assert_host_slots_accounted(h)
    # Our slots: the ones the tree kept are in the tree, the rest are free again.
    in_tree = set(_host_slots_in_tree(h))
    free = set(h.host_pool.free_slots.tolist())
    ours = alloc.kv_indices
    raced = racer_pages * ps
    assert all(s in free for s in ours[:raced])
    assert all(s in in_tree for s in ours[raced:])
    # The racer's device pages get a host copy either way: by write-through, or by the
    # commit (a host-only node needs backed-up ancestors).
    racer_host = len(racer_tokens) - ps
    assert _host_only_nodes_have_backed_up_ancestors(h)
    assert after.host_available == before.host_available - (len(ours) - raced) - racer_host

    # The tree's KV: the prefix, the racer's pages (they won), then ours.
    got = h.read_device_kv(h.load_back(tokens))
    if attention == "mha":
        want = [
            torch.cat([p, r[:, ps:], f[:, raced:]], dim=1)
            for p, r, f in zip(prefix_kv, racer_kv, fake, strict=True)
        ]
    else:
        want = [
            torch.cat([p, r[ps:], f[raced:]])
            for p, r, f in zip(prefix_kv, racer_kv, fake, strict=True)
        ]
    assert _same_bytes(got, want)


def test_pin_waits_for_a_write_through_still_in_flight(harness_factory):
    """Source side: pages whose device->host copy was queued (host_value already set)
    but not yet acknowledged are not ready to read until the copy is acknowledged."""
    h = harness_factory(host_layout="page_first")
    tokens = _tokens(4 * 16)
    h.insert_random(tokens, seed=1)  # write-through queued, acks not drained
    held = sglang_adapter.match_held_prefix(h.cache, tokens, None)
    nodes = sglang_adapter.path_from_root(h.cache, held.last_node)
    assert all(n.backuped for n in nodes)
    assert any(n.id in h.cache.ongoing_write_through for n in nodes)
    pinned = sglang_adapter.pin_host_pages(h.cache, tokens, None, 16, 64)
    try:
        in_flight = {n.id for n in nodes if n.id in h.cache.ongoing_write_through}
        assert in_flight and in_flight <= pinned.copying_ids
        assert not sglang_adapter.host_pages_ready(h.cache, pinned)
        h.cache.writing_check()  # what the scheduler loop (and our poll) runs
        assert not any(n.id in h.cache.ongoing_write_through for n in nodes)
        assert sglang_adapter.host_pages_ready(h.cache, pinned)
        assert len(pinned.host_indices) == 48
        assert all(n.host_ref_counter > 0 for n in nodes)
    finally:
        sglang_adapter.unpin_host_pages(pinned)
    snap = h.snapshot()
    assert snap.total_host_ref == 0 and snap.total_lock_ref == 0


def _host_only_nodes_have_backed_up_ancestors(h: Harness) -> bool:
    for node in h.iter_nodes():
        if node.evicted:
            parent = node.parent
            while parent is not h.cache.root_node:
                if not parent.backuped:
                    return False
                parent = parent.parent
    return True


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_commit_below_a_device_only_prefix_keeps_the_tree_evictable(harness_factory, policy):
    """The target's prefix was never backed up (selective / write-back policy): commit
    must back it up, or SGLang's device eviction trips over a non-leaf without a copy."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = harness_factory(write_policy=policy, host_layout="page_first", load_back_threshold=1)
    tokens = _tokens(4 * 16)
    prefix_kv = h.read_device_kv(h.insert_random(tokens[:32], seed=1))
    h.drain_writes()
    assert not any(n.backuped for n in h.iter_nodes())
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    fake = _fake_kv(h, 32, seed=2)
    _write_host_kv(h, alloc.kv_indices, fake)
    assert pending.commit("m") == 64
    assert _host_only_nodes_have_backed_up_ancestors(h)
    assert h.snapshot().host_available == before.host_available - 64
    assert h.snapshot().total_lock_ref == 0
    # Device eviction of everything works and the whole prefix is then on host.
    h.cache.evict(EvictParams(num_tokens=h.cache.evictable_size()))
    assert h.match(tokens).host_hit_length == 64
    got = h.read_device_kv(h.load_back(tokens))
    want = [torch.cat([a, b], dim=1) for a, b in zip(prefix_kv, fake, strict=True)]
    assert _same_bytes(got, want)
    _assert_host_slots_accounted(h)


def test_pin_never_evicts_a_host_page_of_its_own_path(harness_factory):
    """write_back policy: a device-only node with a host-only child. Backing up the
    parent on a full host pool must not evict the child it is about to send."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    ps = 16
    h = harness_factory(write_policy="write_back", host_layout="layer_first")
    tokens = _tokens(6 * ps)
    h.insert_random(tokens[: 2 * ps], seed=1)
    h.insert_random(tokens, seed=2)
    # Evict just the leaf (4 pages): written back, then host-only below a device-only parent.
    h.cache.evict(EvictParams(num_tokens=4 * ps))
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (2 * ps, 4 * ps)
    # Leave less free host room than the parent needs, so write_backup must evict.
    hog = h.host_pool.alloc(h.host_pool.available_size() - ps)
    assert hog is not None
    with pytest.raises(MigrationError) as info:
        sglang_adapter.pin_host_pages(h.cache, tokens, None, 0, 6 * ps)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    # The child is still there with its own slots; nothing stays protected.
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (2 * ps, 4 * ps)
    assert h.snapshot().total_host_ref == 0
    h.host_pool.free(hog)
    pinned = sglang_adapter.pin_host_pages(h.cache, tokens, None, 0, 6 * ps)
    try:
        assert len(set(pinned.host_indices.tolist())) == 6 * ps
    finally:
        sglang_adapter.unpin_host_pages(pinned)
    _assert_host_slots_accounted(h)


def test_pending_imports_no_host_path_module() -> None:
    """The state machine works on any `DataPath` its caller passes: nothing from
    `paths/host` is imported, at module or function level."""
    import ast
    import pathlib

    from sglang_kv_migration.server.target import pending as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if m and m.startswith("sglang_kv_migration.paths.host")]
