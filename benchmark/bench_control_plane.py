"""The control plane of a migration on CPU: what each HTTP round trip costs per token.

Two CPU mini servers (`test/support/mini_server.py`: our FastAPI routes under uvicorn, the real
zmq communicators, SGLang's HiRadixCache from the CPU harness, the real scheduler hooks
and handlers, Mooncake TCP on 127.0.0.1), page size 1. The source preloads one prefix per
length; each repeat flushes the target and migrates the prefix again through
`MigrationClient.migrate` (host path: the only one on CPU). Reported per length: the
median of every phase of `result.timings`, and the transfer phase less the source's copy
time (`copy_seconds`), which is what the device path's transfer trip shares with it.

    PYTHONPATH=python .venv/bin/python benchmark/bench_control_plane.py
    PYTHONPATH=python .venv/bin/python benchmark/bench_control_plane.py --tokens 32768 \
        --repeats 5 --profile 32768

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
FIRST_TOKEN = {1024: 100_000, 8192: 200_000, 32768: 300_000}  # distinct radix branches


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


def _start(lengths: list[int]) -> tuple[Any, Any]:
    import cpu_harness
    from mini_server import ServerSpec, start_servers

    room = sum(lengths) + 4096
    harness = cpu_harness.HarnessConfig(page_size=1, device_tokens=room, hicache_ratio=2.0)
    common = {
        "harness": harness,
        "grant_ttl_s": 10.0,
        "transfer_timeout_s": 20.0,
        "extension": _ProfilerFactory(),
    }
    preload = [(_prefix(n), i + 1) for i, n in enumerate(lengths)]
    source, target = start_servers(
        [ServerSpec(preload=preload, **common), ServerSpec(**common)], timeout_s=600.0
    )
    return source, target


def _migrate(client: Any, source: Any, target: Any, n: int) -> Any:
    target.ask(0, "flush")  # the target must not hold the prefix yet
    result = client.migrate(source.url, target.url, _prefix(n))
    if result.migrated_token_size != n:
        raise RuntimeError(f"moved {result.migrated_token_size} of {n} tokens: {result}")
    return result


def _measure(client: Any, source: Any, target: Any, n: int, repeats: int) -> dict[str, Any]:
    _migrate(client, source, target, n)  # warm-up (session info cached, code paths hot)
    rows = [_migrate(client, source, target, n) for _ in range(repeats)]
    cell: dict[str, Any] = {"tokens": n, "repeats": repeats}
    for phase in PHASES:
        cell[phase] = statistics.median(r.timings[phase] for r in rows) * 1e3
    cell["copy"] = statistics.median(r.copy_seconds for r in rows) * 1e3
    cell["transfer_less_copy"] = (
        statistics.median(r.timings["transfer"] - r.copy_seconds for r in rows) * 1e3
    )
    cell["total_less_copy"] = (
        statistics.median(sum(r.timings[p] for p in PHASES[:-1]) - r.copy_seconds for r in rows)
        * 1e3
    )
    return cell


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
        "| prefix tokens | extra_token_size | allocate | transfer (copy) | transfer − copy "
        "| commit | total | total − copy |"
    )
    rows = [head, "|" + "---|" * 8]
    for c in cells:
        rows.append(
            f"| {c['tokens']} | {c['extra_token_size']:.2f} | {c['allocate']:.2f} "
            f"| {c['transfer']:.2f} ({c['copy']:.2f}) | {c['transfer_less_copy']:.2f} "
            f"| {c['commit']:.2f} | {c['total']:.2f} | {c['total_less_copy']:.2f} |"
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
    args = parser.parse_args()
    unknown = sorted(set(args.tokens + args.profile) - set(FIRST_TOKEN))
    if unknown:
        parser.error(f"lengths must be among {sorted(FIRST_TOKEN)}: {unknown}")

    from sglang_kv_migration.client.migration import MigrationClient

    lengths = sorted(set(args.tokens + args.profile))
    started = time.perf_counter()
    source, target = _start(lengths)
    print(f"servers up in {time.perf_counter() - started:.0f} s; load {os.getloadavg()}")
    try:
        with MigrationClient() as client:
            cells = [_measure(client, source, target, n, args.repeats) for n in args.tokens]
            print(f"\nMedians of {args.repeats} migrations, page size 1, host path, ms:\n")
            print(_table(cells))
            for n in args.profile:
                _profile(client, source, target, n, args.profile_repeats, args.top)
    finally:
        source.stop()
        target.stop()
    print(f"\nload average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
