"""Scheduler-side handlers of the six operations, run on every (tp, pp) rank of a server.

SGLang broadcasts every control request to all TP ranks of a stage, and only the first
rank's reply reaches the tokenizer manager. So each handler does its rank's part, then the
stage's ranks exchange their parts with a collective on the TP CPU (gloo) group
(`rank/context.py`), and every rank builds the same reply (the non-first ranks' sends
are no-ops). With PP every stage answers for its own ranks and stages agree forward
through the request stream (`pp_stages.py`). The source's transfers live in
`source/transfers.py`, the target's commit in `commits.py`; each cross-rank step is a
named agreement on `RankContext` ("all ranks agree that ...").

IMPORTANT: collectives must be entered by every rank the same number of times in the
same order. Handlers run in broadcast order, and `poll()` runs once per scheduler loop
iteration (which TP ranks run in lockstep); its collectives depend only on state that is
identical across ranks (in-flight transfers, pending ids, the iteration counter), never
on a rank's own clock.

Handlers never raise across the process boundary: errors become
`Output(success=False, error_kind=..., message=...)`.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from sglang_kv_migration import PROTOCOL_VERSION, binary_ids, grants, sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.fingerprint import LayoutFingerprint
from sglang_kv_migration.page_ranges import to_page_ranges
from sglang_kv_migration.paths.base import DEVICE, HOST, DataPath
from sglang_kv_migration.paths.factory import PATH_FACTORIES
from sglang_kv_migration.paths.host.layout import HostPoolLayout
from sglang_kv_migration.paths.host.mooncake import KVTransport, TransportConfig
from sglang_kv_migration.paths.host.target_staging import TargetStaging
from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.diag.metrics import LoopTimer, MigrationMetrics, NullMetrics
from sglang_kv_migration.server.diag.profiling import RankProfile
from sglang_kv_migration.server.diag.trace import mark_received, ms, stamp
from sglang_kv_migration.server.messages import (
    REQUEST_TYPES,
    AbortTransferReqInput,
    AbortTransferReqOutput,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    CommitTransferRequestKVCacheReqOutput,
    GetRequestExtraTokenSizeReqInput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
    StageSyncReqInput,
    TransferRequestKVCacheReqInput,
)
from sglang_kv_migration.server.rank.context import RankContext, check_peer_fingerprint, guarded
from sglang_kv_migration.server.rank.pp_stages import refusal_of, refused_output
from sglang_kv_migration.server.same_host.allocate_channel import FEATURE as SOURCE_ALLOCATE
from sglang_kv_migration.server.same_host.allocate_channel import ChannelCaller, open_channel
from sglang_kv_migration.server.same_host.mailbox import FEATURE as SOURCE_COMMIT
from sglang_kv_migration.server.same_host.mailbox import Deliverer
from sglang_kv_migration.server.source.known_destinations import FEATURE as DESTINATION_DIGEST
from sglang_kv_migration.server.source.known_destinations import KnownDestinations
from sglang_kv_migration.server.source.transfers import SourceTransfers
from sglang_kv_migration.server.target.channel_allocations import ChannelAllocations
from sglang_kv_migration.server.target.commits import Commits, in_progress_output
from sglang_kv_migration.server.target.mailbox_commits import SourceCommits, builds_on
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.wire.messages import AllocatedRank, RankSessionInfo

logger = logging.getLogger(__name__)

# The watchdog's collective runs every this many loop iterations while anything is pending.
WATCHDOG_EVERY_ITERATIONS = 64
# Longest an idle scheduler waits at once for what its transfers wait for (`wait_briefly`:
# before the iteration's poll, and with `WAIT_IN_POLL_ENV` in a poll that prepared moves
# or started copies). A pass of SGLang's idle loop (pool checks, batch planning) takes
# ~0.2 ms on an H200 server: each allocate reply and copy event waited for the next
# poll, which the waits remove; the bound keeps every other duty of the loop at most
# this late per wait (a request for SGLang ends a wait at once).
BRIEF_WAIT_S = 0.002
# "1" in a server's environment: brief waits inside the poll too, not only before it.
# Off by default: side by side on one H200 (`h200_runs.sh 25`) a one-page
# move took 5.14 ms without them against 6.10-6.54 with them (8K: 6.92 against
# 8.39-8.66), the target's allocate slower while the source spun on its reply.
WAIT_IN_POLL_ENV = "SGLANG_KV_MIGRATION_WAIT_IN_POLL"
# "0": a poll prepares the moves it asked for even while more requests wait (no
# `SourceTransfers._defer_prepare`), for the same side-by-side measurement.
ASK_FIRST_ENV = "SGLANG_KV_MIGRATION_ASK_FIRST"

# How many distinct poll errors are remembered (each logged once with its traceback).
MAX_DISTINCT_POLL_ERRORS = 64
# Takes of the allocate channel one loop iteration serves at most (each up to
# `allocate_channel.MAX_PER_ITERATION` requests): requests that arrive while the
# iteration allocates are served in it, within a bound on the iteration's length.
CHANNEL_ROUNDS = 4

# What an unsigned fleet exposes. --api-key is named: operators expect it to protect the
# fleet, and it cannot (every client of /generate holds it, so it never signs).
_UNSIGNED_WARNING = (
    "KV migration grants are UNSIGNED (neither --kv-migration-grant-key nor --admin-api-key "
    "is set; --api-key never signs grants, every inference client holds it): any client that "
    "reaches the migration routes, or any peer on the transfer network, can forge a grant and "
    "overwrite KV in this server's host pool, including committed prefixes other requests "
    "reuse. Set --kv-migration-grant-key (the same on every server) or --admin-api-key."
)


class MigrationSchedulerSide:
    """The six operations on one rank, plus the watchdog and transfer completion."""

    def __init__(
        self,
        ctx: RankContext,
        *,
        watchdog_timeout_s: float,
        transport_config: TransportConfig,
        transport: KVTransport | None = None,
        metrics: MigrationMetrics | None = None,
        path_names: tuple[str, ...] = (HOST,),
        enable_memory_saver: bool = False,
        grant_key: bytes | None = None,
        grant_ttl_s: float = 15.0,
        staging_bytes: int = 0,
        verify: bool = False,
        attn_cp_size: int = 1,
        landing_bytes: int = 0,
        profile: RankProfile | None = None,
    ):
        self.ctx = ctx
        self.profile = profile  # SGLANG_KV_MIGRATION_PROFILE_DIR (`profiling.py`)
        self.metrics = metrics or NullMetrics()
        self.loop_timer = LoopTimer(self.metrics)
        cache = ctx.tree_cache
        self.host_pool = sglang_adapter.host_pool(cache)
        self.layout = HostPoolLayout.from_host_pool(self.host_pool)
        self.fingerprint = self._rank_fingerprint(attn_cp_size)
        self.pending = PendingMigrations(cache, watchdog_timeout_s)
        # Grants must expire well before the watchdog frees the slots they name.
        self.grant_ttl_s = min(grant_ttl_s, watchdog_timeout_s / 2)
        self.signer = grants.Signer(grant_key)
        self.verify_all = verify  # --kv-migration-verify: check every commit's digest
        self._transfer_timeout_s = transport_config.transfer_timeout_s
        if not self.signer.signed and ctx.tp_rank == 0:
            logger.warning(_UNSIGNED_WARNING)
        self.bytes_per_token = sum(self.layout.item_lens)  # on this rank
        # A restarted server gets a new epoch: clients drop their cached session info.
        # One for the whole server: every PP stage's reply carries it.
        self.server_epoch = ctx.first_rank_value_on_world(ctx.launch_id or uuid.uuid4().hex)
        # Bumped by every KV memory resume (memory saver): part of the epoch clients see,
        # so they read session info again (the device path's landing arena is new).
        self.memory_generation = 0
        self.memory_released = False
        # Memory saver: the device path's target writes land in an arena of this size.
        self.landing_bytes = landing_bytes if enable_memory_saver else 0
        self.paths = self._open_paths(path_names, transport_config, transport, enable_memory_saver)
        # One list of kept-back log lines for the source and the target parts.
        self.log_later = DeferredLog()
        self.transfers = self._open_source_side()
        if os.environ.get(WAIT_IN_POLL_ENV, "0") == "1":  # (see WAIT_IN_POLL_ENV)
            self.transfers.brief_wait = self.wait_briefly
        if os.environ.get(ASK_FIRST_ENV, "1") != "0" and self.transfers.caller is not None:
            self.transfers.requests_waiting = self.requests_waiting
        self._destinations: dict[str, str] = {}  # path name -> destination digest
        self._open_target_side(staging_bytes)
        self._iteration = 0
        self._poll_timed = False  # between `begin_poll` and `end_iteration`
        self._poll_errors: set[str] = set()  # poll errors already logged with a traceback
        # Offer the GIL to our helper threads once per busy iteration (see `poll`);
        # benchmarks turn it off to show what it is for.
        self.yield_gil = True
        # `wait_briefly`: tests of SGLang's state, set by the scheduler hook (None: no
        # waits), and off after an error.
        self.scheduler_idle: Callable[[], bool] | None = None
        self.input_waiting: Callable[[], bool] | None = None
        self._brief_wait_off = False
        logger.info(
            "KV migration ready on tp_rank=%d pp_rank=%d: paths %s, page_size=%d",
            ctx.tp_rank,
            ctx.pp_rank,
            ", ".join(self.paths) or "none",
            self.layout.page_size,
        )

    def _open_source_side(self) -> SourceTransfers:
        """The source role: its transfers, with what a single-rank source has besides."""
        single_rank = self.ctx.tp_size == 1 and self.ctx.pp_size == 1
        return SourceTransfers(
            self.ctx,
            self.fingerprint,
            self.paths,
            self.metrics,
            self.server_epoch,
            self.signer,
            server_fingerprints={
                (fp.tp_rank, fp.pp_rank): fp for fp in self.ctx.all_gather_world(self.fingerprint)
            },
            max_tokens=self.layout.num_slots,
            deliverer=Deliverer(),
            # Feature "source_allocate": asks a target's allocate channel (one rank).
            caller=ChannelCaller() if single_rank else None,
            # Feature "destination_digest": device destinations named by digest.
            destinations=KnownDestinations() if single_rank else None,
            log_later=self.log_later,
        )

    @property
    def transport(self) -> KVTransport:
        """The host path's transport (tests and the flush hook use it)."""
        return self.paths[HOST].transport

    # ------------------------------------------------------------------ wiring

    def handlers(self) -> list[tuple[type, Callable[[Any], Any]]]:
        """(request type, handler) pairs for the scheduler's TypeBasedDispatcher. Every
        reply carries its request's `rid` (the tokenizer side matches replies by it); the
        time each spends on the scheduler thread is charged to `loop_timer`."""
        answering = self._answering
        pairs = [
            (GetTransferSessionInfoReqInput, answering(self.get_transfer_session_info)),
            (GetRequestExtraTokenSizeReqInput, answering(self.get_request_extra_token_size)),
            (AllocateTokenForTransferReqInput, answering(self.allocate_token_for_transfer)),
            (TransferRequestKVCacheReqInput, self.transfer_request_kvcache),  # replies later
            (
                CommitTransferRequestKVCacheReqInput,
                answering(self.commit_transfer_request_kvcache),  # staged: replies later
            ),
            (AbortTransferReqInput, answering(self.abort_transfer)),
        ]
        outputs = {request: output for _name, request, output in REQUEST_TYPES}
        dispatched = [(kind, self._dispatched(h, outputs[kind])) for kind, h in pairs]
        dispatched.append((StageSyncReqInput, self._dispatched(self.stage_sync, None)))
        return dispatched

    def _dispatched(
        self, handler: Callable[[Any], Any], output_type: type | None
    ) -> Callable[[Any], Any]:
        """`handler` as the scheduler runs it, from the dispatcher or the allocate
        channel: guarded (`_guarding`), profiled when the profile is on, timed on
        `loop_timer`, and stamped and given its ids list when taken up."""
        guarded = self._guarding(handler, output_type)
        if self.profile is not None:
            guarded = self.profile.wrap(guarded)
        return _received_first(self.loop_timer.timed(guarded))

    def before_requests(self, recv_reqs: list[Any]) -> None:
        """Once per loop iteration, before its requests are dispatched: allocate what
        sources asked for on the allocate channel (`channel_allocations.py`) and commit
        what sources delivered to the mailbox (`target/mailbox_commits.py`). Never raises."""
        channel = self.channel_allocations
        if not self.pending.by_id and channel is None:
            return  # idle, and no channel to read (multi-rank servers): two reads
        try:
            if channel is not None:
                if recv_reqs:
                    channel.observe(recv_reqs)
                self._allocate_asked(channel)
            if self.pending.by_id:
                self.source_commits.take(recv_reqs)
        except Exception as e:
            self._poll_failed(e)

    def _allocate_asked(self, channel: ChannelAllocations) -> None:
        """Serve the channel until it is empty (at most `CHANNEL_ROUNDS` takes), each
        take before the commits it may build on and before the other commits.

        A source's next allocate may build on its last commit (the next round into a
        landing arena, a conversation's next turn): it delivered that commit before it
        asked, so reading the mailbox *after* taking the requests finds it, and it is
        committed first. Every other delivered commit waits until the channel is
        empty: commits take the target's thread too, and moves sent together were
        otherwise answered in waves (8-13 ms apart on the H200)."""
        asked = channel.due()
        for rounds in range(1, CHANNEL_ROUNDS + 1):
            if not asked:
                return
            try:
                if self.pending.by_id:
                    requests = [a.request for a in asked if a.request is not None]
                    self.source_commits.commit_delivered(functools.partial(_built_on, requests))
            finally:  # taken off the channel: answered whatever happens (else 10 s waits)
                channel.answer(asked)
            if rounds == CHANNEL_ROUNDS or not channel.readable():
                return
            asked = channel.take()

    def wait_briefly(self) -> bool:
        """Before the iteration's poll, on a scheduler with nothing else to do: wait up
        to `BRIEF_WAIT_S` for what this rank's transfers wait for (a target's allocate
        reply, a copy's event; `SourceTransfers.awaited`), so the poll acts on it at once
        instead of after another pass of SGLang's idle loop. Stops as soon as a request
        for SGLang (`input_waiting`) or for this rank's allocate channel arrives. Waits
        only when SGLang is idle (`scheduler_idle`) and no helper thread of ours needs
        the GIL.
        True when what it waited for is ready. Never raises."""
        state = self._sglang_state()
        if state is None:
            return False
        scheduler_idle, input_waiting = state
        try:
            ready = self.transfers.awaited()
            if ready is None or self._helpers_may_wait() or not scheduler_idle():
                return False
            channel = self.channel_allocations
            if channel is not None:
                own = channel.readable
                interrupted = lambda: input_waiting() or own()  # noqa: E731
            else:
                interrupted = input_waiting
            return spin_until(ready, interrupted, BRIEF_WAIT_S)
        except Exception:  # a bug: stop waiting, never stop the scheduler
            return self._off_after_error()

    def requests_waiting(self) -> bool:
        """Whether requests wait on this rank's input while SGLang is idle (then they are
        likely more migrations sent together: `SourceTransfers._defer_prepare`). False
        without SGLang's state (set by the scheduler hook) and after an error. Never
        raises."""
        state = self._sglang_state()
        if state is None:
            return False
        scheduler_idle, input_waiting = state
        try:
            return input_waiting() and scheduler_idle()
        except Exception:  # a bug: stop looking, never stop the scheduler
            return self._off_after_error()

    def _sglang_state(self) -> tuple[Callable[[], bool], Callable[[], bool]] | None:
        """SGLang's (scheduler_idle, input_waiting) tests for the brief waits and the
        deferred prepares: None before the scheduler hook set them, and after an error
        turned both off."""
        if self._brief_wait_off or self.scheduler_idle is None or self.input_waiting is None:
            return None
        return self.scheduler_idle, self.input_waiting

    def _off_after_error(self) -> bool:
        logger.exception("KV migration: brief waits off after an error")
        self._brief_wait_off = True
        return False

    def poll(self) -> list[Any]:
        """Once per scheduler loop iteration: finish transfers and staged commits, run the
        watchdog; closes the iteration's `loop_timer` account. Returns messages for the
        later PP stages (the watchdog's decisions, on stage 0).

        Never raises: an exception here would leave SGLang's scheduler loop and take the
        server down. It fails what is in flight instead (`_poll_failed`)."""
        try:
            if self.profile is None:
                return self._poll_once()
            return self._profiled_poll(self.profile)
        except Exception as e:
            self._poll_failed(e)
            return []

    def _profiled_poll(self, profile: RankProfile) -> list[Any]:
        # The idle test of `_poll_once`, which keeps its own inline (it runs every
        # iteration of every server; this one only with the profile on).
        if not (self.loop_timer.handled or self.has_work()):
            profile.idle()
            return self._poll_once()
        with profile:
            return self._poll_once()

    def _poll_once(self) -> list[Any]:
        timer = self.loop_timer
        self._iteration += 1
        if not (timer.handled or self.has_work()):
            # Idle, the usual case (the same on every rank): nothing to time, poll or
            # gather. This is all the flag costs a server that migrates nothing, every
            # loop iteration: keep it to a few attribute reads (`bench_idle_poll.py`).
            timer.idle_iteration()
            if self.log_later:  # the lines our moves kept back (`deferred_log.py`)
                self.log_later.flush()
            return []
        timer.begin_poll()
        self._poll_timed = True
        active = bool(len(self.transfers) or len(self.commits))
        self.transfers.poll()
        timer.lap("poll.transfers")
        self.commits.poll()
        timer.lap("poll.staged_commits")
        active = active or bool(len(self.transfers) or len(self.commits))
        messages: list[Any] = []
        busy = len(self.pending) or self.pending.quarantined()
        # Later stages free what stage 0's watchdog freed (`stage_sync`), at the same
        # point of the request stream, so every stage's tree stays the same.
        if busy and self._iteration % WATCHDOG_EVERY_ITERATIONS == 0:
            active = True
            if not self.ctx.first_stage:
                # Quarantines may differ between stages (a receipt settled on one stage
                # only), and freeing one changes no tree: each stage frees its own.
                self._run_watchdog(quarantine_only=True)
            else:
                expired = self._run_watchdog()
                if expired and self.ctx.pp_size > 1:
                    messages.append(StageSyncReqInput(expired_ids=expired))
            timer.lap("poll.watchdog")
        if (active or busy) and self.yield_gil:
            # Hand the GIL to our helper threads (transport worker, staging scatter,
            # digests) once per iteration. SGLang's loop never blocks, even idle, so a
            # thread that gave the GIL up (every torch op and engine call does) would
            # otherwise wait out the 5 ms switch interval each time: planning a write
            # took seconds on an idle H200 server. A zero sleep costs 50-120 us (the
            # kernel's timer slack): device-path moves, which need no helper, only offer
            # the GIL with a yield of the CPU (~2 us).
            if self._helpers_may_wait():
                time.sleep(0)
            else:
                os.sched_yield()
            timer.lap("poll.yield")
        timer.end_iteration(active)
        self._poll_timed = False
        return messages

    def _helpers_may_wait(self) -> bool:
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
            self.loop_timer.end_iteration(True)

    def has_work(self) -> bool:
        """Anything of ours in flight or pending (the same on every rank). Called every
        loop iteration: a few attribute reads."""
        pending = self.pending
        return bool(
            self.transfers.inflight or self.commits.waiting or pending.by_id or pending.quarantine
        )

    def prepare_for_cache_flush(self) -> None:
        """Called before SGLang resets the radix cache and clears the pools.

        Never refuses: SGLang asserts that the flush after a weight update succeeds.
        Pending allocations are dropped (their pages would be KV of old weights): a later
        commit answers "gone"; slots a granted write may still reach stay quarantined
        across the reset (`after_cache_flush`). Transfers this source is sending are
        failed: their pages are about to be reused, so their receipts say failure.
        """
        self.transfers.fail_all("the source's cache was flushed during the transfer")
        self.commits.fail_waiting("the target's cache was flushed during the commit")
        dropped = self.pending.prepare_for_reset()
        if dropped and self.ctx.tp_rank == 0:
            logger.warning("Cache flush drops pending KV migrations: %s", ", ".join(dropped))

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
        self.memory_released = True
        self.transfers.fail_all("the source released its KV cache memory during the transfer")
        self.commits.fail_waiting("the target released its KV cache memory during the commit")
        dropped = self.pending.prepare_for_release()
        if dropped and self.ctx.tp_rank == 0:
            logger.warning(
                "KV cache memory release drops pending KV migrations: %s", ", ".join(dropped)
            )

    def after_memory_release(self) -> None:
        for path in self.paths.values():
            path.release_memory()

    def after_memory_resume(self) -> None:
        """The KV pool is mapped again: new destinations (a new landing arena) and a new
        epoch, so clients and sources drop what they cached of the old ones."""
        for path in self.paths.values():
            path.resume_memory()
        self._destinations.clear()
        self.memory_generation += 1
        self.transfers.epoch_suffix = f".m{self.memory_generation}"
        self.memory_released = False

    def close(self) -> None:
        self.log_later.flush()
        self.commits.close()  # no scatter may run into pools being released
        self.pending.abort_all()
        self.source_commits.close()
        if self.channel_allocations is not None:
            self.channel_allocations.close()
        self.transfers.close()
        for path in self.paths.values():
            path.close()
        if self.staging is not None:
            self.staging.close()  # after the transport: the arena was registered there
        if self.profile is not None:
            self.profile.close()

    def device_tokens_held(self) -> int:
        """Device slots pending migrations hold (SGLang's leak check counts them)."""
        return self.pending.device_tokens_held()

    # ------------------------------------------------------------------ handlers

    def get_transfer_session_info(
        self, req: GetTransferSessionInfoReqInput
    ) -> GetTransferSessionInfoReqOutput:
        host = self.paths[HOST].advertise() if HOST in self.paths else {}
        local = RankSessionInfo(
            tp_rank=self.ctx.tp_rank,
            pp_rank=self.ctx.pp_rank,
            session_id=host.get("session_id", ""),
            host_kv_data_ptrs=host.get("host_kv_data_ptrs", []),
            host_kv_data_lens=host.get("host_kv_data_lens", []),
            host_kv_item_lens=host.get("host_kv_item_lens", []),
            page_size=self.layout.page_size,
            fingerprint=self.fingerprint_for(req).to_dict(),
            paths={name: path.advertise() for name, path in self.paths.items()},
            server_epoch=self.epoch_for(req),
            stage_writer=HOST in self.paths,
            staging_region=self.staging.region if self.staging is not None else [],
        )
        ranks = self.ctx.all_gather(local)
        output = GetTransferSessionInfoReqOutput(
            success=True,
            ranks=ranks,
            protocol_version=PROTOCOL_VERSION,
            server_epoch=self.epoch_for(req),
            instance_id=self.server_epoch,
        )
        if self.source_commits.enabled:
            output.features.append(SOURCE_COMMIT)
        if self.channel_allocations is not None:
            output.features.append(SOURCE_ALLOCATE)
            output.allocate_channel = self.channel_allocations.channel.advertise()
        if self.transfers.destinations is not None and DEVICE in self.paths:
            output.features.append(DESTINATION_DIGEST)
        return output

    def get_request_extra_token_size(
        self, req: GetRequestExtraTokenSizeReqInput
    ) -> GetRequestExtraTokenSizeReqOutput:
        def run() -> GetRequestExtraTokenSizeReqOutput:
            cache = self.ctx.tree_cache
            total = len(sglang_adapter.make_key(cache, req.input_ids, req.extra_key))
            held = sglang_adapter.match_held_prefix(cache, req.input_ids, req.extra_key)
            return GetRequestExtraTokenSizeReqOutput(
                success=True,
                matched_token_size=held.length,
                extra_token_size=total - held.length,
                total_token_size=total,
                device_token_size=held.device_length,
                host_headroom_tokens=(
                    sglang_adapter.host_headroom_tokens(cache) if req.headroom else -1
                ),
                server_epoch=self.epoch_for(req),
            )

        # The tree is identical on every TP rank: no exchange needed.
        return guarded(run, GetRequestExtraTokenSizeReqOutput)

    def allocate_token_for_transfer(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        """Target: reserve slots for the tokens it lacks on every rank, all or nothing;
        each rank's part carries its slots and its signed write grant."""
        if req.stage_refusal is not None:  # an earlier PP stage refused: so do we
            return refused_output(AllocateTokenForTransferReqOutput, req.stage_refusal)
        started = time.monotonic()
        local = guarded(lambda: self._allocate_on_rank(req), AllocateTokenForTransferReqOutput)
        outputs, first = self.ctx.first_failure_on_any_rank(local)
        if first is not None:
            # All or nothing: ranks that did allocate give it back (also a rank whose
            # own part failed after its slots were reserved).
            if self.pending.get(req.migration_id) is not None:
                self.pending.abort(req.migration_id, settled=True)
            self.metrics.outcome("target", "allocate_failed")
            req.stage_refusal = refusal_of(first)  # later PP stages do not allocate
            return AllocateTokenForTransferReqOutput(
                success=False,
                migration_id=req.migration_id,
                message=first.message,
                error_kind=first.error_kind,
                server_epoch=self.epoch_for(req),  # a stale caller learns it is
            )
        self.metrics.outcome("target", "allocated")
        self.metrics.phase("allocate", time.monotonic() - started)
        if req.source_commit:  # rank 0 says whether it granted a mailbox slot
            self.source_commits.mark(req.migration_id, outputs[0].source_commit)
        return AllocateTokenForTransferReqOutput(
            success=True,
            migration_id=outputs[0].migration_id,
            matched_token_size=outputs[0].matched_token_size,
            extra_token_size=outputs[0].extra_token_size,
            ranks=[rank for o in outputs for rank in o.ranks],
            path=outputs[0].path,
            page_size=outputs[0].page_size,
            server_epoch=self.epoch_for(req),
            source_commit=outputs[0].source_commit,
            steps_ms=outputs[0].steps_ms,
        )

    def _allocate_on_rank(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        """This rank's part of an allocate (raises; the caller turns errors into replies)."""
        check_peer_fingerprint(self.fingerprint_for(req), req.source_fingerprints, role="source")
        if self.memory_released:
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                "this server released its KV cache memory (/release_memory_occupation); "
                "migrate to it after /resume_memory_occupation",
            )
        if req.expect_epoch and req.expect_epoch != self.epoch_for(req):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"this server's epoch is {self.epoch_for(req)}, not {req.expect_epoch}: it "
                "restarted, updated its weights or resumed its KV memory since that session "
                "info was read (read /get_transfer_session_info again)",
            )
        path = self._path(req.path)
        started = time.perf_counter()
        alloc = self.pending.allocate(
            req.migration_id,
            req.input_ids,
            req.extra_key,
            req.extra_token_size,
            path=path,
            nothing_ok=req.nothing_ok,
            weight_version=req.weight_version,
            write_window_s=self.grant_ttl_s + path.late_write_margin_s,
        )
        reserved = time.perf_counter()
        rank = self._allocated_rank(req, alloc)
        listed = time.perf_counter()
        extent = self._grant_staging(req, alloc, path)
        if extent is not None:
            rank.staging = list(extent)
        mailbox = ""
        if req.source_commit and alloc.extra_length and extent is None:
            # (A staged write commits after a scatter, not in one iteration: no mailbox.)
            mailbox = self.source_commits.grant_slot(alloc.migration_id)
        if alloc.extra_length:
            rank.grant = self._sign_grant(req, alloc, path, extent, mailbox)
        return AllocateTokenForTransferReqOutput(
            # This rank's part (rank 0's is the reply's): the radix match and the
            # reservation, the slots listed, the grant signed.
            steps_ms={
                "match_reserve": ms(reserved - started),
                "slots": ms(listed - reserved),
                "grant": ms(time.perf_counter() - listed),
            },
            success=True,
            source_commit=bool(mailbox),
            migration_id=alloc.migration_id if alloc.extra_length else "",
            matched_token_size=alloc.matched_length,
            extra_token_size=alloc.extra_length,
            ranks=[rank],
            path=path.name,
            page_size=self.layout.page_size,
            server_epoch=self.epoch_for(req),
        )

    def _allocated_rank(self, req: AllocateTokenForTransferReqInput, alloc: Any) -> AllocatedRank:
        """This rank's reserved slots, in the index format the request asks for."""
        if req.index_format == "pages":
            return AllocatedRank(
                self.ctx.tp_rank, self.ctx.pp_rank, [], alloc.kv_pages(self.layout.page_size)
            )
        elif req.index_format == "ranges":  # [first_page, count] runs: page_ranges.py
            return AllocatedRank(
                self.ctx.tp_rank,
                self.ctx.pp_rank,
                [],
                kv_page_ranges=to_page_ranges(alloc.host_slots, self.layout.page_size),
            )
        else:
            return AllocatedRank(self.ctx.tp_rank, self.ctx.pp_rank, alloc.kv_indices)

    def _sign_grant(
        self,
        req: AllocateTokenForTransferReqInput,
        alloc: Any,
        path: DataPath,
        extent: tuple[int, int] | None,
        mailbox: str = "",
    ) -> str:
        """The signed write grant of this rank's slots (also marks the pending migration
        with the verify choice and the source it was issued to)."""
        verify = req.verify or self.verify_all
        pending = self.pending.get(alloc.migration_id)
        pending.verify, pending.source = verify, req.source_instance
        expires_at = time.time() + self.grant_ttl_s
        token = self.signer.encode(
            grants.Grant(
                migration_id=alloc.migration_id,
                tp=self.ctx.tp_rank,
                pp=self.ctx.pp_rank,
                path=path.name,
                slots_digest=grants.slots_digest(alloc.host_slots),
                num_tokens=alloc.extra_length,
                expires_at=expires_at,
                tokens_digest=grants.request_tokens_digest(
                    req, alloc.matched_length + alloc.extra_length
                ),
                staging_addr=extent[0] if extent else 0,
                staging_length=extent[1] if extent else 0,
                # The source stops submitting bytes halfway through the late-write
                # margin; the other half bounds a batch already in flight.
                write_until=expires_at + path.late_write_margin_s / 2,
                verify=verify,
                destination=self._destination(path),
                source=req.source_instance,
                mailbox=mailbox,
            )
        )
        pending.grant = grants.grant_digest(token)
        return token

    def transfer_request_kvcache(self, req: TransferRequestKVCacheReqInput) -> None:
        """Source: start this rank's part; the reply is sent later, from `poll()`."""
        self.transfers.start(req)
        return None

    def commit_transfer_request_kvcache(
        self, req: CommitTransferRequestKVCacheReqInput
    ) -> CommitTransferRequestKVCacheReqOutput | None:
        """Target: insert the written pages (`commits.py`); None: a staged write, the
        reply is sent later, from `poll()`."""
        return self.commits.commit(req)

    def abort_transfer(self, req: AbortTransferReqInput) -> AbortTransferReqOutput:
        def run_local() -> AbortTransferReqOutput:
            self.pending.abort(req.migration_id, settled=settled)
            return AbortTransferReqOutput(success=True)

        if self.commits.in_progress(req.migration_id):
            return in_progress_output(req.migration_id, "abort")
        was_pending = self.pending.get(req.migration_id) is not None
        # Without the source's word that no write can still land, the slots stay
        # quarantined until the grant's write window closes. Agreed across ranks. A
        # repeated abort of a quarantined id checks its receipts against the same grant,
        # slots and source as the first.
        held = self.pending.held(req.migration_id)
        settled = self.ctx.all_ranks_agree(
            bool(req.receipts)
            and self.commits.receipt_refusal(
                req.receipts, held, need_success=False, migration_id=req.migration_id
            )
            is None
        )
        local = guarded(run_local, AbortTransferReqOutput)
        _, failed = self.ctx.first_failure_on_any_rank(local)
        if failed is not None:
            return failed
        if was_pending:
            self.metrics.outcome("target", "aborted")
        return local

    def stage_sync(self, req: StageSyncReqInput) -> None:
        """Later PP stages: free what stage 0's watchdog freed (skips unknown ids)."""
        for _ in self.pending.expire(req.expired_ids):
            self.metrics.outcome("target", "expired")
        return None

    # ------------------------------------------------------------------ helpers

    def _grant_staging(
        self, req: AllocateTokenForTransferReqInput, alloc: Any, path: DataPath
    ) -> tuple[int, int] | None:
        """A staging extent for a fragmented host allocation, kept with the pending
        migration; None when not asked, not fragmented or no room (never a failure)."""
        if not (req.staging and alloc.extra_length and self.staging and path.name == HOST):
            return None
        extent = self.staging.grant(alloc.slots, self.pending.clock())
        if extent is not None:
            self.pending.get(alloc.migration_id).staging = extent
        return extent

    def _destination(self, path: DataPath) -> str:
        """`grants.destination_digest` of what this rank publishes for `path` (fixed for
        the server's lifetime: buffers are registered and exported once, at start-up)."""
        digest = self._destinations.get(path.name)
        if digest is None:
            digest = self._destinations[path.name] = grants.destination_digest(path.advertise())
        return digest

    def _reply_later(self, req: Any, output: Any) -> None:
        if getattr(req, "from_mailbox", False):
            return  # a commit of the mailbox's (`target/mailbox_commits.py`): nobody waits for it
        output.rid = req.rid
        stamp(output, req, self.ctx.pp_rank)
        self.ctx.send_output(output, req)

    def _open_target_side(self, staging_bytes: int) -> None:
        """The target role's staging arena, commits and mailbox (feature "source_commit":
        sources hand their receipts to it, `target/mailbox_commits.py`)."""
        self.staging = self._open_staging(staging_bytes)
        self.commits = Commits(
            self.ctx,
            self.pending,
            self.signer,
            self.metrics,
            self.staging,
            self.bytes_per_token,
            self._reply_later,
            log_later=self.log_later,
        )
        self.source_commits = SourceCommits(
            self.ctx,
            self.pending,
            self.commits,
            self.metrics,
            sglang_adapter.weight_update_types(),
        )
        self.channel_allocations = self._open_channel()

    def _open_channel(self) -> ChannelAllocations | None:
        """Feature "source_allocate" on a single-rank server (one rank takes each channel
        request, so every rank of a stage could not allocate it together)."""
        if self.ctx.tp_size != 1 or self.ctx.pp_size != 1:
            return None
        from sglang_kv_migration.paths.device.cuda_ipc import host_identity

        channel = open_channel(host_identity())
        if channel is None:
            return None
        allocate = self._dispatched(
            self._answering(self.allocate_token_for_transfer), AllocateTokenForTransferReqOutput
        )
        return ChannelAllocations(channel, sglang_adapter.weight_update_types(), allocate)

    def _open_staging(self, nbytes: int) -> TargetStaging | None:
        """The staging arena of the host path's target role (None: staging off)."""
        if nbytes <= 0 or HOST not in self.paths:
            return None
        if self.ctx.pp_size > 1:
            # A staged commit answers later, but PP stages agree through the request as it
            # passes (`pp_stages.py`): a scatter failing on stage 0 could not stop a later
            # stage that already inserted. Direct writes only under PP.
            logger.info("KV migration staging is off under PP (--pp-size > 1)")
            return None
        staging = TargetStaging(self.layout, nbytes, self.paths[HOST].transport)
        self.pending.release_staging = staging.release
        return staging

    def _guarding(
        self, handler: Callable[[Any], Any], output_type: type | None
    ) -> Callable[[Any], Any]:
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
                return self._answering(lambda _req: output)(req)

        return guard

    def _answering(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
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

    def _rank_fingerprint(self, attn_cp_size: int) -> LayoutFingerprint:
        """This rank's layout fingerprint (its host pool, model and place in the server)."""
        ctx = self.ctx
        return LayoutFingerprint.from_shape(
            sglang_adapter.kv_cache_shape(self.host_pool),
            model=ctx.model,
            tp_size=ctx.tp_size,
            tp_rank=ctx.tp_rank,
            pp_size=ctx.pp_size,
            pp_rank=ctx.pp_rank,
            attn_cp_size=attn_cp_size,
        )

    def fingerprint_for(self, req: Any) -> LayoutFingerprint:
        """This rank's fingerprint with the weight version the request was stamped with."""
        return self.fingerprint.with_weight_version(req.weight_version)

    def epoch_for(self, req: Any) -> str:
        """Changes on a restart, a weight update and a KV memory resume: cached session
        info is stale."""
        return self.transfers.epoch_of(req.weight_version)

    def _path(self, name: str) -> DataPath:
        path = self.paths.get(name)
        if path is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"data path {name!r} is not available on this server (available: "
                f"{', '.join(self.paths) or 'none'})",
            )
        return path

    def _open_paths(
        self,
        names: tuple[str, ...],
        transport_config: TransportConfig,
        transport: KVTransport | None,
        enable_memory_saver: bool,
    ) -> dict[str, DataPath]:
        """The data paths this rank serves, in preference order (`PATH_FACTORIES`). A
        path that cannot run here is left out (logged once, on the first rank); every
        rank leaves out the same ones, since they agree through a gather."""
        reasons: dict[str, str] = {}
        for name in names:
            reason = PATH_FACTORIES[name].unavailable(self, enable_memory_saver)
            if reason is not None:
                reasons[name] = reason
        # Offered only if every (tp, pp) rank can: the client treats a server as one peer.
        skipped = self.ctx.merged_on_world(reasons)
        paths: dict[str, DataPath] = {}
        for name in names:
            if name in skipped:
                if self.ctx.tp_rank == 0:
                    logger.warning("KV migration %s path off: %s", name, skipped[name])
                continue
            paths[name] = PATH_FACTORIES[name].open(self, transport_config, transport)
        return paths

    def _run_watchdog(self, quarantine_only: bool = False) -> list[str]:
        """Free what is due; returns the ids (pending and quarantined) it decided on."""
        # The deadline is judged on each rank's clock, then unioned so that every rank
        # frees the same ids and the trees stay identical.
        local_due = self.pending.due()
        if quarantine_only:
            local_due = [mid for mid in local_due if self.pending.get(mid) is None]
        due = self.ctx.union_on_all_ranks(local_due)
        # A commit whose scatter runs owns its slots until it answers (a local copy).
        due = [mid for mid in due if not self.commits.in_progress(mid)]
        for _ in self.pending.expire(due):
            self.metrics.outcome("target", "expired")
        return due


def _built_on(requests: list[Any], pending: Any) -> bool:
    return any(builds_on(pending, r) for r in requests)


def _received_first(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Stamp when the scheduler took the request up (`trace.py`), before anything else."""

    def received(req: Any) -> Any:
        mark_received(req)
        binary_ids.unpack_request(req)  # ids sent as bytes: the list the handlers read
        return handler(req)

    return received


def advertised_hostname(configured: str | None, server_host: str) -> str:
    """The address peers should use to reach this server's transfer engine."""
    if configured:
        return configured
    if server_host and server_host not in ("0.0.0.0", "::", ""):
        return server_host
    # Wildcard bind: the address this host's name resolves to.
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def spin_until(ready: Callable[[], bool], interrupted: Callable[[], bool], limit_s: float) -> bool:
    """Busy-wait (the scheduler thread spins anyway when idle) until `ready()`, or until
    `interrupted()` or `limit_s` passed; returns `ready()`'s last answer."""
    deadline = time.perf_counter() + limit_s
    while True:
        if ready():
            return True
        if interrupted() or time.perf_counter() >= deadline:
            return False
