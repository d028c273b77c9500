"""Scheduler loop iterations per move on busy servers, on CPU: one move against six sent
together (in one call, and from six threads), per side.

Two CPU mini servers (`test/support/mini_server.py`: our routes and communicators, the
real scheduler hooks and handlers, HiRadixCache, the allocate channel, the mailbox,
Mooncake TCP), page 16, whose loops take a fixed step every iteration as a busy batch's
decode does (`test/support/slowed_loop.py`; `--step-s`, the target's `--target-step-s`,
0: an idle target). Moves are the default one-call client's (`MigrationClient.migrate` /
`migrate_many`); between rounds the target's cache is flushed, so every move moves its
whole prefix.

Per move, counted (iterations do not depend on the machine's speed as long as each
step's work fits in a step): the source iterations from the one that took the transfer
up to the one that replied (`polls`), the poll that took it up (`first_poll`), the
target iteration that answered its allocate (`target_iteration`) and, on a slowed
target, the one that committed it. Per way of sending: the most source iterations of a
move, the iterations the moves were taken up / allocated / committed in, and the wall
time of all of them in steps, against one move alone.

`--flows`: `ahead` (the source's HTTP layer asks the target while its scheduler is
busy: the default) and `scheduler` (the scheduler asks, as an idle one does).

    PYTHONPATH=python:test/support .venv/bin/python benchmark/bench_loop_iterations.py \
        --rounds 5 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))

PAGE = 16
WAYS = ("one", "one_call", "threads")


def main() -> None:
    args = _parse()
    import slowed_loop
    from mini_server import ServerPair, ServerSpec, serving
    from sglang_kv_migration.client.migration import MigrationClient
    from slowed_loop import SlowedLoop

    prefixes = [
        list(range(100_000 * (i + 1), 100_000 * (i + 1) + args.tokens))
        for i in range(2 + 2 * args.k)
    ]
    preload = [(ids, seed) for seed, ids in enumerate(prefixes, start=1)]
    target_ext = SlowedLoop(args.target_step_s) if args.target_step_s > 0 else None
    specs = [
        ServerSpec(preload=preload, extension=SlowedLoop(args.step_s)),
        ServerSpec(extension=target_ext),
    ]
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()
    with serving(specs) as handles:
        servers = ServerPair(*handles)
        with MigrationClient(timeout=120) as client:
            client.migrate(servers.source.url, servers.target.url, prefixes[0])  # first contact
        _settle(servers, target_ext is not None, [])
        for r in range(args.rounds):
            for flow in args.flows:
                slowed_loop.reset(servers.source.url, busy=flow == "ahead")
                row = _round(servers, prefixes[1:], args.k, target_ext is not None)
                rounds.append({"round": r, "flow": flow, **row})
                print(_line(rounds[-1], args.step_s), flush=True)
    summary = summarize(rounds, args.step_s)
    record = {
        "config": {**vars(args), "page_size": PAGE},
        "commit": _commit(),
        "wall_s": time.monotonic() - started,
        "rounds": rounds,
        "summary": summary,
    }
    print(markdown(summary, args.step_s))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-s", type=float, default=0.02, help="the source's loop step")
    p.add_argument("--target-step-s", type=float, default=0.02, help="0: an idle target")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=16 * PAGE, help="each prefix")
    p.add_argument("--k", type=int, default=6, help="moves sent together")
    p.add_argument("--flows", nargs="+", default=["ahead", "scheduler"])
    p.add_argument("--json", default="")
    return p.parse_args()


def _round(servers: Any, prefixes: list[list[int]], k: int, counted: bool) -> dict[str, Any]:
    """One move alone, `k` in one call, `k` from `k` threads; the target flushed after."""
    from sglang_kv_migration.client import Move
    from sglang_kv_migration.client.migration import MigrationClient

    source, target = servers.source.url, servers.target.url
    row: dict[str, Any] = {}
    with MigrationClient(timeout=120) as client:
        for url in (source, target):
            client.session_info(url)  # cached: the moves make only their own trips
        t0 = time.perf_counter()
        one = [client.migrate(source, target, prefixes[0])]
        row["one"] = _moves(one, t0)
        t0 = time.perf_counter()
        many = client.migrate_many([Move(source, target, p) for p in prefixes[1 : 1 + k]])
        row["one_call"] = _moves(many, t0)
    threads, row["threads"] = _threads(source, target, prefixes[1 + k : 1 + 2 * k])
    committed = _settle(servers, counted, [*one, *many, *threads])
    for way in WAYS:
        for move in row[way]["moves"]:
            move["target_committed"] = committed.get(move["migration_id"])
    return row


def _threads(
    source: str, target: str, prefixes: list[list[int]]
) -> tuple[list[Any], dict[str, Any]]:
    from sglang_kv_migration.client.migration import MigrationClient

    results: list[Any] = [None] * len(prefixes)
    ready = threading.Barrier(len(prefixes) + 1)

    def move(i: int) -> None:
        with MigrationClient(timeout=120) as client:
            for url in (source, target):
                client.session_info(url)  # this thread's connections, before the barrier
            ready.wait(timeout=120)
            results[i] = client.migrate(source, target, prefixes[i])

    threads = [threading.Thread(target=move, args=(i,)) for i in range(len(prefixes))]
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    t0 = time.perf_counter()
    for thread in threads:
        thread.join(timeout=300)
    return results, _moves(results, t0)


def _moves(results: list[Any], t0: float) -> dict[str, Any]:
    wall = time.perf_counter() - t0
    moves = []
    for r in results:
        steps = r.steps_ms.get("transfer", {})
        moves.append(
            {
                "migration_id": r.migration_id,
                "migrated": r.migrated_token_size,
                "polls": steps.get("polls"),
                "first_poll": steps.get("first_poll"),
                "target_iteration": steps.get("target_iteration"),
                "allocate_ahead_ms": steps.get("allocate_ahead"),
                "to_scheduler_ms": steps.get("to_scheduler"),
                "steps_ms": steps,
            }
        )
    return {"wall_s": wall, "moves": moves}


def _settle(servers: Any, counted: bool, results: list[Any]) -> dict[str, int]:
    """Wait for the target's commits, then flush its cache; returns the iteration that
    committed each move (on a slowed target)."""
    import slowed_loop

    committed: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if servers.target.ask(0, "pending") == 0:
            break
        time.sleep(0.05)
    if counted:
        seen = slowed_loop.iterations(servers.target.url)["committed"]
        committed = {r.migration_id: seen[r.migration_id] for r in results}
        slowed_loop.reset(servers.target.url)
    servers.target.ask(0, "flush")
    return committed


def summarize(rounds: list[dict[str, Any]], step_s: float) -> dict[str, Any]:
    """Per flow and way: the most source iterations of a move (and their spread over the
    rounds), the distinct iterations the moves were taken up / allocated / committed in,
    and the wall time in steps and against one move."""
    out: dict[str, Any] = {}
    for flow in dict.fromkeys(r["flow"] for r in rounds):
        mine = [r for r in rounds if r["flow"] == flow]
        out[flow] = {way: _cell(mine, way, step_s) for way in WAYS}
    return out


def _cell(rounds: list[dict[str, Any]], way: str, step_s: float) -> dict[str, Any]:
    def per_round(key: str, distinct: bool) -> list[int]:
        values = []
        for r in rounds:
            got = [m[key] for m in r[way]["moves"] if m.get(key) is not None]
            if got:  # (none: not counted, e.g. the commits of an idle target)
                values.append(len(set(got)) if distinct else max(got))
        return values

    walls = [r[way]["wall_s"] / step_s for r in rounds]
    ones = [r["one"]["wall_s"] / step_s for r in rounds]
    return {
        "source_iterations_max": per_round("polls", False),
        "taken_up_in": per_round("first_poll", True),
        "allocated_in": per_round("target_iteration", True),
        "committed_in": per_round("target_committed", True),
        "wall_steps": walls,
        "wall_over_one": [w / o for w, o in zip(walls, ones, strict=True)],
    }


def _spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    if min(values) == max(values):
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def _counts(values: list[int]) -> str:
    return "–".join(str(v) for v in sorted({min(values), max(values)})) if values else "—"


def markdown(summary: dict[str, Any], step_s: float) -> str:
    lines = [
        f"loop step {step_s * 1e3:.0f} ms; per cell over the rounds: counts min–max, "
        "walls median (min–max)",
        "| flow | moves | source iterations per move (most) | taken up in | allocated in "
        "| committed in | wall, steps | / one move |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for flow, cells in summary.items():
        for way, c in cells.items():
            lines.append(
                f"| {flow} | {way} | {_counts(c['source_iterations_max'])} "
                f"| {_counts(c['taken_up_in'])} | {_counts(c['allocated_in'])} "
                f"| {_counts(c['committed_in'])} | {_spread(c['wall_steps'])} "
                f"| {_spread(c['wall_over_one'])} |"
            )
    return "\n".join(lines)


def _line(row: dict[str, Any], step_s: float) -> str:
    parts = [f"round {row['round']} {row['flow']}:"]
    for way in WAYS:
        polls = [m["polls"] for m in row[way]["moves"]]
        parts.append(f"{way} {row[way]['wall_s'] / step_s:.2f} steps, polls {polls}")
    return "  ".join(parts)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    main()
