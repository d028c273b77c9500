"""What Starlette's route matching costs a migration trip on SGLang's own FastAPI app (CPU).

Starlette tries an app's routes in order until one matches; SGLang 0.5.12's app holds
~90 routes, and its API-key middleware matches the request once more to read the
route's auth level. This builds SGLang's real app (CPU test shims for its GPU imports),
adds our six routes as the plugin does (`http_api.add_routes`, which puts them first),
and times matching `/transfer_request_kvcache` against the list as it is, and against
the same list with our routes moved back to its end (where `add_api_route` appends
them), interleaved, medians of `--repeats` rounds of `--walks` matches.

    PYTHONPATH=python .venv/bin/python benchmark/probes/probe_route_walk.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "support"))


def _walk(routes: list[Any], scope: dict[str, Any]) -> Any:
    from starlette.routing import Match

    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route
    raise AssertionError("no route matched")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import cpu_harness

    cpu_harness.install_cpu_shims()
    from sglang.srt.entrypoints.http_server import app
    from sglang_kv_migration.server.http import routes as http_api

    http_api.add_routes(app, lambda: None)
    first = list(app.router.routes)
    ours = [r for r in first if getattr(r, "tags", None) == ["kv-migration"]]
    last = [r for r in first if r not in ours] + ours
    scope = {"type": "http", "path": "/transfer_request_kvcache", "method": "POST",
             "root_path": "", "headers": [], "query_string": b""}  # fmt: skip
    assert _walk(first, scope) is _walk(last, scope)
    timings: dict[str, list[float]] = {"ours first": [], "ours last": []}
    for _ in range(args.repeats):
        for name, routes in (("ours first", first), ("ours last", last)):
            t0 = time.perf_counter()
            for _ in range(args.walks):
                _walk(routes, scope)
            timings[name].append((time.perf_counter() - t0) / args.walks * 1e6)
    print(f"{len(first)} routes, ours at {first.index(ours[0])}..{first.index(ours[-1])}")
    for name, samples in timings.items():
        print(f"{name}: {statistics.median(samples):.1f} us per match (median of {args.repeats})")


if __name__ == "__main__":
    main()
