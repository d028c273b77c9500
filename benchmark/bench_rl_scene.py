"""The rollout manager's scene, staged as it happens (issue 20; GPU machine only).

Two real SGLang servers on one GPU (Llama-3-8B shape, dummy weights, page 16,
`--enable-priority-scheduling`, HiCache). Per mode, on flushed caches, the same seeded
workload:

1. history: `--conversations` high-priority conversations run their first turn
   (`--context` tokens of prompt) on server A, so A's cache holds their KV;
2. pressure: `--max-running-requests` long low-priority decodes fill A's running slots
   and KV pool, which pushes the conversations' KV out of A's GPU into its host tier (the
   size query's `device_token_size` per conversation is recorded: the tier a move reads
   from); B runs only `--b-low` short low-priority requests (variant `room`), or
   `--b-full-requests` long ones that take `--b-full-fill` of its GPU pool (variant
   `full`, `--target-gpu full`: a moved history finds no room on B's GPU, nothing there
   evictable while they run);
3. next turns: each conversation's next turn (history + `--observation` new tokens)
   arrives on A with priority `--high` over `--low`, less than SGLang's preemption
   threshold (`--preemption-threshold`), so it waits in A's queue instead of preempting.

Modes: `none` (nobody moves anything); `recompute` (the `Rebalancer` moves the queued
high-priority turns to B by abort + re-prefill, what RL frameworks do today); `migrate`
(the same rebalancer with the cost model on: `mode="auto"`, each move priced on the path
it will take). Both rebalancing modes use the scene policy: only queued requests at least
`--high` urgent whose KV A holds (any tier), at most `--max-concurrent` at once.

Servers run with CUDA graphs on (`--no-cuda-graph` turns them off), started one after
another with pools of `--max-total-tokens` each (`gpu_servers.py` sizes each one's
`--mem-fraction-static` from the memory free when it starts); the host tiers are sized
for the scene within 70% of the machine's free memory. The modes run `--repeats` times
per variant (default 3; repeat r draws its workload from seed `--seed` + r), and the
p99s are over all turns of all repeats together, with their spread (the lowest and
highest per-repeat p99) and each repeat's own ratios (`rl_scene_stats.py`). Result files
of separate runs of one context (e.g. one repeat per device call, `--repeat-start`)
merge with `--merge`. No mode starts that the last one's duration says would end after
`--deadline-s` (from this process's start).

Reported per mode: high-priority completion from arrival p50/p99, low-priority
completion p50/p99, makespan, prefill tokens computed (SGLang's
`sglang:realtime_tokens_total{mode="prefill_compute"}`, both servers), every move's
outcome, path, tier (device/host tokens held on A when planned), the tier it landed in
on B and what B served the moved turn from (`rl_scene_report.py`), and phases, and
whether each moved turn's output equals the same turn's output in `none` (greedy, same
dummy weights on both servers). Then the issue's ratios.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rl_scene.py --context 8192
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_rl_scene.py --context 16384 --repeats 1 \
        --repeat-start 2                               # one repeat of three
    python3 benchmark/bench_rl_scene.py --merge a.json b.json   # pool the repeats
    python3 benchmark/bench_rl_scene.py --quick        # tiny model, small scene
    python3 benchmark/bench_rl_scene.py --scene early  # the earlier scene:
                                                       # bench_rollout_rebalance.py

Writes `$KVMIG_GPU_OUT/bench_rl_scene_<context>.json` (`_r<start>` with
`--repeat-start`) after every mode and, with matplotlib, a PNG per variant; prints
markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import gpu_servers
import httpx
import rl_scene_report as report
import rl_scene_stats
from rl_scene_report import ModeResult, Turn
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
    b_prompt: int  # ... their prompt tokens
    high: int
    low: int
    vocab: int
    seed: int = 0
    variant: str = rl_scene_stats.ROOM  # B's GPU with room for the moves, or full


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
        low_on_b=[tokens(rng, s.b_prompt, s.vocab) for _ in range(s.b_low)],
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
        if scene.variant == rl_scene_stats.FULL:  # B's pool taken before anything moves
            await wait_running(b, scene.b_low)
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
        turn.moves = [report.move_record(m) for m in out.moves]
        if out.moves and out.segments:
            turn.target_cached = report.served_from(out.segments[-1].meta_info)
        turn.output_ids = out.output_ids
        turns.append(turn)
    return turns


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
    add("--target-gpu", nargs="+", choices=rl_scene_stats.VARIANTS, default=[rl_scene_stats.ROOM],
        help="variants, in order: B's GPU with room for the moves, or full")  # fmt: skip
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
    add("--b-low", type=int, default=2, help="short low-priority requests on B (room)")
    add("--b-full-requests", type=int, default=4, help="long low-priority requests on B (full)")
    add("--b-full-fill", type=float, default=0.9, help="share of B's pool they take (full)")
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
    add("--mem-fraction-static", type=float, default=None,
        help="one value for both servers (default: each one's, from the memory free)")  # fmt: skip
    add("--max-concurrent", type=int, default=6, help="rebalancer: moves in flight at once")
    add("--target-max-ratio", type=float, default=0.95, help="rebalancer: B's KV headroom")
    add("--mode-timeout", type=float, default=150.0, help="seconds per mode")
    add("--deadline-s", type=float, default=None, help="seconds from start; see the docstring")
    add("--host-share", type=float, default=0.7,
        help="share of the machine's free memory both host tiers may pin")  # fmt: skip
    add("--seed", type=int, default=0, help="workload seed")
    args, rest = p.parse_known_args(argv)
    if args.scene == "queued" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.quick:
        args.context, args.conversations, args.observation, args.repeats = 1024, 4, 64, 1
        args.high_gen, args.low_gen, args.max_total_tokens = 16, 64, 8192
        args.max_running_requests = 4
    args.t0 = time.monotonic()
    return args


def scene_from(args: argparse.Namespace, vocab: int, variant: str = rl_scene_stats.ROOM) -> Scene:
    low_prompt = int(args.max_total_tokens * args.kv_fill / args.max_running_requests)
    low_prompt = max(16, low_prompt - args.low_gen)
    b_low, b_prompt = args.b_low, low_prompt // 4
    if variant == rl_scene_stats.FULL:
        b_low = args.b_full_requests
        b_prompt = max(16, int(args.max_total_tokens * args.b_full_fill / b_low) - args.low_gen)
    return Scene(
        conversations=args.conversations, context=args.context, observation=args.observation,
        history_gen=args.history_gen, high_gen=args.high_gen,
        low_count=args.max_running_requests, low_prompt=low_prompt,
        low_gen=args.low_gen, b_low=b_low, b_prompt=b_prompt, high=args.high, low=args.low,
        vocab=vocab, seed=args.seed, variant=variant,
    )  # fmt: skip


def host_needs(scenes: list[Scene], in_flight: int) -> tuple[int, int]:
    """Tokens A's and B's host tiers should hold: on A every conversation and A's own
    low-priority decodes; on B the conversations moved and not yet done (at most
    `in_flight` at once: B's running slots and the moves in flight; a finished one may
    fall out) and B's own decodes, in the largest variant."""
    s = scenes[0]
    per_conv = s.context + s.history_gen + s.observation + s.high_gen
    a = s.conversations * per_conv + s.low_count * (s.low_prompt + s.low_gen)
    b = min(s.conversations, in_flight) * per_conv
    b += max(v.b_low * (v.b_prompt + v.low_gen) for v in scenes)
    return a, b


def host_ratios(args: argparse.Namespace, scenes: list[Scene], per_token: int) -> list[float]:
    """A's and B's `--hicache-ratio`: A's tier first (none of the conversations may fall
    out of it: that is what moves), within `--host-share` of the machine's free memory
    less B's smallest tier; B's gets what is left, at least SGLang's floor."""
    in_flight = args.max_running_requests + args.max_concurrent
    need_a, need_b = host_needs(scenes, in_flight)
    pool_bytes = args.max_total_tokens * per_token
    budget = int(gpu_servers.mem_available_bytes() * args.host_share)
    floor = 2.0
    ratio_a = gpu_servers.host_ratio(
        need_a, args.max_total_tokens, budget - int(floor * pool_bytes), per_token, floor=floor
    )
    left = budget - int(ratio_a * pool_bytes)
    ratio_b = gpu_servers.host_ratio(need_b, args.max_total_tokens, left, per_token, floor=floor)
    return [ratio_a, ratio_b]


def server_flags(args: argparse.Namespace, scenes: list[Scene], per_token: int) -> list[list[str]]:
    """A's and B's flags; the host tiers as `host_ratios` sizes them."""
    context_len = 64 + max(
        max(v.context + v.history_gen + v.observation + v.high_gen,
            v.low_prompt + v.low_gen, v.b_prompt + v.low_gen)
        for v in scenes
    )  # fmt: skip
    return [
        [
            "--page-size",
            str(args.page_size),
            "--hicache-ratio",
            str(ratio),
            "--max-running-requests",
            str(args.max_running_requests),
            "--context-length",
            str(context_len),
            "--enable-priority-scheduling",
            "--priority-scheduling-preemption-threshold",
            str(args.preemption_threshold),
            "--enable-metrics",
        ]  # fmt: skip
        for ratio in host_ratios(args, scenes, per_token)
    ]


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


def merge_files(files: list[Path]) -> None:
    for variant, seconds in rl_scene_stats.merge(files).items():
        rows = rl_scene_stats.pooled_rows(seconds)
        print(f"## target GPU {variant}")
        print(report.markdown(rows))
        print(json.dumps({"pooled": rl_scene_stats.ratios(rows),
                          "per_repeat": rl_scene_stats.repeat_ratios(seconds)}))  # fmt: skip


class Scenes:
    """Every (repeat, variant, mode) on the running servers; the file after each."""

    def __init__(self, args: argparse.Namespace, config: dict, scenes: list[Scene], urls: list):
        self.args, self.config, self.scenes, self.urls = args, config, scenes, urls
        self.runs: list[report.Run] = []
        self.errors: dict[str, str] = {}
        suffix = f"_r{args.repeat_start}" if args.repeat_start else ""
        self.stem = f"bench_rl_scene_{args.context}{suffix}"

    def content(self) -> dict[str, Any]:
        scenes = {v.variant: asdict(v) for v in self.scenes}
        return report.result_file(self.config, scenes, self.runs, self.errors)

    def too_late(self, last_s: float) -> bool:
        if self.args.deadline_s is None:
            return False
        return time.monotonic() - self.args.t0 + last_s > self.args.deadline_s

    def run(self) -> None:
        last = 0.0
        for rep in range(self.args.repeat_start, self.args.repeat_start + self.args.repeats):
            for scene in self.scenes:
                scene_r = replace(scene, seed=self.args.seed + rep)
                work = make_workload(scene_r)
                for mode in self.args.modes:
                    if self.too_late(last):
                        print(f"deadline: stopping before {scene.variant} {rep} {mode}", flush=True)
                        return
                    t = time.monotonic()
                    self.one_mode(rep, scene_r, work, mode)
                    last = time.monotonic() - t

    def one_mode(self, rep: int, scene: Scene, work: Workload, mode: str) -> None:
        for url in self.urls:
            flush_cache(url)
        print(f"== {scene.variant} repeat {rep}: {mode}", flush=True)
        run = run_mode(mode, scene, work, self.urls, policy_for(mode, self.args))
        try:
            result = asyncio.run(asyncio.wait_for(run, self.args.mode_timeout))
        except TimeoutError:  # report it and go on: the other modes still count
            self.errors[f"{scene.variant}:{rep}:{mode}"] = (
                f"did not finish in {self.args.mode_timeout} s"
            )
            return
        self.runs.append(report.Run(scene.variant, rep, result))
        content = self.content()
        report.write(OUT_DIR / f"{self.stem}.json", content)
        rows = content["variants"][scene.variant]["repeat_rows"]
        print(json.dumps(rows[-1]) if rows else "{}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge_files(args.merge)
        return
    if args.scene == "early":
        import bench_rollout_rebalance

        sys.argv = [sys.argv[0], *args.rest]
        bench_rollout_rebalance.main()
        return
    card = gpu_servers.require_gpu("bench_rl_scene")
    shape, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    scenes = [scene_from(args, shape["vocab_size"], v) for v in args.target_gpu]
    os.environ.setdefault("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "1")  # prefill seconds
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}"))
    graphs = not args.no_cuda_graph
    flags_a, flags_b = server_flags(args, scenes, gpu_servers.kv_bytes_per_token(shape))
    specs = {
        "A": ServerSpec(30700, flags_a, cuda_graph=graphs),
        "B": ServerSpec(30800, flags_b, cuda_graph=graphs),
    }
    config = {k: v for k, v in vars(args).items() if k not in ("rest", "merge", "t0")}
    config |= {"shape": name, "server_flags": {"A": flags_a, "B": flags_b},
               **gpu_servers.run_info(card)}  # fmt: skip
    servers = gpu_servers.sized_servers(
        model_dir, specs, shape, args.max_total_tokens, args.mem_fraction_static
    )
    with servers as started:
        config["startup_s"] = {s.name: s.startup_s for s in started}
        urls = [s.url for s in started]
        rng = random.Random(1)
        for url in urls:  # compile kernels before anything is timed
            generate(url, tokens(rng, 1024, shape["vocab_size"]), 4)
        run = Scenes(args, config, scenes, urls)
        run.run()
    content = run.content()
    report.write(OUT_DIR / f"{run.stem}.json", content)
    title = f"RL scene, {name}, {args.context}-token histories: none / re-prefill / migrate"
    report.print_final(content, OUT_DIR, run.stem, title)


if __name__ == "__main__":
    main()
