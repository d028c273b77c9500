"""Scheduler side of a server with several data-parallel ranks (`--dp-size N`).

Every DP rank's schedulers see every migration request (`server/http/dp_ranks.py` says
why); each request names the DP rank that acts on it in `dp_rank` (None: every one).
A rank of another DP rank returns nothing for it: it neither touches its tree nor
replies, and since all ranks of one DP rank see the same request they all skip it
together, so the collectives of the DP rank that acts (over its own TP group) stay
matched. Replies to requests every DP rank answers say which DP rank sent them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_kv_migration.server.messages import (
    REQUEST_TYPES,
    AllocateTokenForTransferReqOutput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqOutput,
)

Handler = Callable[[Any], Any]


def for_dp_rank(
    handlers: list[tuple[type, Handler]], dp_rank: int, load: Callable[[], int]
) -> list[tuple[type, Handler]]:
    """`handlers` that act only on requests for `dp_rank` (or for every DP rank), and
    stamp `dp_rank` (and the size query's `dp_load`, from `load`) on their replies.
    Handlers of other types (messages between PP stages) are left as they are."""
    routed = {request_type for _name, request_type, _output_type in REQUEST_TYPES}
    return [
        (kind, _on_dp_rank(handler, dp_rank, load) if kind in routed else handler)
        for kind, handler in handlers
    ]


def _on_dp_rank(handler: Handler, dp_rank: int, load: Callable[[], int]) -> Handler:
    def handle(request: Any) -> Any:
        if request.dp_rank is not None and request.dp_rank != dp_rank:
            return None  # another DP rank's request: its ranks answer it
        output = handler(request)
        if isinstance(output, GetTransferSessionInfoReqOutput):
            for rank in output.ranks:
                rank.dp_rank = dp_rank
        elif isinstance(output, GetRequestExtraTokenSizeReqOutput):
            output.dp_rank = dp_rank
            output.dp_load = load()
        elif isinstance(output, AllocateTokenForTransferReqOutput):
            output.dp_rank = dp_rank
        return output

    return handle
