"""The control plane of a migration on CPU: what each HTTP round trip costs per token.

Two CPU mini servers (`test/support/mini_server.py`: our FastAPI routes under uvicorn, the real
zmq communicators, SGLang's HiRadixCache from the CPU harness, the real scheduler hooks
and handlers, Mooncake TCP on 127.0.0.1), page size 1. The source preloads one prefix per
length; each repeat flushes the target and migrates the prefix again through
`MigrationClient.migrate` (host path: the only one on CPU). Reported per length: the
median of every phase of `result.timings`, and the transfer phase less the source's copy
time (`copy_seconds`), which is what the device path's transfer trip shares with it.
Then where each trip's time went (`result.steps_ms`, `server/diag/trace.py`): the client and
HTTP server outside the route, the body parse, the hop to the scheduler and the wait for
its loop, the scheduler's part (for the transfer: its handler and the loop iterations
until the reply), the hop back, and the rest of the route.

`--floor N` first times N trips that do no work (an abort of an unknown id: HTTP, the
tokenizer side, the scheduler's dispatch and back, a 404) through the clients' own HTTP
(`client/http11.py`, `client/aio_http11.py`) and through httpx (sync and asyncio),
interleaved: the fixed cost of one trip.

`--concurrent K` then moves K other prefixes of `--concurrent-tokens` at once (threads,
one client, as `bench_any_tier.py` on the GPU) and then in one `migrate_many` (feature
"transfer_batch": their transfers in one call) against one alone, and reports the wall
time of all against one and each phase's steps in each.

    PYTHONPATH=python .venv/bin/python benchmark/bench_control_plane.py
    PYTHONPATH=python .venv/bin/python benchmark/bench_control_plane.py --tokens 32768 \
        --repeats 5 --profile 32768
    PYTHONPATH=python .venv/bin/python benchmark/bench_control_plane.py --tokens 1024 \
        --concurrent 6 --concurrent-tokens 8192

`--flows` (default all five, interleaved migration by migration), each forced by hiding
wire features from one client's session info: `one-trip`, the client's default with
single-rank servers of this version on one host (one call: the transfer asks the
target's allocate channel for the slots itself — "source_allocate" —, sends what the
source holds of the whole request — "partial_transfer" —, the ids travel as bytes —
"binary_ids" — and the source hands its receipts to the target's mailbox, which commits
by itself — "source_commit"); `source-commit` (the same with the client's allocate trip:
two trips); `binary` (that with a commit trip: three trips); `partial` (that with JSON
id lists); `size-query` (none of them: the source's size query first, four trips, as
with servers that predate all four).

`--profile N` then runs a few more migrations of N tokens under cProfile on three
threads: the benchmark's client, the source's and the target's HTTP event loop, and
their scheduler threads (a test-only extension of the mini server turns the profilers
on and off), and prints each one's top functions by own time. Profiling slows Python
code down unevenly: read it for where time goes, not for totals.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the annotation by name

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))

PHASES = ("extra_token_size", "allocate", "transfer", "commit", "total")
IDLE_FUNCTIONS = {
    "<built-in method time.sleep>",
    "<method 'recv' of '_socket.socket' objects>",
    "<method 'poll' of 'select.epoll' objects>",
    "<method 'select' of 'select.epoll' objects>",
    "<built-in method select.select>",
    "<method 'poll' of 'select.poll' objects>",
    "<method 'acquire' of '_thread.lock' objects>",
}
FIRST_TOKEN = {2: 50_000, 1024: 100_000, 8192: 200_000, 32768: 300_000}  # distinct branches
CONCURRENT_FIRST_TOKEN = 1_000_000  # the concurrent mode's prefixes: one branch each
STEPS = (
    "outside",
    "parse",
    "to_scheduler",
    "scheduler",
    "handler",  # the transfer's scheduler part, split (`server/diag/trace.py`)
    "waited",
    "allocate",  # one trip: the part of `waited` until the target's channel answered
    "replying",
    "polls",
    "to_tokenizer",
    "route",
)


# --------------------------------------------------------------------------------------
# Server-side profiler (a mini-server extension: runs inside rank 0's process)
# --------------------------------------------------------------------------------------


class _ProfilerFactory:
    """Picklable `ServerSpec.extension`: builds the profiler switch in the server."""

    def __call__(self, harness: Any) -> ProfilerSwitch:
        return ProfilerSwitch()


class ProfilerSwitch:
    """cProfile on the HTTP event loop thread and on the scheduler thread, switched by
    `POST /_bench/profile {"on": bool, "out": path}` (off: both dump their stats)."""

    def __init__(self) -> None:
        self.http = cProfile.Profile()
        self.sched = cProfile.Profile()
        self.want_sched = False
        self.sched_on = False
        self.sched_synced = threading.Event()

    def add_routes(self, app: Any) -> None:
        import asyncio

        @app.post("/_bench/profile", response_model=None)
        async def profile(request: Request) -> Any:
            body = await request.json()
            self.sched_synced.clear()
            self.want_sched = bool(body["on"])
            # The scheduler thread switches its own profiler in its next `tick()`.
            await asyncio.to_thread(self.sched_synced.wait, 30)
            if body["on"]:
                self.http = cProfile.Profile()
                self.http.enable()  # this (event loop) thread from here on
                return {"ok": True}
            self.http.disable()
            self.http.dump_stats(body["out"] + ".http")
            self.sched.dump_stats(body["out"] + ".sched")
            return {"ok": True}

    def tick(self) -> None:
        if self.want_sched != self.sched_on:
            if self.want_sched:
                self.sched = cProfile.Profile()
                self.sched.enable()
            else:
                self.sched.disable()
            self.sched_on = self.want_sched
        if not self.sched_synced.is_set():
            self.sched_synced.set()


# --------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------


def _prefix(n: int) -> list[int]:
    return list(range(FIRST_TOKEN[n], FIRST_TOKEN[n] + n))


def _concurrent_prefix(i: int, n: int) -> list[int]:
    first = CONCURRENT_FIRST_TOKEN + i * (n + 1)
    return list(range(first, first + n))


def _start(lengths: list[int], concurrent: int = 0, concurrent_tokens: int = 0) -> tuple[Any, Any]:
    import cpu_harness
    from mini_server import ServerSpec, start_servers

    extra = [_concurrent_prefix(i, concurrent_tokens) for i in range(concurrent + 1)]
    room = sum(lengths) + sum(map(len, extra)) + 4096
    harness = cpu_harness.HarnessConfig(page_size=1, device_tokens=room, hicache_ratio=2.0)
    common = {
        "harness": harness,
        "grant_ttl_s": 10.0,
        "transfer_timeout_s": 20.0,
        "extension": _ProfilerFactory(),
    }
    preload = [(_prefix(n), i + 1) for i, n in enumerate(lengths)]
    preload += [(p, 100 + i) for i, p in enumerate(extra) if concurrent]
    source, target = start_servers(
        [ServerSpec(preload=preload, **common), ServerSpec(**common)], timeout_s=600.0
    )
    return source, target


# Flow -> the wire features its client is made not to see (as with older servers).
FLOWS = {
    "one-trip": (),  # the client's default with servers of this version
    "source-commit": ("source_allocate",),  # two trips
    "binary": ("source_allocate", "source_commit"),
    "partial": ("source_allocate", "source_commit", "binary_ids"),
    "size-query": ("source_allocate", "source_commit", "binary_ids", "partial_transfer"),
}


def _clients(flows: list[str], source: Any, target: Any) -> dict[str, Any]:
    """One client per flow, seeing both servers without the flow's hidden features."""
    from sglang_kv_migration.client.migration import MigrationClient

    clients = {}
    for flow in flows:
        client = clients[flow] = MigrationClient()
        for url in (source.url, target.url):
            info = client.session_info(url)  # the cached info the client plans from
            info.features = [f for f in info.features if f not in FLOWS[flow]]
    return clients


def _migrate(client: Any, source: Any, target: Any, n: int) -> Any:
    target.ask(0, "flush")  # the target must not hold the prefix yet
    result = client.migrate(source.url, target.url, _prefix(n))
    if result.migrated_token_size != n:
        raise RuntimeError(f"moved {result.migrated_token_size} of {n} tokens: {result}")
    return result


def _measure(
    clients: dict[str, Any], source: Any, target: Any, n: int, repeats: int
) -> list[dict[str, Any]]:
    """One cell per flow; the flows' migrations interleaved, one warm-up each."""
    rows: dict[str, list[Any]] = {flow: [] for flow in clients}
    for i in range(repeats + 1):
        for flow, client in clients.items():
            result = _migrate(client, source, target, n)
            if i:
                rows[flow].append(result)
    return [_cell(flow, n, flow_rows) for flow, flow_rows in rows.items()]


def _cell(flow: str, n: int, rows: list[Any]) -> dict[str, Any]:
    cell: dict[str, Any] = {"flow": flow, "tokens": n, "repeats": len(rows)}
    for phase in PHASES:
        cell[phase] = statistics.median(r.timings.get(phase, 0.0) for r in rows) * 1e3
    cell["copy"] = statistics.median(r.copy_seconds for r in rows) * 1e3
    cell["transfer_less_copy"] = (
        statistics.median(r.timings["transfer"] - r.copy_seconds for r in rows) * 1e3
    )
    less_copy = [
        (sum(r.timings.get(p, 0.0) for p in PHASES[:-1]) - r.copy_seconds) * 1e3 for r in rows
    ]
    cell["total_less_copy"] = statistics.median(less_copy)
    # The spread the results page quotes beside the median.
    cell["total_less_copy_range"] = [min(less_copy), max(less_copy)]
    cell["total_less_copy_repeats"] = less_copy
    cell["steps"] = _median_steps(rows)
    return cell


def _median_steps(rows: list[Any]) -> dict[str, dict[str, float]]:
    """Per phase and step, the median over `rows` (steps a server did not report: absent)."""
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES[:-1]:
        out[phase] = {}
        for step in STEPS:
            values = [getattr(r, "steps_ms", {}).get(phase, {}).get(step) for r in rows]
            values = [v for v in values if v is not None]
            if values:
                out[phase][step] = statistics.median(values)
    return out


def _steps_table(title: str, steps: dict[str, dict[str, float]]) -> str:
    rows = [f"{title}", "", "| trip | " + " | ".join(STEPS) + " |", "|" + "---|" * (len(STEPS) + 1)]
    for phase in PHASES[:-1]:
        cells = [steps.get(phase, {}).get(step) for step in STEPS]
        rows.append(
            f"| {phase} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |"
        )
    return "\n".join(rows)


def _floor(target: Any, n: int) -> dict[str, Any]:
    """Median and p10 ms of `n` no-work trips per HTTP client, interleaved: the sync
    client's (`http11`, httpx) and the asyncio client's (`aio_http11`, httpx)."""
    import asyncio

    import httpx
    from sglang_kv_migration.client.migration import (
        AsyncMigrationClient,
        MigrationClient,
        MigrationFailed,
    )

    loop = asyncio.new_event_loop()
    clients = {
        "http11": MigrationClient(),
        "httpx": MigrationClient(http_client=httpx.Client()),
        "aio_http11": AsyncMigrationClient(),
        "httpx_async": AsyncMigrationClient(http_client=httpx.AsyncClient()),
    }
    times: dict[str, list[float]] = {name: [] for name in clients}
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
    body = {"migration_id": "no-such-id"}
    for i in range(n + 10):
        for name, client in clients.items():
            t0 = time.perf_counter()
            try:
                reply = client.call(target.url, "/abort_transfer", body)
                if asyncio.iscoroutine(reply):
                    loop.run_until_complete(reply)
            except MigrationFailed as e:  # 404: the trip we time
                reply = e.reply or {}
            if i >= 10:
                times[name].append((time.perf_counter() - t0) * 1e3)
                steps[name].append(reply.get("steps_ms", {}))
    for client in clients.values():
        closed = client.aclose() if isinstance(client, AsyncMigrationClient) else client.close()
        if closed is not None:
            loop.run_until_complete(closed)
    loop.close()
    out: dict[str, Any] = {}
    for name, ts in times.items():
        ts.sort()
        keys = set().union(*steps[name])
        out[name] = {
            "median": statistics.median(ts),
            "p10": ts[len(ts) // 10],
            "steps": {k: statistics.median(s.get(k, 0.0) for s in steps[name]) for k in keys},
        }
    return out


def _concurrency(client: Any, source: Any, target: Any, k: int, n: int, repeats: int) -> dict:
    """One migration alone, then `k` at once from `k` threads, then the same `k` in one
    `migrate_many` (feature "transfer_batch"), `repeats` times; medians (ms)."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang_kv_migration.client import MigrationResult, Move

    prefixes = [_concurrent_prefix(i, n) for i in range(k + 1)]

    def move(p: list[int]) -> Any:
        t0 = time.perf_counter()
        r = client.migrate(source.url, target.url, p)
        if r.migrated_token_size != n:
            raise RuntimeError(f"moved {r.migrated_token_size} of {n} tokens: {r}")
        return r, (time.perf_counter() - t0) * 1e3

    def batch(ps: list[list[int]]) -> list[Any]:
        results = client.migrate_many([Move(source.url, target.url, p) for p in ps])
        bad = [r for r in results if not isinstance(r, MigrationResult)]
        if bad or any(r.migrated_token_size != n for r in results):
            raise RuntimeError(f"a batched move failed or moved less: {bad or results}")
        return results

    ones, walls, lasts, everyone, batches, batched = [], [], [], [], [], []
    with ThreadPoolExecutor(k) as pool:
        for _ in range(repeats + 1):  # the first round warms up
            target.ask(0, "flush")
            one = move(prefixes[0])
            target.ask(0, "flush")
            t0 = time.perf_counter()
            many = list(pool.map(move, prefixes[1:]))
            walls.append((time.perf_counter() - t0) * 1e3)
            ones.append(one)
            lasts.append(max(w for _r, w in many))
            everyone.extend(many)
            target.ask(0, "flush")
            t0 = time.perf_counter()
            batched.extend(batch(prefixes[1:]))  # the same k in one migrate_many
            batches.append((time.perf_counter() - t0) * 1e3)
    ones, walls, lasts, batches = ones[1:], walls[1:], lasts[1:], batches[1:]
    everyone, batched = everyone[k:], batched[k:]
    one_ms = statistics.median(w for _r, w in ones)
    wall_ms = statistics.median(walls)
    batch_ms = statistics.median(batches)
    return {
        "tokens": n,
        "k": k,
        "repeats": repeats,
        "one_ms": one_ms,
        "concurrent_wall_ms": wall_ms,
        "ratio": wall_ms / one_ms,
        "batch_ms": batch_ms,
        "batch_ratio": batch_ms / one_ms,
        "batch_steps": _median_steps(batched),
        "one_phases_ms": {
            p: statistics.median(r.timings.get(p, 0.0) for r, _ in ones) * 1e3 for p in PHASES
        },
        "concurrent_phases_ms": {
            p: statistics.median(r.timings.get(p, 0.0) for r, _ in everyone) * 1e3 for p in PHASES
        },
        "one_steps": _median_steps([r for r, _ in ones]),
        "concurrent_steps": _median_steps([r for r, _ in everyone]),
    }


def _print_concurrency(c: dict[str, Any]) -> None:
    print(
        f"\n[{c['flow']}] {c['k']} concurrent migrations of {c['tokens']} tokens to one "
        f"target (medians of {c['repeats']} rounds): all {c['concurrent_wall_ms']:.2f} ms "
        f"against one {c['one_ms']:.2f} ms: {c['ratio']:.2f}x; in one migrate_many "
        f"{c['batch_ms']:.2f} ms: {c['batch_ratio']:.2f}x\n"
    )
    print("| phase | " + " | ".join(PHASES) + " |")
    print("|" + "---|" * (len(PHASES) + 1))
    for name in ("one", "concurrent"):
        phases = c[f"{name}_phases_ms"]
        print(f"| {name} | " + " | ".join(f"{phases[p]:.2f}" for p in PHASES) + " |")
    print()
    print(_steps_table("Steps of one alone, ms (median):", c["one_steps"]))
    print()
    print(
        _steps_table(
            f"Steps of each of the {c['k']} concurrent ones, ms (median):", c["concurrent_steps"]
        )
    )
    print()
    title = f"Steps of each of the {c['k']} batched ones, ms (median):"
    print(_steps_table(title, c["batch_steps"]))


def _profile(client: Any, source: Any, target: Any, n: int, repeats: int, top: int) -> None:
    out = tempfile.mkdtemp(prefix="bench-control-plane-")
    _migrate(client, source, target, n)
    for server in (source, target):
        _switch(server, {"on": True})
    prof = cProfile.Profile()
    for _ in range(repeats):
        target.ask(0, "flush")
        prof.enable()
        client.migrate(source.url, target.url, _prefix(n))
        prof.disable()
    for name, server in (("source", source), ("target", target)):
        path = os.path.join(out, name)
        _switch(server, {"on": False, "out": path})
        _print_stats(f"{name} HTTP event loop", path + ".http", repeats, top)
        _print_stats(f"{name} scheduler thread", path + ".sched", repeats, top)
    client_path = os.path.join(out, "client")
    prof.dump_stats(client_path)
    _print_stats("client", client_path, repeats, top)


def _switch(server: Any, body: dict[str, Any]) -> None:
    import httpx

    r = httpx.post(server.url + "/_bench/profile", json=body, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"profiler switch on {server.url}: {r.status_code} {r.text}")


def _print_stats(title: str, path: str, repeats: int, top: int) -> None:
    stream = io.StringIO()
    stats = pstats.Stats(path, stream=stream)
    # Waiting is not work: the mini server's idle loop sleeps, the client waits on sockets.
    idle = sum(
        row[2]
        for (_file, _line, name), row in stats.stats.items()  # type: ignore[attr-defined]
        if name in IDLE_FUNCTIONS
    )
    busy = stats.total_tt - idle  # type: ignore[attr-defined]
    print(f"\n### {title}: {busy / repeats * 1e3:.1f} ms busy per migration (idle waits left out)")
    stats.sort_stats("tottime").print_stats(top)
    # Keep the table rows only (pstats prints a header and the path first).
    lines = stream.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))


def _table(cells: list[dict[str, Any]]) -> str:
    head = (
        "| prefix tokens | flow | extra_token_size | allocate | transfer (copy) "
        "| transfer − copy | commit | total | total − copy (min–max) |"
    )
    rows = [head, "|" + "---|" * 9]
    for c in cells:
        rows.append(
            f"| {c['tokens']} | {c['flow']} | {c['extra_token_size']:.2f} | {c['allocate']:.2f} "
            f"| {c['transfer']:.2f} ({c['copy']:.2f}) | {c['transfer_less_copy']:.2f} "
            f"| {c['commit']:.2f} | {c['total']:.2f} | {c['total_less_copy']:.2f} "
            f"({c['total_less_copy_range'][0]:.2f}–{c['total_less_copy_range'][1]:.2f}) |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="TOKENS")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", help="write the cells here as JSON")
    parser.add_argument("--concurrent", type=int, default=0, metavar="K")
    parser.add_argument("--floor", type=int, default=0, metavar="N")
    parser.add_argument("--concurrent-tokens", type=int, default=8192)
    parser.add_argument("--concurrent-repeats", type=int, default=5)
    parser.add_argument("--flows", nargs="+", choices=list(FLOWS), default=list(FLOWS))
    args = parser.parse_args()
    unknown = sorted(set(args.tokens + args.profile) - set(FIRST_TOKEN))
    if unknown:
        parser.error(f"lengths must be among {sorted(FIRST_TOKEN)}: {unknown}")

    lengths = sorted(set(args.tokens + args.profile))
    started = time.perf_counter()
    source, target = _start(lengths, args.concurrent, args.concurrent_tokens)
    print(f"servers up in {time.perf_counter() - started:.0f} s; load {os.getloadavg()}")
    floor = None
    try:
        if args.floor:
            floor = _floor(target, args.floor)
            print(f"\nNo-work trips (abort of an unknown id), {args.floor} each, ms:")
            for name, f in floor.items():
                inner = ", ".join(f"{k} {v:.2f}" for k, v in sorted(f["steps"].items()))
                print(f"  {name}: median {f['median']:.2f}, p10 {f['p10']:.2f}; server: {inner}")
        clients = _clients(args.flows, source, target)
        try:
            cells = [
                c for n in args.tokens for c in _measure(clients, source, target, n, args.repeats)
            ]
            print(f"\nMedians of {args.repeats} migrations, page size 1, host path, ms:\n")
            print(_table(cells))
            for c in cells:
                print()
                print(
                    _steps_table(
                        f"[{c['flow']}] where each trip's time went at {c['tokens']} tokens, "
                        "ms (median):",
                        c["steps"],
                    )
                )
            concurrency = []
            for flow, client in clients.items() if args.concurrent else ():
                c = _concurrency(
                    client,
                    source,
                    target,
                    args.concurrent,
                    args.concurrent_tokens,
                    args.concurrent_repeats,
                )
                concurrency.append({"flow": flow, **c})
                _print_concurrency(concurrency[-1])
            for n in args.profile:
                _profile(clients[args.flows[0]], source, target, n, args.profile_repeats, args.top)
        finally:
            for client in clients.values():
                client.close()
    finally:
        source.stop()
        target.stop()
    print(f"\nload average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cells": cells, "concurrency": concurrency, "floor": floor}, indent=1)
        )


if __name__ == "__main__":
    main()
