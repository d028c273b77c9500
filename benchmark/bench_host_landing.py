"""A same-host move into a target whose GPU pool is full (it lands in the target's host
tier: path `shared_host`) beside the device-path move of the same length into a target
with room, and beside re-prefill (GPU machine only).

Two real SGLang servers on one GPU, Llama-3-8B shape (dummy weights), page 16, CUDA
graphs ON. Per repeat (`--repeats`, default 3), caches flushed first:
1. the source holds one N-token prompt per length (`--lengths`, default 8K and 32K) only
   in its host tier (pushed there by a flood of other prompts; its size query is
   recorded with each move) and another on its GPU, prefilled after the flood;
2. per length and source tier:
   a. device: the target flushed, its GPU pool with room; `migrate(path="device")`;
   b. landing: the target flushed, its GPU pool held full by its own requests
      (`test/gpu/full_pool.py`: `--decodes` requests of `--decode-prompt` tokens, paused
      in place: about 6K of 49K tokens free, nothing evictable; the free count is
      recorded); `migrate()` with the auto path, which the device path refuses at
      allocate ("device KV pool is full") and which must land on `shared_host`, in the
      target's host tier (`landing_tier` "host"); then the requests end;
   after each, the target serves the prompt: its TTFT and `cached_tokens_details`
   (`host` counts what HiCache loaded back);
3. re-prefill: the target, flushed, serves a fresh N-token prompt (TTFT, one token).
Summary per length and tier (`host_landing_report.py`): medians with min-max over the
repeats of each move's client wall time and of re-prefill, landing / device-path
(target <= 3x) and landing / re-prefill (target <= 10%).

Settings changed from SGLang's defaults, and why:
- `--max-total-tokens`: the source 81920 (a 32K and an 8K prefix on its GPU, the same in
  its host tier), the target 49152 (the issue's scene: room for a 32K device-path move,
  and four requests fill it);
- `--cuda-graph-max-bs 8`, `--max-running-requests 16`: the target runs four requests,
  the moved prompts one at a time; capturing larger batches only costs start-up time;
- `--hicache-ratio 2`: both host pools, pinned, fit the machine's memory.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_host_landing.py
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_host_landing.py --quick   # 8K, one repeat

Writes `$KVMIG_GPU_OUT/bench_host_landing.json`, rewritten after every repeat (`complete`
false until the last); a repeat does not start after `--deadline-s`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import host_landing_report as report
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from full_pool import FullPool  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    flush_cache,
    generate,
    running_servers,
    timed_generate,
    write_model,
)

RESULT = OUT_DIR / "bench_host_landing.json"
FLOOD_TOKENS = 16384
SETTLE_S = 0.5
WARM_UP_ATTEMPTS = 3


def main() -> None:
    args = _parse()
    lengths = [8192] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    shape = dict(LLAMA3_8B, max_position_embeddings=40960)
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    common = [
        *("--page-size", str(args.page_size), "--mem-fraction-static", str(args.mem_fraction)),
        *("--context-length", "40960", "--hicache-ratio", "2", "--max-running-requests", "16"),
        *("--cuda-graph-max-bs", "8", "--enable-metrics"),
    ]
    source_flags = [*common, "--max-total-tokens", str(args.source_pool)]
    target_flags = [*common, "--max-total-tokens", str(args.target_pool)]
    specs = [ServerSpec(30950, source_flags, 0, True), ServerSpec(30960, target_flags, 0, True)]
    config = {**vars(args), "lengths": lengths, "repeats": repeats, "model": shape,
              "source_flags": source_flags, "target_flags": target_flags}  # fmt: skip
    result: dict[str, Any] = {"config": config, "rows": [], "complete": False}
    started = time.monotonic()

    def save(complete: bool = False) -> None:
        result["summary"] = report.summarize(result["rows"])
        result["wall_s"] = time.monotonic() - started
        result["complete"] = complete
        report.write_result(RESULT, result)

    with (
        running_servers(model_dir, specs, sequential=True) as (source, target),
        MigrationClient(timeout=600) as client,
    ):
        config["startup_s"] = time.monotonic() - started
        rng = random.Random(0)
        _warm_up(client, source, target, rng)
        for rep in range(repeats):
            if rep and time.monotonic() - started > args.deadline_s:
                result["stopped_at_deadline"] = rep
                break
            result["rows"].extend(_repeat(args, client, source, target, lengths, rep, rng))
            save()
    save(complete=result.get("stopped_at_deadline") is None)
    print(report.markdown(result["summary"]), flush=True)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(report.LENGTHS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--mem-fraction", type=float, default=0.4, help="per server (one GPU)")
    p.add_argument("--source-pool", type=int, default=81920, help="source GPU KV tokens")
    p.add_argument("--target-pool", type=int, default=49152, help="target GPU KV tokens")
    p.add_argument("--decodes", type=int, default=4, help="requests that fill the target")
    p.add_argument(
        "--decode-prompt", type=int, default=10688,
        help="their prompt tokens: 4 x 10688 leave ~6.4K of 49152 free, as in the issue",
    )  # fmt: skip
    p.add_argument(
        "--decode-new", type=int, default=1024,
        help="their max_new_tokens: admitted together (4 x (10688 + 0.7 x 1024) < 49152), "
        "and still decoding when the last is prefilled",
    )  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=420.0, help="no repeat starts after")
    p.add_argument("--quick", action="store_true", help="8K, one repeat")
    return p.parse_args()


def _repeat(
    args: argparse.Namespace,
    client: MigrationClient,
    source: str,
    target: str,
    lengths: list[int],
    rep: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    for url in (source, target):
        flush_cache(url)
    prompts = _place_prefixes(client, source, lengths, rng, args.source_pool)
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"tokens": n, "repeat": rep, "device": {}, "landing": {}}
        for tier in report.TIERS:
            prompt = prompts[(n, tier)]
            flush_cache(target)
            row["device"][tier] = _move(client, source, target, prompt, args.page_size, "device")
            flush_cache(target)
            full = FullPool(
                target,
                decodes=args.decodes,
                prompt_tokens=args.decode_prompt,
                max_new_tokens=args.decode_new,
                vocab_size=int(LLAMA3_8B["vocab_size"]),
                seed=rng.randrange(1 << 30),
            )
            row["landing"][tier] = _move(client, source, target, prompt, args.page_size, None, full)
        flush_cache(target)
        _, ttft = timed_generate(target, _tokens(rng, n), 1)
        row["reprefill_ms"] = ttft * 1e3
        print(f"rep {rep} {n}: {_line(row)}", flush=True)
        rows.append(row)
    return rows


def _move(
    client: MigrationClient,
    source: str,
    target: str,
    prompt: list[int],
    page_size: int,
    path: str | None,
    full: FullPool | None = None,
) -> dict[str, Any]:
    """One migration of `prompt` (less its last token) and the target serving it after;
    with `full`, the move runs while `full` holds the target's GPU pool full."""
    held = client.call(source, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})
    pool: dict[str, Any] = {}
    if full is None:
        t0 = time.perf_counter()
        result = client.migrate(source, target, prompt[:-1], path=path)
        wall = time.perf_counter() - t0
    else:
        with full:
            pool = {"free_tokens": full.free_tokens, "usage": full.usage,
                    "filled_in_s": full.paused_after_s}  # fmt: skip
            t0 = time.perf_counter()
            result = client.migrate(source, target, prompt[:-1], path=path)
            wall = time.perf_counter() - t0
    served, ttft = timed_generate(target, prompt, 1)
    whole_pages = (len(prompt) - 1) // page_size * page_size
    row = report.move_row(result, wall, served, ttft, held, whole_pages)
    if pool:
        row["target_pool_while_full"] = pool
    return row


def _place_prefixes(
    client: MigrationClient, source: str, lengths: list[int], rng: random.Random, pool: int
) -> dict[tuple[int, str], list[int]]:
    """Host-tier prefixes first, pushed out of the source's GPU by a flood of other
    prompts (only until none is left there), then the GPU-tier ones."""
    prompts = {(n, "host"): _tokens(rng, n) for n in lengths}
    for p in prompts.values():
        generate(source, p, 1)
    pushed = 0
    while any(_held(client, source, p)["device_token_size"] for p in prompts.values()):
        generate(source, _tokens(rng, FLOOD_TOKENS), 1)
        pushed += FLOOD_TOKENS
        if pushed > 4 * pool:
            raise RuntimeError("host-tier prefixes still on the source's GPU")
    for n in lengths:
        prompts[(n, "gpu")] = _tokens(rng, n)
        generate(source, prompts[(n, "gpu")], 1)
    time.sleep(SETTLE_S)
    return prompts


def _warm_up(client: MigrationClient, source: str, target: str, rng: random.Random) -> None:
    """Compile kernels on both servers, open the device path, and map (and register) the
    target's host pool in the source: each once, outside the measured moves."""
    for url in (source, target):
        generate(url, _tokens(rng, 2048), 4)
    for path in ("device", "shared_host"):
        p = _tokens(rng, 1024)
        generate(source, p, 1)
        for attempt in range(WARM_UP_ATTEMPTS):
            # Registering the target's host pool with CUDA takes seconds: a grant may
            # expire meanwhile; the mapping goes on and is kept for the next attempt.
            try:
                client.migrate(source, target, p[:-1], path=path)
                break
            except MigrationFailed as e:
                print(f"warm-up on {path}, attempt {attempt + 1}: {e}", flush=True)
        flush_cache(target)
    for url in (source, target):
        flush_cache(url)


def _held(client: MigrationClient, url: str, prompt: list[int]) -> dict[str, Any]:
    return client.call(url, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128000) for _ in range(n)]


def _line(row: dict[str, Any]) -> str:
    parts = []
    for tier in report.TIERS:
        landing, device = row["landing"][tier], row["device"][tier]
        parts.append(
            f"{tier}: landing {landing['client_wall_ms']:.1f} ms ({landing['path']}, "
            f"host hit {landing['served_cached_details'].get('host', 0)}), device "
            f"{device['client_wall_ms']:.1f} ms"
        )
    return "; ".join(parts) + f"; re-prefill {row['reprefill_ms']:.1f} ms"


if __name__ == "__main__":
    main()
