"""`sglang-kv-migrate demo`: two CPU servers, a prefix moved between them, watched.

Starts two demo servers (`cpu_server.py`, each its own process, a progress line while
they start), lets the first compute a conversation's KV (`/demo/prefill`), moves it to
the second with `MigrationClient` (the six routes, Mooncake TCP), then asks the second
what the conversation's next turn finds there (`/demo/serve`): how many tokens from
cache, loaded back from its host pool, and whether their KV bytes are the first's.
Exit status 0 when every step did what it says, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import httpx

from sglang_kv_migration.client.migration import (
    SIZE_QUERY_ROUTE,
    MigrationClient,
    MigrationFailed,
    MigrationResult,
    size_query,
)
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply

START_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 5.0  # a new progress line this often when the output is not a terminal


def main(argv: list[str] | None = None, out: IO[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang-kv-migrate demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tokens", type=int, default=1024, help="the conversation's length")
    parser.add_argument("--host", default="127.0.0.1", help="address both servers use")
    args = parser.parse_args(argv)
    if args.tokens < 16:
        parser.error("--tokens: at least one page (16 tokens)")
    say = Printer(out or sys.stdout)
    say.line("sglang-kv-migrate demo: KV-cache migration between two SGLang servers, on CPU\n")
    with tempfile.TemporaryDirectory(prefix="kvmig-demo-logs-") as logs:
        servers = [DemoProcess(name, args.host, logs) for name in "AB"]
        try:
            if not start(servers, say):
                return 1
            return 0 if walk(servers[0].url, servers[1].url, args.tokens, say) else 1
        except (httpx.HTTPError, MigrationFailed, RuntimeError) as e:
            say.line(f"\nfailed: {type(e).__name__}: {e}")
            return 1
        finally:
            for server in servers:
                server.stop()
            say.line("\nStopped both servers.")


@dataclass
class Printer:
    stream: IO[str]
    interactive: bool = field(init=False)

    def __post_init__(self) -> None:
        self.interactive = self.stream.isatty()

    def line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, text: str) -> None:
        """One line, rewritten in place on a terminal."""
        if self.interactive:
            self.stream.write("\r" + text.ljust(78))
            self.stream.flush()
        else:
            self.line(text)


class DemoProcess:
    """One `cpu_server.py` process: its URL once it printed it, its log on failure."""

    def __init__(self, name: str, host: str, logs: str):
        self.name = name
        self.url = ""
        self.log_path = os.path.join(logs, f"server-{name}.log")
        command = [sys.executable, "-m", "sglang_kv_migration.demo.cpu_server", "--host", host]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def poll(self) -> str:
        """'ready', 'starting' or 'failed'."""
        while not self.url:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return "failed" if self.process.poll() is not None else "starting"
            if line.startswith("{"):
                self.url = json.loads(line)["url"]
        return "ready"

    def log_tail(self, chars: int = 2000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)


def start(servers: list[DemoProcess], say: Printer) -> bool:
    say.line(
        "Starting two servers: SGLang's HiRadixCache, device and host pools on CPU, this "
        "plugin's routes, Mooncake over TCP (the first start imports SGLang: ~10-60 s)"
    )
    started = time.monotonic()
    last = 0.0
    while True:
        states = {s.name: s.poll() for s in servers}
        elapsed = time.monotonic() - started
        if "failed" in states.values() or elapsed > START_TIMEOUT_S:
            say.line("")
            for server in servers:
                say.line(f"server {server.name}: {states[server.name]}\n{server.log_tail()}")
            return False
        if all(state == "ready" for state in states.values()):
            break
        if say.interactive or elapsed - last >= PROGRESS_EVERY_S:
            last = elapsed
            listed = ", ".join(f"{name} {state}" for name, state in states.items())
            say.progress(f"  starting ... {elapsed:4.0f} s  ({listed})")
        time.sleep(0.25)
    if say.interactive:
        say.line("")
    say.line(
        f"  A {servers[0].url}   B {servers[1].url}   (ready in {time.monotonic() - started:.1f} s)"
    )
    return True


def walk(a: str, b: str, tokens: int, say: Printer) -> bool:
    """The three steps; True when each did what it says."""
    ids = list(range(1000, 1000 + tokens))
    with httpx.Client(timeout=60) as http, MigrationClient(timeout=60) as client:
        prefill = _timed(lambda: _post(http, a, "/demo/prefill", {"tokens": ids, "seed": 7}))
        held = prefill.value["inserted_tokens"]
        say.line(
            f"\n1. A prefills a {tokens}-token conversation: {held} tokens of KV in its "
            f"cache, backed up to its host pool ({prefill.ms:.1f} ms)"
        )
        say.line(f"   held now: A {_held(client, a, ids)}, B {_held(client, b, ids)}")
        turn = ids + [1]  # the next turn: the conversation so far and a new token
        moved = _timed(lambda: client.migrate(a, b, turn))
        _say_migration(moved.value, moved.ms, say)
        served = _post(http, b, "/demo/serve", {"tokens": turn})
        source = _post(http, a, "/demo/serve", {"tokens": ids[:held]})
    same = served["kv_digest"] == source["kv_digest"]
    say.line(
        f"\n3. B serves the next turn ({len(turn)} tokens): {served['cached_tokens']} of "
        f"{len(turn)} from cache ({served['host_tokens']} loaded back from its host pool in "
        f"{served['load_back_ms']:.1f} ms, {served['device_tokens']} already on its device)"
    )
    say.line(
        f"   the KV it serves is A's, byte for byte: {'yes' if same else 'NO'} "
        f"(digest {served['kv_digest'][:16]})"
    )
    say.line(f"   without the move B would prefill all {len(turn)} tokens again")
    return moved.value.migrated_token_size == held and served["cached_tokens"] == held and same


def _say_migration(result: MigrationResult, total_ms: float, say: Printer) -> None:
    kib = result.migrated_bytes / 1024
    how = (
        "one call: A reserved the slots on B, wrote the pages and B committed them"
        if result.source_committed
        else "the client's allocate, transfer and commit calls"
    )
    say.line(
        f"\n2. Migrate A -> B: {result.migrated_token_size} tokens, {kib:.1f} KiB, over the "
        f"{result.path or 'no'} path ({how})"
    )
    for phase, seconds in result.timings.items():
        if phase != "total":
            say.line(f"     {phase:<14}{seconds * 1e3:8.1f} ms")
    say.line(f"     {'total':<14}{total_ms:8.1f} ms  (as the client saw it)")


@dataclass
class _Timed:
    value: Any
    ms: float


def _timed(fn: Callable[[], Any]) -> _Timed:
    started = time.perf_counter()
    value = fn()
    return _Timed(value, (time.perf_counter() - started) * 1e3)


def _post(http: httpx.Client, url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = http.post(url + route, json=body)
    if reply.status_code >= 300:
        raise RuntimeError(f"{url}{route}: HTTP {reply.status_code}: {reply.text[:300]}")
    return reply.json()


def _held(client: MigrationClient, url: str, ids: list[int]) -> str:
    """What `url` holds of `ids` (its size query, as a migration asks it)."""
    body = size_query(client.session_info(url), ids)
    reply = from_dict(ExtraTokenSizeReply, client.call(url, SIZE_QUERY_ROUTE, body))
    return f"{reply.matched_token_size} tokens"
