"""`sglang-kv-migrate rebalance`: watch servers, or run a batch of requests with rebalancing.

    sglang-kv-migrate rebalance --server http://a:30000 --server http://b:30000 \\
        --requests work.jsonl --output results.jsonl [--mode auto|migrate|recompute]

With `--requests` (JSON lines: ``{"server": url, "input_ids": [...], "sampling_params":
{...}, "priority": 5}``; "-" for stdin) every request is submitted to its server and the
rebalancer moves queued ones off KV-pressured servers until all have finished; each
request's whole output goes to `--output` (one JSON line each, input order) and a summary
of the moves to stdout. Without `--requests` it only watches: one JSON line of loads and
pressured servers per round, for `--max-rounds` rounds.

Exit status: 0 all requests finished (watch: every server answered in the last round),
1 some request failed or did not finish (watch: a server did not answer), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from sglang_kv_migration.client import DEFAULT_TIMEOUT_S, AsyncMigrationClient
from sglang_kv_migration.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestHandle,
)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    work: list[tuple[str, GenerateRequest]] = []
    if args.requests is not None:
        try:
            work = _read_requests(args.requests)
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--requests: {e}")
    policy = RebalancePolicy(
        kv_pressure=args.kv_pressure,
        min_waiting=args.min_waiting,
        target_max_ratio=args.target_max_ratio,
        max_concurrent=args.max_concurrent,
        max_moves_per_round=args.max_moves_per_round,
        low_priority_values_first=args.low_priority_values_first,
        mode=args.mode,
    )
    if not work:
        return asyncio.run(_watch(args, policy))
    return asyncio.run(_run(args, policy, work))


async def _watch(args: argparse.Namespace, policy: RebalancePolicy) -> int:
    async with AsyncRequestMigrator(
        api_key=args.api_key, admin_api_key=args.admin_api_key
    ) as migrator:
        rebalancer = Rebalancer(migrator, args.server, policy)
        loads = {}
        for round_no in range(args.max_rounds):
            loads = await rebalancer.poll()
            line = {
                "round": round_no,
                "loads": {u: dataclasses.asdict(load) for u, load in loads.items()},
                "pressured": [u for u, load in loads.items() if policy.is_pressured(load)],
            }
            print(json.dumps(line), flush=True)
            if round_no + 1 < args.max_rounds:
                await asyncio.sleep(args.interval)
        return 0 if all(load.ok for load in loads.values()) else 1


async def _run(
    args: argparse.Namespace, policy: RebalancePolicy, work: list[tuple[str, GenerateRequest]]
) -> int:
    keys = {"api_key": args.api_key, "admin_api_key": args.admin_api_key}
    client = AsyncMigrationClient(timeout=args.timeout, **keys)
    async with client, AsyncRequestMigrator(client, **keys) as migrator:
        handles = [await migrator.submit(url, request) for url, request in work]
        rebalancer = Rebalancer(migrator, args.server, policy)
        summary = await rebalancer.run(max_rounds=args.max_rounds, interval_s=args.interval)
        pending = [asyncio.ensure_future(h.result()) for h in handles]
        await asyncio.wait(pending, timeout=args.drain_timeout)
        results = [_result_line(handle) for handle in handles]
    _write_results(args.output, results)
    ok = sum(r["success"] for r in results)
    print(
        json.dumps(
            {
                "requests": len(results),
                "finished": ok,
                "rounds": summary.rounds,
                "moves_started": summary.moves_started,
                "outcomes": summary.outcomes,
                "errors": summary.errors,
            }
        )
    )
    return 0 if ok == len(results) else 1


def _result_line(handle: RequestHandle) -> dict[str, Any]:
    if not handle.done():
        return {"success": False, "rid": handle.request.rid, "error": "did not finish in time"}
    try:
        out = handle.output()
    except Exception as e:  # the request failed: reported in its line
        return {"success": False, "rid": handle.request.rid, "error": f"{type(e).__name__}: {e}"}
    return {"success": True, **out.to_dict()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-kv-migrate rebalance",
        description="Move queued requests off KV-pressured SGLang servers.",
    )
    p.add_argument("--server", action="append", required=True, help="server URL (repeat)")
    p.add_argument("--requests", default=None, help="JSON-lines requests file, - for stdin")
    p.add_argument("--output", default=None, help="JSON-lines results file (default: none)")
    p.add_argument("--mode", choices=("auto", "migrate", "recompute"), default="auto")
    p.add_argument("--kv-pressure", type=float, default=RebalancePolicy.kv_pressure)
    p.add_argument("--min-waiting", type=int, default=RebalancePolicy.min_waiting)
    p.add_argument("--target-max-ratio", type=float, default=RebalancePolicy.target_max_ratio)
    p.add_argument("--max-concurrent", type=int, default=RebalancePolicy.max_concurrent)
    p.add_argument("--max-moves-per-round", type=int, default=RebalancePolicy.max_moves_per_round)
    p.add_argument("--low-priority-values-first", action="store_true")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between rounds")
    p.add_argument("--max-rounds", type=int, default=1200, help="rounds before stopping")
    p.add_argument("--drain-timeout", type=float, default=600.0, help="wait for the rest (s)")
    p.add_argument("--api-key", default=None, help="bearer key (admin key if configured)")
    p.add_argument("--admin-api-key", default=None, help="the servers' --admin-api-key")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per call")
    return p


def _read_requests(path: str) -> list[tuple[str, GenerateRequest]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    work = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        ids = item["input_ids"]
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"line {n}: input_ids must be a non-empty list of token ids")
        request = GenerateRequest(
            input_ids=ids,
            sampling_params=dict(item.get("sampling_params") or {}),
            priority=item.get("priority"),
            extra_key=item.get("extra_key"),
        )
        if item.get("rid"):
            request.rid = str(item["rid"])
        work.append((str(item["server"]), request))
    return work


def _write_results(path: str | None, results: list[dict[str, Any]]) -> None:
    if path is None:
        return
    with open(path, "w", encoding="utf-8") as f:
        for result in results:
            f.write(json.dumps(result) + "\n")
