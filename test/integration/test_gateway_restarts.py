"""A pin reaches the worker it names across restarts of the real model gateway (`smg
launch`, smg==1.13.0) and changes of its worker list.

The gateway numbers its workers in the order they registered, a new order on every
start: its `X-SMG-Target-Worker` index, and its passthrough's worker ids, are good only
against the list they were read from. Here the gateway is restarted on one address
between turns (registration order random, sometimes with a worker missing and added
later through its `POST /workers`, sometimes with a turn already waiting for it), and
every turn is pinned to a worker chosen at random: through the migrator
(`AsyncRequestMigrator(gateway=...)`) and through `SessionPins.route` for a caller that
posts itself. The workers are trivial HTTP servers that record every request they
receive (`recording_workers.py`), so a request the gateway sent elsewhere, even one
cancelled at once, is on the record of the worker that got it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import smg_gateway
from recording_workers import RecordingWorker, recording_workers
from sglang_kv_migration.integrations.gateway import GatewayWorker, ModelGateway, SessionPins
from sglang_kv_migration.rollout.request_migration import AsyncRequestMigrator, GenerateRequest

# Every combination of a worker added late (restart % 3) and a turn waiting for the
# start (restart % 4) once, each with its own random registration order.
RESTARTS = 12
# Stopped at once: a restart here is a crash and a new start, as far as clients can tell.
FAST_STOP = ("--shutdown-grace-period-secs", "0")


@pytest.fixture
def workers() -> Iterator[list[RecordingWorker]]:
    with recording_workers(3) as started:
        yield started


@dataclass
class Run:
    """The gateway's address, its restarts, and every pinned turn sent (rid -> worker)."""

    workers: list[RecordingWorker]
    policy_args: tuple[str, ...]
    port: int = field(default_factory=smg_gateway.port_to_restart_on)
    pinned: dict[str, str] = field(default_factory=dict)
    # The turns sent while the gateway's list was settled (not starting, not growing).
    settled: set[str] = field(default_factory=set)
    orders: list[tuple[str, ...]] = field(default_factory=list)
    misroutes_seen: int = 0  # `ModelGateway.misroutes` at the end

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @contextlib.asynccontextmanager
    async def gateway(self, urls: list[str]) -> AsyncIterator[smg_gateway.Gateway]:
        """The gateway in front of `urls`, started (in a thread: starting blocks until
        every worker registered) and stopped on exit."""
        with contextlib.ExitStack() as stack:
            gateway = smg_gateway.running_gateway(
                urls, "consistent_hashing", *self.policy_args, *FAST_STOP, port=self.port
            )
            started = await asyncio.to_thread(stack.enter_context, gateway)
            self.orders.append(tuple(w["url"] for w in started.workers()))
            yield started

    def misrouted(self) -> list[tuple[str, str, str]]:
        """(rid, pinned to, served by) of every request a worker got that was pinned to
        another one."""
        return [
            (rid, self.pinned.get(rid, "?"), w.url)
            for w in self.workers
            for rid in w.rids()
            if self.pinned.get(rid) != w.url
        ]


async def _turn_through_migrator(
    run: Run,
    migrator: AsyncRequestMigrator,
    worker: RecordingWorker,
    ids: list[int],
    settled: bool = True,
) -> None:
    request = GenerateRequest(ids, {"max_new_tokens": 1})
    run.pinned[request.rid] = worker.url
    if settled:
        run.settled.add(request.rid)
    handle = await migrator.submit(worker.url, request)
    out = await handle.result()
    assert out.output_ids == [worker.number], (worker.url, out.segments)


async def _turn_through_route(
    run: Run, pins: SessionPins, http: httpx.AsyncClient, session: str, worker: RecordingWorker
) -> None:
    pins.pin(session, worker.url)
    rid = f"{session}-{len(run.pinned)}"
    run.pinned[rid] = worker.url
    run.settled.add(rid)
    route = await pins.route(session)  # resolved now, posted at once
    reply = await http.post(
        route.url, json={"rid": rid, "input_ids": [1, 2]}, headers=route.headers
    )
    assert reply.status_code == 200, reply.text
    route.check(reply.headers)


async def _restarts(run: Run, pin: str, restarts: int, rng: random.Random) -> None:
    policy = "consistent_hashing"
    async with (
        ModelGateway(run.url, policy=policy, pin=pin) as gateway,
        AsyncRequestMigrator(gateway=gateway) as migrator,
        httpx.AsyncClient(timeout=30) as http,
    ):
        pins = SessionPins(gateway)
        for restart in range(restarts):
            urls = [w.url for w in run.workers]
            rng.shuffle(urls)
            late = urls.pop() if restart % 3 == 2 else None  # added once the gateway runs
            listed = [w for w in run.workers if w.url in urls]
            early = None
            if restart % 4 == 1:  # a turn that waits for the gateway to come back
                worker = rng.choice(listed)
                waiting = _turn_through_migrator(run, migrator, worker, [restart, 0], False)
                early = asyncio.create_task(waiting)
            async with run.gateway(urls) as gw:
                if early is not None:
                    await asyncio.wait_for(early, 120)
                for turn in range(2):
                    await _turn_through_migrator(
                        run, migrator, rng.choice(listed), [restart, turn + 1]
                    )
                    await _turn_through_route(run, pins, http, f"s{turn}", rng.choice(listed))
                if late is not None:  # the list grows under the running gateway
                    added = await http.post(gw.url + "/workers", json={"url": late})
                    assert added.status_code < 300, added.text
                    await asyncio.to_thread(_wait_listed, gw, len(run.workers))
                    for turn in range(2):
                        worker = rng.choice(run.workers)
                        await _turn_through_migrator(run, migrator, worker, [restart, 10 + turn])
        run.misroutes_seen = gateway.misroutes


def _wait_listed(gw: smg_gateway.Gateway, n: int) -> None:
    """Until the gateway lists `n` healthy workers (bounded)."""
    for _ in range(600):
        listed = gw.workers()
        if len(listed) == n and all(w.get("is_healthy") for w in listed):
            return
        time.sleep(0.05)
    raise TimeoutError(f"the gateway did not list {n} workers in 30 s: {gw.workers()}")


@pytest.mark.parametrize(("pin", "restarts"), [("target_worker", RESTARTS), ("rl_passthrough", 6)])
def test_pinned_turns_reach_their_worker_across_gateway_restarts(
    workers: list[RecordingWorker], pin: str, restarts: int
) -> None:
    policy_args = ("--enable-rl",) if pin == "rl_passthrough" else ()
    run = Run(workers, policy_args)
    asyncio.run(_restarts(run, pin, restarts, random.Random(20261206)))
    assert len(run.orders) == restarts
    # The gateway's order did change between starts (else this proved nothing) ...
    assert len(set(run.orders)) > 1, run.orders
    # ... and yet every turn was served by the worker it was pinned to, exactly once.
    by_url = {w.url: w for w in workers}
    for rid, url in run.pinned.items():
        assert by_url[url].rids().count(rid) == 1, (rid, url)
    # No turn sent while the gateway's list was settled reached another worker; a turn
    # that waited for a starting gateway could (its list still filling): each such
    # request was caught at its first byte, cancelled, and counted.
    misrouted = run.misrouted()
    assert not [m for m in misrouted if m[0] in run.settled], misrouted
    assert len(misrouted) == run.misroutes_seen, (misrouted, run.misroutes_seen)


class _ListReadBeforeARestart(ModelGateway):
    """A gateway client whose first read of the worker list is one taken before the
    gateway restarted: what a request resolved in the instant before a restart sees."""

    def __init__(self, url: str, stale: list[GatewayWorker]) -> None:
        super().__init__(url)
        self.stale: list[GatewayWorker] | None = stale

    async def workers(self) -> list[GatewayWorker]:
        if self.stale is not None:
            stale, self.stale = self.stale, None
            return stale
        return await super().workers()


def test_a_request_another_worker_took_is_cancelled_and_sent_to_its_own(
    workers: list[RecordingWorker],
) -> None:
    """The one window left: the list changes between its read and the request. The
    reply's first header names the worker that took it; the request is cancelled there
    and sent again against the list read anew."""
    run = Run(workers, ())
    target = workers[0]

    async def scenario() -> None:
        urls = [w.url for w in workers]
        async with run.gateway(urls):
            async with ModelGateway(run.url) as reader:
                stale = await reader.workers()
        old_index = [w.url for w in stale].index(target.url)
        for _ in range(40):  # until the target's index moved (1 chance in 3 it stays)
            random.shuffle(urls)
            async with run.gateway(urls):
                if run.orders[-1].index(target.url) == old_index:
                    continue
                async with (
                    _ListReadBeforeARestart(run.url, stale) as gateway,
                    AsyncRequestMigrator(gateway=gateway) as migrator,
                ):
                    await _turn_through_migrator(run, migrator, target, [7, 7])
                    assert gateway.misroutes == 1
                return
        raise AssertionError(f"the target kept index {old_index} over 40 restarts")

    asyncio.run(scenario())
    [rid] = run.pinned
    assert target.rids() == [rid]  # served by its own worker
    # The worker the stale index named got the request once, and it was cancelled there.
    elsewhere = [w for w in workers if w is not target and rid in w.rids()]
    assert len(elsewhere) == 1 and elsewhere[0].rids() == [rid]
