"""Scheduler-side handlers, run on every TP rank of a server.

SGLang broadcasts every control request to all TP ranks, and only the first rank's reply
reaches the tokenizer manager. So each handler does its rank's part, then the ranks
exchange their parts with a collective on the scheduler's CPU (gloo) group, and every
rank builds the same reply (the non-first ranks' sends are no-ops upstream).

IMPORTANT: collectives must be entered by every rank the same number of times in the
same order. Handlers run in broadcast order, and `poll()` runs once per scheduler loop
iteration (which TP ranks run in lockstep); its collectives depend only on state that is
identical across ranks (in-flight transfers, pending ids, the iteration counter), never
on a rank's own clock.

Handlers never raise across the process boundary: errors become
`Output(success=False, error_kind=..., message=...)`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import PROTOCOL_VERSION, tree_helpers
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.io_types import (
    AbortTransferReqInput,
    AbortTransferReqOutput,
    AllocatedRank,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    CommitTransferRequestKVCacheReqOutput,
    GetRequestExtraTokenSizeReqInput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
    RankSessionInfo,
    RankTransferResult,
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
    TransferRequestKVCacheTarget,
)
from sglang_kv_migration.layout import HostPoolLayout, LayoutFingerprint, plan_writes
from sglang_kv_migration.metrics import MigrationMetrics, NullMetrics
from sglang_kv_migration.pending import MigrationState, PendingMigrations
from sglang_kv_migration.transfer import (
    KVTransport,
    MemoryRegion,
    TransferHandle,
    TransportConfig,
    open_transport,
)

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import BaseReq
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

logger = logging.getLogger(__name__)

# The watchdog's collective runs every this many loop iterations while anything is pending.
WATCHDOG_EVERY_ITERATIONS = 64


@dataclass
class RankContext:
    """What the handlers need from one scheduler rank (decoupled from `Scheduler`)."""

    tree_cache: HiRadixCache
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cpu_group: Any  # torch.distributed ProcessGroup spanning the server's ranks, or None
    model: str  # model identity for the layout fingerprint
    send_output: Callable[[BaseReq, BaseReq], None]  # (output, request it answers)


@dataclass
class _RankTransferStatus:
    """One rank's view of an in-flight transfer, exchanged in `poll()`."""

    done: bool
    success: bool = False
    bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    error_kind: str = ""


@dataclass
class _InflightTransfer:
    """One rank's part of a transfer: validated → pinned (host copies filling) → sent."""

    request: TransferRequestKVCacheReqInput
    started: float
    target: TransferRequestKVCacheTarget | None = None  # this rank's peer
    pinned: tree_helpers.PinnedHostPages | None = None
    handle: TransferHandle | None = None  # set once the writes were submitted
    error: MigrationError | None = None  # failed before anything was sent
    result: _RankTransferStatus | None = field(default=None)

    def awaiting_host_copy(self) -> bool:
        """Pinned, waiting for device->host copies; identical on every TP rank."""
        return self.pinned is not None and self.handle is None and self.error is None

    def local_status(self) -> _RankTransferStatus:
        if self.result is not None:
            return self.result
        if self.error is not None:
            self.result = _RankTransferStatus(
                done=True, message=self.error.message, error_kind=self.error.kind.value
            )
        elif self.handle is not None and self.handle.done():
            try:
                stats = self.handle.result(timeout=0)
                self.result = _RankTransferStatus(
                    done=True, success=True, bytes=stats.bytes, seconds=stats.seconds
                )
            except MigrationError as e:
                self.result = _RankTransferStatus(
                    done=True, message=e.message, error_kind=e.kind.value
                )
        return self.result or _RankTransferStatus(done=False)


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
    ):
        self.ctx = ctx
        self.metrics = metrics or NullMetrics()
        cache = ctx.tree_cache
        self.host_pool = cache.cache_controller.mem_pool_host
        self.layout = HostPoolLayout.from_host_pool(self.host_pool)
        self.fingerprint = LayoutFingerprint.from_host_pool(
            self.host_pool,
            model=ctx.model,
            tp_size=ctx.tp_size,
            tp_rank=ctx.tp_rank,
            pp_size=ctx.pp_size,
            pp_rank=ctx.pp_rank,
        )
        self.pending = PendingMigrations(cache, watchdog_timeout_s)
        self.bytes_per_token = sum(self.layout.item_lens)  # on this rank
        # Registered once: peers write into these buffers for the server's lifetime.
        self.transport = transport or open_transport(transport_config)
        self.transport.register(_regions(self.layout))
        self._inflight: list[_InflightTransfer] = []
        self._iteration = 0
        logger.info(
            "KV migration ready on tp_rank=%d pp_rank=%d: session %s, %d host buffers, "
            "page_size=%d",
            ctx.tp_rank,
            ctx.pp_rank,
            self.transport.session_id,
            len(self.layout.buffers),
            self.layout.page_size,
        )

    # ------------------------------------------------------------------ wiring

    def handlers(self) -> list[tuple[type, Callable[[Any], Any]]]:
        """(request type, handler) pairs for the scheduler's TypeBasedDispatcher."""
        return [
            (GetTransferSessionInfoReqInput, self.get_transfer_session_info),
            (GetRequestExtraTokenSizeReqInput, self.get_request_extra_token_size),
            (AllocateTokenForTransferReqInput, self.allocate_token_for_transfer),
            (TransferRequestKVCacheReqInput, self.transfer_request_kvcache),
            (CommitTransferRequestKVCacheReqInput, self.commit_transfer_request_kvcache),
            (AbortTransferReqInput, self.abort_transfer),
        ]

    def poll(self) -> None:
        """Once per scheduler loop iteration: finish transfers, run the watchdog."""
        self._iteration += 1
        if self._inflight:
            self._send_ready_transfers()
            self._finish_transfers()
        if len(self.pending) and self._iteration % WATCHDOG_EVERY_ITERATIONS == 0:
            self._run_watchdog()

    def prepare_for_cache_flush(self) -> bool:
        """Called before SGLang resets the radix cache and clears the host pool.

        Pending allocations are dropped (their pages would be KV of old weights, and the
        reset frees their slots anyway): a later commit answers "gone". Returns False to
        refuse the flush while a transfer still reads pinned host pages; such transfers
        end within the transport timeout, so a flush retried then succeeds.
        """
        if self._inflight:
            if self.ctx.tp_rank == 0:
                logger.warning(
                    "Cache flush refused: %d KV migration transfer(s) still read host pages",
                    len(self._inflight),
                )
            return False
        dropped = self.pending.abort_all(MigrationState.FLUSHED)
        if dropped and self.ctx.tp_rank == 0:
            logger.warning("Cache flush drops pending KV migrations: %s", ", ".join(dropped))
        return True

    def close(self) -> None:
        self.pending.abort_all()
        for inflight in self._inflight:
            if inflight.pinned is not None:
                tree_helpers.unpin_host_pages(inflight.pinned)
        self._inflight.clear()
        self.transport.close()

    # ------------------------------------------------------------------ handlers

    def get_transfer_session_info(
        self, req: GetTransferSessionInfoReqInput
    ) -> GetTransferSessionInfoReqOutput:
        local = RankSessionInfo(
            tp_rank=self.ctx.tp_rank,
            pp_rank=self.ctx.pp_rank,
            session_id=self.transport.session_id,
            host_kv_data_ptrs=self.layout.data_ptrs,
            host_kv_data_lens=self.layout.data_lens,
            host_kv_item_lens=self.layout.item_lens,
            page_size=self.layout.page_size,
            fingerprint=self.fingerprint.to_dict(),
        )
        ranks = self._all_gather(local)
        return GetTransferSessionInfoReqOutput(
            success=True, ranks=ranks, protocol_version=PROTOCOL_VERSION
        )

    def get_request_extra_token_size(
        self, req: GetRequestExtraTokenSizeReqInput
    ) -> GetRequestExtraTokenSizeReqOutput:
        def run() -> GetRequestExtraTokenSizeReqOutput:
            cache = self.ctx.tree_cache
            total = len(tree_helpers.make_key(cache, req.input_ids, req.extra_key))
            held = tree_helpers.match_held_prefix(cache, req.input_ids, req.extra_key)
            return GetRequestExtraTokenSizeReqOutput(
                success=True,
                matched_token_size=held.length,
                extra_token_size=total - held.length,
                total_token_size=total,
            )

        # The tree is identical on every TP rank: no exchange needed.
        return self._guarded(run, GetRequestExtraTokenSizeReqOutput)

    def allocate_token_for_transfer(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        def run_local() -> AllocateTokenForTransferReqOutput:
            self._check_peer_fingerprint(req.source_fingerprints, role="source")
            alloc = self.pending.allocate(
                req.migration_id, req.input_ids, req.extra_key, req.extra_token_size
            )
            return AllocateTokenForTransferReqOutput(
                success=True,
                migration_id=alloc.migration_id,
                matched_token_size=alloc.matched_length,
                extra_token_size=alloc.extra_length,
                ranks=[AllocatedRank(self.ctx.tp_rank, self.ctx.pp_rank, alloc.kv_indices)],
            )

        started = time.monotonic()
        local = self._guarded(run_local, AllocateTokenForTransferReqOutput)
        outputs = self._all_gather(local)
        failed = [o for o in outputs if not o.success]
        if failed:
            # All or nothing: ranks that did allocate give it back.
            if local.success:
                self.pending.abort(req.migration_id)
            self.metrics.outcome("target", "allocate_failed")
            first = failed[0]
            return AllocateTokenForTransferReqOutput(
                success=False,
                migration_id=req.migration_id,
                message=first.message,
                error_kind=first.error_kind,
            )
        self.metrics.outcome("target", "allocated")
        self.metrics.phase("allocate", time.monotonic() - started)
        return AllocateTokenForTransferReqOutput(
            success=True,
            migration_id=req.migration_id,
            matched_token_size=outputs[0].matched_token_size,
            extra_token_size=outputs[0].extra_token_size,
            ranks=[rank for o in outputs for rank in o.ranks],
        )

    def transfer_request_kvcache(self, req: TransferRequestKVCacheReqInput) -> None:
        """Start this rank's part; `poll()` sends the writes once the host copies are
        complete, and replies when every rank has finished."""
        inflight = _InflightTransfer(request=req, started=time.monotonic())
        self._inflight.append(inflight)
        local_error = self._guard_error(lambda: self._validate_transfer(req, inflight))
        # IMPORTANT: agree on validity before touching the tree. A rank that pinned and
        # queued write-backs while another did not would leave the ranks' write-through
        # state different, and SGLang's `writing_check` collectives would deadlock.
        errors = [e for e in self._all_gather(local_error) if e is not None]
        if errors:
            inflight.error = errors[0]
            return None
        inflight.error = self._guard_error(
            lambda: self._pin_source_pages(req, inflight)
        )  # same outcome on every rank: the trees and host pools are identical
        return None

    def _validate_transfer(
        self, req: TransferRequestKVCacheReqInput, inflight: _InflightTransfer
    ) -> None:
        target = self._target_for_this_rank(req.target_per_rank)
        if len(target.kv_indices) != req.extra_token_size:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target rank tp={target.tp} pp={target.pp} has {len(target.kv_indices)} "
                f"kv_indices for extra_token_size={req.extra_token_size}",
            )
        inflight.target = target

    def _pin_source_pages(
        self, req: TransferRequestKVCacheReqInput, inflight: _InflightTransfer
    ) -> None:
        start = req.matched_token_size
        inflight.pinned = tree_helpers.pin_host_pages(
            self.ctx.tree_cache, req.input_ids, req.extra_key, start, start + req.extra_token_size
        )

    def _submit_writes(self, inflight: _InflightTransfer) -> None:
        """Plan and submit this rank's writes (host copies are complete)."""
        target = inflight.target
        peer = HostPoolLayout.from_published(
            data_ptrs=target.host_kv_data_ptrs,
            data_lens=target.host_kv_data_lens,
            item_lens=target.host_kv_item_lens,
            page_size=self.layout.page_size,
        )
        writes = plan_writes(self.layout, inflight.pinned.host_indices, peer, target.kv_indices)
        inflight.handle = self.transport.write(
            target.session_id,
            writes,
            _regions(peer),
        )

    def commit_transfer_request_kvcache(
        self, req: CommitTransferRequestKVCacheReqInput
    ) -> CommitTransferRequestKVCacheReqOutput:
        def run_local() -> CommitTransferRequestKVCacheReqOutput:
            matched_after = self.pending.commit(req.migration_id)
            return CommitTransferRequestKVCacheReqOutput(
                success=True, matched_after_commit=matched_after
            )

        pending = self.pending.get(req.migration_id)  # None for a repeated commit
        started = time.monotonic()
        local = self._guarded(run_local, CommitTransferRequestKVCacheReqOutput)
        outputs = self._all_gather(local)
        failed = [o for o in outputs if not o.success]
        if failed:
            self.metrics.outcome("target", "commit_failed")
            return failed[0]
        matched_after = min(o.matched_after_commit for o in outputs)
        if pending is not None:
            nbytes = pending.extra_length * self.bytes_per_token
            now = time.monotonic()
            self.metrics.outcome("target", "committed")
            self.metrics.moved("target", pending.extra_length, nbytes)
            self.metrics.phase("commit", now - started)
            self.metrics.phase("pending", now - pending.created_at)
            if self.ctx.tp_rank == 0:
                logger.info(
                    "KV migration %s committed: %d tokens, %d bytes (%d ranks), %.1f ms after "
                    "allocate; prefix now %d tokens",
                    req.migration_id,
                    pending.extra_length,
                    nbytes * len(outputs),
                    len(outputs),
                    (now - pending.created_at) * 1e3,
                    matched_after,
                )
        return CommitTransferRequestKVCacheReqOutput(
            success=True, matched_after_commit=matched_after
        )

    def abort_transfer(self, req: AbortTransferReqInput) -> AbortTransferReqOutput:
        def run_local() -> AbortTransferReqOutput:
            self.pending.abort(req.migration_id)
            return AbortTransferReqOutput(success=True)

        was_pending = self.pending.get(req.migration_id) is not None
        local = self._guarded(run_local, AbortTransferReqOutput)
        outputs = self._all_gather(local)
        failed = [o for o in outputs if not o.success]
        if failed:
            return failed[0]
        if was_pending:
            self.metrics.outcome("target", "aborted")
        return local

    # ------------------------------------------------------------------ helpers

    def _guarded(self, run: Callable[[], Any], output_type: type) -> Any:
        """Run a handler body; turn every exception into a failed output."""
        try:
            return run()
        except MigrationError as e:
            return output_type(success=False, message=e.message, error_kind=e.kind.value)
        except Exception as e:
            logger.exception("KV migration handler %s failed", output_type.__name__)
            return output_type(
                success=False,
                message=f"internal error: {type(e).__name__}: {e}",
                error_kind=ErrorKind.INTERNAL.value,
            )

    def _guard_error(self, run: Callable[[], None]) -> MigrationError | None:
        """Run a step of a transfer; return its error instead of raising it."""
        try:
            run()
            return None
        except MigrationError as e:
            return e
        except ValueError as e:  # layout planning rejects inconsistent peer data
            return MigrationError(ErrorKind.BAD_REQUEST, str(e))
        except Exception as e:
            logger.exception("KV migration transfer step failed")
            return MigrationError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")

    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (just [obj] on a single rank)."""
        group = self.ctx.cpu_group
        if group is None:
            return [obj]
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if world == 1:
            return [obj]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    def _check_peer_fingerprint(self, peer_fingerprints: list[dict], role: str) -> None:
        """Compare this rank's fingerprint with the peer rank at the same (tp, pp)."""
        mine = self.fingerprint
        for raw in peer_fingerprints:
            try:
                peer = LayoutFingerprint.from_dict(raw)
            except ValueError as e:
                raise MigrationError(ErrorKind.BAD_REQUEST, f"{role} fingerprint: {e}") from None
            if (peer.tp_rank, peer.pp_rank) == (mine.tp_rank, mine.pp_rank):
                this_side = "target" if role == "source" else "source"
                mismatch = peer.first_mismatch(mine, self_name=role, other_name=this_side)
                if mismatch is not None:
                    raise MigrationError(
                        ErrorKind.CONFLICT,
                        f"KV layouts differ between {role} and this server: {mismatch}",
                    )
                return
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"no {role} fingerprint for tp_rank={mine.tp_rank} pp_rank={mine.pp_rank} "
            f"({len(peer_fingerprints)} given)",
        )

    def _target_for_this_rank(
        self, targets: list[TransferRequestKVCacheTarget]
    ) -> TransferRequestKVCacheTarget:
        for target in targets:
            if (target.tp, target.pp) == (self.ctx.tp_rank, self.ctx.pp_rank):
                self._check_peer_fingerprint([target.fingerprint], role="target")
                return target
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"target_per_rank has no entry for tp={self.ctx.tp_rank} pp={self.ctx.pp_rank}",
        )

    def _send_ready_transfers(self) -> None:
        """Submit the writes of transfers whose host copies have completed.

        Collective-safe: whether any transfer waits, and whether its copies are done,
        is the same on every TP rank, so every rank calls `writing_check` together.
        """
        waiting = [t for t in self._inflight if t.awaiting_host_copy()]
        if not waiting:
            return
        cache = self.ctx.tree_cache
        cache.writing_check()
        for inflight in waiting:
            if tree_helpers.host_pages_ready(cache, inflight.pinned):
                inflight.error = self._guard_error(lambda t=inflight: self._submit_writes(t))

    def _finish_transfers(self) -> None:
        local = [t.local_status() for t in self._inflight]
        per_rank = self._all_gather(local)
        still_running: list[_InflightTransfer] = []
        for i, inflight in enumerate(self._inflight):
            statuses = [rank_statuses[i] for rank_statuses in per_rank]
            if not all(s.done for s in statuses):
                still_running.append(inflight)
                continue
            if inflight.pinned is not None:
                tree_helpers.unpin_host_pages(inflight.pinned)
            self._reply_transfer(inflight, statuses)
        self._inflight = still_running

    def _reply_transfer(
        self, inflight: _InflightTransfer, statuses: list[_RankTransferStatus]
    ) -> None:
        req = inflight.request
        ranks = [
            RankTransferResult(
                tp_rank=i % self.ctx.tp_size,
                pp_rank=i // self.ctx.tp_size,
                success=s.success,
                bytes=s.bytes,
                seconds=s.seconds,
                message=s.message,
            )
            for i, s in enumerate(statuses)
        ]
        failed = [s for s in statuses if not s.success]
        total_bytes = sum(s.bytes for s in statuses)
        elapsed = time.monotonic() - inflight.started
        elapsed_ms = elapsed * 1e3
        # Only the first rank logs: every rank builds this same reply.
        log = logger if self.ctx.tp_rank == 0 else None
        self.metrics.phase("transfer", elapsed)
        if failed:
            output = TransferRequestKVCacheReqOutput(
                success=False,
                ranks=ranks,
                message=failed[0].message,
                error_kind=failed[0].error_kind,
            )
            self.metrics.outcome("source", "send_failed")
            if log:
                log.warning(
                    "KV migration %s transfer failed after %.1f ms: %s",
                    req.migration_id,
                    elapsed_ms,
                    failed[0].message,
                )
        else:
            output = TransferRequestKVCacheReqOutput(
                success=True,
                transferred_token_size=req.extra_token_size,
                transferred_bytes=total_bytes,
                ranks=ranks,
            )
            self.metrics.outcome("source", "sent")
            self.metrics.moved("source", req.extra_token_size, statuses[self._rank_index()].bytes)
            if log:
                log.info(
                    "KV migration %s sent: %d tokens, %d bytes (%d ranks), %.1f ms",
                    req.migration_id,
                    req.extra_token_size,
                    total_bytes,
                    len(statuses),
                    elapsed_ms,
                )
        self.ctx.send_output(output, req)

    def _run_watchdog(self) -> None:
        # The deadline is judged on each rank's clock, then unioned so that every rank
        # frees the same ids and the trees stay identical.
        local_due = self.pending.due()
        due = sorted({mid for ids in self._all_gather(local_due) for mid in ids})
        for _ in self.pending.expire(due):
            self.metrics.outcome("target", "expired")

    def _rank_index(self) -> int:
        """This rank's position in `_all_gather` results (gathers run over TP ranks)."""
        return self.ctx.tp_rank


def _regions(layout: HostPoolLayout) -> list[MemoryRegion]:
    return [MemoryRegion(addr=b.ptr, length=b.length) for b in layout.buffers]


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
