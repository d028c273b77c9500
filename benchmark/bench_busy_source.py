"""A move from a busy source vs the same move between idle servers (GPU machine only).

Two real SGLang servers on one GPU, Llama-3-8B shape (dummy weights), CUDA graphs ON
(decode replays captured graphs, as in production). Per repeat, side by side in one run:

1. idle: both servers idle; per prefix length N (default 1K / 8K / 32K) the source
   holds one N-token prefix on its GPU and another only in its host tier (pushed there
   by a flood of other prompts just before the two move; the size query's tiers are
   recorded per move, and a move of less than the whole prefix is left out of the
   summary and counted); each
   moves to the target with `path="device"` (the device path reads both tiers); beside
   them the target re-prefills a fresh N-token prompt (its TTFT, max_new_tokens=1);
2. busy: the same with the source decoding a full batch: `--busy` requests (>= 32) of
   mixed prompt and output lengths, each resubmitted as it ends (so the batch also takes
   new prefills, as a rollout worker does), running before and during every move;
3. decode throughput of the busy batch: `--window-s` seconds alone, then the same with a
   stream of 8K moves from it (the target's cache is flushed after each, so each moves
   the whole prefix), from SGLang's `sglang:realtime_tokens_total{mode="decode"}`.

With `--only-concurrency`: six concurrent 8K moves against one, from six threads and in
one call, `--concurrency-rounds` rounds each with the source idle and with the source
decoding a full batch, with the loop iterations each move took on each side
(`busy_concurrency.py`; `bench_busy_source_concurrency.json`; targets <= 1.5x, and
<= 2x from the busy source).

Per move the file keeps what the replies already report: phases, per-trip `steps_ms`
(the scheduler trips, the loop iterations a transfer waited, the copy), `copy_ms`, the
wall time and the TTFT of the target serving the prompt afterwards. Medians with
min-max over the repeats, busy/idle ratios (target <= 2x) and decode kept (>= 95%)
come from `busy_source_report.py`. The result file is rewritten after every row (a run
cut at its limit keeps what it measured; `complete` false).

Both servers are started one after the other with the same planned GPU KV pool
(`gpu_servers.sized_servers`: what the card has free, shared evenly, at most
`--max-total-tokens`); the record names the card, the pool and each server's start. (One
`--mem-fraction-static` for both, as before, leaves the second server of an 80 GB card a
fifth of the first's pool: on an H100 the target held three 8K prefixes, 27,744 tokens.)

Settings changed from SGLang's defaults, and why:
- `--cuda-graph-max-bs 64`: the busy batch is at most `--busy` (40) + the moved
  prompts' requests; capturing larger batch sizes only costs start-up time and memory;
- `--max-running-requests 64`: room for the batch plus the prompts being served;
- `--decode-log-interval 10` and `--enable-metrics` on the source: the decode token
  counter the throughput is read from is updated every 10 steps instead of 40;
- `--hicache-ratio 1.5`: two servers' pinned host pools must fit the machine's memory.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_busy_source.py
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_busy_source.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import busy_concurrency
import busy_source_report as report
import gpu_servers
import httpx
from busy_batch import BusyBatch, held, tokens
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.rollout.cost_model import parse_prometheus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    flush_cache,
    generate,
    kv_pool_usage,
    timed_generate,
    write_model,
)

RESULT = OUT_DIR / "bench_busy_source.json"
FLOOD_TOKENS = 4096
SETTLE_S = 0.5
SAMPLE_S = 0.25  # /metrics sampling period in a throughput window


def main() -> None:
    args = _parse()
    card = gpu_servers.require_gpu("bench_busy_source")
    lengths = [1024, 4096] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    shape = dict(LLAMA3_8B, max_position_embeddings=max(args.context_length, 40960))
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    flags = [
        *("--page-size", str(args.page_size), "--context-length", "40960"),
        *("--hicache-ratio", str(args.hicache_ratio), "--max-running-requests", "64"),
        *("--cuda-graph-max-bs", "64", "--enable-metrics", "--decode-log-interval", "10"),
    ]
    graphs = not args.no_cuda_graph
    specs = {
        "source": ServerSpec(30910, flags, 0, graphs),
        "target": ServerSpec(30920, flags, 0, graphs),
    }
    pool = _pool(args, card, shape)

    @contextmanager
    def servers(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """Both servers with the planned pool; the record's config says where it ran."""
        config.update({"kv_tokens": pool, "server_flags": flags, **gpu_servers.run_info(card)})
        with gpu_servers.sized_servers(model_dir, specs, shape, pool, args.mem_fraction) as up:
            config["servers"] = [dataclasses.asdict(server) for server in up]
            yield up[0].url, up[1].url

    if args.only_concurrency:
        busy_concurrency.run(args, servers, _warm_up)
        return
    config = {**vars(args), "lengths": lengths, "repeats": repeats}
    result: dict[str, Any] = {"config": config, "rows": [], "windows": [], "complete": False}
    started = time.monotonic()

    def save(complete: bool = False) -> None:
        result["summary"] = report.summarize(result["rows"])
        result["decode"] = report.decode_kept(result["windows"])
        result["wall_s"] = time.monotonic() - started
        result["complete"] = complete
        report.write_result(RESULT, result)

    with servers(config) as (source, target), MigrationClient(timeout=600) as client:
        config["startup_s"] = time.monotonic() - started
        rng = random.Random(0)
        _warm_up(client, source, target, rng)
        for rep in range(repeats):
            _repeat(args, client, source, target, lengths, rep, rng, result, save)
    save(complete=True)
    print(report.markdown(result["summary"], result["decode"]), flush=True)


def _pool(args: argparse.Namespace, card: gpu_servers.Card, shape: dict[str, int]) -> int:
    """The GPU KV pool both servers get: the card's free memory shared by two, at most
    `--max-total-tokens`; exit (status 2, one line) when it cannot hold what the run
    moves at once (with --only-concurrency: the target takes one 8K prefix and six more)."""
    pool = gpu_servers.plan_kv_tokens(
        card.free_mib * gpu_servers.MIB, 2, gpu_servers.weight_bytes(shape),
        gpu_servers.kv_bytes_per_token(shape), cap=args.max_total_tokens,
    )  # fmt: skip
    needed = busy_concurrency.target_tokens() if args.only_concurrency else max(args.lengths)
    if pool < needed:
        sys.exit(f"bench_busy_source: {card.name} gives each server a {pool}-token KV pool; "
                 f"the run needs {needed}")  # fmt: skip
    return pool


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(report.LENGTHS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=40, help="decodes the busy source runs (>= 32)")
    p.add_argument("--window-s", type=float, default=10.0, help="each throughput window")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--mem-fraction", type=float, default=None,
        help="one --mem-fraction-static for both servers (default: each server's own, "
        "computed from the memory free at its start)",
    )  # fmt: skip
    p.add_argument(
        "--max-total-tokens", type=int, default=163840,
        help="GPU KV pool per server, at most: the busy batch (~40 x 2K) plus the moved "
        "prefixes (less where the card has less free)",
    )  # fmt: skip
    p.add_argument("--hicache-ratio", type=float, default=1.5)
    p.add_argument("--context-length", type=int, default=40960)
    p.add_argument("--no-cuda-graph", action="store_true", help="servers without CUDA graphs")
    p.add_argument("--quick", action="store_true", help="1K and 4K, one repeat")
    p.add_argument("--only-concurrency", action="store_true", help="six 8K moves vs one")
    p.add_argument("--concurrency-rounds", type=int, default=3)
    p.add_argument(
        "--deadline-s", type=float, default=1e9,
        help="--only-concurrency: no round starts after this many seconds of the run",
    )  # fmt: skip
    return p.parse_args()


def _repeat(
    args: argparse.Namespace,
    client: MigrationClient,
    source: str,
    target: str,
    lengths: list[int],
    rep: int,
    rng: random.Random,
    result: dict[str, Any],
    save: Any,
) -> None:
    rows = {n: {"tokens": n, "repeat": rep} for n in lengths}
    for state in report.SOURCES:
        for url in (source, target):
            flush_cache(url)
        batch = BusyBatch(source, args.busy, rng.randrange(1 << 30)) if state == "busy" else None
        try:
            if batch is not None:
                batch.start(min_running=min(32, args.busy))
            prompts: dict[tuple[int, str], list[int]] = {}
            for n in lengths:
                # Placed just before they move: under a busy batch the host tier turns
                # over in seconds, and a prefix placed earlier is gone from it too.
                prompts.update(_place_prefixes(client, source, [n], rng, args.max_total_tokens))
                flush_cache(target)
                if state == "idle":
                    _, ttft = timed_generate(target, tokens(rng, n), 1)
                    rows[n]["reprefill_ms"] = ttft * 1e3
                rows[n][state] = {
                    tier: _move(client, source, target, prompts[(n, tier)], args.page_size)
                    for tier in report.TIERS
                }
                if batch is not None:
                    rows[n][state]["running_on_source"] = kv_pool_usage(source)["num_running_reqs"]
            if batch is not None:
                streamed = 8192 if 8192 in lengths else lengths[0]
                moved = [p for (n, _), p in prompts.items() if n == streamed]
                result["windows"].append(_windows(client, source, target, moved, args.window_s))
        finally:
            if batch is not None:
                batch.stop()
    result["rows"].extend(rows.values())
    save()


def _place_prefixes(
    client: MigrationClient, source: str, lengths: list[int], rng: random.Random, pool: int
) -> dict[tuple[int, str], list[int]]:
    """Host-tier prefixes first, pushed out of the source's GPU by a flood of other
    prompts (only until none is left there: a longer flood, or a busy batch meanwhile,
    pushes them out of the host tier too), then the GPU-tier ones."""
    prompts = {(n, "host"): tokens(rng, n) for n in lengths}
    for p in prompts.values():
        generate(source, p, 1)
    pushed = 0
    while any(held(client, source, p)["device_token_size"] for p in prompts.values()):
        generate(source, tokens(rng, FLOOD_TOKENS), 1)
        pushed += FLOOD_TOKENS
        if pushed > 4 * pool:
            raise RuntimeError("host-tier prefixes still on the source's GPU")
    for n in lengths:
        prompts[(n, "gpu")] = tokens(rng, n)
        generate(source, prompts[(n, "gpu")], 1)
    time.sleep(SETTLE_S)
    return prompts


def _move(
    client: MigrationClient, source: str, target: str, prompt: list[int], page_size: int
) -> dict:
    where = held(client, source, prompt)
    t0 = time.perf_counter()
    r = client.migrate(source, target, prompt[:-1], path="device")
    wall = time.perf_counter() - t0
    _, ttft = timed_generate(target, prompt, 1)
    whole_pages = (len(prompt) - 1) // page_size * page_size
    return report.move_row(r, wall, ttft, where, whole_pages)


def _windows(
    client: MigrationClient, source: str, target: str, prompts: list[list[int]], window_s: float
) -> dict[str, Any]:
    """The busy batch's decode rate alone, then during a stream of moves of `prompts`."""
    without = report.counter_rate(_sample_decode(source, window_s))
    stop = threading.Event()
    moves = [0]

    def stream() -> None:
        while not stop.is_set():
            for p in prompts:
                client.migrate(source, target, p[:-1], path="device")
                flush_cache(target)
                moves[0] += 1

    mover = threading.Thread(target=stream, daemon=True)
    mover.start()
    during = report.counter_rate(_sample_decode(source, window_s))
    stop.set()
    mover.join(timeout=120)
    return {"without_tok_s": without, "with_moves_tok_s": during, "moves": moves[0]}


def _sample_decode(url: str, seconds: float) -> list[tuple[float, float]]:
    samples = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < deadline:
            text = http.get(url + "/metrics").text
            value = sum(
                s.value
                for s in parse_prometheus(text)
                if s.name == "sglang:realtime_tokens_total" and s.labels.get("mode") == "decode"
            )
            samples.append((time.monotonic(), value))
            time.sleep(SAMPLE_S)
    return samples


def _warm_up(client: MigrationClient, source: str, target: str, rng: random.Random) -> None:
    """Compile kernels on both servers and open the device path once."""
    for url in (source, target):
        generate(url, tokens(rng, 2048), 4)
    p = tokens(rng, 1024)
    generate(source, p, 1)
    client.migrate(source, target, p[:-1], path="device")
    for url in (source, target):
        flush_cache(url)


if __name__ == "__main__":
    main()
