"""The memory-saver target on CPU: a landing arena in front of the device KV pool.

A target started with --enable-memory-saver cannot export its KV pool through CUDA IPC,
so its device path reserves pool slots *and* arena rows, sources write the rows, and the
commit copies them into the pool before inserting (`paths/device/landing.py`). Here the
pool and the arena live on the CPU (CPU harness): everything but the source's CUDA copy
runs, and the bytes a source would push are written straight into the arena rows.

Also: a KV memory release (`/release_memory_occupation`) drops pending migrations (a
later commit answers 410), drops the arena, refuses allocations until the resume, and the
resume brings a new arena under a new instance id and a new server epoch.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from cpu_harness import Harness
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.server.messages import (
    CommitTransferRequestKVCacheReqInput,
    GetTransferSessionInfoReqInput,
)
from sglang_kv_migration.server.scheduler.hooks import (
    after_resume_memory_occupation,
    around_release_memory_occupation,
)
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.wire import features
from sglang_kv_migration.wire.moments import Moment
from side_helpers import allocate_on
from timing import FakeClock

CONFIGS = [("mha", 1), ("mha", 16), ("mla", 1), ("mla", 16)]
CONFIG_IDS = [f"{a}-page{p}" for a, p in CONFIGS]
TIMEOUT_S = 5.0


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _landing_path(h: Harness, tokens: int) -> DevicePath:
    buffers = adapter.device_kv_buffers(h.cache)
    per_token = sum(b[0].numel() * b.element_size() for b in buffers)
    return DevicePath(h.cache, landing_bytes=tokens * per_token)


def _write_rows(path: DevicePath, rows: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random bytes into the arena rows, as a pushing source would; returns them per
    buffer as (len(rows), row_bytes) uint8."""
    arena = path.target.landing
    gen = torch.Generator().manual_seed(seed)
    written = []
    for buf, rb in zip(arena.buffers, arena.row_bytes, strict=True):
        raw = torch.randint(0, 256, (len(rows), rb), generator=gen, dtype=torch.uint8)
        buf.view(arena.capacity, rb)[rows] = raw
        written.append(raw)
    return written


def _pool_rows(h: Harness, slots: torch.Tensor) -> list[torch.Tensor]:
    return [
        b.view(b.shape[0], -1).view(torch.uint8)[slots] for b in adapter.device_kv_buffers(h.cache)
    ]


def _free_pool(h: Harness) -> int:
    return h.allocator.available_size()


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_commit_copies_the_arena_rows_into_the_pool(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, layer_num=2)
    path = _landing_path(h, 128)
    ad = path.advertise()
    assert ad["landing_tokens"] == 128
    assert ad["num_rows"] == [128] * len(ad["row_bytes"])  # the arena's, not the pool's
    assert path.held_prefix(_tokens(96), None).length == 0
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=FakeClock())
    free = _free_pool(h)

    alloc = pending.allocate("m", _tokens(96), None, path=path)
    rows = alloc.slots
    assert rows.max() < 128  # what the source is told to write: arena rows
    pool = path.target.landing.pool_slots(rows)
    assert _free_pool(h) == free - 96 and pending.device_tokens_held() == 96
    assert path.target.landing.free_tokens == 128 - 96
    written = _write_rows(path, rows, seed=7)
    digest = path.content_digest(rows)

    assert pending.commit("m") == 96
    m = h.match(_tokens(96))
    assert m.device_indices.tolist() == pool.tolist()  # the pool slots, now in the tree
    for got, want in zip(_pool_rows(h, m.device_indices), written, strict=True):
        assert torch.equal(got, want)
    assert path.target.landing.free_tokens == 128  # rows free again once copied (CPU: at once)
    assert _free_pool(h) == free - 96
    # The digest the target checks is of what the source wrote (verify).
    rows_again = pending.allocate("m2", _tokens(96, start=5000), None, path=path).slots
    _write_rows(path, rows_again, seed=7)
    assert path.content_digest(rows_again) == digest


def test_a_full_arena_refuses_and_gives_the_pool_slots_back(harness_factory):
    h = harness_factory(page_size=16, layer_num=2)
    path = _landing_path(h, 64)
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=FakeClock())
    free = _free_pool(h)
    pending.allocate("a", _tokens(48), None, path=path)
    with pytest.raises(MigrationError) as info:
        pending.allocate("b", _tokens(32, start=3000), None, path=path)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "landing arena has 16 free tokens" in info.value.message
    assert _free_pool(h) == free - 48  # b's pool slots went back
    pending.abort("a", settled=True)
    assert _free_pool(h) == free and path.target.landing.free_tokens == 64


def test_every_exit_frees_pool_slots_and_arena_rows(harness_factory):
    h = harness_factory(page_size=16, layer_num=2)
    path = _landing_path(h, 64)
    clock = FakeClock()
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=clock)
    free = _free_pool(h)
    pending.allocate("a", _tokens(64), None, path=path, write_window_s=1.0)
    pending.abort("a")  # unsettled: rows and slots wait out the write window
    assert path.target.landing.free_tokens == 0 and _free_pool(h) == free - 64
    clock.now += 1.0
    pending.release_quarantine()
    assert path.target.landing.free_tokens == 64 and _free_pool(h) == free
    pending.allocate("b", _tokens(64), None, path=path)
    clock.now += TIMEOUT_S
    assert pending.expire() == ["b"]
    assert path.target.landing.free_tokens == 64 and _free_pool(h) == free


def test_release_drops_pending_and_the_arena_then_resume_makes_a_new_one(harness_factory):
    h = harness_factory(page_size=16, layer_num=2)
    path = _landing_path(h, 64)
    pending = PendingMigrations(h.cache, TIMEOUT_S, clock=FakeClock())
    free = _free_pool(h)
    pending.allocate("a", _tokens(32), None, path=path, write_window_s=10.0)
    pending.allocate("q", _tokens(32, start=4000), None, path=path, write_window_s=10.0)
    pending.abort("q")  # quarantined: a write may still land, but only in the arena
    old_instance = path.target.instance_id

    assert pending.prepare_for_release() == ["a"]
    assert pending.quarantined() == 0 and _free_pool(h) == free
    with pytest.raises(MigrationError) as info:
        pending.commit("a")
    assert info.value.kind is ErrorKind.GONE and "released its KV cache" in info.value.message
    path.release_memory()
    assert path.advertise()["buffers"] == [] and "landing_tokens" not in path.advertise()
    with pytest.raises(MigrationError) as info:
        path.reserve(16)
    assert info.value.kind is ErrorKind.UNAVAILABLE

    path.resume_memory()
    assert path.target.instance_id != old_instance
    assert path.advertise()["landing_tokens"] == 64
    alloc = pending.allocate("b", _tokens(32), None, path=path)
    _write_rows(path, alloc.slots, seed=1)
    assert pending.commit("b") == 32


# --------------------------------------------------------------------------- the hooks


def _memory_scheduler(side, idle: bool = True):
    return SimpleNamespace(
        kv_migration=side, is_fully_idle=lambda: idle, cache=side.loop.ctx.tree_cache
    )


def _release(scheduler, tags: list[str] | None) -> str:
    # What SGLang's release_memory_occupation does to the cache, behind our AROUND hook.
    def original(s, req):
        assert s.is_fully_idle(), "release_memory_occupation should be called only when idle"
        if not req.tags or "kv_cache" in req.tags:
            s.cache.reset()
        return "released"

    return around_release_memory_occupation(original, scheduler, SimpleNamespace(tags=tags))


def _allocate(side, ids: list[int], migration_id: str, path: str = "device"):
    return allocate_on(side, ids, migration_id, path=path)


def _epoch(side) -> str:
    return side.get_transfer_session_info(GetTransferSessionInfoReqInput()).server_epoch


@pytest.mark.parametrize("tags", [None, ["kv_cache"], ["weights", "kv_cache"]])
def test_release_hook_drops_then_resume_hook_renews_the_epoch(side_factory, tags):
    side = side_factory(page_size=16, layer_num=2)
    h = side.harness
    side.paths["device"] = _landing_path(h, 64)  # the memory-saver target role, on CPU
    epoch = _epoch(side)
    assert _allocate(side, _tokens(32), "a").success
    scheduler = _memory_scheduler(side)

    assert _release(scheduler, tags) == "released"
    out = side.commit_transfer_request_kvcache(CommitTransferRequestKVCacheReqInput("a"))
    assert not out.success and out.error_kind == "gone"
    refused = _allocate(side, _tokens(32), "b", path="host")
    assert not refused.success and refused.error_kind == "unavailable"
    assert "released its KV cache memory" in refused.message
    assert side.paths["device"].advertise()["buffers"] == []

    after_resume_memory_occupation(None, scheduler, SimpleNamespace(tags=tags))
    assert _epoch(side) != epoch
    assert _allocate(side, _tokens(32), "c").success
    assert side.target.pending.get("c").state is Moment.ALLOCATED


def test_release_of_other_memory_or_a_busy_server_changes_nothing(side_factory):
    side = side_factory(page_size=16, layer_num=2)
    side.paths["device"] = _landing_path(side.harness, 64)
    assert _allocate(side, _tokens(32), "a").success
    epoch = _epoch(side)
    assert _release(_memory_scheduler(side), ["weights"]) == "released"
    with pytest.raises(AssertionError):  # SGLang refuses a busy server: so do we, quietly
        _release(_memory_scheduler(side, idle=False), ["kv_cache"])
    assert side.target.pending.get("a") is not None and not side.identity.memory_released
    after_resume_memory_occupation(None, _memory_scheduler(side), SimpleNamespace(tags=["weights"]))
    assert _epoch(side) == epoch


# --------------------------------------------------------------------------- client rounds


def _ids_in(body: dict) -> int:
    """How many ids a body carries, as a list or as bytes (feature "binary_ids")."""
    from sglang_kv_migration.wire import binary_ids

    if binary_ids.FIELD in body:
        return binary_ids.count(binary_ids.decode(body[binary_ids.FIELD], 1 << 21))
    return len(body["input_ids"])


def _allocate_on(target: dict, asked: int, call_number: int) -> dict:
    """The allocate reply of `target` (see `_drive`) for a prefix of `asked` tokens."""
    held = min(target["held"], asked)
    extra = asked - held
    assert extra <= target["limit"], "a round larger than the landing arena"
    target["asked"] = asked
    return {
        "success": True,
        "migration_id": f"m{call_number}" if extra else "",
        "matched_token_size": held,
        "extra_token_size": extra,
        "ranks": [
            {"tp_rank": 0, "pp_rank": 0, "kv_indices": [], "kv_pages": list(range(extra // 16))}
        ],
    }


def _drive(steps, target, source_held: int):
    """Answer the client's calls as a source holding `source_held` tokens and `target`
    (a dict: the target's session info, its landing limit and what it holds) would."""
    import orjson
    from sglang_kv_migration.client.calls import encode

    calls, reply = [], None
    try:
        while True:
            call = steps.send(reply)
            calls.append(call)
            body = orjson.loads(encode(call.body))  # what the server would read
            if call.phase == "session_info":
                reply = (200, target["info"])
            elif call.phase == "extra_token_size":
                reply = (200, {"success": True, "matched_token_size": source_held})
            elif call.phase == "allocate":
                reply = (200, _allocate_on(target, _ids_in(body), len(calls)))
            elif call.phase == "transfer":
                allocation = None
                if "allocate_on_target" in body:  # feature source_allocate: one call
                    allocation = _allocate_on(target, _ids_in(body), len(calls))
                    body = {**body, **allocation}
                n = body["extra_token_size"]
                if body.get("partial_ok"):  # sends what it holds (feature partial_transfer)
                    n = max(0, min(n, source_held - body["matched_token_size"]))
                target["sent_to"] = body["matched_token_size"] + n
                reply = (
                    200,
                    {
                        "success": True,
                        "transferred_token_size": n,
                        "transferred_bytes": n * 10,
                        "ranks": [],
                        **({"allocation": allocation} if allocation else {}),
                    },
                )
            elif call.phase == "commit":
                target["held"] = target["sent_to"]
                reply = (200, {"success": True, "matched_after_commit": target["held"]})
            else:
                raise AssertionError(f"unexpected call {call.phase}")
    except StopIteration as done:
        return done.value, calls


@pytest.mark.parametrize(("held", "rounds"), [(0, 4), (96, 3), (200, 1)])
def test_the_client_moves_a_long_prefix_in_landing_sized_rounds(side_factory, held, rounds):
    from sglang_kv_migration.client.migration import SessionCache
    from sglang_kv_migration.client.steps import migration_steps

    side = side_factory(page_size=16, layer_num=2)
    side.paths["device"] = _landing_path(side.harness, 64)
    info = dataclasses.asdict(side.get_transfer_session_info(GetTransferSessionInfoReqInput()))
    info["features"] = []
    target = {"info": info, "limit": 64, "held": held}
    steps = migration_steps("http://src", "http://dst", _tokens(208), None, sessions=SessionCache())
    result, calls = _drive(steps, target, source_held=208)
    assert result.path == "device" and result.rounds == rounds
    assert result.migrated_token_size == 208 - held and target["held"] == 208
    assert result.migrated_bytes == (208 - held) * 10
    assert [c.phase for c in calls].count("commit") == rounds


def test_rounds_without_a_size_query_stop_where_the_source_holds_no_more(side_factory):
    """Feature "partial_transfer": the client asks the source nothing; each round moves
    what the source holds of it, and a short round is the last."""
    from sglang_kv_migration.client.migration import SessionCache
    from sglang_kv_migration.client.steps import migration_steps

    side = side_factory(page_size=16, layer_num=2)
    side.paths["device"] = _landing_path(side.harness, 64)
    info = dataclasses.asdict(side.get_transfer_session_info(GetTransferSessionInfoReqInput()))
    assert features.PARTIAL_TRANSFER in info["features"]
    target = {"info": info, "limit": 64, "held": 0}
    steps = migration_steps("http://src", "http://dst", _tokens(208), None, sessions=SessionCache())
    result, calls = _drive(steps, target, source_held=144)
    assert "extra_token_size" not in [c.phase for c in calls]
    # Single-rank servers on one host: each round one transfer that allocates itself.
    assert "allocate" not in [c.phase for c in calls]
    assert result.rounds == 3 and [c.phase for c in calls].count("commit") == 3
    assert result.migrated_token_size == 144 and target["held"] == 144


def test_the_adapter_reads_the_tags_of_sglangs_own_memory_requests():
    from sglang.srt.managers.io_struct import (
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )

    assert adapter.frees_kv_cache(ReleaseMemoryOccupationReqInput())  # no tags: everything
    assert adapter.frees_kv_cache(ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
    assert not adapter.frees_kv_cache(ReleaseMemoryOccupationReqInput(tags=["weights"]))
    assert adapter.frees_kv_cache(ResumeMemoryOccupationReqInput(tags=["weights", "kv_cache"]))


def test_a_landing_arena_is_mapped_per_send_never_kept():
    """Sources keep no mapping of a landing arena (it would hold the arena's memory on
    the target after a release): `cached=False` hands the caller its own mapping."""
    from sglang_kv_migration.paths.device.cuda_ipc import PeerBuffers

    peers = PeerBuffers()
    try:
        for cached in (False, True):
            future = peers.open_async("arena-1", [{"handle": "not base64!"}], 0, cached=cached)
            with pytest.raises(MigrationError) as info:
                future.result(timeout=30)
            assert info.value.kind is ErrorKind.BAD_REQUEST
            assert len(peers) == 0
    finally:
        peers.close()
