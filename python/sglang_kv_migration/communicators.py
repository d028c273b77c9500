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

from sglang_kv_migration.io_types import REQUEST_TYPES
from sglang_kv_migration.server_args import kv_migration_enabled


class RidCommunicator:
    """Any number of requests in flight; each reply is matched to its request by `rid`.

    The scheduler side copies the request's `rid` onto its reply
    (`MigrationSchedulerSide.handlers`, `source_transfers`)."""

    def __init__(self, send_to_scheduler: Any):
        self._sender = send_to_scheduler
        self._waiting: dict[str, asyncio.Future] = {}

    async def __call__(self, request: Any) -> list[Any]:
        request.rid = uuid.uuid4().hex
        reply = asyncio.get_running_loop().create_future()
        self._waiting[request.rid] = reply
        try:
            self._sender.send_pyobj(request)
            return [await reply]
        finally:
            self._waiting.pop(request.rid, None)

    def handle_recv(self, output: Any) -> None:
        reply = self._waiting.get(output.rid)
        if reply is not None and not reply.done():
            reply.set_result(output)


class KVMigrationCommunicators:
    """Sends migration requests to the scheduler and awaits their replies."""

    def __init__(
        self,
        send_to_scheduler: Any,
        before_call: Callable[[], None] | None = None,
        weight_version: Callable[[], str] | None = None,
    ):
        self._before_call = before_call
        self._weight_version = weight_version
        # One reply per request: --dp-size > 1 is refused with migration.
        self._by_input_type = {
            input_type: RidCommunicator(send_to_scheduler)
            for _name, input_type, _output_type in REQUEST_TYPES
        }
        # (output type, receiver) pairs for the tokenizer's result dispatcher.
        self.result_handlers: list[tuple[type, Callable[[Any], None]]] = [
            (output_type, self._by_input_type[input_type].handle_recv)
            for _name, input_type, output_type in REQUEST_TYPES
        ]

    async def call(self, request: Any) -> Any:
        """Send `request` to the scheduler; return the first rank's reply."""
        if self._before_call is not None:
            self._before_call()
        if self._weight_version is not None:
            # The scheduler does not see weight updates; the tokenizer manager does.
            request.weight_version = self._weight_version()
        results = await self._by_input_type[type(request)](request)
        return results[0]


def after_init_communicators(_result: None, tokenizer_manager: Any, server_args: Any) -> None:
    """Hook: attach our communicators to SGLang's tokenizer manager."""
    tokenizer_manager.kv_migration_communicators = None
    if not kv_migration_enabled(server_args):
        return
    from sglang.utils import TypeBasedDispatcher

    comms = KVMigrationCommunicators(
        tokenizer_manager.send_to_scheduler,
        before_call=tokenizer_manager.auto_create_handle_loop,
        weight_version=lambda: tokenizer_manager.server_args.weight_version,
    )
    tokenizer_manager.kv_migration_communicators = comms
    tokenizer_manager._result_dispatcher += TypeBasedDispatcher(comms.result_handlers)
