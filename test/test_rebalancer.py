"""`plan_moves`, the rebalancer's pure planning step, with literal loads and requests.

The rebalancer against live servers is in `test_request_migration.py` (it shares that
module's mini servers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_kv_migration.rebalancer import (
    RebalancePolicy,
    ServerLoad,
    _from_get_load,
    _from_v1_loads,
    plan_moves,
)
from sglang_kv_migration.request_migration import GenerateRequest

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
