"""What the device-path benchmarks share: random prompts, one migration followed by the
target serving the prompt, and a concurrency round (one move alone, `k` at once from `k`
threads, the same `k` in one `migrate_many`). `bench_device_path.py` and
`bench_any_tier.py` both import it; neither imports the other."""

from __future__ import annotations

import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_kv_migration.client import MigrationResult, Move
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    cached_details,
    cached_tokens,
    flush_cache,
    generate,
    timed_generate,
)

SETTLE_S = 0.5  # idle time on the source between its prefills and the migrations


def migrate_and_serve(
    client: MigrationClient,
    source: str,
    target: str,
    prompt: list[int],
    path: str,
    auto: bool = False,
) -> dict[str, Any]:
    """`auto`: let the client choose (it must choose `path`)."""
    t0 = time.perf_counter()
    r = client.migrate(source, target, prompt[:-1], path=None if auto else path)
    wall_s = time.perf_counter() - t0
    served, ttft_s = timed_generate(target, prompt, 1)
    if r.path != path:
        raise AssertionError(f"asked for the {path} path, got {r.path!r}: {r.fallback_reason}")
    copy_s = r.copy_seconds
    transfer_s = r.timings.get("transfer", 0.0)
    return {
        "path": r.path,
        "migrated_tokens": r.migrated_token_size,
        "bytes": r.migrated_bytes,
        "timings_ms": timings_ms(r.timings),
        "client_wall_ms": wall_s * 1e3,
        "copy_ms": copy_s * 1e3,
        "copy_gb_s": r.migrated_bytes / copy_s / 1e9 if copy_s > 0 else None,
        "transfer_gb_s": r.migrated_bytes / transfer_s / 1e9 if transfer_s > 0 else None,
        "ttft_ms": ttft_s * 1e3,
        "cached_tokens": cached_tokens(served),
        "cached_details": cached_details(served),
        "transfer_steps_ms": r.transfer_steps_ms,
        "steps_ms": r.steps_ms,  # per trip: where its time went (server/diag/trace.py)
    }


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128000) for _ in range(n)]


def timings_ms(timings: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in timings.items()}


def concurrency_round(
    client: MigrationClient, source: str, target: str, k: int, n: int, rng: random.Random
) -> dict[str, Any]:
    """One move alone, then `k` at once from `k` threads. `ratio`: the wall time of the
    `k` from the moment all of them are ready to start (each thread has made one call to
    both servers first, so it holds kept-alive connections as the one alone did) to the
    last one's end, over the one's. `ratio_with_thread_start`: from before the threads
    were made, their start, first connections and those calls inside (the measure of
    earlier runs had the first two, not the calls)."""
    for url in (source, target):
        flush_cache(url)
    prompts = [random_tokens(rng, n) for _ in range(k + 1)]
    for p in prompts:
        generate(source, p, 1)
    time.sleep(SETTLE_S)
    ready = threading.Barrier(k)

    def move(p: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = client.migrate(source, target, p[:-1])
        end = time.perf_counter()
        return {"path": r.path, "wall_ms": (end - t0) * 1e3, "started": t0, "ended": end,
                "copy_ms": r.copy_seconds * 1e3, "timings_ms": timings_ms(r.timings),
                "fallback_reason": r.fallback_reason, "steps_ms": r.steps_ms}  # fmt: skip

    def warm_then_move(p: list[int]) -> dict[str, Any]:
        for url in (source, target):  # this thread's own kept-alive connections
            client.call(url, "/get_transfer_session_info", {})
        ready.wait(timeout=60)
        return move(p)

    one = move(prompts[0])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        many = list(pool.map(warm_then_move, prompts[1:]))
    all_ms = (time.perf_counter() - t0) * 1e3
    wall_ms = (max(m["ended"] for m in many) - min(m["started"] for m in many)) * 1e3
    batch = batched_round(client, source, target, prompts[1:])
    print(f"concurrency: one {one['wall_ms']:.1f} ms; {k} threads {wall_ms:.1f} ms "
          f"({wall_ms / one['wall_ms']:.2f}x); {k} in one migrate_many {batch['wall_ms']:.1f} "
          f"ms ({batch['wall_ms'] / one['wall_ms']:.2f}x)", flush=True)  # fmt: skip
    return {"tokens": n, "one": one, "concurrent": many, "concurrent_wall_ms": wall_ms,
            "ratio": wall_ms / one["wall_ms"], "with_thread_start_ms": all_ms,
            "ratio_with_thread_start": all_ms / one["wall_ms"], "batch": batch,
            "batch_ratio": batch["wall_ms"] / one["wall_ms"]}  # fmt: skip


def batched_round(
    client: MigrationClient, source: str, target: str, prompts: list[list[int]]
) -> dict[str, Any]:
    """The same prompts again, once the target forgot them, in one `migrate_many` (feature
    "transfer_batch": their transfers in one call), from this thread."""
    flush_cache(target)
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    results = client.migrate_many([Move(source, target, p[:-1]) for p in prompts])
    wall_ms = (time.perf_counter() - t0) * 1e3
    moves = []
    for p, r in zip(prompts, results, strict=True):
        if not isinstance(r, MigrationResult):
            moves.append({"failed": str(r)})
            continue
        moves.append({"path": r.path, "migrated": r.migrated_token_size, "of": len(p) - 1,
                      "copy_ms": r.copy_seconds * 1e3, "timings_ms": timings_ms(r.timings),
                      "fallback_reason": r.fallback_reason, "steps_ms": r.steps_ms,
                      "transfer_steps_ms": r.transfer_steps_ms})  # fmt: skip
    return {"wall_ms": wall_ms, "moves": moves}
