"""Six concurrent 8K moves against one, from an idle source and from a source decoding a
full batch (`bench_busy_source.py --only-concurrency`; GPU machine only).

Per round and source state (idle; busy: `--busy` greedy decodes of mixed lengths kept
running on the source, CUDA graphs on), seven fresh 8K prompts are placed on the source
(a one-token generate each, the busy batch running), then:
- `one`: the first moves alone;
- `threads`: the other six at once from six threads (each thread's connections made
  first, then a barrier), timed from the barrier to the last reply;
- `one_call`: the target's cache flushed, the same six again in one `migrate_many`
  (feature "transfer_batch": one call carries the six transfers).
Every move is the default client's, `path="device"`. Per move the file keeps its wall
time, where the source held the prefix just before (`tier`: a move from the host tier
copies at ~48 GB/s, from the GPU at ~1.9 TB/s), whether it moved the whole prefix, its
copy, and the loop iterations its trip took on each side (`busy_source_report.
concurrent_move`). The summary (`busy_source_report.concurrency_summary`) gives per state
and way the six over one (targets: <= 1.5x; <= 2x from a busy source) and per round the
iterations. No round starts after `--deadline-s`; the file is rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import busy_source_report as report
from busy_batch import BusyBatch, held, tokens
from sglang_kv_migration.client import MigrationResult, Move
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import OUT_DIR, flush_cache, generate  # noqa: E402

RESULT = OUT_DIR / "bench_busy_source_concurrency.json"
TOKENS = 8192
MOVES = 6  # moved at once, against one alone
SETTLE_S = 0.5

Servers = Callable[[dict[str, Any]], AbstractContextManager[tuple[str, str]]]


def target_tokens(page_size: int = 16) -> int:
    """The GPU pool a round's moves need on the target at once: the one move's prefix
    and the six's, in whole pages (each prompt less its last token)."""
    return (MOVES + 1) * ((TOKENS - 1) // page_size * page_size)


def run(args: argparse.Namespace, servers: Servers, warm_up: Any) -> None:
    """`servers(config)`: both servers up, yielding (source, target) and filling in the
    config's card, pool and start-ups; `warm_up(client, source, target, rng)`: the
    benchmark's own (kernels, device path)."""
    started = time.monotonic()
    result: dict[str, Any] = {"config": dict(vars(args)), "rounds": [], "complete": False}
    with servers(result["config"]) as (source, target), MigrationClient(timeout=600) as client:
        result["config"]["startup_s"] = time.monotonic() - started
        rng = random.Random(0)
        warm_up(client, source, target, rng)
        for r in range(args.concurrency_rounds):
            for state in report.SOURCES:
                if time.monotonic() - started > args.deadline_s:
                    break
                row = _state_round(args, client, source, target, state, rng)
                result["rounds"].append({"round": r, "state": state, **row})
                result["summary"] = report.concurrency_summary(result["rounds"])
                result["wall_s"] = time.monotonic() - started
                report.write_result(RESULT, result)
                print(json.dumps(_brief(result["rounds"][-1])), flush=True)
    result["complete"] = len(result["rounds"]) == 2 * args.concurrency_rounds
    result["summary"] = report.concurrency_summary(result["rounds"])
    report.write_result(RESULT, result)
    print(report.concurrency_markdown(result["summary"]), flush=True)


def _state_round(
    args: argparse.Namespace,
    client: MigrationClient,
    source: str,
    target: str,
    state: str,
    rng: random.Random,
) -> dict[str, Any]:
    for url in (source, target):
        flush_cache(url)
    batch = BusyBatch(source, args.busy, rng.randrange(1 << 30)) if state == "busy" else None
    try:
        if batch is not None:
            batch.start(min_running=min(32, args.busy))
        row = _round(client, source, target, rng, args.page_size)
        if batch is not None:
            row["running_on_source"] = batch.running()
        return row
    finally:
        if batch is not None:
            batch.stop()


def _round(
    client: MigrationClient,
    source: str,
    target: str,
    rng: random.Random,
    page_size: int,
    k: int = MOVES,
) -> dict[str, Any]:
    prompts = [tokens(rng, TOKENS) for _ in range(k + 1)]
    for p in prompts:
        generate(source, p, 1)
    time.sleep(SETTLE_S)
    whole = (TOKENS - 1) // page_size * page_size
    where = [held(client, source, p) for p in prompts]
    t0 = time.perf_counter()
    r = client.migrate(source, target, prompts[0][:-1], path="device")
    one = report.concurrent_move(r, time.perf_counter() - t0, where[0], whole)
    threads = _threads(source, target, prompts[1:], where[1:], whole)
    flush_cache(target)
    time.sleep(SETTLE_S)
    where = [held(client, source, p) for p in prompts[1:]]
    moves = [Move(source, target, p[:-1]) for p in prompts[1:]]
    t0 = time.perf_counter()
    results = client.migrate_many(moves, path="device")
    wall = time.perf_counter() - t0
    one_call = {
        "wall_ms": wall * 1e3,
        "moves": [_move(r, wall, w, whole) for r, w in zip(results, where, strict=True)],
    }
    return {"one": one, "threads": threads, "one_call": one_call}


def _threads(
    source: str, target: str, prompts: list[list[int]], where: list[dict], whole: int
) -> dict[str, Any]:
    """Six moves from six threads, each with its own client and kept-alive connections
    made before the barrier; the wall time from the barrier to the last reply."""
    moves: list[dict[str, Any]] = [{} for _ in prompts]
    ready = threading.Barrier(len(prompts) + 1)

    def move(i: int) -> None:
        with MigrationClient(timeout=600) as client:
            for url in (source, target):
                client.session_info(url)
            ready.wait(timeout=120)
            t0 = time.perf_counter()
            try:
                r = client.migrate(source, target, prompts[i][:-1], path="device")
            except Exception as e:  # noqa: BLE001 - recorded as this move's failure
                r = e
            moves[i] = _move(r, time.perf_counter() - t0, where[i], whole)

    threads = [threading.Thread(target=move, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    t0 = time.perf_counter()
    for thread in threads:
        thread.join(timeout=300)
    return {"wall_ms": (time.perf_counter() - t0) * 1e3, "moves": moves}


def _move(r: Any, wall_s: float, where: dict, whole: int) -> dict[str, Any]:
    if not isinstance(r, MigrationResult):  # a move of `migrate_many` that failed
        return {"failed": str(r), "whole": False, "wall_ms": wall_s * 1e3}
    return report.concurrent_move(r, wall_s, where, whole)


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    """One line per round for the log: walls and each move's source iterations."""
    out: dict[str, Any] = {"round": row["round"], "state": row["state"]}
    out["one"] = (round(row["one"]["wall_ms"], 1), row["one"].get("polls"), row["one"]["tier"])
    for way in report.CONCURRENT_WAYS:
        moves = row[way]["moves"]
        out[way] = (round(row[way]["wall_ms"], 1), [m.get("polls") for m in moves])
    return out
