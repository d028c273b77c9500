"""The device path's target role on CPU: device KV slots held by pending migrations.

`DevicePath` reserves slots from SGLang's real token-to-KV allocator, `PendingMigrations`
holds them like host slots, and commit inserts ordinary device radix nodes. Here the
device pool lives on the CPU (CPU harness), so everything but the CUDA IPC copy runs: the
bytes a source would push are written straight into the pool's buffers at the reserved
slots. Every exit (abort, watchdog, flush) must hand the allocator back exactly what it
took and unlock the prefix; a commit that lost a race frees exactly the surplus.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch
from cpu_harness import Harness
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.wire.moments import Moment
from side_helpers import one_rank_context
from timing import FakeClock

TIMEOUT_S = 5.0
# NSA at page size 1 (SGLang's ROCm NSA pool, see cpu_harness): these tests' prefixes
# are a few 16-token pages; page size 64 is in test_nsa_layout.py.
CONFIGS = [("mha", 1), ("mha", 16), ("mla", 1), ("mla", 16), ("nsa", 1)]
CONFIG_IDS = [f"{a}-page{p}" for a, p in CONFIGS]


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _error_kind(fn, *args, **kwargs) -> ErrorKind:
    with pytest.raises(MigrationError) as info:
        fn(*args, **kwargs)
    return info.value.kind


def _same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _write_device_kv(h: Harness, slots: list[int], seed: int) -> list[torch.Tensor]:
    """Random bytes into the device pool buffers at `slots`, as a pushing source would
    write them; returns them in `Harness.read_device_kv`'s format."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(slots, dtype=torch.int64)
    for buf in adapter.device_kv_buffers(h.cache):
        row = buf[0]
        raw = torch.randint(
            0, 256, (len(slots), row.numel() * buf.element_size()), generator=gen, dtype=torch.uint8
        )
        buf[idx] = raw.view(buf.dtype).view(len(slots), *row.shape)
    return h.read_device_kv(idx)


def _cat_tokens(h: Harness, parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Concatenate per-layer KV (read_device_kv format) along the token axis."""
    dim = 1 if h.cfg.attention == "mha" else 0
    return [torch.cat(layer, dim=dim) for layer in zip(*parts, strict=True)]


def _slice_tokens(h: Harness, kv: list[torch.Tensor], start: int) -> list[torch.Tensor]:
    return [t[:, start:] if h.cfg.attention == "mha" else t[start:] for t in kv]


def _free_device_slots(h: Harness) -> list[int]:
    alloc, ps = h.allocator, h.cfg.page_size
    free = torch.cat([alloc.free_pages, alloc.release_pages]).tolist()
    return free if ps == 1 else [p * ps + i for p in free for i in range(ps)]


def _tree_device_slots(h: Harness) -> list[int]:
    return [int(s) for n in h.iter_nodes() if n.value is not None for s in n.value.tolist()]


def _assert_device_slots_accounted(h: Harness, reserved: Sequence[int] = ()) -> None:
    """Every device slot is exactly once free, in the tree, or `reserved` by a pending
    migration."""
    free, tree = _free_device_slots(h), _tree_device_slots(h)
    everything = free + tree + list(reserved)
    assert len(set(everything)) == len(everything), "a device slot is counted twice"
    ps = h.cfg.page_size
    first = 1 if ps == 1 else ps  # slot 0 / page 0 is SGLang's padding
    assert set(everything) == set(range(first, first + h.allocator.size)), "device slots leaked"


def _setup_prefix(h: Harness, tokens: list[int], held: int) -> list[torch.Tensor]:
    """Put tokens[:held] on device (backed up); return its KV."""
    kv = h.read_device_kv(h.insert_random(tokens[:held], seed=3))
    h.write_back_all()
    return kv


# --------------------------------------------------------------------------- DevicePath


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_device_path_target_role_on_a_cpu_pool(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, layer_num=3)
    path = DevicePath(h.cache)
    assert path.name == "device" and path.holds_device_slots
    assert path.copier.device.type == "cpu"
    ad = path.advertise()
    # Nothing to export without CUDA, but the shape of the pool is described.
    assert ad["buffers"] == [] and ad["gpu_uuid"] == ""
    buffers = adapter.device_kv_buffers(h.cache)
    assert ad["row_bytes"] == [b[0].numel() * b.element_size() for b in buffers]
    assert ad["num_rows"] == [b.shape[0] for b in buffers]
    # MHA: K and V per layer; MLA: the latent per layer; NSA: the latent, then the
    # indexer's keys per layer.
    assert len(ad["row_bytes"]) == {"mha": 6, "mla": 3, "nsa": 6}[attention]

    tokens = _tokens(96)
    prefix = h.insert_random(tokens[:32], seed=1)
    h.insert_random(tokens, seed=2)
    h.write_back_all()
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.cache.evict(EvictParams(num_tokens=64))  # the leaf goes host-only
    held = path.held_prefix(tokens, None)
    assert (held.length, held.device_length) == (32, 32)  # host-only part not counted
    assert adapter.match_held_prefix(h.cache, tokens, None).length == 96

    available = h.allocator.available_size()
    slots = path.reserve(64)
    assert len(slots) == 64 and h.allocator.available_size() == available - 64
    h.cache.inc_lock_ref(held.last_node)
    key = adapter.make_key(h.cache, tokens, None)
    assert path.insert(held.last_node, key, 32, slots) == 0
    assert h.match(tokens).device_indices.tolist() == prefix.tolist() + slots.tolist()
    h.cache.dec_lock_ref(held.last_node)
    extra = path.reserve(16)
    path.release(extra)
    assert h.allocator.available_size() == available - 64
    path.close()


# --------------------------------------------------------------------------- allocate / commit


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_allocate_write_commit_serves_the_bytes_from_device(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, layer_num=3)
    tokens = _tokens(96)
    prefix_kv = _setup_prefix(h, tokens, 32)
    path = DevicePath(h.cache)
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=FakeClock())
    before = h.snapshot()
    assert before.total_lock_ref == 0
    assert pending.device_tokens_held() == 0

    input_ids = tokens + ([7, 8, 9] if page_size > 1 else [])  # a partial page stays behind
    alloc = pending.allocate("m", input_ids, None, path=path)
    assert (alloc.matched_length, alloc.extra_length) == (32, 64)
    assert len(set(alloc.kv_indices)) == 64
    assert pending.device_tokens_held() == 64
    assert h.allocator.available_size() == before.device_available - 64
    during = h.snapshot()
    assert during.total_lock_ref > 0
    anchor = pending.get("m").anchor
    assert all(n.lock_ref > 0 for n in adapter.path_from_root(h.cache, anchor))
    assert not set(alloc.kv_indices) & set(_tree_device_slots(h))
    _assert_device_slots_accounted(h, alloc.kv_indices)

    fake = _write_device_kv(h, alloc.kv_indices, seed=99)
    assert pending.commit("m") == 96
    assert pending.device_tokens_held() == 0 and len(pending) == 0
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (96, 0)
    assert m.device_indices[32:].tolist() == alloc.kv_indices
    assert _same_bytes(h.read_device_kv(m.device_indices), _cat_tokens(h, [prefix_kv, fake]))
    # The slots moved into the tree: the allocator does not get them back.
    assert h.allocator.available_size() == before.device_available - 64
    _assert_device_slots_accounted(h)
    h.drain_writes()  # write-through backs the new nodes up, locked until acknowledged
    after = h.snapshot()
    assert after.total_lock_ref == 0
    assert after.evictable == before.evictable + 64
    # A repeated commit changes nothing.
    assert pending.commit("m") == 96
    assert h.snapshot() == after


def test_written_bytes_negative_control(harness_factory):
    # Bytes written to the wrong reserved slots must show: the byte check is not vacuous.
    h = harness_factory(page_size=16)
    tokens = _tokens(64)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    alloc = pending.allocate("m", tokens, None, path=DevicePath(h.cache))
    shuffled = alloc.kv_indices[16:32] + alloc.kv_indices[:16] + alloc.kv_indices[32:]
    fake = _write_device_kv(h, shuffled, seed=5)
    pending.commit("m")
    assert not _same_bytes(h.read_device_kv(h.match(tokens).device_indices), fake)


# --------------------------------------------------------------------------- every exit frees


EXITS = ["abort", "watchdog", "flush"]


@pytest.mark.parametrize("exit_by", EXITS)
@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_every_exit_returns_the_device_slots(harness_factory, attention, page_size, exit_by):
    h = harness_factory(attention=attention, page_size=page_size, layer_num=2)
    tokens = _tokens(128)
    prefix_kv = _setup_prefix(h, tokens, 32)
    path = DevicePath(h.cache)
    clock = FakeClock()
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=clock)
    before = h.snapshot()
    available = h.allocator.available_size()

    alloc = pending.allocate("m", tokens, None, path=path)
    assert h.allocator.available_size() == available - 96
    assert pending.device_tokens_held() == 96
    assert h.snapshot().total_lock_ref > before.total_lock_ref
    _write_device_kv(h, alloc.kv_indices, seed=1)

    if exit_by == "abort":
        pending.abort("m")
        late_error = ErrorKind.CONFLICT
    elif exit_by == "watchdog":
        clock.now += TIMEOUT_S - 0.001
        assert pending.expire() == []
        assert h.allocator.available_size() == available - 96
        clock.now += 0.001
        assert pending.expire() == ["m"]
        late_error = ErrorKind.GONE
    else:
        assert pending.abort_all(Moment.FLUSHED) == ["m"]
        late_error = ErrorKind.GONE

    assert h.allocator.available_size() == available
    assert h.snapshot() == before  # lock_ref back to baseline, nothing evicted or added
    assert pending.device_tokens_held() == 0 and len(pending) == 0
    free = set(_free_device_slots(h))
    assert set(alloc.kv_indices) <= free
    assert not set(alloc.kv_indices) & set(_tree_device_slots(h))
    _assert_device_slots_accounted(h)
    # A late commit is refused and frees nothing twice.
    assert _error_kind(pending.commit, "m") is late_error
    assert h.snapshot() == before
    # The tree still serves only the prefix, with its own bytes.
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (32, 0)
    assert _same_bytes(h.read_device_kv(m.device_indices), prefix_kv)


def test_flush_after_reset_forgets_without_freeing(harness_factory):
    """SGLang's flush resets the tree and clears the allocator itself: the registry must
    only forget the migration, not free its slots a second time."""
    h = harness_factory(page_size=16)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    pending.allocate("m", _tokens(64), None, path=DevicePath(h.cache))
    h.cache.reset()
    h.allocator.clear()
    full = h.allocator.available_size()
    assert pending.abort_all(Moment.FLUSHED) == ["m"]
    assert h.allocator.available_size() == full
    assert pending.device_tokens_held() == 0
    assert _error_kind(pending.commit, "m") is ErrorKind.GONE


# --------------------------------------------------------------------------- edges


def test_nothing_ok_when_the_device_holds_everything(harness_factory):
    h = harness_factory(page_size=16)
    tokens = _tokens(64)
    _setup_prefix(h, tokens, 64)
    path = DevicePath(h.cache)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()

    alloc = pending.allocate("m", tokens + [1, 2], None, path=path, nothing_ok=True)
    assert (alloc.matched_length, alloc.extra_length, alloc.kv_indices) == (64, 0, [])
    assert len(pending) == 0 and pending.get("m") is None
    assert h.snapshot() == before
    assert _error_kind(pending.allocate, "m2", tokens, None, path=path) is ErrorKind.CONFLICT
    assert h.snapshot() == before

    # Held on host only: the device path still has everything to move.
    h.evict_device_all()
    alloc = pending.allocate("m3", tokens, None, path=path, nothing_ok=True)
    assert (alloc.matched_length, alloc.extra_length) == (0, 64)
    pending.abort("m3")


@pytest.mark.parametrize("page_size", [1, 16])
def test_too_big_a_device_allocation_evicts_nothing(harness_factory, page_size):
    h = harness_factory(page_size=page_size, device_tokens=256)
    tokens = _tokens(256 + 64)
    _setup_prefix(h, tokens, 32)  # the migration's prefix: locked during allocate
    h.insert_random(_tokens(96, start=50_000), seed=4)  # unlocked, evictable
    h.write_back_all()
    path = DevicePath(h.cache)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    tree = sorted(
        (n.id, None if n.value is None else tuple(n.value.tolist())) for n in h.iter_nodes()
    )
    # 288 needed; 128 free + 96 evictable (the 32 of the prefix are locked first).
    assert (before.device_available, before.evictable) == (128, 128)

    with pytest.raises(MigrationError) as info:
        pending.allocate("big", tokens, None, path=path)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "288 token slots needed, 128 free and 96 evictable" in info.value.message
    assert h.snapshot() == before
    assert tree == sorted(
        (n.id, None if n.value is None else tuple(n.value.tolist())) for n in h.iter_nodes()
    )
    assert len(pending) == 0 and pending.device_tokens_held() == 0

    # Within free + evictable: unlocked pages are evicted, the locked prefix is kept.
    alloc = pending.allocate("fits", tokens[: 32 + 192], None, path=path)
    assert alloc.extra_length == 192
    assert len(h.match(tokens).device_indices) == 32
    assert len(h.match(_tokens(96, start=50_000)).device_indices) < 96
    _assert_device_slots_accounted(h, alloc.kv_indices)
    pending.abort("fits")
    assert h.snapshot().total_lock_ref == 0
    _assert_device_slots_accounted(h)


@pytest.mark.parametrize(("attention", "racer_tokens"), [("mha", 48), ("mla", 96), ("mha", 16)])
def test_concurrent_insert_before_commit_frees_the_surplus(
    harness_factory, attention, racer_tokens
):
    h = harness_factory(attention=attention, page_size=16, layer_num=2)
    tokens = _tokens(128)
    prefix_kv = _setup_prefix(h, tokens, 32)
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    alloc = pending.allocate("m", tokens, None, path=DevicePath(h.cache))
    fake = _write_device_kv(h, alloc.kv_indices, seed=2)

    # A request prefilled some of the same tokens while the migration was pending.
    racer = h.insert_random(tokens[: 32 + racer_tokens], seed=3)
    racer_kv = h.read_device_kv(racer[32:])
    available = h.allocator.available_size()

    assert pending.commit("m") == 128
    assert h.allocator.available_size() == available + racer_tokens
    ours = alloc.kv_indices
    free, tree = set(_free_device_slots(h)), set(_tree_device_slots(h))
    assert set(ours[:racer_tokens]) <= free and not set(ours[:racer_tokens]) & tree
    assert set(ours[racer_tokens:]) <= tree
    _assert_device_slots_accounted(h)
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (128, 0)
    want = _cat_tokens(h, [prefix_kv, racer_kv, _slice_tokens(h, fake, racer_tokens)])
    assert _same_bytes(h.read_device_kv(m.device_indices), want)
    h.drain_writes()
    assert h.snapshot().total_lock_ref == 0


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_commit_adopts_host_only_nodes(harness_factory, attention, page_size):
    """The target holds the range on host only: device slots are reserved for all of it
    and commit hands them to the host-only nodes (no load-back needed afterwards)."""
    h = harness_factory(attention=attention, page_size=page_size, layer_num=2)
    tokens = _tokens(64)
    h.insert_random(tokens, seed=1)
    h.evict_device_all()
    pending = PendingMigrations(h.cache, TIMEOUT_S)
    before = h.snapshot()
    alloc = pending.allocate("m", tokens, None, path=DevicePath(h.cache))
    assert (alloc.matched_length, alloc.extra_length) == (0, 64)
    fake = _write_device_kv(h, alloc.kv_indices, seed=2)
    assert pending.commit("m") == 64
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (64, 0)
    assert m.device_indices.tolist() == alloc.kv_indices
    assert _same_bytes(h.read_device_kv(m.device_indices), fake)
    assert all(n.backuped and not n.evicted for n in h.iter_nodes())
    after = h.snapshot()
    assert after.host_available == before.host_available  # the host copies stay
    assert after.device_available == before.device_available - 64
    _assert_device_slots_accounted(h)


# --------------------------------------------------------------------------- scheduler side


def test_scheduler_side_leaves_the_device_path_out_without_cuda(harness_factory, caplog):
    from sglang_kv_migration.paths.host.mooncake import TransportConfig
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics
    from sglang_kv_migration.server.messages import (
        AllocateTokenForTransferReqInput,
        GetTransferSessionInfoReqInput,
    )
    from sglang_kv_migration.server.rank.settings import RankSettings
    from sglang_kv_migration.server.scheduler.compose import compose_rank

    assert not torch.cuda.is_available()
    h = harness_factory(page_size=16)
    ctx = one_rank_context(h.cache)
    with caplog.at_level(logging.WARNING, logger="sglang_kv_migration"):
        side = compose_rank(
            ctx,
            RankSettings(
                watchdog_timeout_s=5.0,
                transport_config=TransportConfig(hostname="127.0.0.1"),
                metrics=MigrationMetrics("tiny", 0, 0),
                path_names=("device", "host"),
            ),
        )
    try:
        off = [r for r in caplog.records if "device path off" in r.getMessage()]
        assert len(off) == 1
        assert "CUDA is not available" in off[0].getMessage()
        assert off[0].levelno == logging.WARNING
        assert list(side.paths) == ["host"]

        info = side.get_transfer_session_info(GetTransferSessionInfoReqInput())
        assert info.success
        assert [list(r.paths) for r in info.ranks] == [["host"]]

        def allocate(path: str):
            return side.allocate_token_for_transfer(
                AllocateTokenForTransferReqInput(
                    input_ids=_tokens(64),
                    migration_id=f"m-{path}",
                    source_fingerprints=[side.identity.fingerprint.to_dict()],
                    path=path,
                )
            )

        before = h.snapshot()
        out = allocate("device")
        assert not out.success
        assert out.error_kind == "conflict"
        assert "'device' is not available" in out.message and "available: host" in out.message
        assert h.snapshot() == before
        assert len(side.target.pending) == 0 and side.device_tokens_held() == 0
        # The host path still serves.
        out = allocate("host")
        assert out.success and out.path == "host" and out.extra_token_size == 64
        assert side.device_tokens_held() == 0
    finally:
        side.close()
    assert h.snapshot().total_lock_ref == 0


def test_the_loop_offers_the_gil_cheaply_when_no_helper_thread_waits(side, monkeypatch):
    """A pending host-path allocation (its staging watcher may need the GIL) gets the
    zero sleep of the poll; device-path work only a yield of the CPU."""
    from sglang_kv_migration.server.scheduler import loop

    calls: list[str] = []
    monkeypatch.setattr(loop.time, "sleep", lambda s: calls.append(f"sleep {s}"))
    monkeypatch.setattr(loop.os, "sched_yield", lambda: calls.append("yield"))
    host_allocation = side.target.pending.allocate(
        "m-host", _tokens(32), None, path=side.paths["host"]
    )
    side.poll()
    assert "sleep 0" in calls and "yield" not in calls
    side.target.pending.abort("m-host")
    device = DevicePath(side.harness.cache)
    side.target.pending.allocate("m-device", _tokens(32, start=5000), None, path=device)
    calls.clear()
    side.poll()
    assert calls.count("yield") == 1 and "sleep 0" not in calls
    side.target.pending.abort("m-device")
    assert host_allocation.extra_length == 32
