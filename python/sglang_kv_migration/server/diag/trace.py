"""Where one round trip's time goes, for every route's reply (`steps_ms`).

A trip crosses three threads of two processes on one host: the HTTP event loop (body
read and parsed, request built: `parse`), the zmq hop to the scheduler and the wait for
its next loop iteration (`to_scheduler`), the scheduler's handler and, for the replies
sent later from `poll()` (transfers, staged commits), the iterations until then
(`scheduler`; a transfer's reply splits it into `handler`, `waited`: the loop iterations
until the poll that found the copy done, and `replying`: that poll's gather, receipts and
mailbox delivery), the hop back and the event loop's wake-up (`to_tokenizer`), the rest
of the route until its reply is encoded (`route`: the whole route, from the first byte
of the body read to the reply's bytes). Clients add `outside` (their trip less
`route`: HTTP client, server, middleware, network).

Stamps are `time.monotonic()` (CLOCK_MONOTONIC: one clock for every process of the
host). The split uses PP stage 0's reply: its first rank runs on the tokenizer
manager's host (a later stage may run on another host, another clock). Raw stamps
travel on the request (`mark_*`, in-process attributes) and on the scheduler's reply
(`trace`, never sent to HTTP clients); the tokenizer side turns them into `steps_ms`.
"""

from __future__ import annotations

import time
from typing import Any

_SENT = "_kvmig_sent"  # tokenizer side: when the request went to the scheduler
_RECEIVED = "_kvmig_received"  # scheduler side: when its handler started
_ARRIVED = "_kvmig_arrived"  # tokenizer side: when a reply came back


def mark_sent(request: Any) -> None:
    setattr(request, _SENT, time.monotonic())


def mark_received(request: Any) -> None:
    setattr(request, _RECEIVED, time.monotonic())


def mark_arrived(output: Any) -> None:
    # `output.__dict__`, not a dataclass field: never pickled back anywhere.
    setattr(output, _ARRIVED, time.monotonic())


_STAMPS = ("received", "replied", "stage")


def stamp(output: Any, request: Any, stage: int, **extra: float) -> Any:
    """Scheduler side, just before `output` is sent by PP stage `stage`: when its
    request's handler started, now, and `extra` counts (e.g. loop iterations waited)."""
    received = getattr(request, _RECEIVED, 0.0)
    output.trace = {"received": received, "replied": time.monotonic(), "stage": stage, **extra}
    return output


def trip_steps(request: Any, replies: list[Any]) -> dict[str, float]:
    """Tokenizer side: ms from the request's send to the reply's arrival, split at the
    scheduler's stamps (of PP stage 0's reply, on this host's clock)."""
    sent = getattr(request, _SENT, 0.0)
    traced = [r for r in replies if getattr(r, "trace", None) and getattr(r, _ARRIVED, 0.0)]
    first = [r for r in traced if r.trace.get("stage", 0) == 0]
    if not sent or not first:
        return {}
    reply = first[0]
    arrived = getattr(reply, _ARRIVED)
    t = reply.trace
    steps = {
        "to_scheduler": ms(t["received"] - sent),
        "scheduler": ms(t["replied"] - t["received"]),
        "to_tokenizer": ms(arrived - t["replied"]),
    }
    steps.update({k: v for k, v in t.items() if k not in _STAMPS})
    return steps


def ms(seconds: float) -> float:
    """Seconds as ms, to the µs; never negative (stamps from two processes)."""
    return round(max(seconds, 0.0) * 1e3, 3)
