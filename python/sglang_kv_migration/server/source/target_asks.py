"""Feature "source_allocate" on a single-rank source: the transfers whose target
allocates first, from the ask to the poll that starts them.

    handler (`ask`)      an idle scheduler asks the target's allocate channel itself; a
                         busy one finds the answer its HTTP layer asked for ahead
                         (`server/same_host/ask_ahead.py`) in the request
    poll (`prepare`)     while the targets allocate, the moves asked in this iteration
                         are prepared (ids digest, the path's match and pin), once every
                         move sent together has asked
    poll (`take`)        every answer that came, asked here or ahead, is taken up in one
                         pass: the transfers start there, and their copies launch together
                         (`SourceTransfers._take_allocations`)

An answer asked ahead waits for the poll like one read off the channel, so the moves a
busy scheduler takes up in one iteration launch their copies back to back, whichever way
their targets were asked.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import DataPath
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.rank.context import error_of
from sglang_kv_migration.server.same_host.allocate_channel import ALLOCATE_TIMEOUT_S, ChannelCaller
from sglang_kv_migration.server.source.inflight import (
    InflightTransfer,
    TargetAllocation,
    TokensDigest,
)
from sglang_kv_migration.server.source.validation import read_allocation
from sglang_kv_migration.wire.moments import Moment

logger = logging.getLogger(__name__)

# Polls in a row that may leave their prepares while requests wait (`_defer_prepare`):
# enough for moves sent together, bounded for a scheduler whose input never runs dry.
PREPARE_DEFER_POLLS = 3
# Call ids of answers asked ahead: shorter than any channel call id (16 random bytes).
_AHEAD_ID_PREFIX = b"ahead:"

# (transfer, the target's allocate reply) -> None; raises what fails the transfer.
Allocated = Callable[[InflightTransfer, bytes], None]


class TargetAsks:
    """The allocate calls of one single-rank source's transfers (`SourceTransfers.asks`)."""

    def __init__(
        self,
        caller: ChannelCaller,
        paths: Callable[[], Mapping[str, DataPath]],
        requests_waiting: Callable[[], bool] | None = None,
    ):
        self.caller = caller
        self.paths = paths
        self.timeout_s = ALLOCATE_TIMEOUT_S
        # A test that requests wait on the scheduler's input (`IdleProbe.
        # requests_waiting`): a poll then leaves its prepares to a later poll, so that
        # moves sent together all ask their targets first. None: never.
        self.requests_waiting = requests_waiting
        self.to_prepare: list[InflightTransfer] = []  # asked their target this iteration
        self.ahead: dict[bytes, bytes] = {}  # answers asked ahead, by their call id
        self._prepare_deferred = 0  # polls in a row that left their prepares
        self._ahead_calls = 0

    def ask(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        """The handler's part: ask the target's channel for the slots, or take the answer
        the HTTP layer asked for ahead; the transfer starts in the poll that takes the
        answer up (`take`). Raises what fails the transfer now."""
        on_target = req.allocate_on_target
        if on_target.error_ahead:  # asked ahead, and the target did not answer
            inflight.ask_refused(on_target.error_ahead)
            raise MigrationError(ErrorKind.UNAVAILABLE, on_target.error_ahead)
        if on_target.reply_ahead:
            self._ahead_calls += 1
            call = _AHEAD_ID_PREFIX + str(self._ahead_calls).encode()
            self.ahead[call] = on_target.reply_ahead
            inflight.ask_target(call, time.monotonic() + self.timeout_s)
            return
        try:
            call = self.caller.call(
                on_target.address, on_target.secret, on_target.allocate, on_target.ids
            )
        except ValueError as e:
            inflight.ask_refused(str(e))
            raise MigrationError(ErrorKind.BAD_REQUEST, str(e)) from None
        inflight.ask_target(call, time.monotonic() + self.timeout_s)
        # Prepared in this iteration's poll, after every transfer of the iteration asked
        # its target: moves sent at once are all being allocated while this rank works.
        self.to_prepare.append(inflight)

    @property
    def waiting(self) -> bool:
        """An answer may come, or one asked ahead waits for the poll."""
        return bool(self.ahead) or bool(self.caller.waiting)

    def ready_test(self) -> Callable[[], bool] | None:
        """A non-blocking test that an answer came (for the brief wait); None when one
        is there already or the poll has prepares to do."""
        if self.to_prepare or self.ahead:
            return None
        return self.caller.replied if self.caller.waiting else (lambda: False)

    def prepare(self, inflight: list[InflightTransfer]) -> None:
        """The poll's prepares of the transfers asked since the last one, unless they are
        left to a later poll (`_defer_prepare`)."""
        if not self.to_prepare or self._defer_prepare():
            return
        asked, self.to_prepare = self.to_prepare, []
        for one in asked:
            waiting = one.state is Moment.ALLOCATING
            if waiting and one.prepared is None and one in inflight:
                self._prepare(one)

    def take(
        self, inflight: list[InflightTransfer], poll_started: float, allocated: Allocated
    ) -> list[InflightTransfer]:
        """Start the transfers whose target answered; fail those it did not answer in
        time (a late allocation is freed by the target's watchdog) or whose target's
        process exited. Returns the transfers taken up (started, or failed on the answer)."""
        answered: list[InflightTransfer] = []
        replies = dict(self.caller.replies())
        replies.update(self.ahead)
        self.ahead.clear()
        gone = set(self.caller.gone())
        now = time.monotonic()
        for one in inflight:
            if not one.asking:
                continue
            asked = one.allocate
            reply = replies.get(asked.call)
            if reply is None and now < asked.answer_by and asked.call not in gone:
                continue
            self.caller.forget(asked.call)
            asked.taken_up()
            if one.state is not Moment.ALLOCATING:
                # Failed while it waited (a cache flush): the failure is the reply, with
                # the target's allocation in it, so the client aborts what it holds.
                if reply is not None:
                    error_of(functools.partial(keep_allocation, asked, reply))
                continue
            if reply is None:
                asked.unanswered(
                    "the target's process exited before it answered the allocate"
                    if now < asked.answer_by
                    else f"the target did not answer the allocate within {self.timeout_s:.0f} s"
                )
                one.fail(MigrationError(ErrorKind.UNAVAILABLE, asked.channel_error))
                continue
            one.answer_taken(poll_started, time.monotonic())  # (the poll that took it)
            error = error_of(functools.partial(allocated, one, reply))
            if error is not None:
                one.fail(error)
            answered.append(one)
        return answered

    def forget(self, inflight: InflightTransfer) -> None:
        """Stop waiting for the answer of a transfer that ended without it."""
        if inflight.asking:
            self.caller.forget(inflight.allocate.call)
            self.ahead.pop(inflight.allocate.call, None)

    def clear(self) -> None:
        self.to_prepare = []
        self.ahead.clear()

    def close(self) -> None:
        self.clear()
        self.caller.close()

    # ------------------------------------------------------------------ helpers

    def _prepare(self, inflight: InflightTransfer) -> None:
        """While the target allocates (1-5 ms on one host): the work that does not need
        its answer, the digest of the ids and the path's radix match and pin. Best
        effort: what fails here fails again, and is reported, once the answer came."""
        req = inflight.request
        count = len(req.input_ids)
        inflight.tokens_digested(TokensDigest(count, grants.request_tokens_digest(req, count)))
        path = self.paths().get(req.target_per_rank[0].path) if req.target_per_rank else None
        if path is None or req.running_rid:  # (running slots: no radix match to prepare)
            return
        try:
            inflight.send_prepared(path.prepare_send(req.input_ids, req.extra_key))
        except Exception as e:  # noqa: BLE001 - the transfer's own start says it again
            logger.debug("KV migration: nothing prepared while the target allocates: %s", e)

    def _defer_prepare(self) -> bool:
        """Whether this poll leaves the moves it would prepare to a later one: while
        requests wait for the scheduler (the rest of moves sent together: a client's
        threads, or one call's moves, which reach the scheduler ~0.1 ms apart), up to
        `PREPARE_DEFER_POLLS` polls in a row. Their handlers ask their targets at once;
        six 8K moves on the H200 were otherwise asked in two waves ~4 ms apart, the
        second after the first wave's prepares and starts. A move not yet prepared when
        its answer comes is matched by its start, as without a prepare."""
        waiting = self.requests_waiting
        if waiting is None or self._prepare_deferred >= PREPARE_DEFER_POLLS or not waiting():
            self._prepare_deferred = 0
            return False
        self._prepare_deferred += 1
        return True


def keep_allocation(asked: TargetAllocation, reply: bytes) -> None:
    """The target's allocate reply, as it answered and checked, on the transfer's record."""
    asked.answered(*read_allocation(reply))
