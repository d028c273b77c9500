"""Target side of feature "source_allocate": allocations a source asks for directly.

    each loop iteration,   the requests of the iteration are read for weight updates and
    before dispatch        for the weight version our HTTP layer stamped last; then the
                           channel's waiting requests are taken (`due`, `take`), the
                           mailbox commits they may build on are made, and they are
                           allocated, each with the handler of
                           `/allocate_token_for_transfer`, and answered (`answer`);
                           `MigrationSchedulerSide.before_requests` orders these steps

The scheduler does not see the weight version (the tokenizer manager keeps it), so a
channel allocation takes the one stamped on the last migration request from this
server's HTTP layer, and only while no weight update has arrived after it: otherwise it
is refused (CONFLICT) and the client reads session info again, which stamps the new one.
Single-rank servers only (TP 1, PP 1): an allocation on more ranks would need every rank
to take the request in the same iteration.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.server.diag.trace import ms
from sglang_kv_migration.server.messages import (
    REQUEST_TYPES,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
)
from sglang_kv_migration.server.same_host.allocate_channel import (
    MAX_PER_ITERATION,
    ChannelServer,
    open_channel,
)
from sglang_kv_migration.wire import binary_ids, bodies
from sglang_kv_migration.wire.messages import reply_content

logger = logging.getLogger(__name__)

_STAMPED_TYPES = tuple(request for _name, request, _output in REQUEST_TYPES)

# How often an idle loop reads the channel (a request waits up to this much longer).
CHECK_EVERY_S = 50e-6

Handler = Callable[[AllocateTokenForTransferReqInput], AllocateTokenForTransferReqOutput]


@dataclass
class Asked:
    """One request read from the channel: its allocate request, or why it is refused."""

    route: list[bytes]
    request: AllocateTokenForTransferReqInput | None
    refusal: MigrationError | None
    taken_at: float  # time.monotonic() when read


class ChannelAllocations:
    """One single-rank target's allocate channel and what it knows of its weights."""

    def __init__(
        self,
        channel: ChannelServer,
        weight_update_types: tuple[type, ...],
        allocate: Handler,
    ):
        self.channel = channel
        self.weight_update_types = weight_update_types
        self._allocate = allocate  # the route's handler, wrapped like the dispatcher's
        self._stamped: str | None = None  # the last weight version our HTTP layer sent
        self._updates = 0  # weight updates seen
        self._stamped_after = -1  # `_updates` when `_stamped` was taken
        self._next_check = 0.0  # monotonic time the channel is read next
        # Loop iterations seen (`due` runs once in each): each reply names the one that
        # answered it (`steps_ms["iteration"]`), so moves sent together can be seen to
        # share one.
        self.iterations = 0

    def observe(self, recv_reqs: list[Any]) -> None:
        """The iteration's requests, in order: weight updates, and our own requests'
        weight version stamps."""
        for req in recv_reqs:
            if isinstance(req, _STAMPED_TYPES):
                self._stamped, self._stamped_after = req.weight_version, self._updates
            elif isinstance(req, self.weight_update_types):
                self._updates += 1

    def weight_version(self) -> str | None:
        """This server's weight version, None when a weight update came after the last
        stamp (unknown until the HTTP layer sends the next request)."""
        return self._stamped if self._stamped_after == self._updates else None

    def due(self) -> list[Asked]:
        """Once per loop iteration: what waits on the channel, if `CHECK_EVERY_S` has
        passed since it was last read. Reading it costs a zmq socket option (~3 us); a
        clock read costs ~0.05 us, and a request then waits at most that much more."""
        self.iterations += 1
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + CHECK_EVERY_S
        return self.take() if self.channel.readable() else []

    def take(self) -> list[Asked]:
        """Up to `MAX_PER_ITERATION` waiting requests, each parsed and checked (the
        weight version as of now) or refused, not yet allocated."""
        taken = self.channel.take()
        if len(taken) == MAX_PER_ITERATION:
            self._next_check = 0.0  # more may wait: read again next iteration
        now = time.monotonic()
        return [Asked(route, *self._parsed(body, ids), now) for route, body, ids in taken]

    def answer(self, asked: list[Asked]) -> None:
        """Allocate for each request taken and reply (never raises per request)."""
        for one in asked:
            output = self._answer(one)
            self.channel.reply(one.route, orjson.dumps(_content(output)))

    def readable(self) -> bool:
        return self.channel.readable()

    def close(self) -> None:
        self.channel.close()

    def _parsed(
        self, body: dict[str, Any] | MigrationError, ids: bytes
    ) -> tuple[AllocateTokenForTransferReqInput | None, MigrationError | None]:
        try:
            return self._request(body, ids), None
        except MigrationError as e:
            return None, e

    def _answer(self, asked: Asked) -> AllocateTokenForTransferReqOutput:
        if asked.request is None:
            refusal = asked.refusal
            assert refusal is not None
            return AllocateTokenForTransferReqOutput(
                success=False, message=refusal.message, error_kind=refusal.kind.value
            )
        output = self._allocate(asked.request)
        trace = getattr(output, "trace", None) or {}
        if "received" in trace and "replied" in trace:
            output.steps_ms = {
                **(output.steps_ms or {}),
                "scheduler": ms(trace["replied"] - trace["received"]),
                # Read from the channel until taken up: other allocations, commits first.
                "queued": ms(trace["received"] - asked.taken_at),
                "iteration": self.iterations,
            }
        return output

    def _request(
        self, body: dict[str, Any] | MigrationError, ids: bytes
    ) -> AllocateTokenForTransferReqInput:
        if isinstance(body, MigrationError):
            raise body
        weight_version = self.weight_version()
        if weight_version is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                "this server loaded new weights since its session info was read; read "
                "/get_transfer_session_info again",
            )
        try:
            return allocate_request(
                body, migration_id=uuid.uuid4().hex, weight_version=weight_version, ids=ids
            )
        except ValueError as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, str(e)) from None


def allocate_request(
    body: Any, *, migration_id: str, weight_version: str, ids: bytes = b""
) -> AllocateTokenForTransferReqInput:
    """An allocate from a JSON object that did not come through a route (the allocate
    channel), validated like the route's body (`wire/bodies.py`); `ids`: its ids as
    little-endian uint32 bytes, when the object has none. ValueError naming what is
    wrong."""
    parsed = bodies.validated(bodies.AllocateFields if ids else bodies.AllocateBody, body)
    fields = bodies.body_fields(parsed)
    if ids:
        try:
            binary_ids.check_bytes(ids, bodies.MAX_TOKENS)
        except ValueError as e:
            raise ValueError(f"the ids frame: {e}") from None
        fields.update(input_ids=[], input_ids_u32=ids)
    return AllocateTokenForTransferReqInput(
        **fields, migration_id=migration_id, weight_version=weight_version
    )


def _content(output: AllocateTokenForTransferReqOutput) -> dict[str, Any]:
    return reply_content(output)


def open_channel_allocations(
    single_rank: bool,
    host: Callable[[], str],
    weight_update_types: tuple[type, ...],
    allocate: Handler,
) -> ChannelAllocations | None:
    """Feature "source_allocate" on a single-rank server (one rank takes each channel
    request, so every rank of a stage could not allocate it together); `allocate` is the
    allocate handler, wrapped like the dispatcher's. None where the channel cannot be
    bound (logged). `host`: which machine this is, as same-host peers compare it."""
    if not single_rank:
        return None
    channel = open_channel(host())
    if channel is None:
        return None
    return ChannelAllocations(channel, weight_update_types, allocate)
