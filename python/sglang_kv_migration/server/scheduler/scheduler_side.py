"""The migration side of one (tp, pp) rank: what SGLang's scheduler calls, through our
hooks (`hooks.py`) and the handlers added to its dispatcher. It only delegates, to

- the source role (`source/transfers.py`): this rank's transfers;
- the target role (`target/role.py`): allocations, pending migrations and their
  watchdog, commits, aborts, staging grants and the allocate channel;
- the session info (`session_info.py`): what the rank publishes;
- the loop policy (`loop.py`): before the requests, the brief wait, the poll, the idle
  test, cache flush, KV memory release and resume, shutdown;
- the diagnostics (`diag/rank_diagnostics.py`) and the handler wrapping (`dispatch.py`).

`server/scheduler/compose.py` builds all of them, once, from the server args and the scheduler.

SGLang broadcasts every control request to all TP ranks of a stage, and only the first
rank's reply reaches the tokenizer manager. So each handler does its rank's part, then the
stage's ranks exchange their parts with a collective on the TP CPU (gloo) group
(`context.py`), and every rank builds the same reply. With PP every stage answers for its
own ranks and stages agree forward through the request stream (`pp_stages.py`).
Handlers never raise across the process boundary: errors become
`Output(success=False, error_kind=..., message=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_kv_migration.paths.base import DataPath
from sglang_kv_migration.server.diag.rank_diagnostics import RankDiagnostics
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
from sglang_kv_migration.server.rank.dispatch import Dispatch
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.scheduler.loop import RankLoop
from sglang_kv_migration.server.scheduler.session_info import SessionInfo
from sglang_kv_migration.server.source.transfers import SourceTransfers
from sglang_kv_migration.server.target.role import TargetRole


class MigrationSchedulerSide:
    """The six operations on one rank, plus the loop's work, over the roles
    `server/scheduler/compose.py` built."""

    def __init__(
        self,
        identity: RankIdentity,
        paths: dict[str, DataPath],
        transfers: SourceTransfers,
        target: TargetRole,
        session: SessionInfo,
        loop: RankLoop,
        dispatch: Dispatch,
        diagnostics: RankDiagnostics,
    ):
        self.identity = identity
        self.paths = paths  # the data paths this rank serves, in preference order
        self.transfers = transfers  # the source role
        self.target = target
        self.session = session
        self.loop = loop
        self.dispatch = dispatch
        self.diagnostics = diagnostics

    # ------------------------------------------------------------------ wiring

    def handlers(self) -> list[tuple[type, Callable[[Any], Any]]]:
        """(request type, handler) pairs for the scheduler's TypeBasedDispatcher. Every
        reply carries its request's `rid` (the tokenizer side matches replies by it); the
        time each spends on the scheduler thread is charged to `loop_timer`."""
        answering, dispatched = self.dispatch.answering, self.dispatch.dispatched
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
        wrapped = [(kind, dispatched(h, outputs[kind])) for kind, h in pairs]
        wrapped.append((StageSyncReqInput, dispatched(self.stage_sync, None)))
        return wrapped

    # ------------------------------------------------------------------ the loop

    def before_requests(self, recv_reqs: list[Any]) -> None:
        """Once per loop iteration, before its requests are dispatched. Never raises."""
        self.loop.before_requests(recv_reqs)

    def wait_briefly(self) -> bool:
        """Before the iteration's poll: `RankLoop.wait_briefly`. Never raises."""
        return self.loop.wait_briefly()

    def requests_waiting(self) -> bool:
        """Requests wait on an idle scheduler's input (`IdleProbe`). Never raises."""
        return self.loop.probe.requests_waiting()

    def poll(self) -> list[Any]:
        """Once per loop iteration; messages for later PP stages. Never raises."""
        return self.loop.poll()

    def has_work(self) -> bool:
        """Anything of ours in flight or pending (the same on every rank)."""
        return self.loop.has_work()

    def device_tokens_held(self) -> int:
        """Device slots pending migrations hold (SGLang's leak check counts them)."""
        return self.target.pending.device_tokens_held()

    def prepare_for_cache_flush(self) -> None:
        self.loop.prepare_for_cache_flush()

    def after_cache_flush(self) -> None:
        self.loop.after_cache_flush()

    def prepare_for_memory_release(self) -> None:
        self.loop.prepare_for_memory_release()

    def after_memory_release(self) -> None:
        self.loop.after_memory_release()

    def after_memory_resume(self) -> None:
        self.loop.after_memory_resume()

    def close(self) -> None:
        self.loop.close()

    # ------------------------------------------------------------------ handlers

    def get_transfer_session_info(
        self, req: GetTransferSessionInfoReqInput
    ) -> GetTransferSessionInfoReqOutput:
        return self.session.get_transfer_session_info(req)

    def get_request_extra_token_size(
        self, req: GetRequestExtraTokenSizeReqInput
    ) -> GetRequestExtraTokenSizeReqOutput:
        return self.session.get_request_extra_token_size(req)

    def allocate_token_for_transfer(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        """Target: reserve slots on every rank, all or nothing (`allocations.py`)."""
        return self.target.allocations.allocate_token_for_transfer(req)

    def transfer_request_kvcache(self, req: TransferRequestKVCacheReqInput) -> None:
        """Source: start this rank's part; the reply is sent later, from `poll()`."""
        self.transfers.start(req)

    def commit_transfer_request_kvcache(
        self, req: CommitTransferRequestKVCacheReqInput
    ) -> CommitTransferRequestKVCacheReqOutput | None:
        """Target: insert the written pages; None: a staged write, replied later."""
        return self.target.commit(req)

    def abort_transfer(self, req: AbortTransferReqInput) -> AbortTransferReqOutput:
        return self.target.abort_transfer(req)

    def stage_sync(self, req: StageSyncReqInput) -> None:
        """Later PP stages: free what stage 0's watchdog freed."""
        self.target.stage_sync(req)

    # ------------------------------------------------------------------ identity

    def fingerprint_for(self, req: Any) -> Any:
        """This rank's fingerprint with the weight version the request was stamped with."""
        return self.identity.fingerprint_for(req)

    def epoch_for(self, req: Any) -> str:
        """Changes on a restart, a weight update and a KV memory resume: cached session
        info is stale."""
        return self.transfers.epoch_of(req.weight_version)
