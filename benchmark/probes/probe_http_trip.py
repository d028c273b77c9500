"""What one HTTP trip to a migration route costs outside the scheduler, on CPU: the
client, uvicorn, the app's middleware and routing, and the route's own parse.

Two servers, each SGLang's real FastAPI app (CPU test shims for its GPU imports) with
our six routes added as the plugin adds them, under uvicorn with httptools and uvloop as
SGLang runs it, and a backend that answers at once (no scheduler): one with the fast
path (`server/http/fast_path.py`), one with it taken out (every request through Starlette's
router and FastAPI). Two clients: ours (`client/http11.py`) and `http.client` (what
`http11` used before). Each of the four pairs makes `--trips` trips of an abort body,
interleaved, `--gap-ms` apart: a migration server answers now and then, so its calls
run cold (the gap) — `--gap-ms 0` shows the hot loop. Reported per pair: the trip, the
route's own time (`steps_ms.route`, from the first byte of the body to the reply), and
the rest (`outside`: client, kernel, uvicorn, middleware, routing), p50 and p90 µs.

    PYTHONPATH=python .venv/bin/python benchmark/probes/probe_http_trip.py
    PYTHONPATH=python .venv/bin/python benchmark/probes/probe_http_trip.py --gap-ms 0 --trips 2000
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
BODY = orjson.dumps({"migration_id": "probe", "receipts": []})
HEADERS = {"Content-Type": "application/json"}


def serve(port: int, fast: bool) -> None:
    """Child process: SGLang's app with our routes, a backend that answers at once."""
    sys.path.insert(0, str(ROOT / "test" / "support"))
    import cpu_harness

    cpu_harness.install_cpu_shims()
    import uvicorn
    from sglang.srt.entrypoints.http_server import app
    from sglang_kv_migration.server.http import fast_path as fast_routes
    from sglang_kv_migration.server.http import routes as http_api
    from sglang_kv_migration.server.messages import AbortTransferReqOutput

    class Backend:
        async def call(self, request: Any) -> Any:
            return AbortTransferReqOutput(success=True)

    backend = Backend()
    http_api.add_routes(app, lambda: backend)
    if not fast:
        app.user_middleware = [
            m for m in app.user_middleware if m.cls is not fast_routes.FastRoutes
        ]
    # lifespan off: SGLang's lifespan starts its tokenizer workers.
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", lifespan="off", timeout_keep_alive=600)  # fmt: skip


def _wait_for(port: int, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server on port {port} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--port", type=int, default=18230)
    parser.add_argument("--serve", choices=["fast", "routed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.port, args.serve == "fast")

    from sglang_kv_migration.client.http11 import Http11

    servers = {"fast path": args.port, "routed": args.port + 1}
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'python'}:{os.environ.get('PYTHONPATH', '')}"}
    children = [
        subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)], env=env)
        for kind, port in (("fast", servers["fast path"]), ("routed", servers["routed"]))
    ]
    try:
        for port in servers.values():
            _wait_for(port)
        ours = Http11(timeout=10)
        stdlib = {
            p: http.client.HTTPConnection("127.0.0.1", p, timeout=10) for p in servers.values()
        }

        def via_http11(port: int) -> bytes:
            return ours.post(f"http://127.0.0.1:{port}/abort_transfer", BODY, HEADERS)[1]

        def via_stdlib(port: int) -> bytes:
            conn = stdlib[port]
            conn.request("POST", "/abort_transfer", body=BODY, headers=HEADERS)
            return conn.getresponse().read()

        clients = {"http11": via_http11, "http.client": via_stdlib}
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        warm = max(args.trips // 10, 5)
        for i in range(args.trips + warm):
            for server, port in servers.items():
                for client, post in clients.items():
                    if args.gap_ms:
                        time.sleep(args.gap_ms / 1e3)
                    t0 = time.perf_counter()
                    reply = post(port)
                    trip_us = (time.perf_counter() - t0) * 1e6
                    route_us = orjson.loads(reply)["steps_ms"]["route"] * 1e3
                    if i >= warm:
                        samples.setdefault((server, client), []).append((trip_us, route_us))
        print(f"{args.trips} trips per pair, {args.gap_ms:g} ms apart, µs (p50 / p90)")
        print(f"{'server':<10} {'client':<12} {'trip':>13} {'route':>13} {'outside':>13}")
        for (server, client), rows in samples.items():
            trip = [t for t, _ in rows]
            route = [r for _, r in rows]
            outside = [t - r for t, r in rows]
            print(
                f"{server:<10} {client:<12} "
                + " ".join(f"{_p(v):>13}" for v in (trip, route, outside))
            )
    finally:
        for child in children:
            child.kill()


def _p(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered):.0f} / {ordered[int(len(ordered) * 0.9)]:.0f}"


if __name__ == "__main__":
    main()
