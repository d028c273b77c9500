"""`server/diag/trace.py`: a trip's steps from the stamps of both sides."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_kv_migration.server.diag import trace


def _reply(received: float, replied: float, arrived: float, stage: int, **extra: float) -> object:
    reply = SimpleNamespace(
        trace={"received": received, "replied": replied, "stage": stage, **extra}
    )
    setattr(reply, trace._ARRIVED, arrived)
    return reply


def test_steps_split_the_trip_at_stage_zeros_stamps() -> None:
    request = SimpleNamespace()
    setattr(request, trace._SENT, 10.0)
    # A later PP stage (another host's clock, say) replied last: stage 0's split is used.
    later = _reply(500.0, 900.0, 10.020, stage=1)
    first = _reply(10.001, 10.004, 10.006, stage=0, polls=3)
    steps = trace.trip_steps(request, [later, first])
    assert steps == {"to_scheduler": 1.0, "scheduler": 3.0, "to_tokenizer": 2.0, "polls": 3}


def test_no_stamps_no_steps() -> None:
    request = SimpleNamespace()
    assert trace.trip_steps(request, [_reply(1.0, 2.0, 3.0, stage=0)]) == {}  # never sent
    setattr(request, trace._SENT, 1.0)
    assert trace.trip_steps(request, [SimpleNamespace(trace={})]) == {}  # an older rank


def test_stamp_records_the_handlers_start() -> None:
    request, output = SimpleNamespace(), SimpleNamespace()
    trace.mark_received(request)
    trace.stamp(output, request, 0, polls=2)
    assert output.trace["received"] <= output.trace["replied"]
    assert (output.trace["stage"], output.trace["polls"]) == (0, 2)
