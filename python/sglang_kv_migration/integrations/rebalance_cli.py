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
import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from sglang_kv_migration.client.cli import (
    HelpFormatter,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from sglang_kv_migration.client.migration import DEFAULT_TIMEOUT_S, AsyncMigrationClient
from sglang_kv_migration.integrations.gateway import ModelGateway, default_pin
from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestHandle,
)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.gateway and args.gateway_pin is None:
        try:
            default_pin(args.gateway_policy)
        except ValueError as e:
            parser.error(f"--gateway-policy: {e}")
    if args.live and not args.move_running:
        parser.error("--live moves decoding requests: it needs --move-running")
    _log_one_line_each()
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
        move_running=args.move_running,
        min_priority=args.min_priority,
        min_held_tokens=args.min_held_tokens,
        max_moves_per_request=args.max_moves_per_request,
        kv_headroom=args.kv_headroom,
        device_path=args.device_path,
        shared_host=args.shared_host,
        no_room=args.no_room,
        live=args.live,
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
        unanswered = 0  # rounds in a row in which no server answered
        for round_no in range(args.max_rounds):
            loads = await rebalancer.poll()
            line = {
                "round": round_no,
                "loads": {u: dataclasses.asdict(load) for u, load in loads.items()},
                "pressured": [u for u, load in loads.items() if policy.is_pressured(load)],
            }
            print(json.dumps(line), flush=True)
            unanswered = 0 if any(load.ok for load in loads.values()) else unanswered + 1
            if unanswered >= args.max_failed_rounds:
                print(
                    f"error: no server answered in {unanswered} rounds in a row "
                    f"({', '.join(args.server)}); stopping",
                    file=sys.stderr,
                )
                return 1
            if round_no + 1 < args.max_rounds:
                await asyncio.sleep(args.interval)
        return 0 if all(load.ok for load in loads.values()) else 1


async def _run(
    args: argparse.Namespace, policy: RebalancePolicy, work: list[tuple[str, GenerateRequest]]
) -> int:
    keys = {"api_key": args.api_key, "admin_api_key": args.admin_api_key}
    client = AsyncMigrationClient(timeout=args.timeout, **keys)
    gateway = None
    if args.gateway:
        gateway = ModelGateway(args.gateway, policy=args.gateway_policy, pin=args.gateway_pin)
    migrator = AsyncRequestMigrator(client, **keys, gateway=gateway)
    async with client, migrator, contextlib.AsyncExitStack() as stack:
        if gateway is not None:
            stack.push_async_callback(gateway.aclose)
        handles = [await migrator.submit(url, request) for url, request in work]
        rebalancer = Rebalancer(migrator, args.server, policy)
        summary = await rebalancer.run(max_rounds=args.max_rounds, interval_s=args.interval)
        await _drain(handles, args.drain_timeout)
        results = [_result_line(handle) for handle in handles]
    _write_results(args.output, results)
    ok = sum(r["success"] for r in results)
    # Every failure is in the summary: the moves' own, the servers that did not answer
    # in the last round, and each request that failed or did not finish.
    errors = [
        *summary.errors,
        *(f"{url}: load unavailable" for url, load in summary.last_loads.items() if not load.ok),
        *(f"{r['rid']}: {r['error']}" for r in results if not r["success"]),
    ]
    print(
        json.dumps(
            {
                "requests": len(results),
                "finished": ok,
                "rounds": summary.rounds,
                "moves_started": summary.moves_started,
                "outcomes": summary.outcomes,
                "errors": errors,
            }
        )
    )
    return 0 if ok == len(results) else 1


async def _drain(handles: list[RequestHandle], timeout_s: float) -> None:
    """Wait up to `timeout_s` for every request to end. A failed request's exception is
    read from its handle into its result line; the waiters here are retrieved or
    cancelled, so asyncio reports none of them as never retrieved."""
    waiters = [asyncio.ensure_future(h.result()) for h in handles]
    if not waiters:
        return
    done, running = await asyncio.wait(waiters, timeout=timeout_s)
    for waiter in done:
        waiter.exception()
    for waiter in running:
        waiter.cancel()
    if running:
        await asyncio.wait(running)


class _OneLineFormatter(logging.Formatter):
    """A log record as one line: a logged exception adds its type and message, never a
    traceback (the CLI reports failures in its summary; tracebacks are for the library's
    users who configure logging themselves)."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            text += f" ({type(error).__name__}: {error})"
        return text


def _log_one_line_each() -> None:
    if logging.getLogger().handlers:
        return  # the embedding program configured logging
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def _result_line(handle: RequestHandle) -> dict[str, Any]:
    if not handle.done():
        return {"success": False, "rid": handle.request.rid, "error": "did not finish in time"}
    try:
        out = handle.output()
    except Exception as e:  # the request failed: reported in its line
        return {"success": False, "rid": handle.request.rid, "error": f"{type(e).__name__}: {e}"}
    return {"success": True, **out.to_dict()}


EPILOG = """\
batch mode (--requests FILE): one JSON object per line,
  {"server": URL, "input_ids": [...], "sampling_params": {...}, "priority": 5,
   "extra_key": "...", "rid": "..."}   (server and input_ids required)
  Every request is submitted to its server; each round the rebalancer moves queued ones
  off KV-pressured servers. When all have finished (or --max-rounds / --drain-timeout
  ran out) it writes one line per request to --output, in input order:
    {"success": true, "rid", "prompt_ids", "output_ids", "finish_reason", "meta_info",
     "segments": [{"server_url", "rid", "kind", "output_ids", "finish_reason",
                   "cached_tokens", "meta_info"}, ...],
     "moves": [{"rid", "source_url", "target_url", "outcome", "resumed_on",
                "generated_before_move", "estimate", "migration", "failure",
                "seconds", "live", "stages", "moments"}, ...]}
    or {"success": false, "rid", "error"}
  and one summary line to stdout:
    {"requests", "finished", "rounds", "moves_started", "outcomes": {outcome: count},
     "errors": [...]}
  outcome: migrated | recomputed | fell_back | finished_before_move | restarted.
  With --live, "stages" lists each copy: {"index", "while_decoding", "generated",
  "held_tokens", "migrated_tokens", "seconds", "decision", "failure", "path"}; every
  move's "seconds" has "stall" once the resumed piece's first token arrived, and
  "moments" when each step happened (time.time(), the clock of SGLang's meta_info).
  A server is pressured when it has --min-waiting queued requests and its KV demand
  reaches --kv-pressure or its running slots are full; what moves is its queued
  requests (not those decoding, unless --move-running), most urgent first.

watch mode (no --requests): moves nothing; prints one JSON line per round to stdout,
  {"round": N, "loads": {URL: {"url", "num_running", "num_waiting", "used_tokens",
   "demand_tokens", "capacity_tokens", "ok", "max_running", "host_headroom_tokens"}},
   "pressured": [URL, ...]}
  for --max-rounds rounds, --interval seconds apart ("pressured": the servers the
  policy options above would move requests off; "host_headroom_tokens" is null here:
  a rebalancing round asks it of the servers that may take a move); stops early, exit 1,
  once no server has answered for --max-failed-rounds rounds in a row.

exit status:
  0  batch: every request finished; watch: every server answered in the last round
  1  batch: some request failed or did not finish (each is named in "errors");
     watch: a server did not answer in the last round, or none for
     --max-failed-rounds rounds;
     either: a server refused a key (401/403, the route is named on stderr)
  2  bad arguments

keys: --api-key goes with /generate and /v1/loads, --admin-api-key with /abort_request
and the migration routes; one alone is sent everywhere (a server with one key set
accepts it on every route).
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-kv-migrate rebalance",
        description="Move queued requests off KV-pressured SGLang servers.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    policy = RebalancePolicy()
    add = p.add_argument
    add("--server", action="append", required=True, help="server URL (repeat for each)")
    add("--requests", default=None, help="JSON-lines requests file, - for stdin (batch mode)")
    add("--output", default=None, help="JSON-lines results file (batch mode; none: not written)")
    add(
        "--mode",
        choices=("auto", "migrate", "recompute"),
        default=policy.mode,
        help="auto: the cost model picks migrate or re-prefill per move; migrate: always "
        "move the KV; recompute: abort and re-prefill on the target",
    )
    _add_policy_options(p, policy)
    add("--interval", type=non_negative_float, default=0.5, help="seconds between rounds")
    add("--max-rounds", type=positive_int, default=1200, help="rounds before stopping")
    add(
        "--max-failed-rounds",
        type=positive_int,
        default=10,
        help="watch mode: stop (exit 1) after this many rounds in a row in which no server "
        "answered",
    )
    add(
        "--drain-timeout",
        type=non_negative_float,
        default=600.0,
        help="seconds to wait for unfinished requests after the last round",
    )
    add(
        "--api-key",
        default=None,
        help="the servers' --api-key (also the admin key when --admin-api-key is not given)",
    )
    add("--admin-api-key", default=None, help="the servers' --admin-api-key")
    add(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds per migration call",
    )
    add(
        "--gateway",
        default=None,
        help="batch mode: send every /generate through this model gateway (smg), pinned to "
        "the request's --server worker, so a moved request resumes on its target",
    )
    add(
        "--gateway-policy",
        default="consistent_hashing",
        help="the gateway's --policy (consistent_hashing honours X-SMG-Target-Worker)",
    )
    add(
        "--gateway-pin",
        choices=("target_worker", "rl_passthrough"),
        default=None,
        help="how to pin (default: what --gateway-policy honours); rl_passthrough: the "
        "gateway's --enable-rl per-worker passthrough, for policies without a pin header",
    )
    return p


def _add_policy_options(p: argparse.ArgumentParser, policy: RebalancePolicy) -> None:
    """The `RebalancePolicy` fields, with its defaults (which servers are pressured,
    which targets take a request, which requests move, how many at once)."""
    add = p.add_argument
    add(
        "--kv-pressure",
        type=non_negative_float,
        default=policy.kv_pressure,
        help="a server is pressured when its KV demand (used + queued prompts) reaches "
        "this share of its capacity",
    )
    add(
        "--min-waiting",
        type=non_negative_int,
        default=policy.min_waiting,
        help="... and it has at least this many queued requests",
    )
    add(
        "--target-max-ratio",
        type=positive_float,
        default=policy.target_max_ratio,
        help="a target takes a request while its demand plus the request's worst case "
        "(prompt + max_new_tokens) stays under this share of its capacity",
    )
    add(
        "--max-concurrent",
        type=positive_int,
        default=policy.max_concurrent,
        help="moves in flight at once, over all servers",
    )
    add(
        "--max-moves-per-round",
        type=positive_int,
        default=policy.max_moves_per_round,
        help="moves started per round",
    )
    _add_policy_flags(p)
    add(
        "--min-priority",
        type=int,
        default=policy.min_priority,
        help="only requests at least this urgent move (none: any priority)",
    )
    add(
        "--min-held-tokens",
        type=non_negative_int,
        default=policy.min_held_tokens,
        help="only requests whose KV the source holds at least this many tokens of (GPU or "
        "host pool) move; 0: any",
    )
    add(
        "--max-moves-per-request",
        type=positive_int,
        default=policy.max_moves_per_request,
        help="how often one request may move",
    )
    _add_placement_options(p, policy)


def _add_placement_options(p: argparse.ArgumentParser, policy: RebalancePolicy) -> None:
    """Which of a target's pools a move is planned into (`RebalancePolicy.landing_path`)."""
    add = p.add_argument
    add(
        "--no-kv-headroom",
        dest="kv_headroom",
        action="store_false",
        help="let a target take moves beyond what its KV pools can hold at once (without "
        "this flag a target takes a move only while its free GPU slots or, failing that, its "
        "host headroom, less what moves planned and in flight to it claim there, hold what "
        "the source holds of the request)",
    )
    add(
        "--no-device-path",
        dest="device_path",
        action="store_false",
        help="the servers do not share a host: plan every migration into the target's host pool",
    )
    add(
        "--no-shared-host",
        dest="shared_host",
        action="store_false",
        help="servers on one host that do not offer the shared-host path: a move that fits "
        "only the target's host pool goes through the host path (Mooncake)",
    )
    add(
        "--no-room",
        choices=("wait", "recompute"),
        default=policy.no_room,
        help="a move neither of the target's pools can hold: wait for room, or re-prefill "
        "it on the target",
    )


def _add_policy_flags(p: argparse.ArgumentParser) -> None:
    """The `RebalancePolicy` switches that are off unless given."""
    add = p.add_argument
    add(
        "--low-priority-values-first",
        action="store_true",
        help="the servers run --schedule-low-priority-values-first (smaller = more urgent)",
    )
    add(
        "--move-running",
        action="store_true",
        help="also move requests already decoding; without it only requests that have no "
        "output token yet move",
    )
    add(
        "--live",
        action="store_true",
        help="move a decoding request live: copy its KV while it keeps decoding, then stop "
        "it and move only the delta (needs --move-running; each move's report lists its "
        'stages and its "stall" in seconds)',
    )


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
