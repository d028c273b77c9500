"""Live move of a decoding request from its own slots: the stall (GPU only).

Two real SGLang servers on one GPU (Llama-3-8B shape, dummy weights, page 16, HiCache,
**CUDA graphs on**, device path between them; both list the "running_slots" feature).
Per row, a context length (`--contexts`, default 4K / 16K / 32K) × tokens generated on
the source before the move (`--gens`, default 1K / 8K): `--repeats` requests (3), each
with its own seeded prompt, decode greedily on the source; each is submitted once the
previous one has generated `--stagger` tokens, so they reach `generated` one after the
other and are moved one at a time with ``move_request(live=True)``: rounds copy the
pages of the request's own slots while it keeps decoding until at most one page
remains, then the stop, the tail, and the resume on the target, which generates
`--tail` more tokens.

Each repeat records the **stall** (`MoveReport.seconds["stall"]`: the source's last
streamed token to the target's first), the **abort latency** (`seconds["abort"]`),
the rounds (tokens each moved while decoding) and what moved after the stop. Per row
the **target's decode step** (a request the target holds cached, streamed: the median
time between tokens at that length) and the targets (`live_move_report.py`): median
stall ≤ 40 ms and ≤ median abort + 10 ms + one target decode step. Medians with their
range over the repeats.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_live_move.py              # ~7 min
    python3 benchmark/bench_live_move.py --quick                         # tiny model

Writes `$KVMIG_GPU_OUT/bench_live_move.json`, rewritten after every row (a run cut at
its time limit keeps the rows it finished; the shortest rows run first), and prints a
markdown table. `--deadline-s`: start no row after that many seconds from the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    MoveReport,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
import live_move_report as report  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    ServerSpec,
    flush_cache,
    running_servers,
    write_model,
)


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


# --------------------------------------------------------------------------- one row


async def _generated(handle: Any, n: int, deadline: float) -> None:
    while len(handle.generated_so_far()) < n and not handle.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} tokens not generated in time")
        await asyncio.sleep(0.002)


async def run_repeats(
    source: str, target: str, prompts: list[list[int]], generated: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The row's requests, staggered on the source, each moved live at `generated`."""
    total = generated + args.tail
    deadline = time.monotonic() + args.row_timeout
    async with AsyncRequestMigrator(live_max_rounds=args.max_rounds) as migrator:
        handles = []
        for prompt in prompts:
            if handles:
                await _generated(handles[-1], args.stagger, deadline)
            handles.append(await migrator.submit(source, GenerateRequest(prompt, greedy(total))))
        out = []
        for prompt, handle in zip(prompts, handles, strict=True):
            await _generated(handle, generated, deadline)
            moved = await migrator.move_request(handle, target, live=True, mode=args.mode)
            result = await asyncio.wait_for(handle.result(), max(1.0, deadline - time.monotonic()))
            out.append(_repeat(moved, result, len(prompt), total))
    return out


def _repeat(moved: MoveReport, result: Any, prompt_len: int, total: int) -> dict[str, Any]:
    rounds = [s for s in moved.stages if s.while_decoding]
    after = [s for s in moved.stages if not s.while_decoding]
    return {
        "outcome": moved.outcome,
        "stall_s": moved.stall_s,
        "abort_s": moved.seconds.get("abort"),
        "seconds": dict(moved.seconds),
        "generated_before_move": moved.generated_before_move,
        "rounds": [
            {
                "held": s.held_tokens,
                "moved": s.migrated_tokens,
                "s": s.seconds,
                "decision": s.decision,
                "path": s.path,
            }
            for s in rounds
        ],  # fmt: skip
        "after_stop": [
            {"moved": s.migrated_tokens, "s": s.seconds, "decision": s.decision} for s in after
        ],  # fmt: skip
        "failure": moved.failure,
        "output_tokens": len(result.output_ids),
        "complete": len(result.output_ids) == total,
        "resumed_cached": result.segments[-1].cached_tokens if result.segments else None,
        "prompt": prompt_len,
        "output_ids": list(result.output_ids),  # dropped from the file by `run_row`
    }


async def _token_times(url: str, input_ids: list[int], n: int) -> list[float]:
    times: list[float] = []
    body = {"input_ids": input_ids, "sampling_params": greedy(n), "stream": True}
    async with httpx.AsyncClient(timeout=600) as http:
        async with http.stream("POST", url + "/generate", json=body) as r:
            r.raise_for_status()
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ids = json.loads(line[5:]).get("output_ids") or []
                if len(ids) > seen:
                    times.append(time.monotonic())
                    seen = len(ids)
    return times


def target_decode_step(url: str, input_ids: list[int], n: int) -> float | None:
    """One decode step of `url` at this length: the median gap between streamed tokens
    of a request whose input it holds cached."""
    return report.decode_step_s(asyncio.run(_token_times(url, input_ids, n)))


def run_row(
    urls: list[str], context: int, generated: int, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    source, target = urls
    flush_cache(source)
    flush_cache(target)
    rng = random.Random(context * 31 + generated + args.seed)
    prompts = [tokens(rng, context, vocab) for _ in range(args.repeats)]
    t0 = time.monotonic()
    repeats = asyncio.run(run_repeats(source, target, prompts, generated, args))
    outputs = [r.pop("output_ids") for r in repeats]
    # The first request finished on the target: its prompt + output is cached there.
    step = target_decode_step(target, prompts[0] + outputs[0][:-1], args.step_tokens)
    stalls = [r["stall_s"] for r in repeats]
    aborts = [r["abort_s"] for r in repeats]
    return {
        "context": context,
        "generated": generated,
        "seconds": time.monotonic() - t0,
        "stall": report.spread(stalls),
        "abort": report.spread(aborts),
        "rounds": report.spread([float(len(r["rounds"])) for r in repeats]),
        "decode_step_s": step,
        "checks": report.checks(stalls, aborts, step),
        "all_complete": all(r["complete"] for r in repeats),
        "repeats": repeats,
    }


# --------------------------------------------------------------------------- main


def write(args: argparse.Namespace, name: str, rows: list[dict], errors: dict) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / "bench_live_move.json"
    config = {**vars(args), "shape": name}
    path.write_text(json.dumps({"config": config, "rows": rows, "errors": errors}, indent=1))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add("--quick", action="store_true", help="tiny model, 1K context, 256 generated (smoke)")
    add("--contexts", type=int, nargs="+", default=[4096, 16384, 32768], help="prompt tokens")
    add("--gens", type=int, nargs="+", default=[1024, 8192],
        help="tokens generated on the source before the move")  # fmt: skip
    add("--repeats", type=int, default=3, help="requests per row (medians with range)")
    add("--stagger", type=int, default=160, help="tokens between the repeats' starts")
    add("--tail", type=int, default=32, help="tokens the target generates after the move")
    add("--step-tokens", type=int, default=33, help="tokens streamed to time a decode step")
    add("--mode", choices=["auto", "migrate"], default="auto", help="the live move's mode")
    add("--max-rounds", type=int, default=6, help="rounds while decoding, at most")
    add("--page-size", type=int, default=16, help="--page-size of both servers")
    add("--mem-fraction-static", type=float, default=0.4, help="per server (two on one GPU)")
    add("--row-timeout", type=float, default=240.0, help="seconds per row")
    add("--deadline-s", type=float, default=0.0, help="start no row after this (0: none)")
    add("--seed", type=int, default=0, help="prompt seed")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.gens = [1024], [256]
    if args.repeats < 1 or min(args.gens) < 1 or args.tail < 1 or args.stagger < 1:
        p.error("--repeats, --gens, --tail and --stagger must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    base, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    context_len = max(args.contexts) + max(args.gens) + args.tail + 64
    shape = {**base, "max_position_embeddings": max(base["max_position_embeddings"], context_len)}
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}-live"))
    pool = report.pool_tokens(args.contexts, args.gens, args.repeats, args.tail, args.page_size)
    flags = [
        "--page-size", str(args.page_size), "--mem-fraction-static", str(args.mem_fraction_static),
        "--max-total-tokens", str(pool), "--context-length", str(context_len),
        "--max-running-requests", str(max(8, args.repeats + 1)), "--enable-metrics",
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    specs = [ServerSpec(30900, flags, cuda_graph=True), ServerSpec(31000, flags, cuda_graph=True)]
    path = write(args, name, rows, errors)
    with running_servers(model_dir, specs, sequential=True) as urls:
        vocab = shape["vocab_size"]
        # Untimed: the first move opens the peer's KV buffers (CUDA IPC) and compiles
        # the kernels the rounds and the resume use.
        warm = argparse.Namespace(**{**vars(args), "repeats": 1})
        asyncio.run(run_repeats(*urls, [tokens(random.Random(1), 1024, vocab)], 64, warm))
        for context, generated in report.plan_rows(args.contexts, args.gens):
            key = f"{context}x{generated}"
            if args.deadline_s and time.monotonic() - started > args.deadline_s:
                errors[key] = "not run: past --deadline-s"
                continue
            print(f"== {context} context, {generated} generated", flush=True)
            try:
                rows.append(run_row(urls, context, generated, args, vocab))
                print(json.dumps({k: rows[-1][k] for k in ("context", "generated", "stall",
                                                           "checks")}), flush=True)  # fmt: skip
            except Exception as e:  # report it and go on: the other rows still count
                errors[key] = f"{type(e).__name__}: {e}"
                print(f"{key}: {errors[key]}", flush=True)
            path = write(args, name, rows, errors)
    print(report.markdown(rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
