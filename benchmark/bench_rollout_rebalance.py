"""Rollout rebalancing end to end: none vs abort + re-prefill vs migration (GPU machine only).

Two real SGLang servers on one GPU (`--enable-priority-scheduling`, `--enable-metrics`),
and a skewed multi-turn rollout: every conversation starts on server A with a long
context, server B idles. Each conversation runs `--turns` turns; turn k's prompt is the
previous prompt + its output + a new observation, and goes to the server where turn k-1
finished (that is where its KV is: session affinity, as rollout managers do). A quarter
of the conversations (`--high-fraction`) have priority 10, the rest 0. The high-priority
ones start first and their first turn runs at once; the low-priority ones arrive
`--low-delay` seconds later and fill A's KV pool, so the high-priority conversations' later
turns — whose history A has cached — queue behind running low-priority requests (a
difference of 10 is SGLang's default preemption threshold: no preemption). That is the
scene migration exists for: moving such a request by re-prefill recomputes its whole
history on B, moving it with its KV does not. The same seeded workload runs three ways,
on flushed caches:

- `none`: no rebalancing;
- `recompute`: the `Rebalancer` moves queued requests off A by abort + re-prefill on B
  (what RL frameworks do today);
- `migrate`: the same rebalancer, moving the KV with `move_request` (`--migrate-mode
  auto` lets the cost model choose per request instead).

Reported per mode: per-priority turn completion time (submit -> whole output) p50/p99,
makespan, prefill tokens computed (from each piece's `cached_tokens`, and from SGLang's
`sglang:realtime_tokens_total{mode="prefill_compute"}` on both servers), moves and their
outcomes. Then the ratios the issue asks for: high-priority p99 with migration vs none and
vs re-prefill.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rollout_rebalance.py            # 8B shape
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rollout_rebalance.py --quick    # smoke run

Writes `$KVMIG_GPU_OUT/bench_rollout_rebalance.json` and, with matplotlib,
`bench_rollout_rebalance.png`; prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestOutput,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    ServerSpec,
    flush_cache,
    generate,
    prefill_tokens,
    running_servers,
    write_model,
)

HIGH, LOW = 10, 0
MODES = ("none", "recompute", "migrate")


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    context: int  # first-turn prompt length
    observation: int  # tokens added per later turn
    gen: int  # output tokens per turn (ignore_eos)
    high_fraction: float
    seed: int = 0


@dataclass
class Conversation:
    cid: int
    priority: int
    observations: list[list[int]]  # one per turn; the first is the long context


@dataclass
class TurnRecord:
    cid: int
    turn: int
    priority: int
    seconds: float
    finished_at: float  # since the mode started
    servers: list[str]
    moves: list[str]
    prefill_computed: int
    migrated_tokens: int


@dataclass
class ModeResult:
    mode: str
    makespan_s: float
    turns: list[TurnRecord] = field(default_factory=list)
    prefill_tokens_metrics: float | None = None
    rebalancer: dict[str, Any] = field(default_factory=dict)


def make_workload(w: Workload, vocab: int) -> list[Conversation]:
    rng = random.Random(w.seed)
    high = set(rng.sample(range(w.conversations), round(w.conversations * w.high_fraction)))
    lengths = [w.context] + [w.observation] * (w.turns - 1)
    return [
        Conversation(
            cid,
            HIGH if cid in high else LOW,
            [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths],
        )
        for cid in range(w.conversations)
    ]


async def run_mode(
    mode: str,
    convs: list[Conversation],
    urls: list[str],
    gen: int,
    policy: RebalancePolicy,
    low_delay_s: float = 0.0,
) -> ModeResult:
    source = urls[0]
    records: list[TurnRecord] = []
    before = prefill_tokens(urls)
    async with AsyncRequestMigrator() as migrator:
        rebalancer = Rebalancer(migrator, urls, policy)
        t0 = time.perf_counter()

        async def conversation(conv: Conversation) -> None:
            url, history = source, []
            if conv.priority != HIGH:
                await asyncio.sleep(low_delay_s)
            for turn, obs in enumerate(conv.observations):
                prompt = history + obs
                params = {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}
                start = time.perf_counter()
                handle = await migrator.submit(
                    url, GenerateRequest(prompt, params, priority=conv.priority)
                )
                out = await handle.result()
                records.append(_record(conv, turn, start, t0, out))
                history = prompt + out.output_ids
                url = handle.server_url  # the next turn goes where this one's KV is

        task = None
        if mode != "none":
            task = asyncio.ensure_future(
                rebalancer.run(max_rounds=100_000, interval_s=0.1, stop_when_idle=False)
            )
        await asyncio.gather(*(conversation(c) for c in convs))
        makespan = time.perf_counter() - t0
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    after = prefill_tokens(urls)
    metrics = None if before is None or after is None else after - before
    return ModeResult(mode, makespan, records, metrics, rebalancer.summary.to_dict())


def _record(
    conv: Conversation, turn: int, start: float, t0: float, out: RequestOutput
) -> TurnRecord:
    computed, prompt_len = 0, len(out.prompt_ids)
    for seg in out.segments:
        aborted = (seg.finish_reason or {}).get("type") == "abort"
        if not (aborted and not seg.output_ids):  # stopped while queued: nothing prefilled
            computed += prompt_len - int(seg.cached_tokens or 0)
        prompt_len += len(seg.output_ids)
    migrated = sum(m.migration.migrated_token_size for m in out.moves if m.migration)
    now = time.perf_counter()
    return TurnRecord(
        cid=conv.cid,
        turn=turn,
        priority=conv.priority,
        seconds=now - start,
        finished_at=now - t0,
        servers=[s.server_url for s in out.segments],
        moves=[m.outcome for m in out.moves],
        prefill_computed=computed,
        migrated_tokens=migrated,
    )


def summarize(result: ModeResult) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": result.mode, "makespan_s": round(result.makespan_s, 2)}
    for name, prio in (("high", HIGH), ("low", LOW)):
        times = sorted(r.seconds for r in result.turns if r.priority == prio)
        row[f"{name}_p50_s"] = round(_percentile(times, 50), 3) if times else None
        row[f"{name}_p99_s"] = round(_percentile(times, 99), 3) if times else None
    row["prefill_tokens"] = sum(r.prefill_computed for r in result.turns)
    row["prefill_tokens_metrics"] = result.prefill_tokens_metrics
    row["migrated_tokens"] = sum(r.migrated_tokens for r in result.turns)
    row["moves"] = result.rebalancer.get("outcomes", {})
    return row


def _percentile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["high p50", "high p99", "low p50", "low p99"]
    keys = ["high_p50_s", "high_p99_s", "low_p50_s", "low_p99_s"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(keys))]
        ax1.bar(xs, [row[k] or 0 for k in keys], width, label=row["mode"])
    ax1.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))], labels)
    ax1.set_ylabel("turn completion time (s)")
    ax1.legend()
    ax2.bar([r["mode"] for r in rows], [r["makespan_s"] for r in rows], color="gray")
    ax2.set_ylabel("makespan (s)")
    ax2b = ax2.twinx()
    ax2b.plot([r["mode"] for r in rows], [r["prefill_tokens"] for r in rows], "o-", color="C3")
    ax2b.set_ylabel("prefill tokens computed", color="C3")
    fig.suptitle("Rollout rebalancing: none vs abort + re-prefill vs KV migration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small workload")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--migrate-mode", choices=("migrate", "auto"), default="migrate")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--observation", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--high-fraction", type=float, default=0.25)
    parser.add_argument("--low-delay", type=float, default=1.0, help="seconds")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--mem-fraction-static", type=float, default=0.35)
    parser.add_argument(
        "--max-total-tokens", type=int, default=65536,
        help="GPU KV pool per server: small enough that A's long contexts queue",
    )  # fmt: skip
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--kv-pressure", type=float, default=0.8)
    parser.add_argument("--target-max-ratio", type=float, default=0.6)
    parser.add_argument("--max-concurrent", type=int, default=4)
    parser.add_argument("--mode-timeout", type=float, default=240.0, help="seconds per mode")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.context = 8, 2, 1024
        args.observation, args.gen, args.max_total_tokens = 128, 32, 8192
        args.low_delay = 0.5
    shape, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    workload = Workload(
        args.conversations, args.turns, args.context, args.observation, args.gen,
        args.high_fraction,
    )  # fmt: skip
    context_len = args.context + (args.turns - 1) * args.observation + args.turns * args.gen + 64

    os.environ.setdefault("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "1")  # prefill seconds
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}"))
    extra = [
        "--page-size", str(args.page_size), "--mem-fraction-static", str(args.mem_fraction_static),
        "--max-total-tokens", str(args.max_total_tokens), "--context-length", str(context_len),
        "--max-running-requests", str(args.max_running_requests),
        "--enable-priority-scheduling", "--enable-metrics",
    ]  # fmt: skip
    specs = [ServerSpec(30500, extra), ServerSpec(30600, extra)]
    convs = make_workload(workload, shape["vocab_size"])
    policy = RebalancePolicy(
        kv_pressure=args.kv_pressure,
        target_max_ratio=args.target_max_ratio,
        max_concurrent=args.max_concurrent,
    )
    results: list[ModeResult] = []
    errors: dict[str, str] = {}
    with running_servers(model_dir, specs, sequential=True) as urls:
        rng = random.Random(1)
        for url in urls:  # compile kernels before anything is timed
            generate(url, [rng.randrange(3, shape["vocab_size"]) for _ in range(1024)], 4)
        for mode in args.modes:
            for url in urls:
                flush_cache(url)
            move_mode = "recompute" if mode == "recompute" else args.migrate_mode
            mode_policy = dataclasses.replace(policy, mode=move_mode)
            print(f"== {mode}", flush=True)
            run = run_mode(mode, convs, urls, args.gen, mode_policy, args.low_delay)
            try:
                results.append(asyncio.run(asyncio.wait_for(run, args.mode_timeout)))
            except TimeoutError:  # report it and go on: the other modes still count
                errors[mode] = f"did not finish in {args.mode_timeout} s"
                continue
            print(json.dumps(summarize(results[-1])), flush=True)
            _write(args, name, results, errors)  # partial results survive a cut-short run

    rows, ratios = _write(args, name, results, errors)
    png = OUT_DIR / "bench_rollout_rebalance.png"
    plotted = plot(rows, png) if rows else False
    print(_markdown(rows))
    print(json.dumps(ratios))
    print(f"plot: {png}" if plotted else "plot: matplotlib not installed (or no rows)")


def _write(
    args: argparse.Namespace, name: str, results: list[ModeResult], errors: dict[str, str]
) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
    rows = [summarize(r) for r in results]
    ratios = _ratios(rows)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = {
        "config": {**vars(args), "shape": name},
        "rows": rows,
        "ratios": ratios,
        "errors": errors,
        "turns": {r.mode: [asdict(t) for t in r.turns] for r in results},
        "rebalancer": {r.mode: r.rebalancer for r in results},
    }
    (OUT_DIR / "bench_rollout_rebalance.json").write_text(json.dumps(out, indent=1))
    return rows, ratios


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    by_mode = {r["mode"]: r for r in rows}

    def ratio(a: str, b: str) -> float | None:
        if a not in by_mode or b not in by_mode or not by_mode[b]["high_p99_s"]:
            return None
        return round(by_mode[a]["high_p99_s"] / by_mode[b]["high_p99_s"], 3)

    return {
        "high_p99_migrate_over_none": ratio("migrate", "none"),  # target <= 0.5
        "high_p99_migrate_over_recompute": ratio("migrate", "recompute"),  # target < 1
        "high_p99_recompute_over_none": ratio("recompute", "none"),
    }


def _markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| mode | high p50 s | high p99 s | low p50 s | low p99 s | makespan s "
        "| prefill tokens | migrated tokens | moves |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['mode']} | {r['high_p50_s']} | {r['high_p99_s']} | {r['low_p50_s']} "
        f"| {r['low_p99_s']} | {r['makespan_s']} | {r['prefill_tokens']} "
        f"| {r['migrated_tokens']} | {r['moves']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


if __name__ == "__main__":
    main()
