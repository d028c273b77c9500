"""The stop of a move (steps 1 and 2 of `request_migration`): abort the running piece on
its server, again every `abort_retry_s` until its call returns (an abort that arrives
before the tokenizer registered the rid is dropped by SGLang), at most
`abort_timeout_s`; then read what the call returned: the tokens generated so far, a
request that finished on its own meanwhile, or no answer (the request restarts on the
target).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import httpx

from sglang_kv_migration.rollout.move import Migrator, MoveInProgress
from sglang_kv_migration.rollout.request_handle import RequestHandle
from sglang_kv_migration.rollout.request_types import MoveReport, new_rid
from sglang_kv_migration.rollout.resume import resume

logger = logging.getLogger(__name__)


async def stop_piece(migrator: Migrator, move: MoveInProgress) -> list[int] | MoveReport:
    """Stop the running piece (steps 1 and 2): what it generated, or the report when
    nothing is left to place (it finished, or restarts on the target)."""
    handle, target_url = move.handle, move.target_url
    t0 = time.perf_counter()
    move.stop_started = time.monotonic()
    reply = await _stop(migrator, handle)
    move.seconds["abort"] = time.perf_counter() - t0
    move.stop_returned = time.monotonic()
    move.last_source_token = handle.last_token_at
    if move.last_source_token is not None:  # the part of the stall before the stop
        move.seconds["last_token_to_stop"] = time.monotonic() - move.last_source_token
    if reply is None:
        # The source never answered: start over on the target from what we know.
        piece = dataclasses.replace(handle.piece, rid=new_rid())
        failure = "the source did not return the request"
        report = move.report("restarted", target_url, 0, failure=failure)
        return resume(migrator, move, piece, target_url, "restarted", report)
    finish = reply.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") != "abort":
        report = move.report("finished_before_move", "", len(reply.get("output_ids", [])))
        handle.finish_during_move(reply)
        return report
    generated = handle.stopped(reply)
    done = handle.piece.finished_by(generated, migrator.eos_token_ids)
    if done is not None:  # the aborted step completed it: nothing left to resume
        report = move.report("finished_before_move", "", len(generated))
        handle.complete_during_move({**reply.get("meta_info", {}), "finish_reason": done})
        return report
    return generated


async def _stop(migrator: Migrator, handle: RequestHandle) -> dict[str, Any] | None:
    """Abort the running piece and return its reply; None if the source never answers.
    A refused key raises `AuthFailed` at the first reply (the request keeps running
    on the source): retrying cannot help."""
    call = handle.call
    deadline = time.monotonic() + migrator.abort_timeout_s
    while not call.done() and time.monotonic() < deadline:
        try:
            await migrator.servers.abort_request(handle.server_url, handle.rid)
        except httpx.HTTPError as e:
            logger.warning("abort of %s on %s failed: %s", handle.rid, handle.server_url, e)
        wait = min(migrator.abort_retry_s, max(0.0, deadline - time.monotonic()))
        await asyncio.wait([call], timeout=wait)
    if not call.done():
        call.cancel()  # closes the connection; SGLang aborts a disconnected request
        return None
    if call.cancelled() or call.exception() is not None:
        return None
    return call.result()
