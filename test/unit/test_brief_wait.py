"""The scheduler's brief wait for what its transfers wait for (`RankLoop.wait_briefly`,
`SourceTransfers.awaited`, `spin_until`), SGLang's state as the loop reads it
(`IdleProbe`) and the log lines kept back until a rank is idle (`deferred_log.py`)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_kv_migration.paths.device.send_job import TierSendJob
from sglang_kv_migration.server.diag import deferred_log
from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.scheduler import loop
from sglang_kv_migration.server.scheduler.idle_probe import IdleProbe
from sglang_kv_migration.server.scheduler.loop import RankLoop, spin_until
from sglang_kv_migration.server.source import inflight as source_transfers
from sglang_kv_migration.server.source import target_asks
from sglang_kv_migration.server.source.target_asks import TargetAsks
from sglang_kv_migration.server.source.transfers import InflightTransfer, SourceTransfers


class _Event:
    """A CUDA event's `query` (done or not)."""

    def __init__(self, done: bool = False):
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class _Caller:
    def __init__(self, waiting: int = 0, replied: bool = False):
        self.waiting = waiting
        self._replied = replied

    def replied(self) -> bool:
        return self._replied


class _Job:
    def __init__(self, event: Any):
        self.completion_event = event


def _transfers(caller: Any, inflight: list[InflightTransfer]) -> SourceTransfers:
    # `awaited` and `poll` read only these attributes (and `poll` the ones tests set).
    transfers = SourceTransfers.__new__(SourceTransfers)
    transfers.asks = TargetAsks(caller, lambda: {}) if caller is not None else None
    transfers.inflight = inflight
    return transfers


def _inflight(job: Any = None, allocating: bytes = b"") -> InflightTransfer:
    inflight = InflightTransfer(request=SimpleNamespace())  # type: ignore[arg-type]
    if allocating:
        inflight.ask_target(allocating, answer_by=0.0)
    if job is not None:
        inflight.sending(job)
    return inflight


def test_spin_until_returns_when_ready_interrupted_or_out_of_time() -> None:
    calls = iter([False, False, True])
    assert spin_until(lambda: next(calls), lambda: False, 1.0)
    assert not spin_until(lambda: False, lambda: True, 1.0)  # a request came: stop
    started = time.perf_counter()
    assert not spin_until(lambda: False, lambda: False, 0.01)
    assert 0.01 <= time.perf_counter() - started < 1.0  # bounded


def test_awaited_covers_allocate_replies_and_copy_events_only() -> None:
    event = _Event()
    waiting_reply = _inflight(allocating=b"call")
    copying = _inflight(job=_Job(event))
    caller = _Caller(waiting=1)
    ready = _transfers(caller, [waiting_reply, copying]).awaited()
    assert ready is not None and not ready()
    caller._replied = True
    assert ready()  # the target answered
    caller._replied = False
    event.done = True
    assert ready()  # the copy is done

    only_copy = _transfers(_Caller(waiting=0), [_inflight(job=_Job(_Event(done=True)))]).awaited()
    assert only_copy is not None and only_copy()

    # Nothing to wait for, or something the poll must do or another thread does: None.
    assert _transfers(_Caller(), []).awaited() is None
    assert _transfers(None, [copying]).awaited() is None  # a multi-rank source
    assert _transfers(_Caller(), [_inflight(job=_Job(None))]).awaited() is None  # host path
    assert _transfers(_Caller(), [_inflight()]).awaited() is None  # failed or answered
    prepared_next = _transfers(_Caller(waiting=1), [waiting_reply])
    prepared_next.asks.to_prepare = [waiting_reply]
    assert prepared_next.awaited() is None
    # An answer the HTTP layer asked for ahead waits for the poll: nothing to wait for.
    answered_ahead = _transfers(_Caller(waiting=0), [waiting_reply])
    answered_ahead.asks.ahead[b"ahead:1"] = b"{}"
    assert answered_ahead.awaited() is None


def test_a_device_job_waits_only_on_its_copy_once_launched() -> None:
    job = TierSendJob(pin=SimpleNamespace(release=lambda: None))
    assert job.completion_event is None  # not launched
    end = _Event()
    job.launched(_Event(), end, {})
    assert job.completion_event is end
    job.digest_pieces = []  # verify: a digest on a helper thread follows the copy
    assert job.completion_event is None


def _polled(started: int, prepare: bool = False) -> list[str]:
    """The order of a poll's steps when its answers started `started` host-path copies
    (nothing to wait for on the GPU)."""
    steps: list[str] = []
    asked = _inflight(allocating=b"call")
    transfers = _transfers(_Caller(waiting=1), [asked])
    transfers.polls = 0
    transfers.asks.to_prepare = [asked] if prepare else []
    transfers.asks._prepare = lambda one: steps.append("prepare")
    host_copies = [_inflight(job=_Job(None)) for _ in range(started)]
    transfers._take_allocations = lambda: steps.append("take") or host_copies
    transfers._finish_done = lambda: steps.append("finish")
    transfers.poll(lambda events: steps.append("wait"))
    return steps


def test_a_poll_prepares_takes_and_finishes_without_waiting_inside() -> None:
    # The brief wait runs before the poll only (`RankLoop.wait_briefly`): a poll never
    # waits between its steps, whatever it prepared or started.
    assert _polled(1) == ["take", "finish"]
    assert _polled(1, prepare=True) == ["prepare", "take", "finish"]
    assert _polled(0, prepare=True) == ["prepare", "take", "finish"]


def test_a_poll_waits_for_the_gpu_copies_it_launched_before_its_replies() -> None:
    """Only copies on the GPU, launched by this poll, are waited for (`wait_for_copies`
    decides how long), and before the replies; a host-path copy among them: not at all."""
    events = [_Event(), _Event()]
    launched = [_inflight(job=_Job(event)) for event in events]
    done_already = _inflight()  # the target held it all: done without a copy
    done_already.finish(source_transfers.RankTransferStatus(done=True, success=True))
    for started, waited in (
        ([*launched, done_already], [events]),
        ([launched[0], _inflight(job=_Job(None))], []),  # a host-path write among them
        ([], []),
    ):
        steps: list[Any] = []
        transfers = _transfers(_Caller(waiting=1), [_inflight(allocating=b"call")])
        transfers.polls = 0
        transfers._take_allocations = lambda started=started: started
        transfers._finish_done = lambda steps=steps: steps.append("finish")
        transfers.poll(steps.append)
        assert steps == [*waited, "finish"]


def _copy_waits(idle: Any) -> RankLoop:
    side = RankLoop.__new__(RankLoop)
    side.probe = IdleProbe(idle, lambda: False)
    return side


def test_wait_for_copies_waits_only_on_a_busy_scheduler_and_is_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loop, "COPY_WAIT_S", 0.05)
    events = [_Event(done=True), _Event()]
    side = _copy_waits(lambda: False)
    started = time.perf_counter()
    assert not side.wait_for_copies(events)  # one copy never ends: bounded
    assert 0.05 <= time.perf_counter() - started < 1.0
    events[1].done = True
    assert side.wait_for_copies(events)
    idle = _copy_waits(lambda: True)
    events[1].done, queries = False, events[1].queries
    assert not idle.wait_for_copies(events) and events[1].queries == queries  # no wait

    def broken() -> bool:
        raise RuntimeError("boom")

    failing = _copy_waits(broken)
    with caplog.at_level(logging.ERROR):
        assert not failing.wait_for_copies(events)
    assert failing.probe.off


def test_a_poll_leaves_its_prepares_while_requests_wait_for_a_bounded_number_of_polls() -> None:
    """Moves sent together ask their targets first (their handlers run once the poll
    returns); the prepares follow in a later poll, at the latest after
    `PREPARE_DEFER_POLLS` polls in a row that found requests waiting."""
    steps: list[str] = []
    asked = _inflight(allocating=b"call")
    transfers = _transfers(_Caller(waiting=1), [asked])
    asks = transfers.asks
    transfers.polls = 0
    asks._prepare = lambda one: steps.append("prepare")
    transfers._take_allocations = lambda: steps.append("take") or []
    transfers._finish_done = lambda: None
    waiting = [True]
    asks.requests_waiting = lambda: waiting[0]
    asks.to_prepare = [asked]
    for _ in range(target_asks.PREPARE_DEFER_POLLS):
        transfers.poll()
    assert steps == ["take"] * target_asks.PREPARE_DEFER_POLLS  # asked, not prepared
    assert asks.to_prepare == [asked]  # kept for a later poll
    transfers.poll()  # bounded: prepares although requests still wait
    assert steps[-2:] == ["prepare", "take"] and asks.to_prepare == []
    # Once the input is drained a poll prepares at once, and the count starts again.
    steps.clear()
    waiting[0] = False
    asks.to_prepare = [asked]
    transfers.poll()
    assert steps == ["prepare", "take"] and asks._prepare_deferred == 0
    # Without the test (turned off) nothing is left for later.
    steps.clear()
    waiting[0] = True
    asks.requests_waiting = None
    asks.to_prepare = [asked]
    transfers.poll()
    assert steps == ["prepare", "take"]


def test_the_scheduler_side_gives_its_transfers_its_input_test(side_factory: Any) -> None:
    side = side_factory(page_size=16)
    assert side.transfers.asks is not None  # a single-rank source
    assert side.transfers.asks.requests_waiting == side.loop.probe.requests_waiting
    assert not side.requests_waiting()  # no SGLang state set yet


def test_requests_waiting_only_on_an_idle_scheduler_and_off_after_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert IdleProbe(lambda: True, lambda: True).requests_waiting()
    assert not IdleProbe(lambda: False, lambda: True).requests_waiting()  # a batch runs
    assert not IdleProbe(lambda: True, lambda: False).requests_waiting()
    assert not IdleProbe().requests_waiting()  # no SGLang state

    def broken() -> bool:
        raise RuntimeError("boom")

    probe = IdleProbe(lambda: True, broken)
    with caplog.at_level(logging.ERROR):
        assert not probe.requests_waiting()
    assert probe.off
    probe.input_waiting = lambda: True
    assert not probe.requests_waiting()  # off


def _side(ready: Any, idle: bool, input_waiting: Any, helpers: bool = False) -> Any:
    side = RankLoop.__new__(RankLoop)
    side.transfers = SimpleNamespace(awaited=lambda: ready)
    side.target = SimpleNamespace(channel=None)
    side.probe = IdleProbe(lambda: idle, input_waiting)
    side.helpers_may_wait = lambda: helpers
    return side


def test_wait_briefly_waits_only_on_an_idle_scheduler_and_stops_for_sglang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "BRIEF_WAIT_S", 0.05)
    answers = iter([False, False, True])
    assert _side(lambda: next(answers), True, lambda: False).wait_briefly()
    # Busy (a batch runs), a helper thread needs the GIL, nothing awaited: no wait.
    for side in (
        _side(lambda: True, False, lambda: False),
        _side(lambda: True, True, lambda: False, helpers=True),
        _side(None, True, lambda: False),
    ):
        assert not side.wait_briefly()
    # A request for SGLang ends the wait at once.
    started = time.perf_counter()
    assert not _side(lambda: False, True, lambda: True).wait_briefly()
    assert time.perf_counter() - started < 0.05
    # Without SGLang's state (set by the scheduler hook) it never waits.
    side = _side(lambda: True, True, lambda: False)
    side.probe.input_waiting = None
    assert not side.wait_briefly()


def test_wait_briefly_turns_itself_off_after_an_error(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bool:
        raise RuntimeError("boom")

    side = _side(broken, True, lambda: False)
    with caplog.at_level(logging.ERROR):
        assert not side.wait_briefly()
    assert side.probe.off and "brief waits off" in caplog.text
    side.transfers = SimpleNamespace(awaited=lambda: lambda: True)
    assert not side.wait_briefly()  # off: never waits again


def test_deferred_lines_are_written_in_order_on_flush(caplog: pytest.LogCaptureFixture) -> None:
    log = DeferredLog()
    one, two = logging.getLogger("kvmig.test.one"), logging.getLogger("kvmig.test.two")
    with caplog.at_level(logging.INFO):
        log.info(one, "moved %d", 1)
        log.info(two, "committed %s", "x")
        assert len(log) == 2 and caplog.records == []  # kept back
        log.flush()
        assert [(r.name, r.getMessage()) for r in caplog.records] == [
            ("kvmig.test.one", "moved 1"),
            ("kvmig.test.two", "committed x"),
        ]
        assert len(log) == 0


def test_deferred_lines_are_bounded_and_skipped_below_the_level(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deferred_log, "MAX_KEPT", 3)
    log = DeferredLog()
    quiet = logging.getLogger("kvmig.test.quiet")
    with caplog.at_level(logging.WARNING, logger="kvmig.test.quiet"):
        log.info(quiet, "not kept")
        assert len(log) == 0
    loud = logging.getLogger("kvmig.test.loud")
    with caplog.at_level(logging.INFO):
        for i in range(3):
            log.info(loud, "line %d", i)
        assert len(log) == 0  # the third line reached the bound: all written
        assert [r.getMessage() for r in caplog.records] == ["line 0", "line 1", "line 2"]


def test_input_waiting_reads_sglangs_input_sockets_without_taking_anything() -> None:
    import zmq
    from sglang_kv_migration import sglang_adapter

    context = zmq.Context()
    try:
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        pull.bind("inproc://kvmig-brief-wait")
        push.connect("inproc://kvmig-brief-wait")
        # A later rank has no sockets (SGLang sets them to None): never waiting.
        assert not sglang_adapter.input_waiting_check(
            SimpleNamespace(recv_from_tokenizer=None, recv_from_rpc=None)
        )()
        waiting = sglang_adapter.input_waiting_check(
            SimpleNamespace(recv_from_tokenizer=pull, recv_from_rpc=None)
        )
        assert not waiting()
        push.send(b"request")
        deadline = time.monotonic() + 5.0
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waiting() and waiting()  # still there for SGLang to read
        assert pull.recv(zmq.NOBLOCK) == b"request"
        assert not waiting()
    finally:
        context.destroy(linger=0)


def test_sglang_still_names_the_sockets_and_the_idle_test_the_adapter_reads() -> None:
    import inspect

    from sglang.srt.managers.scheduler import Scheduler
    from sglang_kv_migration import sglang_adapter

    source = inspect.getsource(Scheduler.init_ipc_channels)
    assert "self.recv_from_tokenizer = " in source and "self.recv_from_rpc = " in source
    scheduler = SimpleNamespace(is_fully_idle=lambda: False)
    assert sglang_adapter.scheduler_idle_check(scheduler)() is False
    assert callable(Scheduler.is_fully_idle)
