"""One grant, one claim, per server: the HTTP layer of a `--dp-size N` server lets one DP
rank claim each grant (`server/http/grant_claims.py`), with the real routing
(`DataParallelRanks`), the real wire types and scheduler ranks that answer when the
test says so (each claims what it is sent, unless told to refuse before the claim).

The attacks these stand for run on real servers in
`test/integration/test_one_claim_per_server.py`."""

from __future__ import annotations

import asyncio
from typing import Any

from sglang_kv_migration.server.http.dp_ranks import DataParallelRanks
from sglang_kv_migration.server.http.grant_claims import UNKNOWN_HOLD_S, GrantClaims, grant_keys
from sglang_kv_migration.server.messages import (
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.wire.messages import AllocateOnTarget, TransferRequestKVCacheTarget

NOW = 1_000.0
UNTIL = NOW + 30.0  # the grants' expiry


class HeldRanks:
    """DP ranks whose transfers reply only when the test releases them; each claims the
    grants it is sent (`claims`), unless `refuse` names its DP rank (a refusal before
    any grant verified), or `unknown` does (a failure answered without the gather)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.seen: list[tuple[str, int]] = []
        self.refuse: set[int] = set()
        self.unknown: set[int] = set()

    async def call_one(self, request: Any) -> Any:
        self.seen.append((request.rid, request.dp_rank))
        gate = self.gates.setdefault(request.rid, asyncio.Event())
        await gate.wait()
        if request.dp_rank in self.unknown:
            return TransferRequestKVCacheReqOutput(success=False, error_kind="internal")
        claimed = 0.0 if request.dp_rank in self.refuse else UNTIL
        claims = [[request.migration_id, t.tp, t.pp, claimed] for t in request.target_per_rank]
        if request.allocate_on_target is not None:  # the target's channel granted it
            claims = [["granted.dp1", 0, 0, claimed]]
        return TransferRequestKVCacheReqOutput(
            success=bool(claimed), error_kind="" if claimed else "forbidden", claims=claims
        )

    async def send(self, request: Any, replies: int) -> list[Any]:
        raise AssertionError("every transfer here names its DP rank")


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _router() -> tuple[DataParallelRanks, HeldRanks, Clock]:
    ranks, clock = HeldRanks(), Clock()
    router = DataParallelRanks(2, ranks.send, ranks.call_one)
    router.claims = GrantClaims(clock=clock)
    return router, ranks, clock


def _transfer(name: str, dp_rank: int, mid: str = "m.dp0", grant: str = "g") -> Any:
    request = TransferRequestKVCacheReqInput(
        input_ids=[1, 2],
        migration_id=mid,
        dp_rank=dp_rank,
        target_per_rank=[TransferRequestKVCacheTarget(tp=0, pp=0, grant=grant)],
    )
    request.rid = name
    return request


async def _started(router: DataParallelRanks, ranks: HeldRanks, request: Any) -> asyncio.Task:
    task = asyncio.ensure_future(router.call(request))
    for _ in range(100):  # bounded: the task reaches the held rank in a few steps
        if any(name == request.rid for name, _ in ranks.seen):
            return task
        await asyncio.sleep(0)
    raise AssertionError("the transfer never reached its DP rank")


def test_a_second_dp_rank_is_refused_while_the_first_sends_and_after_it_claimed() -> None:
    async def run() -> None:
        router, ranks, clock = _router()
        first = await _started(router, ranks, _transfer("first", 0))
        # While DP rank 0 sends under the grant: DP rank 1 is refused, unseen by any rank.
        second = await router.call(_transfer("second", 1))
        assert (second.success, second.error_kind) == (False, "forbidden")
        assert "replay" in second.message and "DP rank 0" in second.message
        assert second.ranks == []  # no receipt: it settles nothing
        assert [name for name, _ in ranks.seen] == ["first"]
        # The same DP rank is not refused here: its own guard answers (one process).
        same = await _started(router, ranks, _transfer("same", 0))
        ranks.gates["first"].set()
        ranks.gates["same"].set()
        assert (await first).success
        await same
        # Claimed by DP rank 0: still refused on DP rank 1, until the grant expires.
        assert "replay" in (await router.call(_transfer("third", 1))).message
        assert router.claims.holder(("m.dp0", 0, 0)) == 0
        clock.now = UNTIL
        assert router.claims.holder(("m.dp0", 0, 0)) is None
        late = await _started(router, ranks, _transfer("late", 1))
        ranks.gates["late"].set()
        await late

    asyncio.run(run())


def test_a_grant_no_dp_rank_claimed_is_free_for_a_correct_retry() -> None:
    async def run() -> None:
        router, ranks, _clock = _router()
        ranks.refuse.add(0)  # e.g. DP rank 0 does not hold the prefix's pages... before
        first = await _started(router, ranks, _transfer("first", 0))  # the claim
        ranks.gates["first"].set()
        assert not (await first).success
        assert router.claims.holder(("m.dp0", 0, 0)) is None
        assert len(router.claims) == 0
        retry = await _started(router, ranks, _transfer("retry", 1))
        ranks.gates["retry"].set()
        assert (await retry).success

    asyncio.run(run())


def test_a_dp_rank_that_does_not_say_keeps_the_grant() -> None:
    async def run() -> None:
        router, ranks, clock = _router()
        ranks.unknown.add(0)
        first = await _started(router, ranks, _transfer("first", 0))
        ranks.gates["first"].set()
        await first
        clock.now = UNTIL + 60.0  # past any expiry the reply could have named
        assert router.claims.holder(("m.dp0", 0, 0)) == 0
        assert "replay" in (await router.call(_transfer("again", 1))).message
        clock.now = NOW + UNKNOWN_HOLD_S
        assert router.claims.holder(("m.dp0", 0, 0)) is None

    asyncio.run(run())


def test_grants_a_target_s_channel_granted_are_kept_from_the_reply() -> None:
    """Feature "source_allocate": the grant came from the target, named by no body; the
    reply's claims bring it in, so the grant the reply echoes cannot be used again on
    another DP rank."""

    async def run() -> None:
        router, ranks, _clock = _router()
        one_trip = _transfer("one_trip", 1, mid="", grant="")
        one_trip.allocate_on_target = AllocateOnTarget("a", "s", b"{}")
        assert grant_keys(one_trip) == []
        task = await _started(router, ranks, one_trip)
        ranks.gates["one_trip"].set()
        assert (await task).success
        reuse = await router.call(_transfer("reuse", 0, mid="granted.dp1"))
        assert "replay" in reuse.message and "DP rank 1" in reuse.message

    asyncio.run(run())


def test_an_out_of_range_dp_rank_holds_nothing() -> None:
    async def run() -> None:
        router, ranks, _clock = _router()
        refused = await router.call(_transfer("far", 9))
        assert refused.error_kind == "bad_request" and "out of range" in refused.message
        assert len(router.claims) == 0 and ranks.seen == []

    asyncio.run(run())


def test_the_ledger_is_bounded_and_keeps_what_is_in_flight() -> None:
    clock = Clock()
    claims = GrantClaims(clock=clock, limit=4)
    assert claims.take([("busy", 0, 0)], 0) is None
    for i in range(10):
        key = (f"m{i}", 0, 0)
        assert claims.take([key], 1) is None
        claims.release([key], 1, [[f"m{i}", 0, 0, UNTIL]])
    assert len(claims) <= 4
    assert claims.holder(("busy", 0, 0)) == 0  # in flight: never dropped
    assert claims.holder(("m9", 0, 0)) == 1  # the latest kept
