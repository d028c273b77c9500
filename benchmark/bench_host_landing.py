"""A same-host move into a target whose GPU pool is full (it lands in the target's host
tier: path `shared_host`) beside the device-path move of the same length into a target
with room, and beside re-prefill (GPU machine only).

Two real SGLang servers on one GPU, Llama-3-8B shape (dummy weights), page 16, CUDA
graphs ON.
1. Placement (`test/gpu/tier_placement.py`), once, and again only when a check before a
   repeat finds a prompt moved: the source, flushed, holds one N-token prompt per length
   (`--lengths`, default 8K and 32K) only in its host tier, whole (flooded out of its GPU
   by one prompt more than fills its GPU pool, then asked where they are: asking between
   flood prompts keeps them on the GPU, and a flood past the host pool's room loses
   them from both tiers), and another on its GPU, served after the flood. What each attempt
   left where is recorded (`placements`); a prompt that could not be placed is left out
   of the rows (`unplaced`), never fatal.
2. Per repeat (`--repeats`, default 3) and length, one row, per source tier:
   a. device: the target flushed, its GPU pool with room; `migrate(path="device")`;
   b. landing: the target flushed, its GPU pool held full by its own requests
      (`test/gpu/full_pool.py`: `--decodes` requests of `--decode-prompt` tokens, paused
      in place: about 6K of 49K tokens free, nothing evictable; the free count is
      recorded); `migrate()` with the auto path, which the device path refuses at
      allocate ("device KV pool is full") and which must land on `shared_host`, in the
      target's host tier (`landing_tier` "host"); then the requests end;
   after each, the target serves the prompt: its TTFT and `cached_tokens_details`
   (`host` counts what HiCache loaded back), and the size query of the source before
   the move (where it held the prefix);
   then re-prefill: the target, flushed, serves a fresh N-token prompt (TTFT, one token).
Summary per length and tier (`host_landing_report.py`): medians with min-max over the
repeats of each move's client wall time and of re-prefill, landing / device-path
(target <= 3x) and landing / re-prefill (target <= 10%).

Settings changed from SGLang's defaults, and why:
- `--max-total-tokens`: the source 81920 (a 32K and an 8K prefix on its GPU, the same in
  its host tier), the target 49152 (the issue's scene: room for a 32K device-path move,
  and four requests fill it);
- `--cuda-graph-max-bs 8`, `--max-running-requests 16`: the target runs four requests,
  the moved prompts one at a time; capturing larger batches only costs start-up time;
- `--hicache-ratio 2`: both host pools, pinned, fit the machine's memory, and the
  source's keeps the host-tier prompts beside a flood (`tier_placement.host_room`,
  recorded).

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_host_landing.py
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_host_landing.py --quick   # 8K, one repeat

Writes `$KVMIG_GPU_OUT/bench_host_landing.json`, rewritten after every row (`complete`
false until the last: a run cut at its limit keeps its rows); no row starts after
`--deadline-s`, nor one that would not end by `--end-at` (a wall-clock time, at the
pace of the longest row so far). On a machine without a GPU it exits with status 2 and
one line.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpu_servers
import host_landing_report as report
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
import tier_placement  # noqa: E402
from full_pool import FullPool  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    flush_cache,
    generate,
    kv_pool_usage,
    running_servers,
    timed_generate,
    write_model,
)

RESULT = OUT_DIR / "bench_host_landing.json"
HICACHE_RATIO = 2
FLOOD_TOKENS = 16384  # one flood prompt: two prefill chunks
SETTLE_S = 0.5
WARM_UP_ATTEMPTS = 3
# What the first row is expected to take (`--end-at`) before one was timed: the
# placement's flood and prompts, a 32K row's moves and its re-prefill.
FIRST_ROW_S = 40.0

Prompts = dict[tuple[int, str], list[int]]  # (length, source tier) -> ids


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    card = gpu_servers.require_gpu("bench_host_landing")
    lengths = [8192] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    shape = dict(LLAMA3_8B, max_position_embeddings=40960)
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    common = [
        *("--page-size", str(args.page_size), "--mem-fraction-static", str(args.mem_fraction)),
        *("--context-length", "40960", "--hicache-ratio", str(HICACHE_RATIO)),
        *("--max-running-requests", "16", "--cuda-graph-max-bs", "8", "--enable-metrics"),
    ]
    source_flags = [*common, "--max-total-tokens", str(args.source_pool)]
    target_flags = [*common, "--max-total-tokens", str(args.target_pool)]
    specs = [ServerSpec(30950, source_flags, 0, True), ServerSpec(30960, target_flags, 0, True)]
    config = {**vars(args), "lengths": lengths, "repeats": repeats, "model": shape,
              "source_flags": source_flags, "target_flags": target_flags,
              "cuda_graphs": True, **gpu_servers.run_info(card)}  # fmt: skip
    run = Run(args, {"config": config, "rows": [], "placements": [], "complete": False})
    with (
        running_servers(model_dir, specs, sequential=True) as (source, target),
        MigrationClient(timeout=600) as client,
    ):
        config["startup_s"] = run.elapsed()
        rng = random.Random(0)
        _warm_up(client, source, target, rng)
        run.rows(client, source, target, lengths, repeats, rng)
    run.save(complete="stopped_at_deadline" not in run.result)
    print(report.markdown(run.result["summary"]), flush=True)


class Run:
    """The rows in order, the record rewritten after each (see the module docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        result: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.args = args
        self.result = result
        self.clock = clock
        self.started = clock()
        self.longest_row_s = 0.0  # of the rows timed so far
        self.wall_clock = wall_clock

    def row_fits(self) -> bool:
        """A row may start: before `--deadline-s`, and expected to end by `--end-at`."""
        if self.elapsed() > self.args.deadline_s:
            return False
        end_at = self.args.end_at
        expected = self.longest_row_s or FIRST_ROW_S
        return end_at is None or self.wall_clock() + expected <= end_at

    def elapsed(self) -> float:
        return self.clock() - self.started

    def save(self, complete: bool = False) -> None:
        self.result["summary"] = report.summarize(self.result["rows"])
        self.result["wall_s"] = self.elapsed()
        self.result["complete"] = complete
        report.write_result(RESULT, self.result)

    def rows(
        self,
        client: MigrationClient,
        source: str,
        target: str,
        lengths: list[int],
        repeats: int,
        rng: random.Random,
    ) -> None:
        prompts: Prompts | None = None
        placed: dict[str, bool] = {}
        size = self.args.page_size
        for rep in range(repeats):
            for n in lengths:
                if not self.row_fits():
                    self.result["stopped_at_deadline"] = {"repeat": rep, "tokens": n}
                    return
                began = self.clock()
                # Placed once; again only when a check before a repeat finds a prompt
                # away from where its rows need it.
                first = n == lengths[0]
                if prompts is None or (first and not _still_placed(client, source, prompts, size)):
                    prompts, record = _place_prefixes(client, source, lengths, rng, size)
                    placed = record["placed"]
                    self.result["placements"].append({"repeat": rep, **record})
                    self.save()
                row = _row(self.args, client, source, target, prompts, placed, n, rep, rng)
                self.longest_row_s = max(self.longest_row_s, self.clock() - began)
                self.result["rows"].append(row)
                self.save()
                print(f"rep {rep} {n} ({self.elapsed():.0f} s): {_line(row)}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--deadline-s", type=float, default=420.0, help="no row starts after")
    p.add_argument(
        "--end-at", type=float, default=None,
        help="a Unix time: no row starts that would not end by then (at the pace of the "
        "longest row so far; placement included)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="8K, one repeat")
    return p.parse_args(argv)


def _row(
    args: argparse.Namespace,
    client: MigrationClient,
    source: str,
    target: str,
    prompts: Prompts,
    placed: dict[str, bool],
    n: int,
    rep: int,
    rng: random.Random,
) -> dict[str, Any]:
    """One length's moves from each source tier where its prompt was placed, then
    re-prefill."""
    row: dict[str, Any] = {"tokens": n, "repeat": rep, "device": {}, "landing": {}}
    for tier in report.TIERS:
        prompt = prompts[(n, tier)]
        if not placed.get(_name(n, tier)):
            row.setdefault("unplaced", {})[tier] = _held(client, source, prompt)
            continue
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
    return row


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
    held = _held(client, source, prompt)
    whole = tier_placement.whole_tokens(prompt, page_size)
    pool: dict[str, Any] = {}
    try:
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
            # The ended requests' KV is written through to the host pool: until that is
            # done HiCache cannot evict it to load the landed prefix back.
            time.sleep(SETTLE_S)
    except MigrationFailed as e:  # a result of the path under test: kept, not fatal
        row = report.failed_move(str(e), held, whole)
    else:
        served, ttft = timed_generate(target, prompt, 1)
        row = report.move_row(result, wall, served, ttft, held, whole)
    if pool:
        row["target_pool_while_full"] = pool
    return row


def _place_prefixes(
    client: MigrationClient, source: str, lengths: list[int], rng: random.Random, page_size: int
) -> tuple[Prompts, dict[str, Any]]:
    """The source flushed, then its host-tier prompts placed (`tier_placement`), then its
    GPU-tier prompts served; the record says where each was left and whether it is
    where its rows need it (`placed`)."""
    flush_cache(source)
    device_tokens = kv_pool_usage(source)["max_total_num_tokens"]
    on_host = {_name(n, "host"): _tokens(rng, n) for n in lengths}
    kept = sum(tier_placement.whole_tokens(p, page_size) for p in on_host.values())
    started = time.monotonic()
    placement = tier_placement.place_in_host_tier(
        on_host,
        serve=lambda ids: generate(source, ids, 1),
        held=lambda ids: _held(client, source, ids),
        fresh=lambda k: _tokens(rng, k),
        device_tokens=device_tokens,
        page_size=page_size,
        flood_prompt_tokens=FLOOD_TOKENS,
    )
    on_gpu = {_name(n, "gpu"): _tokens(rng, n) for n in lengths}
    for prompt in on_gpu.values():
        generate(source, prompt, 1)
    time.sleep(SETTLE_S)
    named = {**on_host, **on_gpu}
    placed, held_after = _where(client, source, named, page_size)
    record = {
        "device_tokens": device_tokens,
        "host_room_tokens": tier_placement.host_room(
            HICACHE_RATIO * device_tokens, device_tokens, kept, FLOOD_TOKENS
        ),
        **placement.to_dict(),
        "held_after": held_after,
        "placed": placed,
        "seconds": time.monotonic() - started,
    }
    print(f"placed {placed} in {record['seconds']:.1f} s "
          f"({len(placement.attempts)} flood(s))", flush=True)  # fmt: skip
    prompts = {(n, tier): named[_name(n, tier)] for n in lengths for tier in report.TIERS}
    return prompts, record


def _where(
    client: MigrationClient, source: str, named: dict[str, list[int]], page_size: int
) -> tuple[dict[str, bool], dict[str, Any]]:
    """Whether each prompt is where its name says (`N/host`: only in the host tier,
    whole; `N/gpu`: whole on the GPU), and the size query's answer for each."""
    held = {name: _held(client, source, p) for name, p in named.items()}
    placed = {}
    for name, prompt in named.items():
        whole = tier_placement.whole_tokens(prompt, page_size)
        if name.endswith("/host"):
            placed[name] = tier_placement.in_host_tier_only(held[name], whole)
        else:
            placed[name] = tier_placement.on_gpu_whole(held[name], whole)
    return placed, {n: {k: h[k] for k in ("matched_token_size", "device_token_size")}
                    for n, h in held.items()}  # fmt: skip


def _still_placed(client: MigrationClient, source: str, prompts: Prompts, page_size: int) -> bool:
    """Every prompt is where its name says (the source serves nothing between repeats,
    so it should be; one left unplaced is placed anew)."""
    named = {_name(n, tier): p for (n, tier), p in prompts.items()}
    placed, _ = _where(client, source, named, page_size)
    return all(placed.values())


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


def _name(n: int, tier: str) -> str:
    return f"{n}/{tier}"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128000) for _ in range(n)]


def _line(row: dict[str, Any]) -> str:
    parts = []
    for tier in report.TIERS:
        if tier in row.get("unplaced", {}):
            parts.append(f"{tier}: not placed")
            continue
        landing, device = row["landing"][tier], row["device"][tier]
        if "failed" in landing or "failed" in device:
            parts.append(f"{tier}: failed: {landing.get('failed') or device.get('failed')}")
            continue
        parts.append(
            f"{tier}: landing {landing['client_wall_ms']:.1f} ms ({landing['path']}, "
            f"host hit {landing['served_cached_details'].get('host', 0)}), device "
            f"{device['client_wall_ms']:.1f} ms"
        )
    return "; ".join(parts) + f"; re-prefill {row['reprefill_ms']:.1f} ms"


if __name__ == "__main__":
    main()
