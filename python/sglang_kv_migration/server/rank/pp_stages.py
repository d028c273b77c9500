"""Pipeline parallelism: how the PP stages of one server answer as one server.

How SGLang 0.5.12 runs a `--pp-size N` server (`managers/scheduler.py`, `recv_requests` and
`init_ipc_channels`; `managers/scheduler_pp_mixin.py`, `event_loop_pp`):
- Only the first TP rank of stage 0 reads the tokenizer manager's requests. Every stage,
  after dispatching an iteration's requests (`process_input_requests`), hands the same
  request objects (pickled at that moment) to the next stage
  (`_pp_send_pyobj_to_next_stage`), whose `recv_requests` blocks for them; inside a stage
  they reach every TP rank by broadcast. So every rank handles every control request, in
  the same order, but a later stage only after the earlier one finished its iteration: a
  collective spanning stages inside a handler would deadlock.
- Only the first TP rank of stage 0 has a socket to the tokenizer manager (the others get
  `SenderWrapper(None)`); SGLang's own control requests (`flush_cache`, ...) answer from
  stage 0 alone, without waiting for later stages.

Our operations must answer for every (tp, pp) rank and fail as a whole, so:
1. Each stage gathers over its own TP group (`RankContext.all_gather`), and its first TP
   rank sends the stage's reply to the tokenizer manager: stage 0 through SGLang's socket,
   later stages through their own (`sglang_adapter.stage_reply_sender`).
2. The tokenizer side waits for one reply per stage (`communicators.RidCommunicator`) and
   merges them here (`merge_stage_replies`): success only if every stage succeeded,
   per-rank lists concatenated in (pp, tp) order.
3. Stages agree forward, in the request stream: a stage that refuses an allocate, transfer
   or commit marks the request (`wire.messages.StageRefusal`) before it is handed on, and later
   stages refuse it too without touching their trees. Stage 0 also checks what later
   stages would refuse: every rank's transfer entry and grant (`source/validation.py`),
   every rank's commit receipt (`target/commits.py`). The watchdog runs on stage 0 only;
   what it freed travels to later stages as a `StageSyncReqInput` appended to the
   iteration's requests.
4. A later stage can still fail after stage 0 succeeded (an allocation its pool cannot
   hold): the tokenizer side then aborts the allocation on every stage before it answers
   (`needs_rollback`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.messages import (
    AbortTransferReqOutput,
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqOutput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqOutput,
    TransferRequestKVCacheReqOutput,
    replace_message,
)
from sglang_kv_migration.wire.messages import StageRefusal

# --------------------------------------------------------------------------- public API


def merge_stage_replies(replies: list[Any]) -> Any:
    """One reply for the server from one reply per PP stage (any order)."""
    if not replies:
        raise ValueError("no stage replies to merge")
    if len(replies) == 1:
        return replies[0]
    kinds = {type(r) for r in replies}
    if len(kinds) != 1:
        raise ValueError(f"stage replies of different types: {sorted(k.__name__ for k in kinds)}")
    return _MERGERS[type(replies[0])](replies)


def needs_rollback(replies: list[Any], merged: Any) -> bool:
    """True when an allocation failed as a whole but some stage holds its part."""
    return (
        isinstance(merged, AllocateTokenForTransferReqOutput)
        and not merged.success
        and any(r.success and r.migration_id for r in replies)
    )


def refusal_of(output: Any) -> StageRefusal | None:
    """What to mark a request with when this stage's reply is a failure."""
    if output.success:
        return None
    return StageRefusal(message=output.message, error_kind=output.error_kind)


def refused_output(output_type: type, refusal: StageRefusal) -> Any:
    """This stage's reply to a request an earlier stage refused."""
    return output_type(
        success=False,
        message=refusal.message,
        error_kind=refusal.error_kind or ErrorKind.INTERNAL.value,
    )


# --------------------------------------------------------------------------- mergers


def _first_failure(replies: list[Any]) -> Any | None:
    # A later stage's refusal repeats the earlier stage's message, so any failure names
    # the cause.
    return next((r for r in replies if not r.success), None)


def _ranks(replies: Iterable[Any]) -> list[Any]:
    ranks = [rank for reply in replies for rank in reply.ranks]
    return sorted(ranks, key=lambda r: (r.pp_rank, r.tp_rank))


def one_server_session_info(replies: list[Any], parts: str) -> Any:
    """The first failed reply; else a failure if the `parts` (PP stages, DP ranks) of one
    server report different epochs; else None: the replies are one server's."""
    failed = _first_failure(replies)
    if failed is not None:
        return failed
    epochs = {r.server_epoch for r in replies}
    if len(epochs) != 1:
        return GetTransferSessionInfoReqOutput(
            success=False,
            message=f"{parts} report different server epochs {sorted(epochs)}",
            error_kind=ErrorKind.INTERNAL.value,
        )
    return None


def _merge_session_info(replies: list[Any]) -> Any:
    refused = one_server_session_info(replies, "PP stages")
    if refused is not None:
        return refused
    return replace_message(replies[0], ranks=_ranks(replies))


def _merge_extra_size(replies: list[Any]) -> Any:
    failed = _first_failure(replies)
    if failed is not None:
        return failed
    # Stage trees are identical at the same point of the request stream; min() is the
    # safe answer should they ever differ.
    matched = min(r.matched_token_size for r in replies)
    device = min(r.device_token_size for r in replies)
    total = replies[0].total_token_size
    return replace_message(
        replies[0],
        matched_token_size=matched,
        extra_token_size=total - matched,
        device_token_size=min(device, matched),
        host_headroom_tokens=min(r.host_headroom_tokens for r in replies),
    )


def _merge_allocate(replies: list[Any]) -> Any:
    failed = _first_failure(replies)
    if failed is not None:
        return failed
    shapes = {
        (r.migration_id, r.matched_token_size, r.extra_token_size, r.path, r.page_size)
        for r in replies
    }
    if len(shapes) != 1:
        return AllocateTokenForTransferReqOutput(
            success=False,
            migration_id=replies[0].migration_id,
            message="PP stages allocated different ranges (migration_id, matched, extra, "
            f"path, page_size): {sorted(shapes)}",
            error_kind=ErrorKind.CONFLICT.value,
        )
    return replace_message(replies[0], ranks=_ranks(replies))


def _merge_transfer(replies: list[Any]) -> Any:
    # Every rank's receipt goes back, also on failure: /abort_transfer presents them.
    ranks = _ranks(replies)
    failed = _first_failure(replies)
    if failed is not None:
        return replace_message(failed, ranks=ranks)
    return replace_message(
        replies[0], ranks=ranks, transferred_bytes=sum(r.transferred_bytes for r in replies)
    )


def _merge_commit(replies: list[Any]) -> Any:
    failed = _first_failure(replies)
    if failed is not None:
        return failed
    return replace_message(
        replies[0], matched_after_commit=min(r.matched_after_commit for r in replies)
    )


def _merge_abort(replies: list[Any]) -> Any:
    failed = _first_failure(replies)
    return failed if failed is not None else replies[0]


_MERGERS: dict[type, Callable[[list[Any]], Any]] = {
    GetTransferSessionInfoReqOutput: _merge_session_info,
    GetRequestExtraTokenSizeReqOutput: _merge_extra_size,
    AllocateTokenForTransferReqOutput: _merge_allocate,
    TransferRequestKVCacheReqOutput: _merge_transfer,
    CommitTransferRequestKVCacheReqOutput: _merge_commit,
    AbortTransferReqOutput: _merge_abort,
}
