"""A request the migrator can move (`RequestHandle`): the piece now running and its
`/generate` call, what each finished piece produced, and the whole output once the last
piece returns. A move takes the running piece's reply for itself (`begin_move`), records
it (`stopped`) and hands the handle its next piece (`resume_on`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from sglang_kv_migration.rollout.generate_stream import GenerateFailed, PieceProgress
from sglang_kv_migration.rollout.request_types import (
    GenerateRequest,
    MoveReport,
    RequestOutput,
    Segment,
    SegmentKind,
)

# meta_info fields with one entry per output token: joined across pieces in the result.
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class RequestHandle:
    """A request the migrator can move. `result()` waits for the whole output.

    Call contract: create only through `submit`/`adopt`; use from the migrator's event
    loop (the sync facade wraps it in `SyncRequestHandle`).
    """

    def __init__(
        self,
        server_url: str,
        request: GenerateRequest,
        response: Awaitable[Any],
        progress: PieceProgress | None = None,
    ):
        self.request = request  # as first sent; `rid` below is the piece now running
        self.server_url = server_url
        self.submitted_at = time.monotonic()
        self.segments: list[Segment] = []
        self.moves: list[MoveReport] = []
        self._piece = request
        self._piece_kind: SegmentKind = "original"
        self._progress = progress  # None: the call is not the migrator's (adopted)
        self._moving = False
        self._call_consumed = False  # a move recorded this piece's reply itself
        self._done: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._call = self._watch(response)

    @property
    def rid(self) -> str:
        return self._piece.rid

    @property
    def priority(self) -> int | None:
        return self.request.priority

    @property
    def moving(self) -> bool:
        return self._moving

    @property
    def piece(self) -> GenerateRequest:
        """The piece now running (the first request, or the latest resumed rest)."""
        return self._piece

    @property
    def call(self) -> asyncio.Task[Any]:
        """The running piece's `/generate` call (a move awaits its abort reply)."""
        return self._call

    @property
    def started(self) -> bool | None:
        """Whether the piece now running has produced a token (it left the queue and was
        prefilled); None when unknown (an adopted call the migrator does not read)."""
        if self._progress is None:
            return None
        return self._progress.first_token_at is not None

    @property
    def last_token_at(self) -> float | None:
        """`time.monotonic()` of the running piece's last streamed token (None: none yet,
        or an adopted call the migrator does not read)."""
        return self._progress.last_token_at if self._progress is not None else None

    def generated_so_far(self) -> list[int]:
        """What the running piece streamed so far ([] for an adopted call)."""
        return list(self._progress.output_ids) if self._progress is not None else []

    def done(self) -> bool:
        return self._done.done()

    async def result(self) -> RequestOutput:
        return await asyncio.shield(self._done)

    def output(self) -> RequestOutput:
        """The whole output once `done()`; raises like `asyncio.Future.result()`."""
        return self._done.result()

    # -- what a move does to the handle (called by the migrator only) --------------------

    def begin_move(self) -> None:
        """The running piece's reply now belongs to the move, not to `result()`."""
        self._moving = True

    def end_move(self) -> None:
        """The move gave up before resuming: a reply finishes the handle again (one
        that came while the move held it, at once)."""
        self._moving = False
        if self._call.done() and not self._call_consumed:
            self._on_piece_done(self._call)

    def stopped(self, reply: dict[str, Any]) -> list[int]:
        """Record the aborted piece's reply as a segment; returns what it generated."""
        self._call_consumed = True
        return self._add_segment(reply)

    def finish_during_move(self, reply: dict[str, Any]) -> None:
        """The piece finished on its own before the abort reached it: that is the result."""
        self._moving = False
        self._finish(reply)

    def complete_during_move(self, last_meta: dict[str, Any]) -> None:
        """The aborted step completed the request (`last_meta` names the real finish)."""
        self._moving = False
        self._complete(last_meta)

    def resume_on(
        self,
        url: str,
        piece: GenerateRequest,
        kind: SegmentKind,
        response: Awaitable[Any],
        progress: PieceProgress,
    ) -> None:
        """The move is over: `piece` runs on `url` as `response`, read into `progress`."""
        self.server_url = url
        self._piece = piece
        self._piece_kind = kind
        self._progress = progress
        self._moving = False
        self._call_consumed = False
        self._call = self._watch(response)

    # -- internals -------------------------------------------------------------------------

    def _watch(self, response: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run (or adopt) one piece's call; finish the handle unless a move consumes it."""
        task = asyncio.ensure_future(response)
        task.add_done_callback(self._on_piece_done)
        return task

    def _on_piece_done(self, task: asyncio.Task[Any]) -> None:
        if self._moving or self._done.done() or task is not self._call:
            return  # `move_request` reads this piece's reply itself, or it was replaced
        if task.cancelled():
            self._done.set_exception(GenerateFailed(f"request {self.rid} was cancelled"))
        elif task.exception() is not None:
            self._done.set_exception(task.exception())
        else:
            self._finish(task.result())

    def _add_segment(self, reply: dict[str, Any]) -> list[int]:
        meta = reply.get("meta_info", {})
        output_ids = list(reply.get("output_ids", []))
        self.segments.append(
            Segment(
                server_url=self.server_url,
                rid=self._piece.rid,
                kind=self._piece_kind,
                output_ids=output_ids,
                finish_reason=meta.get("finish_reason"),
                cached_tokens=meta.get("cached_tokens"),
                meta_info=meta,
            )
        )
        return output_ids

    def _finish(self, reply: dict[str, Any]) -> None:
        self._add_segment(reply)
        self._complete(reply.get("meta_info", {}))

    def _complete(self, last_meta: dict[str, Any]) -> None:
        output_ids = [t for s in self.segments for t in s.output_ids]
        # The last piece's meta_info, with the counts and finish reason of the whole request.
        meta = dict(last_meta)
        meta["prompt_tokens"] = len(self.request.input_ids)
        meta["completion_tokens"] = len(output_ids)
        for key in _PER_TOKEN_META:  # e.g. logprobs: one entry per output token, per piece
            if len(self.segments) > 1 and all(key in s.meta_info for s in self.segments):
                meta[key] = [x for s in self.segments for x in s.meta_info[key]]
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "length":
            finish = meta["finish_reason"] = {**finish, "length": self.request.max_new_tokens}
        self._done.set_result(
            RequestOutput(
                rid=self.request.rid,
                prompt_ids=list(self.request.input_ids),
                output_ids=output_ids,
                finish_reason=finish,
                meta_info=meta,
                segments=list(self.segments),
                moves=list(self.moves),
            )
        )
