"""The migration work of one rank in SGLang's scheduler loop: what runs before an
iteration's requests are dispatched, the brief wait and the poll after them, the idle
test, and what a cache flush, a KV memory release and resume, and shutdown do.

IMPORTANT: collectives must be entered by every rank the same number of times in the
same order. `poll()` runs once per scheduler loop iteration (which TP ranks run in
lockstep); its collectives depend only on state that is identical across ranks
(in-flight transfers, pending ids, the iteration counter), never on a rank's own clock.

Nothing here raises into SGLang's loop: an exception would take the server down. A
failing poll fails the work in flight instead (`_poll_failed`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.paths.base import DEVICE, DataPath
from sglang_kv_migration.server.diag.profiling import RankProfile
from sglang_kv_migration.server.diag.rank_diagnostics import RankDiagnostics
from sglang_kv_migration.server.messages import (
    StageSyncReqInput,
)
from sglang_kv_migration.server.rank.context import RankContext
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.scheduler.idle_probe import IdleProbe
from sglang_kv_migration.server.source.transfers import SourceTransfers
from sglang_kv_migration.server.target.role import TargetRole

logger = logging.getLogger(__name__)

# The watchdog's collective runs every this many loop iterations while anything is pending.
WATCHDOG_EVERY_ITERATIONS = 64
# Longest an idle scheduler waits at once, before the iteration's poll, for what its
# transfers wait for (`wait_briefly`). A pass of SGLang's idle loop (pool checks, batch
# planning) takes ~0.2 ms on an H200 server: each allocate reply and copy event waited
# for the next poll, which the wait removes; the bound keeps every other duty of the
# loop at most this late (a request for SGLang ends the wait at once).
BRIEF_WAIT_S = 0.002
# Longest a busy scheduler waits, in the poll that launched them, for the GPU copies it
# launched there (`wait_for_copies`). Its next iteration is a forward step of the batch
# away (5-50 ms); an 8K prefix copies from the GPU in ~0.6 ms on an H100. Under SGLang's
# overlap schedule the wait runs while the GPU still computes the previous batch.
COPY_WAIT_S = 0.002
# How many distinct poll errors are remembered (each logged once with its traceback).
MAX_DISTINCT_POLL_ERRORS = 64


class RankLoop:
    """Loop policy of one rank over its source and target roles."""

    def __init__(
        self,
        ctx: RankContext,
        identity: RankIdentity,
        paths: dict[str, DataPath],
        transfers: SourceTransfers,
        target: TargetRole,
        diagnostics: RankDiagnostics,
        probe: IdleProbe,
        yield_gil: bool = True,
    ):
        self.ctx = ctx
        self.identity = identity
        self.paths = paths
        self.transfers = transfers
        self.target = target
        self.pending = target.pending  # (read every iteration: one attribute away)
        self.commits = target.commits
        self.diagnostics = diagnostics
        self.probe = probe
        # Offer the GIL to our helper threads once per busy iteration (see `_poll_once`);
        # benchmarks turn it off to show what it is for.
        self.yield_gil = yield_gil
        self._iteration = 0
        self._poll_timed = False  # between `begin_poll` and `end_iteration`
        self._poll_errors: set[str] = set()  # poll errors already logged with a traceback

    def before_requests(self, recv_reqs: list[Any]) -> None:
        """Once per loop iteration, before its requests are dispatched: the target's
        channel allocations and mailbox commits (`TargetRole.before_requests`)."""
        try:
            self.target.before_requests(recv_reqs)
        except Exception as e:
            self._poll_failed(e)

    def wait_briefly(self) -> bool:
        """Before the iteration's poll, on a scheduler with nothing else to do: wait up
        to `BRIEF_WAIT_S` for what this rank's transfers wait for (a target's allocate
        reply, a copy's event; `SourceTransfers.awaited`), so the poll acts on it at once
        instead of after another pass of SGLang's idle loop. Stops as soon as a request
        for SGLang (`input_waiting`) or for this rank's allocate channel arrives. Waits
        only when SGLang is idle (`scheduler_idle`) and no helper thread of ours needs
        the GIL.
        True when what it waited for is ready. Never raises."""
        tests = self.probe.tests()
        if tests is None:
            return False
        scheduler_idle, input_waiting = tests
        try:
            ready = self.transfers.awaited()
            if ready is None or self.helpers_may_wait() or not scheduler_idle():
                return False
            channel = self.target.channel
            if channel is not None:
                own = channel.readable
                interrupted = lambda: input_waiting() or own()  # noqa: E731
            else:
                interrupted = input_waiting
            return spin_until(ready, interrupted, BRIEF_WAIT_S)
        except Exception:  # a bug: stop waiting, never stop the scheduler
            return self.probe.off_after_error()

    def wait_for_copies(self, events: list[Any]) -> bool:
        """In the poll that launched them, on a scheduler running a batch: wait up to
        `COPY_WAIT_S` for the GPU copies launched there (each ends with one of
        `events`), so their replies go out in this iteration, not a forward step later.
        An idle scheduler does not wait here: its next iteration comes at once and
        waits briefly (`wait_briefly`). True when every copy is done. Never raises.
        Only a single-rank source launches copies in its poll (`TargetAsks.take`): the
        wait, on this rank's clock, changes no collective."""
        tests = self.probe.tests()
        if tests is None:
            return False
        scheduler_idle, _input_waiting = tests
        try:
            if scheduler_idle():
                return False
            done = lambda: all(event.query() for event in events)  # noqa: E731
            return spin_until(done, lambda: False, COPY_WAIT_S)
        except Exception:  # a bug: stop waiting, never stop the scheduler
            return self.probe.off_after_error()

    def poll(self) -> list[Any]:
        """Once per scheduler loop iteration: finish transfers and staged commits, run the
        watchdog; closes the iteration's `loop_timer` account. Returns messages for the
        later PP stages (the watchdog's decisions, on stage 0). Never raises."""
        try:
            profile = self.diagnostics.profile
            if profile is None:
                return self._poll_once()
            return self._profiled_poll(profile)
        except Exception as e:
            self._poll_failed(e)
            return []

    def _profiled_poll(self, profile: RankProfile) -> list[Any]:
        # The idle test of `_poll_once`, which keeps its own inline (it runs every
        # iteration of every server; this one only with the profile on).
        if not (self.diagnostics.loop_timer.handled or self.has_work()):
            profile.idle()
            return self._poll_once()
        with profile:
            return self._poll_once()

    def _poll_once(self) -> list[Any]:
        timer = self.diagnostics.loop_timer
        self._iteration += 1
        if not (timer.handled or self.has_work()):
            # Idle, the usual case (the same on every rank): nothing to time, poll or
            # gather. This is all the flag costs a server that migrates nothing, every
            # loop iteration: keep it to a few attribute reads (`bench_idle_poll.py`).
            timer.idle_iteration()
            log_later = self.diagnostics.log_later
            if log_later:  # the lines our moves kept back (`deferred_log.py`)
                log_later.flush()
            return []
        timer.begin_poll()
        self._poll_timed = True
        active = bool(len(self.transfers) or len(self.commits))
        self.transfers.poll(self.wait_for_copies)
        timer.lap("poll.transfers")
        self.commits.poll()
        timer.lap("poll.staged_commits")
        active = active or bool(len(self.transfers) or len(self.commits))
        messages: list[Any] = []
        busy = len(self.pending) or self.pending.quarantined()
        if busy and self._iteration % WATCHDOG_EVERY_ITERATIONS == 0:
            active = True
            messages = self._watchdog()
            timer.lap("poll.watchdog")
        if (active or busy) and self.yield_gil:
            self._offer_gil()
            timer.lap("poll.yield")
        timer.end_iteration(active)
        self._poll_timed = False
        return messages

    def _watchdog(self) -> list[Any]:
        """Later stages free what stage 0's watchdog freed (`stage_sync`), at the same
        point of the request stream, so every stage's tree stays the same."""
        if not self.ctx.first_stage:
            # Quarantines may differ between stages (a receipt settled on one stage
            # only), and freeing one changes no tree: each stage frees its own.
            self.target.run_watchdog(quarantine_only=True)
            return []
        expired = self.target.run_watchdog()
        if expired and self.ctx.pp_size > 1:
            return [StageSyncReqInput(expired_ids=expired)]
        return []

    def _offer_gil(self) -> None:
        """Hand the GIL to our helper threads (transport worker, staging scatter,
        digests) once per iteration. SGLang's loop never blocks, even idle, so a thread
        that gave the GIL up (every torch op and engine call does) would otherwise wait
        out the 5 ms switch interval each time: planning a write took seconds on an idle
        H200 server. A zero sleep costs 50-120 us (the kernel's timer slack): device-path
        moves, which need no helper, only offer the GIL with a yield of the CPU (~2 us)."""
        if self.helpers_may_wait():
            time.sleep(0)
        else:
            os.sched_yield()

    def helpers_may_wait(self) -> bool:
        """Whether a helper thread of ours may be waiting for the GIL: a staged commit's
        scatter, a pending host-path allocation (its staging watcher), a host-path
        transfer (the transport workers), a verify digest or the mapping of a device-path
        peer's buffers (`SourceTransfers.on_helper_threads`)."""
        if len(self.commits) or self.transfers.on_helper_threads():
            return True
        return any(p.path.name != DEVICE for p in self.pending.by_id.values())

    def _poll_failed(self, error: Exception) -> None:
        """After an exception in `poll`: log its traceback once per distinct error (it may
        repeat every iteration), answer every transfer in flight and every staged commit
        with a failure, and keep the scheduler running. Pending allocations stay: an
        abort or the watchdog frees them."""
        key = f"{type(error).__name__}: {error}"
        if key not in self._poll_errors:
            if len(self._poll_errors) < MAX_DISTINCT_POLL_ERRORS:
                self._poll_errors.add(key)
            logger.exception("KV migration poll failed; failing the work in flight")
        message = f"internal error in the scheduler's poll: {key}"
        for step in (
            lambda: self.transfers.abandon_all(message),
            lambda: self.commits.fail_waiting(message, ErrorKind.INTERNAL),
        ):
            try:
                step()
            except Exception:
                logger.exception("KV migration could not fail the work in flight")
        if self._poll_timed:
            self._poll_timed = False
            self.diagnostics.loop_timer.end_iteration(True)

    def has_work(self) -> bool:
        """Anything of ours in flight or pending (the same on every rank). Called every
        loop iteration: a few attribute reads."""
        pending = self.pending
        return bool(
            self.transfers.inflight
            or self.commits.waiting
            or pending.by_id
            or pending.quarantine.by_id
        )

    # ------------------------------------------------------------------ SGLang's events

    def prepare_for_cache_flush(self) -> None:
        """Called before SGLang resets the radix cache and clears the pools.

        Never refuses: SGLang asserts that the flush after a weight update succeeds.
        Pending allocations are dropped (their pages would be KV of old weights): a later
        commit answers "gone"; slots a granted write may still reach stay quarantined
        across the reset (`after_cache_flush`). Transfers this source is sending are
        failed: their pages are about to be reused, so their receipts say failure.
        """
        self.transfers.fail_all("the source's cache was flushed during the transfer")
        self.target.drop_for_cache_flush()

    def after_cache_flush(self) -> None:
        self.pending.after_reset()

    def prepare_for_memory_release(self) -> None:
        """Before SGLang unmaps the KV pool (`/release_memory_occupation` with the
        kv_cache tag; the scheduler is idle). Every copy in flight on this rank finishes
        first (one reading or writing an unmapped pool would fault the GPU); transfers
        and deferred commits are failed and pending allocations dropped (a later commit
        answers 410). New allocations are refused until the resume."""
        for path in self.paths.values():
            path.quiesce()
        self.identity.kv_memory_released()
        self.transfers.fail_all("the source released its KV cache memory during the transfer")
        self.target.drop_for_memory_release()

    def after_memory_release(self) -> None:
        for path in self.paths.values():
            path.release_memory()

    def after_memory_resume(self) -> None:
        """The KV pool is mapped again: new destinations (a new landing arena) and a new
        epoch, so clients and sources drop what they cached of the old ones."""
        for path in self.paths.values():
            path.resume_memory()
        self.target.allocations.destinations.clear()
        self.transfers.memory_resumed(self.identity.kv_memory_resumed())

    def close(self) -> None:
        self.diagnostics.log_later.flush()
        self.target.close()
        self.transfers.close()
        for path in self.paths.values():
            path.close()
        self.target.close_staging()
        if self.diagnostics.profile is not None:
            self.diagnostics.profile.close()


def spin_until(ready: Callable[[], bool], interrupted: Callable[[], bool], limit_s: float) -> bool:
    """Busy-wait (the scheduler thread spins anyway when idle) until `ready()`, or until
    `interrupted()` or `limit_s` passed; returns `ready()`'s last answer."""
    deadline = time.perf_counter() + limit_s
    while True:
        if ready():
            return True
        if interrupted() or time.perf_counter() >= deadline:
            return False
