"""Same host, any tier: device path from the source's GPU, its host tier, or both, vs the
host path and re-prefill; then six concurrent 8K device-path migrations to one target.

Llama-3-8B shape, dummy weights, two real SGLang servers on one GPU. Per prefix length N
(default 4K/16K/32K) and source tier (`--tiers gpu host mixed`), on flushed caches:
1. re-prefill: the target serves a fresh N-token prompt (max_new_tokens=1: its TTFT);
2. the source prefills prompts A and B; for `host` other prompts are pushed through the
   source until the size query of A and B says `device_token_size` 0 (still held: on
   its host tier only); for `mixed` a request sharing the first half of each loads that
   half back to the source's GPU;
3. A moves with the auto path (it must pick the device path), B with `path="host"`
   (Mooncake TCP on one host); each time every phase of `result.timings`, bytes,
   GB/s = bytes / copy_seconds, the source's per-tier copy times (`copy_device`,
   `copy_host` in `transfer_steps_ms`), then the target serves the prompt (TTFT and
   `cached_tokens_details`).
Last, concurrency: 7 prompts of 8K on the source's GPU; one migrates alone, then six at
once (threads, one client), wall time of each and of all; then the same six again, the
target flushed, in one `migrate_many` (their transfers in one call, "transfer_batch").

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --page-size 1
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --page-size 16
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --quick   # 4K only, smoke run
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --target-gpu 1  # nvidia-h200-x2
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --tp-size 2     # nvidia-h200-x2
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_any_tier.py --pp-size 2     # nvidia-h200-x2

`--target-gpu N` puts the target on GPU N (`--base-gpu-id N`; both servers then start at
once, each on its own GPU); `--tp-size` / `--pp-size` > 1 put both servers on GPUs
0..size-1 (rank or stage r of the source copies into rank or stage r of the target).

Writes `$KVMIG_GPU_OUT/bench_any_tier_page<P>.json` (`..._page<P>_gpu1.json`, `_tp2`,
`_pp2` for the other layouts; `config` and every row name the GPUs) and prints one line
per row. Budget on an H200 for one page size: start-ups ~2.5 min (one GPU, one after the
other) + rounds ~1.5 min (page 16, 2026-12-01: 250 s in all).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.client.migration import MigrationClient

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "test" / "gpu"))
sys.path.insert(0, str(_HERE))
from device_moves import (  # noqa: E402
    SETTLE_S,
    concurrency_round,
    migrate_and_serve,
    random_tokens,
)
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    cached_tokens,
    flush_cache,
    generate,
    running_servers,
    timed_generate,
    write_model,
)

DEFAULT_LENGTHS = [4096, 16384, 32768]
FLOOD_TOKENS = 16384  # one pushing prompt
MAX_FLOOD_PROMPTS = 8  # rounds of 4 more after the first 1.1 pools
PUSH_SETTLE_S = 2.0  # idle time on the source after pushing prompts to its host tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--tiers", nargs="+", default=["gpu", "host", "mixed"])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=0.4)
    parser.add_argument("--max-total-tokens", type=int, default=106496)
    parser.add_argument("--context-length", type=int, default=40960)
    parser.add_argument("--concurrent", type=int, default=6)
    parser.add_argument("--concurrent-tokens", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="4K only")
    parser.add_argument("--target-gpu", type=int, default=0, help="1 on nvidia-h200-x2")
    parser.add_argument("--tp-size", type=int, default=1, help="2 on nvidia-h200-x2")
    parser.add_argument("--pp-size", type=int, default=1, help="2 on nvidia-h200-x2")
    parser.add_argument(
        "--only-concurrency", action="store_true", help="skip the tier rounds (issue 21)"
    )
    parser.add_argument(
        "--concurrency-rounds", type=int, default=1, help="measure the concurrency N times"
    )
    parser.add_argument(
        "--two-trips",
        action="store_true",
        help="every concurrency round also through a client that allocates itself (it does "
        "not see feature source_allocate), right after the default one-call client's",
    )
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="then POST /freeze_gc to both servers and measure the concurrency again",
    )
    args = parser.parse_args()
    lengths = [] if args.only_concurrency else [4096] if args.quick else args.lengths
    if args.tp_size * args.pp_size > 1 and args.target_gpu != 0:
        parser.error(
            "--tp-size/--pp-size > 1 put both servers on GPUs 0..size-1: drop --target-gpu"
        )

    shape = dict(LLAMA3_8B, max_position_embeddings=max(args.context_length, 40960))
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    extra = ["--page-size", str(args.page_size)]
    extra += ["--mem-fraction-static", str(args.mem_fraction_static)]
    extra += ["--max-total-tokens", str(args.max_total_tokens)]
    extra += ["--context-length", str(args.context_length)]
    extra += ["--tp-size", str(args.tp_size), "--pp-size", str(args.pp_size)]
    if args.pp_size > 1:
        extra.append("--disable-overlap-schedule")  # SGLang forces it for PP anyway
    specs = [ServerSpec(30710, extra, gpu_id=0), ServerSpec(30720, extra, args.target_gpu)]
    config = {"shape": shape, "page_size": args.page_size, "lengths": lengths,
              "tiers": args.tiers, "server_flags": extra, "source_gpu": 0,
              "target_gpu": args.target_gpu, "tp_size": args.tp_size,
              "pp_size": args.pp_size}  # fmt: skip
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with (
        running_servers(model_dir, specs, sequential=args.target_gpu == 0) as (source, target),
        MigrationClient(timeout=600) as client,
        MigrationClient(timeout=600) as two_trips,
    ):
        config["startup_s"] = time.monotonic() - started
        config["two_trip_rounds"] = args.two_trips
        for url in (source, target):  # the cached session info the second client plans from
            info = two_trips.session_info(url)
            info.features = [f for f in info.features if f != "source_allocate"]
        rng = random.Random(0)
        _warm_up(client, source, target, rng)
        for n in lengths:
            for tier in args.tiers:
                row = _round(
                    client, source, target, n, tier, args.page_size, rng, args.max_total_tokens
                )
                row["where"] = _where(config)
                rows.append(row)
                print(json.dumps(row), flush=True)
        concurrency = concurrency_round(
            client, source, target, args.concurrent, args.concurrent_tokens, rng
        )
        print(json.dumps({"concurrency": concurrency}), flush=True)
        # Later rounds on the same servers: is a first round's stall a warm-up?
        concurrency["later_rounds"] = []
        concurrency["two_trip_rounds"] = []
        for i in range(args.concurrency_rounds):
            if args.two_trips:  # side by side: each default round, then a two-trip one
                two = concurrency_round(
                    two_trips, source, target, args.concurrent, args.concurrent_tokens, rng
                )
                print(json.dumps({"concurrency_two_trips": two}), flush=True)
                concurrency["two_trip_rounds"].append(two)
            if i == args.concurrency_rounds - 1:
                break
            again = concurrency_round(
                client, source, target, args.concurrent, args.concurrent_tokens, rng
            )
            print(json.dumps({"concurrency_again": again}), flush=True)
            concurrency["later_rounds"].append(again)
        if args.freeze_gc:
            # SGLang's own advice after warm-up: objects alive now leave the collector's
            # generations, so a full collection no longer walks them (a pause of the
            # scheduler's or tokenizer manager's loop while six moves wait on it).
            for url in (source, target):
                httpx.post(url + "/freeze_gc", timeout=60).raise_for_status()
            frozen = concurrency_round(
                client, source, target, args.concurrent, args.concurrent_tokens, rng
            )
            print(json.dumps({"concurrency_after_freeze_gc": frozen}), flush=True)
            concurrency["after_freeze_gc"] = frozen
    result = {"config": config, "rows": rows, "concurrency": concurrency,
              "wall_s": time.monotonic() - started}  # fmt: skip
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"bench_any_tier_page{args.page_size}{_suffix(args)}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}; wall time {result['wall_s']:.0f} s", flush=True)


def _where(config: dict[str, Any]) -> str:
    """Which GPUs the row ran on, for the printed rows and the JSON."""
    if config["tp_size"] * config["pp_size"] > 1:
        last = config["tp_size"] * config["pp_size"] - 1
        return f"tp{config['tp_size']} pp{config['pp_size']} on GPUs 0..{last}"
    return f"GPU 0 -> GPU {config['target_gpu']}"


def _suffix(args: argparse.Namespace) -> str:
    """`_gpu1`, `_tp2`, `_pp2`: runs of other layouts do not overwrite each other."""
    parts = [f"_gpu{args.target_gpu}"] if args.target_gpu else []
    parts += [f"_tp{args.tp_size}"] if args.tp_size > 1 else []
    parts += [f"_pp{args.pp_size}"] if args.pp_size > 1 else []
    return "".join(parts)


def _warm_up(client: MigrationClient, source: str, target: str, rng: random.Random) -> None:
    """Compile both servers' kernels, open the device and host paths once."""
    for url in (source, target):
        p = random_tokens(rng, 2048)
        generate(url, p, 1)
        generate(url, p, 1)
    for path in ("device", "host"):
        p = random_tokens(rng, 1024)
        generate(source, p, 1)
        client.migrate(source, target, p[:-1], path=path)
        generate(target, p, 1)  # the first extend over a cached prefix compiles kernels
    for url in (source, target):
        flush_cache(url)


def _held(client: MigrationClient, url: str, prompt: list[int]) -> dict[str, Any]:
    return client.call(url, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})


def _push_to_host(
    client: MigrationClient,
    source: str,
    prompts: list[list[int]],
    rng: random.Random,
    pool_tokens: int,
) -> int:
    """Push other prompts through the source until none of `prompts` is on its GPU.

    IMPORTANT: the size query is a radix match, and a match refreshes the nodes' LRU
    time: query only after ~1.1 pools of flood, or the prompts never age out. Less than
    the host tier's 2 pools, so the host copies (write-through) stay."""
    pushed = 0
    while pushed < 1.1 * pool_tokens:
        generate(source, random_tokens(rng, FLOOD_TOKENS), 1)
        pushed += FLOOD_TOKENS
    for _ in range(MAX_FLOOD_PROMPTS):
        if all(_held(client, source, p)["device_token_size"] == 0 for p in prompts):
            return pushed
        for _ in range(4):
            generate(source, random_tokens(rng, FLOOD_TOKENS), 1)
            pushed += FLOOD_TOKENS
    raise RuntimeError(f"prompts still on the source's GPU after {pushed} pushed tokens")


def _round(
    client: MigrationClient,
    source: str,
    target: str,
    n: int,
    tier: str,
    page_size: int,
    rng: random.Random,
    pool_tokens: int,
) -> dict[str, Any]:
    for url in (source, target):
        flush_cache(url)
    row: dict[str, Any] = {"tokens": n, "tier": tier}
    baseline, prefill_s = timed_generate(target, random_tokens(rng, n), 1)
    assert cached_tokens(baseline) == 0, baseline["meta_info"]
    row["reprefill_ttft_ms"] = prefill_s * 1e3
    a, b = random_tokens(rng, n), random_tokens(rng, n)
    for p in (a, b):
        generate(source, p, 1)
    if tier in ("host", "mixed"):
        row["pushed_tokens"] = _push_to_host(client, source, [a, b], rng, pool_tokens)
    if tier == "mixed":
        half = n // 2
        for p in (a, b):
            generate(source, p[:half] + random_tokens(rng, 16), 1)  # loads the half back
    # After a push (~130K tokens written through to host, halves loaded back) the source
    # copies on the GPU both servers share for a while: the 4K mixed round of the first
    # run saw the target's TTFT double for both prompts (220 ms against ~100).
    time.sleep(SETTLE_S if tier == "gpu" else PUSH_SETTLE_S)
    # How fast the target answers a tiny prompt right now (contention shows here first).
    row["target_probe_ttft_ms"] = timed_generate(target, random_tokens(rng, 16), 1)[1] * 1e3
    row["size_query_a"] = _held(client, source, a)
    row["size_query_b"] = _held(client, source, b)
    expected = (n - 1) // page_size * page_size
    for key in ("size_query_a", "size_query_b"):
        if row[key]["matched_token_size"] < expected:
            raise RuntimeError(f"{key}: the source lost part of the prefix: {row[key]}")
    row["device"] = migrate_and_serve(client, source, target, a, "device", auto=True)
    row["host"] = migrate_and_serve(client, source, target, b, "host")
    for path in ("device", "host"):
        total = row[path]["timings_ms"].get("total")
        row[path]["total_over_reprefill"] = total / row["reprefill_ttft_ms"]
        row[path]["total_plus_ttft_over_reprefill"] = (total + row[path]["ttft_ms"]) / row[
            "reprefill_ttft_ms"
        ]
    return row


if __name__ == "__main__":
    main()
