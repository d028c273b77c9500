"""How the scheduler runs a migration handler, from SGLang's dispatcher or the allocate
channel: stamped and given its ids list when taken up, timed on the loop timer,
profiled when the profile is on, guarded (an exception becomes a failed reply), and its
reply carrying the request's `rid`, sent by SGLang on stage 0 and by us on later PP
stages (`pp_stages.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.server.diag.metrics import LoopTimer
from sglang_kv_migration.server.diag.profiling import RankProfile
from sglang_kv_migration.server.diag.trace import mark_received, stamp
from sglang_kv_migration.server.rank.context import RankContext
from sglang_kv_migration.wire import binary_ids

logger = logging.getLogger(__name__)

Handler = Callable[[Any], Any]


class Dispatch:
    """Wraps the handlers of one rank."""

    def __init__(self, ctx: RankContext, loop_timer: LoopTimer, profile: RankProfile | None):
        self.ctx = ctx
        self.loop_timer = loop_timer
        self.profile = profile

    def dispatched(self, handler: Handler, output_type: type | None) -> Handler:
        """`handler` as the scheduler runs it: guarded (`guarding`), profiled when the
        profile is on, timed on `loop_timer`, and stamped and given its ids list when
        taken up."""
        guarded = self.guarding(handler, output_type)
        if self.profile is not None:
            guarded = self.profile.wrap(guarded)
        return _received_first(self.loop_timer.timed(guarded))

    def guarding(self, handler: Handler, output_type: type | None) -> Handler:
        """Wrap a handler's whole body: an exception escaping it would leave SGLang's
        scheduler loop and take the server down. It becomes a failed reply of
        `output_type` (INTERNAL, or the `MigrationError`'s kind), logged once with its
        traceback; `output_type` None: no reply (stage_sync)."""

        def guard(req: Any) -> Any:
            try:
                return handler(req)
            except Exception as e:
                if isinstance(e, MigrationError):
                    message, kind = e.message, e.kind
                else:
                    logger.exception("KV migration handler for %s failed", type(req).__name__)
                    message, kind = f"internal error: {type(e).__name__}: {e}", ErrorKind.INTERNAL
                if output_type is None:
                    return None
                output = output_type(success=False, message=message, error_kind=kind.value)
                return self.answering(lambda _req: output)(req)

        return guard

    def answering(self, handler: Handler) -> Handler:
        """Wrap a handler: its reply carries the request's `rid`. On stage 0 SGLang sends
        the returned reply; a later stage sends its own (SGLang sends nothing there).
        A handler that returns None replies later, from `poll()`."""

        def answer(req: Any) -> Any:
            output = handler(req)
            if output is None:
                return None
            output.rid = req.rid
            stamp(output, req, self.ctx.pp_rank)
            if self.ctx.first_stage:
                return output
            self.ctx.send_output(output, req)
            return None

        return answer

    def reply_later(self, req: Any, output: Any) -> None:
        """Send the reply of a request answered after its handler returned (a transfer,
        a staged commit)."""
        if getattr(req, "from_mailbox", False):
            return  # a commit of the mailbox's (`target/mailbox_commits.py`): nobody waits for it
        output.rid = req.rid
        stamp(output, req, self.ctx.pp_rank)
        self.ctx.send_output(output, req)


def _received_first(handler: Handler) -> Handler:
    """Stamp when the scheduler took the request up (`trace.py`), before anything else."""

    def received(req: Any) -> Any:
        mark_received(req)
        binary_ids.unpack_request(req)  # ids sent as bytes: the list the handlers read
        return handler(req)

    return received
