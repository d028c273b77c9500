"""Following a transfer request from its route to the bytes enters no module of the
package more than three times.

One real transfer on CPU, in one process: SGLang's route handlers (`add_routes` on a
FastAPI app, driven through httpx's ASGI transport), the real communicators
(`KVMigrationCommunicators`), a real one-rank scheduler side on a harness cache, the host
path and a real Mooncake loopback write. The one hop replaced is the ZMQ socket between
the HTTP process and the scheduler: the communicators' sender hands the request to the
scheduler's own handler (as its dispatcher would) in the same call, and the scheduler
loop's polls run as a task beside the route. `module_walk.ModuleWalk` counts, for every
call chain, how many times it enters each package module.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import orjson
from module_walk import ModuleWalk, chain_of
from side_helpers import one_rank_context, transfer_to_self

MAX_ENTRIES = 3


class _SchedulerSocket:
    """The communicators' `send_to_scheduler`: runs the scheduler's handler at once."""

    def __init__(self) -> None:
        self.handlers: dict[type, Any] = {}

    def send_pyobj(self, request: Any) -> None:
        self.handlers[type(request)](request)


def _side(harness_factory, send_output) -> Any:
    from sglang_kv_migration.paths.host.mooncake import TransportConfig
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics
    from sglang_kv_migration.server.rank.settings import RankSettings
    from sglang_kv_migration.server.scheduler.compose import compose_rank

    harness = harness_factory(page_size=16)
    ctx = one_rank_context(harness.cache, "tiny", send_output)
    side = compose_rank(
        ctx,
        RankSettings(
            watchdog_timeout_s=60.0,  # 15 s grants: none expires on a loaded box
            transport_config=TransportConfig(hostname="127.0.0.1", transfer_timeout_s=5.0),
            metrics=MigrationMetrics("tiny", 0, 0),
        ),
    )
    side.harness = harness
    return side


def _body(request: Any) -> dict[str, Any]:
    target = dataclasses.asdict(request.target_per_rank[0])
    target = {k: v for k, v in target.items() if v not in (None, [], "", {})}
    return {
        "input_ids": request.input_ids,
        "matched_token_size": request.matched_token_size,
        "extra_token_size": request.extra_token_size,
        "target_per_rank": [target],
        "migration_id": request.migration_id,
    }


async def _transfer(app: Any, side: Any, body: dict[str, Any], walk: ModuleWalk) -> Any:
    """POST the transfer while the scheduler loop polls beside it."""
    done = asyncio.Event()

    async def scheduler_loop() -> None:
        while not done.is_set():
            side.poll()
            await asyncio.sleep(0.001)

    loop = asyncio.create_task(scheduler_loop())
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            with walk.recording():
                return await client.post("/transfer_request_kvcache", content=orjson.dumps(body))
    finally:
        done.set()
        await loop


def test_a_transfer_enters_no_module_more_than_three_times(harness_factory) -> None:
    from fastapi import FastAPI
    from sglang_kv_migration.server.http import routes
    from sglang_kv_migration.server.http.communicators import KVMigrationCommunicators
    from sglang_kv_migration.server.messages import AllocateTokenForTransferReqInput

    socket = _SchedulerSocket()
    comms = KVMigrationCommunicators(socket)
    receivers = dict(comms.result_handlers)  # the tokenizer's result dispatcher
    side = _side(harness_factory, lambda output, _req: receivers[type(output)](output))
    try:
        socket.handlers = dict(side.handlers())
        ids = list(range(7000, 7064))
        side.harness.insert_random(ids, seed=3)
        alloc = side.allocate_token_for_transfer(
            AllocateTokenForTransferReqInput(
                input_ids=list(range(9000, 9064)),
                migration_id="walk",
                source_fingerprints=[side.identity.fingerprint.to_dict()],
                source_instance=side.identity.server_epoch,
            )
        )
        assert alloc.success, alloc.message
        request = transfer_to_self(
            side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="walk"
        )
        app = FastAPI()
        routes.add_routes(app, lambda: comms)
        walk = ModuleWalk()
        reply = asyncio.run(_transfer(app, side, _body(request), walk))
    finally:
        side.close()
    assert reply.status_code == 200, reply.text
    assert reply.json()["success"] and reply.json()["transferred_token_size"] == 64
    # The walk went from the route through the communicators and the scheduler's handler
    # to the source role, the host path and the transport.
    for part in (
        "server.http.routes",
        "server.http.communicators",
        "server.scheduler.scheduler_side",
        "server.source.transfers",
        "paths.host.path",
        "paths.host.mooncake",
    ):
        assert f"sglang_kv_migration.{part}" in walk.reached, sorted(walk.reached)
    over = walk.over(MAX_ENTRIES)
    assert not over, "\n".join(f"{m}: {' > '.join(chain)}" for m, chain in over.items())


def test_the_walk_counts_reentries() -> None:
    """A chain that goes back into a module counts one entry more each time."""
    from sglang_kv_migration.server.rank import context

    walk = ModuleWalk()

    def again(depth: int) -> None:  # this test's module is no package module
        if depth:
            context.error_of(lambda: again(depth - 1))

    with walk.recording():
        again(4)
    assert walk.entries["sglang_kv_migration.server.rank.context"] == 4
    assert set(walk.over(3)) == {"sglang_kv_migration.server.rank.context"}
    assert chain_of(None) == []
