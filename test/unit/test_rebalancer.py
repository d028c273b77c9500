"""`plan_moves`, the rebalancer's pure planning step, with literal loads and requests.

The rebalancer against live servers is in `test_request_migration.py` (it shares that
module's mini servers).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from sglang_kv_migration.rollout.rebalancer import (
    HeldKV,
    RebalancePolicy,
    ServerLoad,
    plan_moves,
)
from sglang_kv_migration.rollout.request_migration import GenerateRequest
from sglang_kv_migration.rollout.server_loads import from_get_load as _from_get_load
from sglang_kv_migration.rollout.server_loads import from_v1_loads as _from_v1_loads

A, B, C = "http://a", "http://b", "http://c"


@dataclass
class FakeHandle:
    server_url: str
    prio: int | None
    submitted_at: float
    prompt_len: int = 100
    max_new: int = 100
    moving: bool = False
    finished: bool = False
    started: bool | None = None
    moves: list = field(default_factory=list)
    request: GenerateRequest = field(init=False)

    def __post_init__(self) -> None:
        self.request = GenerateRequest(
            list(range(self.prompt_len)), {"max_new_tokens": self.max_new}
        )

    @property
    def priority(self) -> int | None:
        return self.prio

    def done(self) -> bool:
        return self.finished


def load(url: str, waiting: int, demand: int, capacity: int = 1000, ok: bool = True):
    return ServerLoad(url, 1, waiting, demand, demand, capacity, ok)


def test_highest_priority_moves_to_the_least_loaded() -> None:
    # A: demand 120% of its KV (queued prompts included); B 40%, C 10%.
    loads = {A: load(A, 3, 1200), B: load(B, 1, 400), C: load(C, 0, 100)}
    handles = [
        FakeHandle(A, 1, 1.0),
        FakeHandle(A, 5, 2.0),
        FakeHandle(A, 5, 3.0),  # same priority, newer: more likely still queued
        FakeHandle(A, None, 4.0),
        FakeHandle(B, 9, 5.0),  # B is not pressured
    ]
    policy = RebalancePolicy(kv_pressure=0.9, target_max_ratio=0.7, max_concurrent=2)
    moves = plan_moves(loads, handles, policy)
    assert [(m.handle, m.source_url, m.target_url, m.tokens) for m in moves] == [
        (handles[2], A, C, 200),  # C: empty queue
        (handles[1], A, C, 200),  # C and B now queue one each; C has less demand (30%)
    ]  # and A, at 80% after two moves, is no longer pressured: the third stays


def test_concurrency_cap_and_in_flight() -> None:
    loads = {A: load(A, 5, 5000, 1000), B: load(B, 0, 0, 100_000)}
    handles = [FakeHandle(A, p, float(p)) for p in range(5)]
    policy = RebalancePolicy(max_concurrent=3, max_moves_per_round=10)
    assert len(plan_moves(loads, handles, policy)) == 3
    assert len(plan_moves(loads, handles, policy, in_flight=2)) == 1
    assert plan_moves(loads, handles, policy, in_flight=3) == []
    assert len(plan_moves(loads, handles, RebalancePolicy(max_moves_per_round=1))) == 1


def test_no_move_without_pressure_or_room() -> None:
    policy = RebalancePolicy(kv_pressure=0.9, target_max_ratio=0.7)
    handles = [FakeHandle(A, 1, 1.0), FakeHandle(A, 2, 2.0)]
    # A is full but has nothing queued: nothing to move.
    assert plan_moves({A: load(A, 0, 1000), B: load(B, 0, 0)}, handles, policy) == []
    # A has a queue but spare KV (80% < 90%).
    assert plan_moves({A: load(A, 2, 800), B: load(B, 0, 0)}, handles, policy) == []
    # B would go above 70% with a 200-token request; a down server takes nothing.
    loads = {A: load(A, 2, 990), B: load(B, 0, 550), C: load(C, 0, 0, ok=False)}
    assert plan_moves(loads, handles, policy) == []
    # Moving or finished requests are not candidates; only as many as are queued move.
    handles = [
        FakeHandle(A, 9, 1.0, moving=True),
        FakeHandle(A, 8, 2.0, finished=True),
        FakeHandle(A, 1, 3.0),
        FakeHandle(A, 0, 4.0),
    ]
    moves = plan_moves({A: load(A, 1, 990), B: load(B, 0, 0)}, handles, policy)
    assert [m.handle for m in moves] == [handles[2]]


def test_moves_stop_once_the_source_is_relieved() -> None:
    # A at 95% with 3 queued; each move takes 200 tokens of demand off it.
    loads = {A: load(A, 3, 950), B: load(B, 0, 0, 10_000)}
    handles = [FakeHandle(A, 1, float(i)) for i in range(3)]
    policy = RebalancePolicy(kv_pressure=0.9, max_concurrent=5, max_moves_per_round=5)
    assert len(plan_moves(loads, handles, policy)) == 1  # 750/1000 after one move


def test_low_priority_values_first() -> None:
    loads = {A: load(A, 1, 990), B: load(B, 0, 0)}
    handles = [FakeHandle(A, 1, 1.0), FakeHandle(A, 7, 2.0)]
    default = plan_moves(loads, handles, RebalancePolicy())
    inverted = plan_moves(loads, handles, RebalancePolicy(low_priority_values_first=True))
    assert [m.handle for m in default] == [handles[1]]
    assert [m.handle for m in inverted] == [handles[0]]


def test_unknown_capacity_uses_queues() -> None:
    # `/get_load` gives no capacity: a queue is pressure, an empty queue is room.
    legacy = [
        {
            "dp_rank": 0,
            "num_reqs": 5,
            "num_waiting_reqs": 2,
            "num_tokens": 900,
            "num_pending_tokens": 300,
        }
    ]
    a = _from_get_load(A, legacy)
    assert (a.num_running, a.num_waiting, a.used_tokens, a.demand_tokens) == (3, 2, 600, 900)
    assert a.capacity_tokens == 0
    b = ServerLoad(B)
    moves = plan_moves({A: a, B: b}, [FakeHandle(A, 1, 1.0)], RebalancePolicy())
    assert [(m.source_url, m.target_url) for m in moves] == [(A, B)]


def test_v1_loads_sum_dp_ranks() -> None:
    rank = {
        "num_running_reqs": 2,
        "num_waiting_reqs": 1,
        "num_used_tokens": 100,
        "num_total_tokens": 150,
        "max_total_num_tokens": 1000,
    }
    got = _from_v1_loads(A, [rank, rank])
    assert (got.num_running, got.num_waiting, got.demand_tokens, got.capacity_tokens) == (
        4,
        2,
        300,
        2000,
    )
    assert got.demand_ratio == 0.15


def test_requests_already_decoding_stay_unless_asked() -> None:
    loads = {A: load(A, 2, 2000), B: load(B, 0, 0)}
    running, queued = FakeHandle(A, 9, 1.0, started=True), FakeHandle(A, 1, 2.0, started=False)
    unknown = FakeHandle(A, 1, 3.0)  # an adopted call: its state is unknown
    policy = RebalancePolicy(max_concurrent=4)
    moved = [m.handle for m in plan_moves(loads, [running, queued, unknown], policy)]
    assert moved == [unknown, queued]  # the high-priority one is running: it stays
    everything = RebalancePolicy(max_concurrent=4, move_running=True)
    planned = plan_moves(loads, [running, queued, unknown], everything)
    assert planned[0].handle is running


def test_full_running_slots_are_pressure() -> None:
    """KV has room (30%) but every running slot is taken and requests queue: pressured."""
    slots_full = ServerLoad(A, 8, 2, 300, 300, 1000, True, max_running=8)
    room = ServerLoad(A, 7, 2, 300, 300, 1000, True, max_running=8)
    policy = RebalancePolicy(kv_pressure=0.9)
    assert policy.is_pressured(slots_full) and not policy.is_pressured(room)
    handles = [FakeHandle(A, 5, 1.0)]
    moves = plan_moves({A: slots_full, B: load(B, 0, 0)}, handles, policy)
    assert [m.handle for m in moves] == [handles[0]]
    assert plan_moves({A: room, B: load(B, 0, 0)}, handles, policy) == []


def test_scene_policy_moves_only_urgent_requests_whose_kv_the_source_holds() -> None:
    """min_priority keeps low-priority requests home; min_held_tokens keeps home those the
    source holds no KV for, on either tier (host-only counts)."""
    loads = {A: load(A, 5, 2000), B: load(B, 0, 0, 100_000)}
    on_host = FakeHandle(A, 10, 1.0)
    on_gpu = FakeHandle(A, 10, 2.0)
    uncached = FakeHandle(A, 10, 3.0)
    low = FakeHandle(A, 0, 4.0)
    decoding = FakeHandle(A, 10, 5.0, started=True)
    handles = [on_host, on_gpu, uncached, low, decoding]
    held = {
        id(on_host): HeldKV(4096, device_tokens=0),
        id(on_gpu): HeldKV(4096, device_tokens=4096),
        id(low): HeldKV(4096, device_tokens=4096),
        id(decoding): HeldKV(4096, device_tokens=4096),
    }
    policy = RebalancePolicy(min_priority=10, min_held_tokens=16, max_concurrent=8)
    moves = plan_moves(loads, handles, policy, held=held)
    assert [m.handle for m in moves] == [on_gpu, on_host]  # newest first, both tiers
    assert [m.held.device_tokens for m in moves] == [4096, 0]
    # Without the held sizes nothing qualifies; without the filters the others move too.
    assert plan_moves(loads, handles, policy) == []
    anything = plan_moves(loads, handles, RebalancePolicy(max_concurrent=8))
    assert [m.handle for m in anything] == [uncached, on_gpu, on_host, low]
    # With smaller values more urgent, min_priority is an upper bound.
    inverted = RebalancePolicy(min_priority=0, low_priority_values_first=True, max_concurrent=8)
    assert [m.handle for m in plan_moves(loads, handles, inverted)] == [low]


def test_v1_loads_running_slots() -> None:
    rank = {
        "num_running_reqs": 2,
        "num_waiting_reqs": 1,
        "num_used_tokens": 100,
        "num_total_tokens": 150,
        "max_total_num_tokens": 1000,
        "max_running_requests": 48,
    }
    assert _from_v1_loads(A, [rank, rank]).max_running == 96


def test_a_request_moves_once_unless_allowed_more() -> None:
    loads = {A: load(A, 2, 2000), B: load(B, 0, 0)}
    moved_before, fresh = FakeHandle(A, 9, 1.0, moves=["a move"]), FakeHandle(A, 1, 2.0)
    policy = RebalancePolicy(max_concurrent=4)
    assert [m.handle for m in plan_moves(loads, [moved_before, fresh], policy)] == [fresh]
    twice = RebalancePolicy(max_concurrent=4, max_moves_per_request=2)
    assert plan_moves(loads, [moved_before, fresh], twice)[0].handle is moved_before


def test_moves_to_one_target_stay_within_its_free_gpu_pool() -> None:
    """The RL scene at 16K: B's GPU pool holds three moved histories, not four. Each move
    claims the tokens the source holds; B takes moves while its free slots (capacity less
    what running requests hold) less those claims still hold the next one."""
    a = ServerLoad(A, 8, 6, 60_000, 200_000, 65_536, True, max_running=8)
    # B: 65,536 slots, 15,000 held by its own running requests; its demand leaves room;
    # its host pool is full of pages nobody may evict.
    b = ServerLoad(B, 2, 0, 15_000, 15_000, 65_536, True, max_running=48, host_headroom_tokens=0)
    handles = [FakeHandle(A, 10, float(i), prompt_len=16_401, max_new=64) for i in range(6)]
    held = {id(h): HeldKV(16_400, device_tokens=0) for h in handles}
    # Demand ratios out of the way (A stays pressured: its running slots are full), so
    # the GPU pool is what limits B.
    policy = RebalancePolicy(
        kv_pressure=5.0,
        target_max_ratio=10.0,
        min_priority=10,
        min_held_tokens=16,
        max_concurrent=8,
        max_moves_per_round=8,
    )
    moves = plan_moves({A: a, B: b}, handles, policy, held=held)
    # 50,536 free: three moves of 16,400 (49,200), not a fourth.
    assert len(moves) == 3
    assert {m.target_url for m in moves} == {B}
    assert [m.kv_tokens for m in moves] == [16_400] * 3
    assert [m.path for m in moves] == ["device"] * 3
    assert moves[0].to_dict()["kv_tokens"] == 16_400
    # Moves still in flight from an earlier round claim their part: one more fits.
    later = plan_moves({A: a, B: b}, handles, policy, held=held, claimed={B: 2 * 16_400})
    assert len(later) == 1
    # Without the check, all six would go.
    unchecked = dataclasses.replace(policy, kv_headroom=False)
    assert len(plan_moves({A: a, B: b}, handles, unchecked, held=held)) == 6


def test_headroom_spreads_moves_and_counts_the_prompt_when_held_is_unknown() -> None:
    # B has the shorter queue but room for one 600-token prompt; C has room for more.
    a = ServerLoad(A, 8, 4, 5000, 5000, 1000, True, max_running=8)  # slots full
    b = ServerLoad(B, 0, 0, 1_300, 1_300, 2_000, True)  # 700 free
    c = ServerLoad(C, 0, 1, 1_000, 1_000, 10_000, True)  # 9,000 free, one queued
    handles = [FakeHandle(A, 5, float(i), prompt_len=600, max_new=0) for i in range(3)]
    policy = RebalancePolicy(
        kv_pressure=5.0, target_max_ratio=10.0, max_concurrent=4, max_moves_per_round=4
    )
    moves = plan_moves({A: a, B: b, C: c}, handles, policy)
    assert [m.target_url for m in moves] == [B, C, C]  # B: room for one prompt only
    assert [m.kv_tokens for m in moves] == [600, 600, 600]
    unchecked = dataclasses.replace(policy, kv_headroom=False)
    assert [m.target_url for m in plan_moves({A: a, B: b, C: c}, handles, unchecked)] == [
        B,
        C,
        B,  # the shorter queue, though its pool cannot hold it
    ]


def test_free_tokens_need_a_known_capacity() -> None:
    assert ServerLoad(A, used_tokens=300, capacity_tokens=1000).free_tokens == 700
    assert ServerLoad(A, used_tokens=1300, capacity_tokens=1000).free_tokens == 0
    assert ServerLoad(A, used_tokens=300).free_tokens is None  # /get_load: not checked
    assert RebalancePolicy().has_headroom(ServerLoad(A), 10**9, 10**9)


class _Migrator:
    """What `Rebalancer` calls on a migrator: fixed loads, and moves that end only when
    the test lets them (`release`)."""

    def __init__(
        self,
        loads: dict[str, dict],
        handles: list[FakeHandle],
        host_headroom: dict[str, int | Exception] | None = None,
    ) -> None:
        self.loads = loads
        self.handles = handles
        self.host_headroom_of = host_headroom or {}  # default: no host room
        self.release = asyncio.Event()
        self.moved: list[tuple[str, str]] = []
        self.calls: list[tuple[str, str, str | None]] = []  # (target, mode, path)
        self.headroom_asked: list[str] = []

    def live(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.moves]

    async def get_json(self, url: str, path: str) -> dict:
        return {"loads": [self.loads[url]]}

    async def host_headroom(self, url: str) -> int | None:
        self.headroom_asked.append(url)
        value = self.host_headroom_of.get(url, 0)
        if isinstance(value, Exception):
            raise value
        return value

    async def move_request(
        self, handle: FakeHandle, target: str, mode: str, path: str | None = None, live=False
    ):
        self.calls.append((target, mode, path))
        handle.moving = True
        await self.release.wait()
        handle.moving, handle.moves = False, ["moved"]
        self.moved.append((handle.request.rid, target))
        return _Report()


@dataclass
class _Report:
    outcome: str = "migrated"


def _v1(running: int, waiting: int, used: int, capacity: int, max_running: int) -> dict:
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": capacity,
        "max_running_requests": max_running,
    }


def test_moves_in_flight_keep_their_claim_on_the_target_until_they_end() -> None:
    """Round 1 plans two 600-token moves to B (1,500 free); round 2, with both still in
    flight and B's load not showing them yet, plans none; once they end the claim is
    gone and round 3 may move the third."""
    from sglang_kv_migration.rollout.rebalancer import Rebalancer

    loads = {A: _v1(8, 4, 5000, 1000, 8), B: _v1(0, 0, 500, 2000, 48)}
    handles = [FakeHandle(A, 5, float(i), prompt_len=600, max_new=0) for i in range(3)]
    migrator = _Migrator(loads, handles)
    policy = RebalancePolicy(
        kv_pressure=5.0, target_max_ratio=10.0, max_concurrent=8, mode="migrate"
    )
    rebalancer = Rebalancer(migrator, [A, B], policy)  # type: ignore[arg-type]

    async def run() -> tuple[int, int, dict, int]:
        first = len(await rebalancer.step())
        second = len(await rebalancer.step())
        claimed = dict(rebalancer._claimed)
        migrator.release.set()
        await asyncio.gather(*rebalancer._tasks)
        third = len(await rebalancer.step())
        await asyncio.gather(*rebalancer._tasks)
        return first, second, claimed, third

    first, second, claimed, third = asyncio.run(run())
    assert (first, second) == (2, 0)
    assert claimed == {B: 1200}
    assert third == 1
    assert dict(rebalancer._claimed) == {}
    assert len(migrator.moved) == 3


def test_a_started_move_is_not_planned_again_before_it_reaches_the_migrator() -> None:
    """A move marks its handle `moving` only inside `move_request` (in mode auto it
    first reads both servers' metrics): the round right after the one that started it
    must not plan the same request again (it did, then failed "already being moved")."""
    from sglang_kv_migration.rollout.rebalancer import Rebalancer

    loads = {A: _v1(8, 4, 5000, 1000, 8), B: _v1(0, 0, 0, 100_000, 48)}
    handles = [FakeHandle(A, 5, 0.0, prompt_len=64, max_new=0)]
    migrator = _Migrator(loads, handles)
    policy = RebalancePolicy(kv_pressure=5.0, target_max_ratio=10.0, mode="migrate")
    rebalancer = Rebalancer(migrator, [A, B], policy)  # type: ignore[arg-type]

    async def run() -> tuple[int, int, int]:
        first = len(await rebalancer.step())  # the move's task has not run yet
        assert not handles[0].moving
        second = len(await rebalancer.step())
        migrator.release.set()
        await asyncio.gather(*rebalancer._tasks)
        return first, second, len(rebalancer._started)

    first, second, started = asyncio.run(run())
    assert (first, second) == (1, 0)
    assert migrator.moved == [(handles[0].request.rid, B)] and started == 0
    assert rebalancer.summary.errors == []


# -- headroom planning: device pool first, then host pool ---------------------------------


def _sixteen_k_scene(host_headroom: int | None) -> tuple[dict, list[FakeHandle], dict]:
    """A: running slots full, six 16K high-priority turns queued, their KV on A's host
    tier. B: 50,536 free GPU slots (three 16,400-token moves) and `host_headroom`."""
    a = ServerLoad(A, 8, 6, 60_000, 200_000, 65_536, True, max_running=8)
    b = ServerLoad(
        B, 2, 0, 15_000, 15_000, 65_536, True, max_running=48, host_headroom_tokens=host_headroom
    )
    handles = [FakeHandle(A, 10, float(i), prompt_len=16_401, max_new=64) for i in range(6)]
    held = {id(h): HeldKV(16_400, device_tokens=0) for h in handles}
    return {A: a, B: b}, handles, held


_SCENE = RebalancePolicy(
    kv_pressure=5.0,
    target_max_ratio=10.0,
    min_priority=10,
    min_held_tokens=16,
    max_concurrent=8,
    max_moves_per_round=8,
)


def test_moves_beyond_the_gpu_pool_are_planned_into_the_host_pool() -> None:
    """The 16K scene: three moves fit B's GPU pool, the next two its host pool (40,000:
    two of 16,400), through shared memory (the servers share a host), the sixth
    neither: it is not planned and waits."""
    loads, handles, held = _sixteen_k_scene(host_headroom=40_000)
    moves = plan_moves(loads, handles, _SCENE, held=held)
    landed = ["device"] * 3 + ["shared_host"] * 2
    assert [m.path for m in moves] == landed
    assert [m.to_dict()["path"] for m in moves] == landed
    assert {m.target_url for m in moves} == {B}
    # Host-pool moves still in flight claim their part of the host pool.
    later = plan_moves(loads, handles, _SCENE, held=held, claimed_host={B: 30_000})
    assert [m.path for m in later] == ["device"] * 3  # 10,000 host slots left: no 16,400
    # A host pool that says nothing is not checked: every move is planned.
    unknown, _, _ = _sixteen_k_scene(host_headroom=None)
    assert [m.path for m in plan_moves(unknown, handles, _SCENE, held=held)] == (
        ["device"] * 3 + ["shared_host"] * 3
    )


def test_the_host_pool_landing_order_is_shared_memory_then_the_host_path() -> None:
    """GPU pool first, then on one host the target's host tier through shared memory;
    the host path (Mooncake) only across hosts or where the servers do not offer it.
    Shared-host and host moves claim the same pool: two of 16,400 fit 40,000."""
    loads, handles, held = _sixteen_k_scene(host_headroom=40_000)
    no_shm = dataclasses.replace(_SCENE, shared_host=False)
    assert [m.path for m in plan_moves(loads, handles, no_shm, held=held)] == (
        ["device"] * 3 + ["host"] * 2
    )
    across = dataclasses.replace(_SCENE, device_path=False)  # two hosts: shared_host off too
    assert [m.path for m in plan_moves(loads, handles, across, held=held)] == ["host"] * 2
    mixed_claims = plan_moves(loads, handles, _SCENE, held=held, claimed_host={B: 20_000})
    assert [m.path for m in mixed_claims] == ["device"] * 3 + ["shared_host"]


def test_a_move_that_fits_neither_pool_is_planned_as_recompute_when_asked() -> None:
    loads, handles, held = _sixteen_k_scene(host_headroom=20_000)
    policy = dataclasses.replace(_SCENE, no_room="recompute")
    moves = plan_moves(loads, handles, policy, held=held)
    assert [m.path for m in moves] == ["device"] * 3 + ["shared_host"] + ["recompute"] * 2
    # Re-prefill allocates nothing at once: a later round's claims do not count it.
    waits = plan_moves(loads, handles, _SCENE, held=held)
    assert [m.path for m in waits] == ["device"] * 3 + ["shared_host"]


def test_without_a_device_path_every_migration_is_planned_against_the_host_pool() -> None:
    loads, handles, held = _sixteen_k_scene(host_headroom=40_000)
    cross_host = dataclasses.replace(_SCENE, device_path=False)
    assert [m.path for m in plan_moves(loads, handles, cross_host, held=held)] == ["host"] * 2


def test_recompute_mode_and_unchecked_headroom_say_so() -> None:
    loads, handles, held = _sixteen_k_scene(host_headroom=0)
    recompute = dataclasses.replace(_SCENE, mode="recompute")
    assert [m.path for m in plan_moves(loads, handles, recompute, held=held)] == ["recompute"] * 6
    unchecked = dataclasses.replace(_SCENE, kv_headroom=False)
    assert [m.path for m in plan_moves(loads, handles, unchecked, held=held)] == [""] * 6


def test_a_target_whose_gpu_pool_fits_is_preferred_to_a_shorter_queue_on_host() -> None:
    """B has the empty queue but only host room; C queues one and has GPU room."""
    a = ServerLoad(A, 8, 4, 5000, 5000, 1000, True, max_running=8)
    b = ServerLoad(B, 0, 0, 2_000, 2_000, 2_000, True, host_headroom_tokens=10_000)
    c = ServerLoad(C, 0, 1, 1_000, 1_000, 10_000, True, host_headroom_tokens=0)
    handles = [FakeHandle(A, 5, 0.0, prompt_len=600, max_new=0)]
    policy = RebalancePolicy(kv_pressure=5.0, target_max_ratio=10.0)
    moves = plan_moves({A: a, B: b, C: c}, handles, policy)
    assert [(m.target_url, m.path) for m in moves] == [(C, "device")]
    full_c = dataclasses.replace(c, used_tokens=9_900)
    moves = plan_moves({A: a, B: b, C: full_c}, handles, policy)
    assert [(m.target_url, m.path) for m in moves] == [(B, "shared_host")]


def test_the_rebalancer_asks_host_headroom_and_pins_host_pool_moves_to_their_path() -> None:
    """Round 1: B's GPU pool (1,500 free) takes two 600-token moves, its host pool (700)
    one more, pinned to path "shared_host" (one host) or, across hosts, "host"; the
    fourth waits. Round 2, all in flight, plans
    nothing; the claims on both pools end with the moves. A server that cannot say its
    host headroom is not checked; pressured servers are not asked."""
    from sglang_kv_migration.rollout.rebalancer import Rebalancer

    loads = {A: _v1(8, 4, 5000, 1000, 8), B: _v1(0, 0, 500, 2000, 48)}
    handles = [FakeHandle(A, 5, float(i), prompt_len=600, max_new=0) for i in range(4)]
    migrator = _Migrator(loads, handles, host_headroom={B: 700})
    policy = RebalancePolicy(
        kv_pressure=5.0, target_max_ratio=10.0, max_concurrent=8, mode="migrate"
    )
    rebalancer = Rebalancer(migrator, [A, B], policy)  # type: ignore[arg-type]

    async def run() -> tuple[list[str], int, dict, dict]:
        first = [m.path for m in await rebalancer.step()]
        second = len(await rebalancer.step())
        claims = (dict(rebalancer._claimed), dict(rebalancer._claimed_host))
        migrator.release.set()
        await asyncio.gather(*rebalancer._tasks)
        return first, second, *claims

    first, second, device_claims, host_claims = asyncio.run(run())
    assert first == ["device", "device", "shared_host"] and second == 0
    assert (device_claims, host_claims) == ({B: 1200}, {B: 600})
    assert Counter(migrator.calls) == {(B, "migrate", None): 2, (B, "migrate", "shared_host"): 1}
    assert migrator.headroom_asked == [B, B]
    assert (dict(rebalancer._claimed), dict(rebalancer._claimed_host)) == ({}, {})
    assert rebalancer.summary.last_loads[B].host_headroom_tokens == 700

    # B cannot say (an older server): its host pool is not checked.
    handles = [FakeHandle(A, 5, float(i), prompt_len=600, max_new=0) for i in range(4)]
    silent = _Migrator(loads, handles, host_headroom={B: RuntimeError("422")})
    rebalancer = Rebalancer(silent, [A, B], policy)  # type: ignore[arg-type]

    async def once() -> list[str]:
        paths = [m.path for m in await rebalancer.step()]
        silent.release.set()
        await asyncio.gather(*rebalancer._tasks)
        return paths

    assert asyncio.run(once()) == ["device", "device", "shared_host", "shared_host"]
    assert rebalancer.summary.last_loads[B].host_headroom_tokens is None

    # Across hosts the same move is pinned to the host path.
    handles = [FakeHandle(A, 5, float(i), prompt_len=600, max_new=0) for i in range(4)]
    across = _Migrator(loads, handles, host_headroom={B: 700})
    rebalancer = Rebalancer(across, [A, B], dataclasses.replace(policy, device_path=False))  # type: ignore[arg-type]

    async def across_hosts() -> list[str]:
        paths = [m.path for m in await rebalancer.step()]
        across.release.set()
        await asyncio.gather(*rebalancer._tasks)
        return paths

    assert asyncio.run(across_hosts()) == ["host"]
    assert across.calls == [(B, "migrate", "host")]


def test_a_move_planned_as_recompute_re_prefills_and_claims_nothing() -> None:
    from sglang_kv_migration.rollout.rebalancer import Rebalancer

    loads = {A: _v1(8, 4, 5000, 1000, 8), B: _v1(0, 0, 1900, 2000, 48)}
    handles = [FakeHandle(A, 5, 0.0, prompt_len=600, max_new=0)]
    migrator = _Migrator(loads, handles, host_headroom={B: 0})
    policy = RebalancePolicy(
        kv_pressure=5.0, target_max_ratio=10.0, no_room="recompute", mode="migrate"
    )
    rebalancer = Rebalancer(migrator, [A, B], policy)  # type: ignore[arg-type]

    async def run() -> tuple[list[str], dict, dict]:
        paths = [m.path for m in await rebalancer.step()]
        claims = (dict(rebalancer._claimed), dict(rebalancer._claimed_host))
        migrator.release.set()
        await asyncio.gather(*rebalancer._tasks)
        return paths, *claims

    paths, device_claims, host_claims = asyncio.run(run())
    assert paths == ["recompute"] and (device_claims, host_claims) == ({}, {})
    assert migrator.calls == [(B, "recompute", None)]


def test_moves_that_start_during_a_cost_refresh_wait_for_it() -> None:
    """Two moves of one pair start together: the second must not price with the model
    the first one's refresh is replacing (one refresh, both after it)."""
    from sglang_kv_migration.rollout.rebalancer import Rebalancer

    class SlowRefresh:
        def __init__(self) -> None:
            self.refreshes = 0
            self.release = asyncio.Event()

        async def refresh_cost_model(self, source: str, target: str) -> None:
            self.refreshes += 1
            await self.release.wait()

    async def scenario() -> tuple[list[bool], int]:
        migrator = SlowRefresh()
        rebalancer = Rebalancer(migrator, [A, B], RebalancePolicy(mode="auto"))  # type: ignore[arg-type]
        learning = [asyncio.ensure_future(rebalancer._learn_costs(A, B)) for _ in range(2)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        waiting = [not task.done() for task in learning]
        migrator.release.set()
        await asyncio.gather(*learning)
        await rebalancer._learn_costs(A, B)  # learned lately: no refresh, no wait
        return waiting, migrator.refreshes

    waiting, refreshes = asyncio.run(scenario())
    assert waiting == [True, True] and refreshes == 1
