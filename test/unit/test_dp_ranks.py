"""The routing of a `--dp-size N` server's migration requests (`server/http/dp_ranks.py`,
`server/scheduler/dp_filter.py`) and of a resumed request (`rollout/dp_routing.py`), with the
real wire types and a stand-in for the scheduler ranks behind the communicators."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sglang_kv_migration.rollout.dp_routing import routed_body
from sglang_kv_migration.server.http.dp_ranks import (
    DataParallelRanks,
    dp_rank_of_id,
    tagged_id,
)
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    GetRequestExtraTokenSizeReqInput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
    StageSyncReqInput,
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.scheduler.dp_filter import for_dp_rank
from sglang_kv_migration.wire.messages import RankSessionInfo


class FakeDpRanks:
    """Each DP rank as a `for_dp_rank`-filtered handler set: what it holds (matched
    tokens), its load, and whether its pool is full."""

    def __init__(self, matched: list[int], loads: list[int], full: set[int] = frozenset()):
        self.allocated: list[int] = []
        self.handlers = []
        for rank, (held, load) in enumerate(zip(matched, loads, strict=True)):
            self.handlers.append(
                dict(
                    for_dp_rank(
                        self._rank_handlers(rank, held, rank in full), rank, lambda n=load: n
                    )
                )
            )

    def _rank_handlers(self, rank: int, held: int, full: bool) -> list[tuple[type, Any]]:
        def size(req: Any) -> Any:
            return GetRequestExtraTokenSizeReqOutput(success=True, matched_token_size=held)

        def allocate(req: Any) -> Any:
            if full:
                return AllocateTokenForTransferReqOutput(
                    success=False, error_kind="unavailable", message="pool full"
                )
            self.allocated.append(rank)
            return AllocateTokenForTransferReqOutput(success=True, migration_id=req.migration_id)

        def info(req: Any) -> Any:
            rank_info = RankSessionInfo(tp_rank=0, pp_rank=0, page_size=1, fingerprint={})
            return GetTransferSessionInfoReqOutput(
                success=True, ranks=[rank_info], server_epoch="e"
            )

        def transfer(req: Any) -> Any:
            return TransferRequestKVCacheReqOutput(success=True, message=f"from {rank}")

        return [
            (GetRequestExtraTokenSizeReqInput, size),
            (AllocateTokenForTransferReqInput, allocate),
            (GetTransferSessionInfoReqInput, info),
            (TransferRequestKVCacheReqInput, transfer),
            (AbortTransferReqInput, lambda req: f"abort on {rank}"),
            (StageSyncReqInput, lambda req: "stage sync"),
        ]

    async def send(self, request: Any, replies: int) -> list[Any]:
        """Every DP rank sees the request (SGLang's control messages); the ones it is
        not for return None."""
        outputs = [h[type(request)](request) for h in self.handlers]
        answered = [o for o in outputs if o is not None]
        assert len(answered) == replies
        return answered

    async def call_one(self, request: Any) -> Any:
        (output,) = await self.send(request, 1)
        return output

    def router(self) -> DataParallelRanks:
        return DataParallelRanks(len(self.handlers), self.send, self.call_one)


def allocate(ranks: FakeDpRanks, **fields: Any) -> Any:
    request = AllocateTokenForTransferReqInput(input_ids=[1, 2, 3], migration_id="m1", **fields)
    return asyncio.run(ranks.router().call(request))


def test_allocate_goes_to_the_least_loaded_dp_rank_that_fits() -> None:
    ranks = FakeDpRanks(matched=[0, 0, 0], loads=[5, 1, 3], full={1})
    out = allocate(ranks)
    assert out.success and out.dp_rank == 2  # 1 is less loaded but full (503)
    assert ranks.allocated == [2]
    assert out.migration_id == tagged_id("m1", 2)
    assert dp_rank_of_id(out.migration_id, 3) == 2


def test_allocate_prefers_the_dp_rank_holding_the_prefix() -> None:
    ranks = FakeDpRanks(matched=[0, 16, 32], loads=[0, 0, 9])
    assert allocate(ranks).dp_rank == 2


def test_allocate_on_a_named_dp_rank_or_refused() -> None:
    ranks = FakeDpRanks(matched=[0, 0], loads=[0, 0])
    assert allocate(ranks, dp_rank=1).dp_rank == 1
    out = allocate(ranks, dp_rank=2)
    assert (out.success, out.error_kind) == (False, "bad_request")
    full = FakeDpRanks(matched=[0, 0], loads=[0, 0], full={0, 1})
    assert allocate(full).error_kind == "unavailable"


def test_session_info_and_transfer_are_routed() -> None:
    ranks = FakeDpRanks(matched=[0, 48], loads=[0, 0])
    info = asyncio.run(ranks.router().call(GetTransferSessionInfoReqInput()))
    assert info.dp_size == 2 and [r.dp_rank for r in info.ranks] == [0, 1]
    transfer = TransferRequestKVCacheReqInput(input_ids=[1, 2, 3])
    out = asyncio.run(ranks.router().call(transfer))
    assert (out.dp_rank, out.message) == (1, "from 1")  # where the prefix is


def test_ids_name_their_dp_rank() -> None:
    assert dp_rank_of_id(tagged_id("abc", 3), 4) == 3
    for bad in ("abc", "abc.dp4", "abc.dp", "abc.dp-1", "abc.dp1x", "abc.dp" + "1" * 40):
        assert dp_rank_of_id(bad, 4) is None, bad
    ranks = FakeDpRanks(matched=[0, 0], loads=[0, 0])
    out = asyncio.run(ranks.router().call(AbortTransferReqInput(migration_id="abc")))
    assert out.error_kind == "not_found"
    out = asyncio.run(ranks.router().call(AbortTransferReqInput(migration_id="abc.dp1")))
    assert out == "abort on 1"


def test_filter_leaves_other_messages_alone() -> None:
    ranks = FakeDpRanks(matched=[0, 0], loads=[0, 0])
    assert ranks.handlers[1][StageSyncReqInput](StageSyncReqInput()) == "stage sync"
    query = GetRequestExtraTokenSizeReqInput(input_ids=[1], dp_rank=0)
    assert ranks.handlers[1][GetRequestExtraTokenSizeReqInput](query) is None


@pytest.mark.parametrize("field", ["routed_dp_rank", "data_parallel_rank"])
def test_continuation_is_routed_to_the_dp_rank_holding_the_kv(field: str) -> None:
    original = {field: 3, "top_k": 1}
    assert routed_body(original, 1) == {"routed_dp_rank": 1, "top_k": 1}
    assert routed_body(original, None) == {"top_k": 1}
    assert original == {field: 3, "top_k": 1}  # the first piece's body is left as it was
