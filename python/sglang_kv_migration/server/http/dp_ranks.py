"""Tokenizer-manager side of a server with several data-parallel ranks (`--dp-size N`).

Each DP rank is its own scheduler group, with its own radix tree, pools and TP group: a
prefix lives on one DP rank, and a migration's slots are reserved on one. SGLang 0.5.12's
`DataParallelController` hands every request that is neither a generate nor an embed
request on as a control message (`send_control_message`): without DP attention to every
DP rank's first scheduler, with it to DP rank 0's first scheduler, which broadcasts it
over the whole TP group (`Scheduler.recv_requests`). Either way every DP rank's
schedulers see each of our requests, and the first scheduler of each DP rank can reply.

So every request carries `dp_rank`, the DP rank that acts on it: the others return
nothing (`server/scheduler/dp_filter.py`). `None` asks every DP rank (session info, size
queries), and this module waits for one reply per DP rank and merges them:

- session info: every DP rank's scheduler ranks (each with its `dp_rank`), `dp_size`;
- size query: the DP rank holding the longest prefix (`dp_rank` in the reply);
- allocate: the body's `dp_rank`, else the DP rank holding the longest prefix of the
  request, ties to the least loaded (requests running and waiting there); one whose
  pool cannot hold the allocation (503) gives way to the next. The migration id names
  the DP rank (`tagged_id`), so commit and abort reach it without any state kept here;
- transfer: the body's `dp_rank`, else the DP rank holding the longest prefix; each grant
  it names is claimed by one DP rank only (`grant_claims.py`: one grant, one claim, per
  server).

The same-host shortcuts ("source_allocate", "source_commit") talk to one scheduler
rank directly, outside this routing: a server with several DP ranks does not list them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.http.grant_claims import GrantClaims, grant_keys
from sglang_kv_migration.server.messages import (
    REQUEST_TYPES,
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
    GetRequestExtraTokenSizeReqInput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    TransferRequestKVCacheReqInput,
    replace_message,
)
from sglang_kv_migration.server.rank.pp_stages import one_server_session_info
from sglang_kv_migration.wire import features

# A migration id minted on such a server ends in this, then the DP rank's number.
ID_TAG = ".dp"

_OUTPUT_TYPE = {input_type: output_type for _name, input_type, output_type in REQUEST_TYPES}

# (request, replies to wait for) -> every reply; request -> the merged reply of one DP rank.
SendToRanks = Callable[[Any, int], Awaitable[list[Any]]]
CallOneRank = Callable[[Any], Awaitable[Any]]


def tagged_id(migration_id: str, dp_rank: int) -> str:
    """`migration_id` naming the DP rank that holds its slots."""
    return f"{migration_id}{ID_TAG}{dp_rank}"


def dp_rank_of_id(migration_id: str, dp_size: int) -> int | None:
    """The DP rank `tagged_id` put into `migration_id`; None when it names none (or one
    this server does not have)."""
    _base, tag, number = migration_id.rpartition(ID_TAG)
    if not tag or not number.isdigit() or len(number) > 6:
        return None
    rank = int(number)
    return rank if rank < dp_size else None


class DataParallelRanks:
    """Routes each migration request of a `--dp-size N` server to its DP rank(s)."""

    def __init__(self, dp_size: int, send: SendToRanks, call_one: CallOneRank):
        if dp_size < 2:
            raise ValueError(f"DataParallelRanks needs at least 2 DP ranks, got {dp_size}")
        self.dp_size = dp_size
        self._send = send
        self._call_one = call_one
        self.claims = GrantClaims()

    async def call(self, request: Any) -> Any:
        """The server's reply to `request` (`weight_version` already stamped)."""
        if isinstance(request, GetTransferSessionInfoReqInput):
            request.dp_rank = None
            return merge_session_info(await self._send(request, self.dp_size))
        if isinstance(request, GetRequestExtraTokenSizeReqInput):
            if request.dp_rank is None:
                return longest_match(await self._send(request, self.dp_size))
            return await self._on_named_rank(request)
        if isinstance(request, AllocateTokenForTransferReqInput):
            return await self._allocate(request)
        if isinstance(request, TransferRequestKVCacheReqInput):
            return await self._transfer(request)
        if isinstance(request, CommitTransferRequestKVCacheReqInput | AbortTransferReqInput):
            request.dp_rank = dp_rank_of_id(request.migration_id, self.dp_size)
            if request.dp_rank is None:
                return _refused(
                    request,
                    ErrorKind.NOT_FOUND,
                    f"unknown migration_id {request.migration_id!r}: no DP rank of this "
                    f"server (--dp-size {self.dp_size}) minted it",
                )
            return await self._call_one(request)
        raise TypeError(f"not a migration request: {type(request).__name__}")

    async def where_held(self, request: Any) -> GetRequestExtraTokenSizeReqOutput:
        """Every DP rank's size query for `request`'s ids; the reply of the one holding
        the longest prefix (ties: the least loaded, then the lowest rank)."""
        return longest_match(await self._send(_size_query(request), self.dp_size))

    # ------------------------------------------------------------------ internals

    async def _on_named_rank(self, request: Any) -> Any:
        if request.dp_rank >= self.dp_size:
            return self._out_of_range(request)
        output = await self._call_one(request)
        output.dp_rank = request.dp_rank
        return output

    async def _allocate(self, request: AllocateTokenForTransferReqInput) -> Any:
        minted = request.migration_id
        if request.dp_rank is not None:
            request.migration_id = tagged_id(minted, request.dp_rank)
            return await self._on_named_rank(request)
        held = await self._send(_size_query(request), self.dp_size)
        failed = next((r for r in held if not r.success), None)
        if failed is not None:
            return _refused(request, ErrorKind(failed.error_kind or "internal"), failed.message)
        output = None
        for reply in sorted(held, key=_allocation_preference):
            request.dp_rank = reply.dp_rank
            request.migration_id = tagged_id(minted, reply.dp_rank)
            output = await self._on_named_rank(request)
            if output.success or output.error_kind != ErrorKind.UNAVAILABLE.value:
                return output
        return output  # every DP rank was full: the last one's 503

    async def _transfer(self, request: TransferRequestKVCacheReqInput) -> Any:
        if request.dp_rank is None:
            held = await self.where_held(request)
            if not held.success:
                return _refused(request, ErrorKind(held.error_kind or "internal"), held.message)
            request.dp_rank = held.dp_rank
        if request.dp_rank >= self.dp_size:
            return self._out_of_range(request)
        # IMPORTANT: one claim per grant for the whole server, before any DP rank sees it.
        keys = grant_keys(request)
        refusal = self.claims.take(keys, request.dp_rank)
        if refusal is not None:
            return _refused(request, ErrorKind.FORBIDDEN, refusal)
        output = None
        try:
            output = await self._on_named_rank(request)
        finally:
            self.claims.release(
                keys, request.dp_rank, output.claims if output is not None else None
            )
        return output

    def _out_of_range(self, request: Any) -> Any:
        return _refused(
            request,
            ErrorKind.BAD_REQUEST,
            f"dp_rank {request.dp_rank} is out of range: this server has --dp-size {self.dp_size}",
        )


def merge_session_info(replies: list[Any]) -> Any:
    """One DP rank's session info per reply -> the server's (ranks by dp, pp, tp)."""
    refused = one_server_session_info(replies, "DP ranks")
    if refused is not None:
        return refused
    ranks = sorted(
        (rank for reply in replies for rank in reply.ranks),
        key=lambda r: (r.dp_rank, r.pp_rank, r.tp_rank),
    )
    first = replies[0]
    return replace_message(
        first,
        ranks=ranks,
        dp_size=len(replies),
        features=[f for f in first.features if f not in features.ONE_DP_RANK],
        allocate_channel={},
    )


def longest_match(replies: list[Any]) -> Any:
    """One DP rank's size query per reply -> the reply of the DP rank holding the longest
    prefix (a failure if any DP rank failed)."""
    failed = next((r for r in replies if not r.success), None)
    if failed is not None:
        return failed
    return min(replies, key=lambda r: (-r.matched_token_size, r.dp_load, r.dp_rank))


def _allocation_preference(reply: GetRequestExtraTokenSizeReqOutput) -> tuple[int, int, int]:
    """Where an allocation goes first: the DP rank holding the longest prefix (it moves
    least, and a live move's later stages land where its earlier ones did), then the
    least loaded."""
    return (-reply.matched_token_size, reply.dp_load, reply.dp_rank)


def _size_query(request: Any) -> GetRequestExtraTokenSizeReqInput:
    """The size query for an allocate's or a transfer's ids."""
    return GetRequestExtraTokenSizeReqInput(
        input_ids=request.input_ids,
        extra_key=request.extra_key,
        weight_version=request.weight_version,
        input_ids_u32=request.input_ids_u32,
    )


def _refused(request: Any, kind: ErrorKind, message: str) -> Any:
    return _OUTPUT_TYPE[type(request)](success=False, message=message, error_kind=kind.value)
