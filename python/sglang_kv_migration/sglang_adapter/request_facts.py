"""What the opt-in request moments (`server/diag/request_moments.py`) read of the SGLang
objects its hooks see, as plain values: a request's rid, length and finish, a batch's
mode and requests, an abort and whether it found its request running or queued.

Reads only; nothing here keeps a reference to an SGLang object. Read on SGLang 0.5.12:
`Req.origin_input_ids` + `Req.output_ids` are a request's tokens, `Req.finished_reason`
its finish (`to_json()["type"]`), `ScheduleBatch.forward_mode` an enum whose name says
the batch's kind (``EXTEND``, ``DECODE``, ``MIXED``, ``IDLE``, ...) and
`extend_num_tokens` the tokens an extend batch computes; an `AbortReq` names `rid` (every
rid starting with it) or `abort_all`; a `TokenizedGenerateReqInput` names `rid` and
`input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_kv_migration.sglang_adapter.running_requests import _running_reqs

MAX_RIDS = 16  # a batch's rids recorded at most (a diagnosis line, not a dump)


@dataclass(frozen=True)
class BatchFacts:
    mode: str  # the forward mode's name, lower case ("extend", "decode", ...)
    size: int  # requests in the batch
    rids: list[str] = field(default_factory=list)  # the first MAX_RIDS
    extend_tokens: int | None = None  # tokens an extend batch computes


@dataclass(frozen=True)
class AbortFacts:
    rid: str
    abort_all: bool
    running: bool  # a running request's rid starts with it (it still runs a decode step)
    waiting: bool  # a queued request's rid starts with it (answered at once)
    batch_size: int  # requests in the running batch when the abort was read


def request_facts(req: Any) -> tuple[str, int, str | None]:
    """(rid, tokens: prompt + output so far, the finish's type or None)."""
    tokens = len(req.origin_input_ids) + len(req.output_ids)
    finish = req.finished_reason
    kind = finish.to_json().get("type") if finish is not None else None
    return str(req.rid), tokens, kind


def batch_facts(batch: Any) -> BatchFacts | None:
    """The batch's mode and requests; None for no batch (the scheduler ran nothing)."""
    if batch is None:
        return None
    reqs = list(batch.reqs or [])
    mode = batch.forward_mode.name.lower()
    extend = batch.extend_num_tokens if batch.forward_mode.is_extend() else None
    return BatchFacts(mode, len(reqs), [str(r.rid) for r in reqs[:MAX_RIDS]], extend)


def abort_facts(scheduler: Any, abort: Any) -> AbortFacts:
    """What an `AbortReq` finds when the scheduler reads it (before it acts on it)."""
    rid, every = str(abort.rid or ""), bool(abort.abort_all)

    def named(req: Any) -> bool:
        return every or str(req.rid).startswith(rid)

    running = _running_reqs(scheduler)
    return AbortFacts(
        rid=rid,
        abort_all=every,
        running=any(named(r) and not r.finished() for r in running),
        waiting=any(named(r) for r in scheduler.waiting_queue),
        batch_size=len(scheduler.running_batch.reqs),
    )


def generate_facts(request: Any) -> tuple[str, int]:
    """(rid, input tokens) of a tokenized `/generate` request a scheduler received."""
    return str(request.rid), len(request.input_ids or [])
