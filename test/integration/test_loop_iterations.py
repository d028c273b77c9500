"""How many scheduler loop iterations a move takes on each side, on servers whose loops
take a fixed step every iteration, as a busy batch's decode does (`slowed_loop.py`).

Two CPU mini servers (`mini_server.py`: real hooks and handlers, HiRadixCache, our routes,
the allocate channel, the mailbox, Mooncake TCP), each loop slowed to `STEP_S`, the
default one-call client. Iterations are counted, not timed: the source's come with each
transfer reply (`polls`: from the iteration that took it up to the one that replied;
`first_poll`: the same for the moves of one iteration), the target's from what its
allocations and commits did per iteration (and `target_iteration` in the reply). A copy
of these few pages ends within one step: the step lasts until the writes it started are
done (`copies_within_step`), however loaded the machine.

- one move: 2 source iterations (the one that takes it up, with the target's answer,
  launches the copy; the next replies), its allocate in one target iteration and its
  commit in a later one, before that iteration's requests;
- six moves sent together (one call, or six threads): no more per move on either side,
  taken up and allocated in at most two iterations;
- the scheduler asking the target itself on a busy loop (what an idle one does) takes
  at least three.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import slowed_loop
from mini_server import ServerHandle, ServerPair, ServerSpec, serving
from sglang_kv_migration.client import MigrationResult, Move
from sglang_kv_migration.client.migration import MigrationClient
from slowed_loop import SlowedLoop

PAGE = 16
STEP_S = 0.1
TOKENS = 8 * PAGE
SIX = 6


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# Distinct prefixes: a warm-up, one alone, six in one call, six from threads, one more
# with the scheduler asking.
PREFIXES = [_seq(10_000 + 1_000 * i, TOKENS) for i in range(2 + 3 * SIX)]
WARM, ALONE, SCHEDULER_ASKS = PREFIXES[0], PREFIXES[1], PREFIXES[2]
ONE_CALL = PREFIXES[3 : 3 + SIX]
THREADS = PREFIXES[3 + SIX : 3 + 2 * SIX]


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    preload = [(ids, seed) for seed, ids in enumerate(PREFIXES, start=1)]
    source = ServerSpec(preload=preload, extension=SlowedLoop(STEP_S, copies_within_step=True))
    target = ServerSpec(extension=SlowedLoop(STEP_S, copies_within_step=True))
    with serving([source, target]) as handles:
        pair = ServerPair(*handles)
        with MigrationClient(timeout=60) as client:
            client.migrate(pair.source.url, pair.target.url, WARM)  # first contact
        yield pair


@pytest.fixture
def counted(servers: ServerPair) -> ServerPair:
    for server in (servers.source, servers.target):
        slowed_loop.reset(server.url)
    return servers


def _steps(result: Any) -> dict[str, float]:
    assert isinstance(result, MigrationResult), result
    assert result.migrated_token_size == TOKENS and result.source_committed
    return result.steps_ms["transfer"]


def _committed(target: ServerHandle, results: list[Any]) -> dict[str, tuple[int, int]]:
    """Per move, the target iterations that allocated and committed it (waits for the
    commits: the iteration after the source's reply makes them)."""
    ids = {r.migration_id for r in results}
    deadline = time.monotonic() + 60.0
    while True:
        seen = slowed_loop.iterations(target.url)
        if ids <= seen["committed"].keys():
            return {m: (seen["allocated"][m], seen["committed"][m]) for m in ids}
        if time.monotonic() > deadline:
            raise AssertionError(f"not committed: {ids - seen['committed'].keys()}")
        time.sleep(STEP_S)


def test_one_move_takes_two_source_iterations_and_one_target_iteration_to_allocate(
    counted: ServerPair,
) -> None:
    with MigrationClient(timeout=60) as client:
        result = client.migrate(counted.source.url, counted.target.url, ALONE)
    steps = _steps(result)
    assert steps["polls"] == 2, steps
    assert "allocate_ahead" in steps  # the source's HTTP layer asked the target
    [(allocated, committed)] = _committed(counted.target, [result]).values()
    assert committed > allocated  # a later iteration, before its requests
    assert sum(counted.target.ask(0, "held", ALONE)) == TOKENS


def test_six_moves_in_one_call_take_no_more_iterations_than_one(counted: ServerPair) -> None:
    with MigrationClient(timeout=60) as client:
        moves = [Move(counted.source.url, counted.target.url, ids) for ids in ONE_CALL]
        results = client.migrate_many(moves)
    _served_together(counted, results)


def test_six_moves_from_six_threads_take_no_more_iterations_than_one(counted: ServerPair) -> None:
    results: list[Any] = [None] * SIX
    ready = threading.Barrier(SIX)

    def move(i: int) -> None:
        with MigrationClient(timeout=60) as client:
            for url in (counted.source.url, counted.target.url):
                client.session_info(url)  # this thread's connections, before the barrier
            ready.wait(timeout=60)
            results[i] = client.migrate(counted.source.url, counted.target.url, THREADS[i])

    threads = [threading.Thread(target=move, args=(i,)) for i in range(SIX)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    _served_together(counted, results)


def _served_together(servers: ServerPair, results: list[Any]) -> None:
    steps = [_steps(r) for r in results]
    assert all(s["polls"] <= 2 for s in steps), [s["polls"] for s in steps]
    assert len({s["first_poll"] for s in steps}) <= 2  # taken up in at most two iterations
    assert len({s["target_iteration"] for s in steps}) <= 2  # allocated in at most two
    iterations = _committed(servers.target, results).values()
    assert len({committed for _, committed in iterations}) <= 2
    assert all(committed > allocated for allocated, committed in iterations)


def test_a_busy_source_that_asks_the_target_itself_takes_three_iterations(
    counted: ServerPair,
) -> None:
    """What the HTTP layer's ask saves: here it sees no generate requests, so the
    scheduler asks in the iteration that took the move up, and the answer can be taken
    up only in a later one (its poll ran before the target's loop took the call)."""
    slowed_loop.reset(counted.source.url, busy=False)
    try:
        with MigrationClient(timeout=60) as client:
            result = client.migrate(counted.source.url, counted.target.url, SCHEDULER_ASKS)
    finally:
        slowed_loop.reset(counted.source.url)
    steps = _steps(result)
    assert "allocate_ahead" not in steps
    assert steps["polls"] >= 3, steps
