"""The rollout manager's scene, staged as it happens (issue 20; GPU machine only).

Two real SGLang servers on one GPU (Llama-3-8B shape, dummy weights, page 16,
`--enable-priority-scheduling`, HiCache). Per mode, on flushed caches, the same seeded
workload:

1. history: `--conversations` high-priority conversations run their first turn
   (`--context` tokens of prompt) on server A, so A's cache holds their KV;
2. pressure: `--max-running-requests` long low-priority decodes fill A's running slots
   and KV pool, which pushes the conversations' KV out of A's GPU into its host tier (the
   size query's `device_token_size` per conversation is recorded: the tier a move reads
   from); B runs only `--b-low` short low-priority requests;
3. next turns: each conversation's next turn (history + `--observation` new tokens)
   arrives on A with priority `--high` over `--low`, less than SGLang's preemption
   threshold (`--preemption-threshold`), so it waits in A's queue instead of preempting.

Modes: `none` (nobody moves anything); `recompute` (the `Rebalancer` moves the queued
high-priority turns to B by abort + re-prefill, what RL frameworks do today); `migrate`
(the same rebalancer with the cost model on: `mode="auto"`, each move priced on the path
it will take). Both rebalancing modes use the scene policy: only queued requests at least
`--high` urgent whose KV A holds (any tier), at most `--max-concurrent` at once.

Servers run with CUDA graphs on (`--no-cuda-graph` turns them off). The modes run
`--repeats` times (default 3; repeat r draws its workload from seed `--seed` + r), and
the p99s are over all turns of all repeats together, with their spread (the lowest
and highest per-repeat p99; `rl_scene_stats.py`). Result files of separate runs of one
context (e.g. one repeat per device call, `--repeat-start`) merge with `--merge`.

Reported per mode: high-priority completion from arrival p50/p99, low-priority
completion p50/p99, makespan, prefill tokens computed (SGLang's
`sglang:realtime_tokens_total{mode="prefill_compute"}`, both servers), every move's
outcome, path, tier (device/host tokens held on A when planned) and phases, and whether
each moved turn's output equals the same turn's output in `none` (greedy, same dummy
weights on both servers). Then the issue's ratios.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rl_scene.py --context 8192
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rl_scene.py --context 16384 --repeats 1 \
        --repeat-start 2                               # one repeat of three
    python3 benchmark/bench_rl_scene.py --merge a.json b.json   # pool the repeats
    python3 benchmark/bench_rl_scene.py --quick        # tiny model, small scene
    python3 benchmark/bench_rl_scene.py --scene early  # the earlier scene:
                                                       # bench_rollout_rebalance.py

Writes `$KVMIG_GPU_OUT/bench_rl_scene_<context>.json` and, with matplotlib, a PNG of the
same name; prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import rl_scene_stats
from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestHandle,
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

MODES = ("none", "recompute", "migrate")


@dataclass(frozen=True)
class Scene:
    conversations: int
    context: int
    observation: int
    history_gen: int  # tokens the first turn generated (part of the history)
    high_gen: int  # tokens of the next turn
    low_count: int  # low-priority decodes on A (= its running slots)
    low_prompt: int
    low_gen: int
    b_low: int  # low-priority requests on B
    high: int
    low: int
    vocab: int
    seed: int = 0


@dataclass
class Turn:
    """One request of the measured phase, as the report needs it."""

    kind: str  # "high" (a conversation's next turn) or "low"
    key: int
    arrival_s: float  # since the mode started
    seconds: float = 0.0  # arrival -> whole output
    servers: list[str] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    held_tokens: int = 0  # what A held of the prompt at arrival (high turns)
    device_tokens: int = 0  # ... of it on A's GPU


@dataclass
class ModeResult:
    mode: str
    makespan_s: float
    turns: list[Turn]
    prefill_tokens: float | None
    rebalancer: dict[str, Any]


# --------------------------------------------------------------------------- workload


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


@dataclass(frozen=True)
class Workload:
    """Every prompt of one run, drawn once from the seed (the same in every mode)."""

    first_turns: list[list[int]]
    observations: list[list[int]]
    low_on_a: list[list[int]]
    low_on_b: list[list[int]]


def make_workload(s: Scene) -> Workload:
    rng = random.Random(s.seed)
    return Workload(
        first_turns=[tokens(rng, s.context, s.vocab) for _ in range(s.conversations)],
        observations=[tokens(rng, s.observation, s.vocab) for _ in range(s.conversations)],
        low_on_a=[tokens(rng, s.low_prompt, s.vocab) for _ in range(s.low_count)],
        low_on_b=[tokens(rng, s.low_prompt // 4, s.vocab) for _ in range(s.b_low)],
    )


# --------------------------------------------------------------------------- one mode


async def run_mode(
    mode: str, scene: Scene, work: Workload, urls: list[str], policy: RebalancePolicy | None
) -> ModeResult:
    a, b = urls
    before = prefill_tokens(urls)
    async with AsyncRequestMigrator() as migrator:
        histories = await compute_histories(migrator, a, scene, work)
        t0 = time.perf_counter()
        lows = await submit_all(migrator, a, work.low_on_a, scene.low_gen, scene.low)
        lows += await submit_all(migrator, b, work.low_on_b, scene.low_gen, scene.low)
        await wait_running(a, scene.low_count)
        prompts = [h + o for h, o in zip(histories, work.observations, strict=True)]
        held = await asyncio.gather(*(migrator.held_kv(a, p) for p in prompts))
        arrival = time.perf_counter() - t0
        highs = await submit_all(migrator, a, prompts, scene.high_gen, scene.high)
        rebalancer = Rebalancer(migrator, urls, policy) if policy else None
        task = None
        if rebalancer is not None:
            run = rebalancer.run(max_rounds=1_000_000, interval_s=0.1, stop_when_idle=False)
            task = asyncio.ensure_future(run)
        turns = await collect(highs, lows, held, arrival, t0)
        makespan = time.perf_counter() - t0
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    after = prefill_tokens(urls)
    computed = None if before is None or after is None else after - before
    summary = rebalancer.summary.to_dict() if rebalancer else {}
    return ModeResult(mode, makespan, turns, computed, summary)


async def submit_all(
    migrator: AsyncRequestMigrator, url: str, prompts: list[list[int]], gen: int, priority: int
) -> list[RequestHandle]:
    return [
        await migrator.submit(url, GenerateRequest(p, greedy(gen), priority=priority))
        for p in prompts
    ]


async def compute_histories(
    migrator: AsyncRequestMigrator, url: str, scene: Scene, work: Workload
) -> list[list[int]]:
    """Step 1: the first turns on A; returns each conversation's history (prompt+output)."""
    handles = await submit_all(migrator, url, work.first_turns, scene.history_gen, scene.high)
    outs = [await h.result() for h in handles]
    return [p + o.output_ids for p, o in zip(work.first_turns, outs, strict=True)]


async def wait_running(url: str, n: int, timeout_s: float = 120.0) -> None:
    """Until `n` requests run on `url` (the low decodes took A's slots), bounded."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < deadline:
            loads = (await http.get(url + "/v1/loads")).json()["loads"]
            if sum(d["num_running_reqs"] for d in loads) >= n:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url}: {n} requests not running after {timeout_s} s")


async def collect(
    highs: list[RequestHandle],
    lows: list[RequestHandle],
    held: list[dict[str, Any]],
    arrival: float,
    t0: float,
) -> list[Turn]:
    """Wait for every request; each one's completion is taken when its own output is
    ready (all waited on together), from its arrival (highs: `arrival`; lows: t0)."""

    async def finished(handle: RequestHandle) -> tuple[Any, float]:
        out = await handle.result()
        return out, time.perf_counter() - t0

    done = await asyncio.gather(*(finished(h) for h in (*highs, *lows)))
    turns = []
    for i, (out, at) in enumerate(done):
        if i < len(highs):
            turn = Turn("high", i, arrival, held_tokens=held[i].matched_token_size)
            turn.device_tokens = held[i].device_token_size
        else:
            turn = Turn("low", i - len(highs), 0.0)
        turn.seconds = at - turn.arrival_s
        turn.servers = [s.server_url for s in out.segments]
        turn.moves = [move_record(m) for m in out.moves]
        turn.output_ids = out.output_ids
        turns.append(turn)
    return turns


def move_record(report: Any) -> dict[str, Any]:
    m = report.migration
    return {
        "outcome": report.outcome,
        "path": m.path if m else "",
        "migrated_tokens": m.migrated_token_size if m else 0,
        "phases_s": m.timings if m else {},
        "move_s": report.seconds,
        "estimate": report.estimate.to_dict() if report.estimate else None,
        "failure": report.failure,
    }


# --------------------------------------------------------------------------- report


def summarize(result: ModeResult, baseline: ModeResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": result.mode, "makespan_s": round(result.makespan_s, 2)}
    for kind in ("high", "low"):
        times = sorted(t.seconds for t in result.turns if t.kind == kind)
        row[f"{kind}_p50_s"] = round(percentile(times, 50), 3) if times else None
        row[f"{kind}_p99_s"] = round(percentile(times, 99), 3) if times else None
    row["prefill_tokens"] = result.prefill_tokens
    moves = [m for t in result.turns for m in t.moves]
    row["moves"] = len(moves)
    row["paths"] = sorted({m["path"] or m["outcome"] for m in moves})
    highs = [t for t in result.turns if t.kind == "high"]
    row["held_on_host_tokens"] = sum(t.held_tokens - t.device_tokens for t in highs)
    row["held_on_device_tokens"] = sum(t.device_tokens for t in highs)
    if baseline is not None:
        same = {t.key: t.output_ids for t in baseline.turns if t.kind == "high"}
        moved = [t for t in highs if t.moves]
        row["moved_outputs_identical"] = sum(t.output_ids == same.get(t.key) for t in moved)
        row["moved"] = len(moved)
    return row


def percentile(sorted_values: list[float], q: float) -> float:
    return rl_scene_stats.percentile(sorted_values, q)


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = [
        *("mode", "repeat", "repeats", "high_turns", "high_p50_s", "high_p99_s"),
        *("high_p99_spread_s", "low_p50_s", "low_p99_s", "low_p99_spread_s", "makespan_s"),
        *("prefill_tokens", "moves", "paths", "held_on_host_tokens", "moved_outputs_identical"),
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = ["high_p50_s", "high_p99_s", "low_p50_s", "low_p99_s"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax1.bar([j + i * width for j in range(len(keys))], [row[k] or 0 for k in keys], width,
                label=row["mode"])  # fmt: skip
    ax1.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))],
                   [k.removesuffix("_s").replace("_", " ") for k in keys])  # fmt: skip
    ax1.set_ylabel("completion from arrival (s)")
    ax1.legend()
    ax2.bar([r["mode"] for r in rows], [r["makespan_s"] or 0 for r in rows], color="gray")
    ax2.set_ylabel("makespan (s)")
    ax2b = ax2.twinx()
    ax2b.plot([r["mode"] for r in rows], [r["prefill_tokens"] or 0 for r in rows], "o-", color="C3")
    ax2b.set_ylabel("prefill tokens computed", color="C3")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--scene",
        choices=("queued", "early"),
        default="queued",
        help="queued: this scene; early: bench_rollout_rebalance.py's (its options follow)",
    )
    add("--quick", action="store_true", help="tiny model and a small scene (smoke run)")
    add("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run, in order")
    add("--context", type=int, default=8192, help="first-turn prompt tokens (4096/8192/16384)")
    add("--conversations", type=int, default=24, help="high-priority conversations")
    add("--repeats", type=int, default=3, help="times every mode runs")
    add("--repeat-start", type=int, default=0, help="index (and seed offset) of the first")
    add("--no-cuda-graph", action="store_true", help="servers without CUDA graphs")
    add("--merge", nargs="+", type=Path, default=None,
        help="pool these result files' repeats (one context) and print the ratios")  # fmt: skip
    add("--observation", type=int, default=256, help="new tokens of the next turn")
    add("--history-gen", type=int, default=32, help="tokens the first turn generates")
    add("--high-gen", type=int, default=64, help="tokens the next turn generates")
    add("--low-gen", type=int, default=512, help="tokens each low-priority decode generates")
    add("--b-low", type=int, default=2, help="low-priority requests on B")
    add("--high", type=int, default=5, help="priority of the conversations")
    add("--low", type=int, default=0, help="priority of the low-priority work")
    add(
        "--preemption-threshold",
        type=int,
        default=10,
        help="--priority-scheduling-preemption-threshold (above high - low: no preemption)",
    )
    add("--page-size", type=int, default=16, help="--page-size of both servers")
    add("--max-total-tokens", type=int, default=65536, help="GPU KV pool per server (tokens)")
    add("--max-running-requests", type=int, default=8,
        help="running slots per server; A's are all taken by low-priority decodes")  # fmt: skip
    add("--kv-fill", type=float, default=0.9, help="share of A's KV the low decodes need")
    add("--mem-fraction-static", type=float, default=0.35, help="per server (two on one GPU)")
    add("--max-concurrent", type=int, default=6, help="rebalancer: moves in flight at once")
    add("--target-max-ratio", type=float, default=0.95, help="rebalancer: B's KV headroom")
    add("--mode-timeout", type=float, default=150.0, help="seconds per mode")
    add("--b-hicache-ratio", type=float, default=None,
        help="B's --hicache-ratio (default: half of A's, at least 2): B's host pool takes "
        "moves, A's holds every conversation; two on one machine must fit its memory")  # fmt: skip
    add("--seed", type=int, default=0, help="workload seed")
    args, rest = p.parse_known_args(argv)
    if args.scene == "queued" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.quick:
        args.context, args.conversations, args.observation, args.repeats = 1024, 4, 64, 1
        args.high_gen, args.low_gen, args.max_total_tokens = 16, 64, 8192
        args.max_running_requests = 4
    return args


def scene_from(args: argparse.Namespace, vocab: int) -> Scene:
    low_prompt = int(args.max_total_tokens * args.kv_fill / args.max_running_requests)
    return Scene(
        conversations=args.conversations, context=args.context, observation=args.observation,
        history_gen=args.history_gen, high_gen=args.high_gen,
        low_count=args.max_running_requests, low_prompt=max(16, low_prompt - args.low_gen),
        low_gen=args.low_gen, b_low=args.b_low, high=args.high, low=args.low, vocab=vocab,
        seed=args.seed,
    )  # fmt: skip


def server_flags(args: argparse.Namespace, scene: Scene, b: bool = False) -> list[str]:
    """A's flags (B's with `b`: its host pool per `--b-hicache-ratio`). A's host pool
    holds every conversation plus the low decodes (none of the scene's KV may fall out
    of A's host tier: that is what moves)."""
    per_conv = scene.context + scene.history_gen + scene.observation + scene.high_gen
    needed = scene.conversations * per_conv + scene.low_count * (scene.low_prompt + scene.low_gen)
    ratio = max(2.0, math.ceil(needed / args.max_total_tokens) + 0.5)
    if b:
        ratio = args.b_hicache_ratio or max(2.0, ratio / 2)
    context_len = max(per_conv, scene.low_prompt + scene.low_gen) + 64
    return [
        "--page-size", str(args.page_size), "--mem-fraction-static", str(args.mem_fraction_static),
        "--max-total-tokens", str(args.max_total_tokens), "--hicache-ratio", str(ratio),
        "--max-running-requests", str(args.max_running_requests),
        "--context-length", str(context_len), "--enable-priority-scheduling",
        "--priority-scheduling-preemption-threshold", str(args.preemption_threshold),
        "--enable-metrics",
    ]  # fmt: skip


def policy_for(mode: str, args: argparse.Namespace) -> RebalancePolicy | None:
    if mode == "none":
        return None
    return RebalancePolicy(
        min_priority=args.high,
        min_held_tokens=args.page_size,
        max_concurrent=args.max_concurrent,
        max_moves_per_round=args.max_concurrent,
        target_max_ratio=args.target_max_ratio,
        mode="recompute" if mode == "recompute" else "auto",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        seconds = rl_scene_stats.merge(args.merge)
        rows = rl_scene_stats.pooled_rows(seconds)
        print(markdown(rows))
        print(json.dumps(rl_scene_stats.ratios(rows)))
        return
    if args.scene == "early":
        import bench_rollout_rebalance

        sys.argv = [sys.argv[0], *args.rest]
        bench_rollout_rebalance.main()
        return
    shape, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    scene = scene_from(args, shape["vocab_size"])
    os.environ.setdefault("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "1")  # prefill seconds
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}"))
    graphs = not args.no_cuda_graph
    specs = [
        ServerSpec(30700, server_flags(args, scene), cuda_graph=graphs),
        ServerSpec(30800, server_flags(args, scene, b=True), cuda_graph=graphs),
    ]
    results: list[tuple[int, ModeResult]] = []
    errors: dict[str, str] = {}
    with running_servers(model_dir, specs, sequential=True) as urls:
        rng = random.Random(1)
        for url in urls:  # compile kernels before anything is timed
            generate(url, tokens(rng, 1024, shape["vocab_size"]), 4)
        for rep in range(args.repeat_start, args.repeat_start + args.repeats):
            scene_r = replace(scene, seed=args.seed + rep)
            work = make_workload(scene_r)
            for mode in args.modes:
                for url in urls:
                    flush_cache(url)
                print(f"== repeat {rep}: {mode}", flush=True)
                run = run_mode(mode, scene_r, work, urls, policy_for(mode, args))
                try:
                    results.append((rep, asyncio.run(asyncio.wait_for(run, args.mode_timeout))))
                except TimeoutError:  # report it and go on: the other modes still count
                    errors[f"{rep}:{mode}"] = f"did not finish in {args.mode_timeout} s"
                    continue
                report(args, name, scene, results, errors, final=False)
    report(args, name, scene, results, errors, final=True)


def report(
    args: argparse.Namespace,
    name: str,
    scene: Scene,
    results: list[tuple[int, ModeResult]],
    errors: dict[str, str],
    final: bool,
) -> None:
    """Write the JSON (after every mode: a cut-short run keeps what it measured); at the
    end also the table, the ratios and the plot. `rows`: pooled over the repeats;
    `repeat_rows`: each repeat's own, its moved turns checked against its `none`."""
    repeat_rows = []
    for rep in sorted({r for r, _ in results}):
        mine = [m for r, m in results if r == rep]
        baseline = next((m for m in mine if m.mode == "none"), None)
        repeat_rows += [{"repeat": rep, **summarize(m, baseline)} for m in mine]
    seconds = turn_seconds(results)
    rows = rl_scene_stats.pooled_rows(seconds)
    for row in rows:  # the plot's and table's per-mode makespan and prefill: medians
        mine = [r for r in repeat_rows if r["mode"] == row["mode"]]
        for key in ("makespan_s", "prefill_tokens", "moves"):
            present = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(present) if present else None
    suffix = f"_r{args.repeat_start}" if args.repeat_start else ""
    stem = f"bench_rl_scene_{args.context}{suffix}"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = {
        "config": {**{k: v for k, v in vars(args).items() if k not in ("rest", "merge")},
                   "shape": name},
        "scene": asdict(scene),
        "rows": rows,
        "ratios": rl_scene_stats.ratios(rows),
        "repeat_rows": repeat_rows,
        "turn_seconds": seconds,
        "errors": errors,
        "turns": {
            f"{rep}:{r.mode}": [asdict(t) | {"output_ids": len(t.output_ids)} for t in r.turns]
            for rep, r in results
        },
        "rebalancer": {f"{rep}:{r.mode}": r.rebalancer for rep, r in results},
    }  # fmt: skip
    (OUT_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1))
    if not final:
        print(json.dumps(repeat_rows[-1]) if repeat_rows else "{}", flush=True)
        return
    png = OUT_DIR / f"{stem}.png"
    title = f"RL scene, {name}, {args.context}-token histories: none / re-prefill / migrate"
    plotted = plot(rows, png, title) if rows else False
    print(markdown(rows))
    print(markdown(repeat_rows))
    print(json.dumps(out["ratios"]))
    print(f"plot: {png}" if plotted else "plot: matplotlib not installed (or no rows)")


def turn_seconds(results: list[tuple[int, ModeResult]]) -> dict[str, dict[str, dict]]:
    """mode -> repeat (as a string: JSON keys) -> kind -> every turn's completion seconds."""
    out: dict[str, dict[str, dict]] = {}
    for rep, result in results:
        kinds = {k: [t.seconds for t in result.turns if t.kind == k] for k in ("high", "low")}
        out.setdefault(result.mode, {})[str(rep)] = kinds
    return out


if __name__ == "__main__":
    main()
