"""Prometheus metrics and the per-migration log line, on a real scheduler side (one rank)."""

from __future__ import annotations

import logging
import time

import pytest
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
)
from side_helpers import receipts_for, transfer_to_self


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        name, {"model_name": "tiny", "tp_rank": "0", "pp_rank": "0", **labels}
    )
    return value or 0.0


def _allocate(side, ids: list[int], migration_id: str):
    return side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=ids,
            migration_id=migration_id,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
        )
    )


def test_target_outcomes_tokens_bytes_and_phases(side, caplog) -> None:
    before = {
        o: _sample("sglang:kv_migration_total", role="target", outcome=o)
        for o in ("allocated", "committed", "aborted", "expired")
    }
    tokens_before = _sample("sglang:kv_migration_tokens_total", role="target")
    bytes_before = _sample("sglang:kv_migration_bytes_total", role="target")
    pending_before = _sample("sglang:kv_migration_phase_seconds_count", phase="pending")

    out = _allocate(side, list(range(1000, 1064)), "m-commit")
    assert out.success, out.message
    receipts = receipts_for(side, out)
    with caplog.at_level(logging.INFO, logger="sglang_kv_migration.server.target.commits"):
        assert side.commit_transfer_request_kvcache(
            CommitTransferRequestKVCacheReqInput(migration_id="m-commit", receipts=receipts)
        ).success
        # The line is kept back until the rank has nothing in flight (`deferred_log.py`).
        assert not [r for r in caplog.records if "m-commit committed" in r.getMessage()]
        side.poll()
    # A repeated commit is harmless and counts nothing.
    assert side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="m-commit")
    ).success
    lines = [r.getMessage() for r in caplog.records if "m-commit committed" in r.getMessage()]
    assert len(lines) == 1
    assert f"64 tokens, {64 * side.identity.bytes_per_token} bytes" in lines[0]

    assert _allocate(side, list(range(2000, 2032)), "m-abort").success
    assert side.abort_transfer(AbortTransferReqInput(migration_id="m-abort")).success

    assert _allocate(side, list(range(3000, 3032)), "m-expire").success
    # Past its deadline by the side's own clock (moved, not waited for).
    real_clock = side.target.pending.clock
    side.target.pending.clock = lambda: real_clock() + 3600.0
    for _ in range(200):  # the watchdog runs every 64 iterations
        side.poll()
        if not len(side.target.pending):
            break

    after = {
        o: _sample("sglang:kv_migration_total", role="target", outcome=o)
        for o in ("allocated", "committed", "aborted", "expired")
    }
    assert {o: after[o] - before[o] for o in after} == {
        "allocated": 3,
        "committed": 1,
        "aborted": 1,
        "expired": 1,
    }
    assert _sample("sglang:kv_migration_tokens_total", role="target") - tokens_before == 64
    assert (
        _sample("sglang:kv_migration_bytes_total", role="target") - bytes_before
        == 64 * side.identity.bytes_per_token
    )
    assert _sample("sglang:kv_migration_phase_seconds_count", phase="pending") - pending_before == 1


def test_failed_send_is_counted(side) -> None:
    before = _sample("sglang:kv_migration_total", role="source", outcome="send_failed")
    # The source does not hold this prefix: the transfer fails before any byte moves.
    alloc = _allocate(side, list(range(6000, 6032)), "m-failed-send")
    req = transfer_to_self(
        side,
        list(range(5000, 5032)),
        alloc.ranks[0].kv_indices,
        alloc.ranks[0].grant,
        migration_id="m-failed-send",
    )
    assert side.transfer_request_kvcache(req) is None
    side.poll()
    assert len(side.replies) == 1 and not side.replies[0].success
    assert "holds only 0 tokens" in side.replies[0].message
    assert _sample("sglang:kv_migration_total", role="source", outcome="send_failed") == before + 1


def test_scheduler_time_is_recorded_per_busy_iteration(side) -> None:
    count = "sglang:kv_migration_scheduler_seconds_count"
    before = _sample(count)
    timer = side.diagnostics.loop_timer
    handlers = dict(side.handlers())
    side.poll()  # idle: nothing of ours ran, nothing recorded
    assert _sample(count) == before
    iterations = timer.iterations
    # A handler in this iteration, then the poll that closes it: one observation.
    request = AllocateTokenForTransferReqInput(
        input_ids=list(range(7000, 7032)),
        migration_id="m-loop",
        source_fingerprints=[side.identity.fingerprint.to_dict()],
    )
    assert handlers[AllocateTokenForTransferReqInput](request).success
    side.poll()
    assert _sample(count) == before + 1
    assert timer.iterations == iterations + 1
    assert 0 < timer.max_s < 5.0
    assert _sample("sglang:kv_migration_scheduler_seconds_sum") > 0
    assert side.abort_transfer(AbortTransferReqInput(migration_id="m-loop")).success


def test_every_iteration_is_accounted_idle_ones_too(side, monkeypatch) -> None:
    from sglang_kv_migration.server.diag import metrics

    seconds, iterations = (
        "sglang:kv_migration_poll_seconds_total",
        "sglang:kv_migration_poll_iterations_total",
    )
    monkeypatch.setattr(metrics, "ACCOUNT_FLUSH_S", 0.0)  # export on every timed iteration
    monkeypatch.setattr(metrics, "IDLE_FLUSH_ITERATIONS", 4)  # and every 4 idle ones
    timer = side.diagnostics.loop_timer
    for _ in range(8):
        side.poll()  # flushes whatever the fixture's earlier iterations left
    before_s, before_n = _sample(seconds), _sample(iterations)
    for _ in range(8):
        side.poll()  # idle: returns at once, counted but not timed
    assert _sample(iterations) == before_n + 8
    assert _sample(seconds) == before_s
    assert not timer.handled
    # A handler ran: that iteration is timed, and its time exported.
    request = AllocateTokenForTransferReqInput(
        input_ids=list(range(9000, 9016)),
        migration_id="m-account",
        source_fingerprints=[side.identity.fingerprint.to_dict()],
    )
    assert dict(side.handlers())[AllocateTokenForTransferReqInput](request).success
    assert timer.handled
    side.poll()
    assert _sample(iterations) == before_n + 9
    assert 0 < _sample(seconds) - before_s < 1.0
    assert side.abort_transfer(AbortTransferReqInput(migration_id="m-account")).success


class _TickingTime:
    """`time` for the loop timer with a `perf_counter` that ticks 1 us per read, so which
    part of an iteration is heaviest is decided by the test, not by the machine's load
    (on a busy 2-core box the poll's GIL hand-off outlasted a 64-token allocate)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_worst_iteration_is_broken_down_by_part(side, monkeypatch) -> None:
    """The worst iteration's parts name the handler that ran and the poll's steps, and
    add up to `max_s`; a lighter iteration later does not replace them."""
    from sglang_kv_migration.server.diag import metrics

    clock = _TickingTime()
    monkeypatch.setattr(metrics, "time", clock)
    allocate = side.allocate_token_for_transfer

    def heavy_allocate(req):  # the handler's work takes 1 ms of the ticking clock
        clock.now += 1e-3
        return allocate(req)

    monkeypatch.setattr(side, "allocate_token_for_transfer", heavy_allocate)
    timer = side.diagnostics.loop_timer
    timer.reset()
    handlers = dict(side.handlers())
    request = AllocateTokenForTransferReqInput(
        input_ids=list(range(8000, 8064)),
        migration_id="m-parts",
        source_fingerprints=[side.identity.fingerprint.to_dict()],
    )
    assert handlers[AllocateTokenForTransferReqInput](request).success
    side.poll()
    parts = dict(timer.worst_parts)
    assert set(parts) == {
        "AllocateTokenForTransferReqInput",
        "poll.transfers",
        "poll.staged_commits",
        "poll.yield",  # a migration is pending: the GIL is offered to our helper threads
        "poll",
    }
    assert all(seconds >= 0 for seconds in parts.values())
    assert sum(parts.values()) == timer.max_s > 0
    assert parts["AllocateTokenForTransferReqInput"] == max(parts.values())
    side.poll()  # pending: recorded, but only the poll ran
    assert timer.worst_parts == parts
    timer.reset()
    assert (timer.max_s, timer.worst_parts) == (0.0, {})
    assert side.abort_transfer(AbortTransferReqInput(migration_id="m-parts")).success


def test_diagnose_charges_collections_and_cpu_time_per_part() -> None:
    """With `diagnose`, a garbage collection inside a handler is its own `gc` part (the
    handler keeps the rest, the sum stays the total) and every part has a CPU probe;
    outside our parts a collection is not charged."""
    import gc

    from sglang_kv_migration.server.diag.metrics import LoopTimer, NullMetrics

    class FakeReq:
        pass

    timer = LoopTimer(NullMetrics())
    timer.diagnose()
    try:
        collecting = timer.timed(lambda req: gc.collect())
        collecting(FakeReq())
        gc.collect()  # between the handler and the poll: SGLang's time
        timer.begin_poll()
        timer.lap("poll.step")
        timer.end_iteration(active=False)
    finally:
        timer.diagnose(cpu=False, collections=False)
    assert timer._on_gc not in gc.callbacks
    parts = timer.worst_parts
    assert set(parts) == {"FakeReq", "gc", "poll.step", "poll"}
    assert 0 < parts["gc"] <= timer.max_s
    assert sum(parts.values()) == timer.max_s
    assert set(timer.worst_probe_parts) == {"FakeReq", "poll.step", "poll"}
    cpu, voluntary, involuntary = timer.worst_probe_parts["FakeReq"]
    assert cpu > 0 and voluntary >= 0 and involuntary >= 0
    # Idle: no handler ran and nothing is in flight, so nothing is recorded.
    timer.reset()
    timer.begin_poll()
    timer.end_iteration(active=False)
    assert timer.worst_parts == {} and timer.iterations == 1


def test_a_finished_send_reports_its_routes_and_fixed_cost(side) -> None:
    """A real host-path send to this same server (loopback): its bytes and wire time land
    on the host -> host route, the rest of the transfer as the host path's fixed cost,
    and the cost model learns that route's rate from the registry's own text."""
    from prometheus_client import REGISTRY, generate_latest
    from sglang_kv_migration.rollout.cost_model import HOST_TO_HOST, CostModel

    route = {"path": "host", "route": HOST_TO_HOST}
    bytes_before = _sample("sglang:kv_migration_route_bytes_total", **route)
    seconds_before = _sample("sglang:kv_migration_route_seconds_total", **route)
    fixed_before = _sample("sglang:kv_migration_fixed_seconds_count", path="host")
    ids = list(range(7000, 7064))
    side.harness.insert_random(ids, seed=5)
    alloc = _allocate(side, list(range(9000, 9064)), "m-routes")
    assert alloc.success, alloc.message
    req = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="m-routes"
    )
    assert side.transfer_request_kvcache(req) is None
    deadline = time.monotonic() + 30
    while not side.replies and time.monotonic() < deadline:
        side.poll()
        time.sleep(0.001)
    assert len(side.replies) == 1 and side.replies[0].success, side.replies
    sent = side.replies[0].transferred_bytes
    assert sent == 64 * side.identity.bytes_per_token

    assert _sample("sglang:kv_migration_route_bytes_total", **route) - bytes_before == sent
    wire_s = _sample("sglang:kv_migration_route_seconds_total", **route) - seconds_before
    assert wire_s > 0
    assert _sample("sglang:kv_migration_fixed_seconds_count", path="host") == fixed_before + 1
    assert _sample("sglang:kv_migration_fixed_seconds_sum", path="host") >= 0
    # The device routes saw nothing.
    assert _sample("sglang:kv_migration_route_bytes_total", path="device", route="gpu_to_gpu") == 0

    # This side's series only (other tests record other model names in the same registry).
    lines = generate_latest(REGISTRY).decode().splitlines()
    text = "\n".join(line for line in lines if 'model_name="tiny"' in line)
    total_bytes = _sample("sglang:kv_migration_route_bytes_total", **route)
    total_s = _sample("sglang:kv_migration_route_seconds_total", **route)
    learned = CostModel.from_metrics(text, None).routes[HOST_TO_HOST]
    assert learned.origin == "metrics"
    assert learned.bandwidth_bytes_per_s == pytest.approx(total_bytes / total_s)
