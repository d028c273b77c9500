"""Tokenizer-manager side: send migration requests to the scheduler, await the replies.

Like SGLang's own admin operations (`tokenizer_control_mixin._COMMUNICATOR_SPECS`), a
request is sent to the scheduler and the caller awaits the reply routed back through
the tokenizer manager's result dispatcher. Unlike SGLang's `FanOutCommunicator`, which
keeps one request of a kind in flight (and, in 0.5.12, trips its own assertion when a
new caller slips in while a queued one is being woken: 500s under concurrent
migrations), `RidCommunicator` keeps any number in flight and matches each reply to its
request by `rid`: a transfer to a stalled peer holds up nobody else.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.diag.trace import mark_arrived, mark_sent, trip_steps
from sglang_kv_migration.server.http.dp_ranks import DataParallelRanks
from sglang_kv_migration.server.messages import (
    REQUEST_TYPES,
    AbortTransferReqInput,
    TransferRequestKVCacheReqInput,
)
from sglang_kv_migration.server.rank.pp_stages import merge_stage_replies, needs_rollback
from sglang_kv_migration.server.same_host.ask_ahead import AskAhead
from sglang_kv_migration.server.server_args import kv_migration_enabled


class RidCommunicator:
    """Any number of requests in flight; each reply is matched to its request by `rid`.

    The scheduler side copies the request's `rid` onto its reply
    (`MigrationSchedulerSide.handlers`, `source_transfers`). A server with PP stages sends
    one reply per stage (`pp_stages.py`), one with DP ranks one per DP rank asked
    (`dp_ranks.py`): a call returns once `replies` have arrived."""

    def __init__(self, send_to_scheduler: Any, replies: int = 1):
        if replies < 1:
            raise ValueError(f"replies must be at least 1, got {replies}")
        self._sender = send_to_scheduler
        self._replies = replies
        self._waiting: dict[str, tuple[asyncio.Future, list[Any], int]] = {}

    async def __call__(self, request: Any, replies: int | None = None) -> list[Any]:
        """Send `request`; return its replies once `replies` (default: the count given at
        construction) have arrived."""
        request.rid = uuid.uuid4().hex
        done = asyncio.get_running_loop().create_future()
        self._waiting[request.rid] = (done, [], replies or self._replies)
        try:
            mark_sent(request)
            sglang_adapter.send_to_scheduler(self._sender, request)
            return await done
        finally:
            self._waiting.pop(request.rid, None)

    def handle_recv(self, output: Any) -> None:
        entry = self._waiting.get(output.rid)
        if entry is None:
            return
        done, received, expected = entry
        mark_arrived(output)
        received.append(output)
        if len(received) == expected and not done.done():
            done.set_result(list(received))


class KVMigrationCommunicators:
    """Sends migration requests to the scheduler and awaits their replies."""

    def __init__(
        self,
        send_to_scheduler: Any,
        before_call: Callable[[], None] | None = None,
        weight_version: Callable[[], str] | None = None,
        pp_size: int = 1,
        dp_size: int = 1,
        ask_ahead: AskAhead | None = None,
    ):
        self._before_call = before_call
        self._weight_version = weight_version
        # A single-rank source asks a transfer's target itself while its scheduler is
        # busy (`same_host/ask_ahead.py`).
        self._ask_ahead = ask_ahead
        # One reply per PP stage (--dp-size > 1 with --pp-size > 1 is refused).
        self._by_input_type = {
            input_type: RidCommunicator(send_to_scheduler, replies=pp_size)
            for _name, input_type, _output_type in REQUEST_TYPES
        }
        # (output type, receiver) pairs for the tokenizer's result dispatcher.
        self.result_handlers: list[tuple[type, Callable[[Any], None]]] = [
            (output_type, self._by_input_type[input_type].handle_recv)
            for _name, input_type, output_type in REQUEST_TYPES
        ]
        self._dp_ranks = (
            DataParallelRanks(dp_size, self._send, self._call_ranks) if dp_size > 1 else None
        )

    async def call(self, request: Any) -> Any:
        """Send `request` to the scheduler; return the server's reply (every stage's
        reply merged; an allocation that failed on some stage is aborted on all first;
        with DP ranks, routed to and merged over them by `dp_ranks.py`)."""
        if self._before_call is not None:
            self._before_call()
        if self._weight_version is not None:
            # The scheduler does not see weight updates; the tokenizer manager does.
            request.weight_version = self._weight_version()
        if self._dp_ranks is not None:
            return await self._dp_ranks.call(request)
        if self._ask_ahead is not None and isinstance(request, TransferRequestKVCacheReqInput):
            steps = await self._ask_ahead.before_transfer(request)
            reply = await self._call_ranks(request)
            reply.steps_ms = {**steps, **reply.steps_ms}
            return reply
        return await self._call_ranks(request)

    async def _send(self, request: Any, replies: int) -> list[Any]:
        return await self._by_input_type[type(request)](request, replies)

    async def _call_ranks(self, request: Any) -> Any:
        """`request` to the ranks of one DP rank (every one without DP): the reply of
        every PP stage, merged."""
        replies = await self._by_input_type[type(request)](request)
        merged = merge_stage_replies(replies)
        merged.steps_ms = {**trip_steps(request, replies), **merged.steps_ms}
        if needs_rollback(replies, merged):
            # IMPORTANT: abort before answering, so the client never sees a failed
            # allocation that still holds slots on some stage.
            abort = AbortTransferReqInput(
                migration_id=request.migration_id,
                weight_version=request.weight_version,
                dp_rank=request.dp_rank,
            )
            undone = await self._by_input_type[AbortTransferReqInput](abort)
            # Stages that allocated nothing answer "unknown id": nothing to undo there.
            stuck = [
                r.message
                for r in undone
                if not r.success and r.error_kind != ErrorKind.NOT_FOUND.value
            ]
            if stuck:
                merged.message += f" (rolling back the other stages failed: {stuck[0]})"
        return merged


def after_init_communicators(_result: None, tokenizer_manager: Any, *_args: Any) -> None:
    """Hook: attach our communicators to SGLang's tokenizer manager. The server args are
    read off the tokenizer manager (SGLang passes them to `init_communicators` on some
    versions only)."""
    server_args = tokenizer_manager.server_args
    tokenizer_manager.kv_migration_communicators = None
    if not kv_migration_enabled(server_args):
        return
    effective = sglang_adapter.effective_server_args(server_args)
    single_rank = effective.tp_size == effective.pp_size == effective.dp_size == 1
    comms = KVMigrationCommunicators(
        tokenizer_manager.send_to_scheduler,
        before_call=tokenizer_manager.auto_create_handle_loop,
        weight_version=lambda: sglang_adapter.current_weight_version(tokenizer_manager),
        pp_size=effective.pp_size,
        dp_size=effective.dp_size,
        ask_ahead=(
            AskAhead(sglang_adapter.generate_requests_in_flight(tokenizer_manager))
            if single_rank
            else None
        ),
    )
    tokenizer_manager.kv_migration_communicators = comms
    sglang_adapter.add_result_handlers(tokenizer_manager, comms.result_handlers)
