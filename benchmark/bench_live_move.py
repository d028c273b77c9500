"""Live move of a decoding request from its own slots: the stall, taken apart (GPU only).

Two real SGLang servers on one GPU (Llama-3-8B shape, dummy weights, page 16, HiCache,
**CUDA graphs on**, ``--enable-metrics``, device path between them; both list the
"running_slots" feature). Per row, a context length (`--contexts`, default 4K / 16K /
32K) × tokens generated on the source before the move (`--gens`, default 1K / 8K):
`--repeats` requests (3), each with its own seeded prompt, decode greedily on the
source; each is submitted once the previous one has generated `--stagger` tokens, so
they reach `generated` one after the other and are moved one at a time with
``move_request(live=True)``: rounds copy the pages of the request's own slots while it
keeps decoding until at most one page remains, then the stop, the tail, and the resume
on the target, which generates `--tail` more tokens.

Each repeat records the **stall** (`MoveReport.seconds["stall"]`: the source's last
streamed token to the target's first), the **abort latency** (`seconds["abort"]`: the
stop, while the request still streams tokens), the rounds, what moved after the stop,
and beside it **SGLang's own cached resume** of the same request on the same target
(`baseline`): once the moved request has finished there, the target holds its KV, and
the same input (prompt + what it had generated before the move) is sent again, streamed,
as the migrator sends a resumed piece; its time to first token, while the other repeats
still decode on the source as during the move. With the servers' request moments on
(default; `--no-moments` leaves SGLang unhooked) each move is taken apart phase by phase
(`live_move_report.py`'s docstring lists them: the stop's HTTP, scheduler, decode steps,
release and return; the resume's HTTP, tokenizer, schedule, prefill launch and result,
and output), and the baseline the same way. Per row the **target's decode step** and
its quiet cached resume (the first request's whole sequence, nothing else running).
Targets (`live_move_report.checks`): median stall ≤ baseline + 10 ms + one target decode
step; at 4K, ≤ 40 ms. Medians with their range over the repeats.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_live_move.py --budget-s 540   # <= 560 s
    python3 benchmark/bench_live_move.py --quick                             # tiny model

Writes `$KVMIG_GPU_OUT/bench_live_move.json`, rewritten after every row (a run cut at
its time limit keeps the rows it finished; the shortest rows run first), and prints
markdown tables (the rows, then the breakdown). `--budget-s`: start a row only when it
is predicted to end in time (the 1K row at its context predicts the 8K one);
`--deadline-s`: start no row after that many seconds from the start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.rollout.generate_stream import (
    JSON_HEADERS,
    PieceProgress,
    encoded_body,
    read_generate_stream,
    wall_clock,
)
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    MoveReport,
    new_rid,
)
from sglang_kv_migration.server.diag import request_moments

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
import gpu_servers  # noqa: E402
import live_move_report as report  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    ServerSpec,
    flush_cache,
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
    """The row's requests, staggered on the source, each moved live at `generated`; once
    each has finished on the target, SGLang's own cached resume of the same request there
    (`cached_resume`), while the other repeats still decode on the source as they did
    during its move."""
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
            resumed = prompt + list(result.output_ids[: moved.generated_before_move])
            baseline = await cached_resume(target, resumed)
            out.append(_repeat(moved, result, len(prompt), total, baseline))
    return out


def _repeat(
    moved: MoveReport, result: Any, prompt_len: int, total: int, baseline: dict[str, Any]
) -> dict[str, Any]:
    rounds = [s for s in moved.stages if s.while_decoding]
    after = [s for s in moved.stages if not s.while_decoding]
    first, last = result.segments[0], result.segments[-1]
    return {
        "outcome": moved.outcome,
        "stall_s": moved.stall_s,
        "abort_s": moved.seconds.get("abort"),
        "baseline_s": baseline["ttft_s"],
        "seconds": dict(moved.seconds),
        "moments": dict(moved.moments),
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
        "resumed_cached": last.cached_tokens,
        "source_rid": first.rid,
        "resumed_rid": last.rid,
        "source_meta": report.meta_stamps(first.meta_info),
        "resumed_meta": report.meta_stamps(last.meta_info),
        "baseline": baseline,
        "prompt": prompt_len,
        "output_ids": list(result.output_ids),  # dropped from the file by `run_row`
    }


async def cached_resume(url: str, input_ids: list[int], n: int = 1) -> dict[str, Any]:
    """SGLang's own resume of a request whose KV `url` holds (all but its last partial
    page, as a moved request's): one streamed `/generate` sent and read as the migrator
    sends and reads a resumed piece (orjson body, the same stream reader); its time to
    first token, SGLang's timestamps, and the times of its `n` tokens."""
    rid = new_rid()
    body = {"input_ids": input_ids, "sampling_params": greedy(n), "rid": rid, "stream": True}
    progress = TimedProgress()
    async with httpx.AsyncClient(timeout=600) as http:
        progress.sent_at = time.monotonic()
        async with http.stream(
            "POST", url + "/generate", content=encoded_body(body), headers=JSON_HEADERS
        ) as r:
            r.raise_for_status()
            reply = await read_generate_stream(r.aiter_lines(), progress, url)
    first = progress.first_token_at
    return {
        "rid": rid,
        "sent": wall_clock(progress.sent_at),
        "first_token": wall_clock(first) if first is not None else None,
        "ttft_s": first - progress.sent_at if first is not None else None,
        "meta": report.meta_stamps(reply.get("meta_info") or {}),
        "cached_tokens": (reply.get("meta_info") or {}).get("cached_tokens"),
        "token_times": progress.token_times,
    }


@dataclass
class TimedProgress(PieceProgress):
    """`PieceProgress` that also notes the monotonic time of each new token."""

    token_times: list[float] = field(default_factory=list)

    def saw(self, output_ids: list[int]) -> None:
        now = time.monotonic()
        self.token_times.extend([now] * max(0, len(output_ids) - self.tokens))
        super().saw(output_ids)


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
    # Quiet (nothing else runs): the first request finished on the target, so its prompt
    # + output is cached there; its TTFT and the gaps between its tokens (decode steps).
    quiet = asyncio.run(cached_resume(target, prompts[0] + outputs[0], args.step_tokens))
    step = report.decode_step_s(quiet.pop("token_times"))
    for r in repeats:
        r["baseline"].pop("token_times")
    if args.moments_dir:
        _add_breakdowns(repeats, Path(args.moments_dir))
    stalls = [r["stall_s"] for r in repeats]
    baselines = [r["baseline_s"] for r in repeats]
    broken_down = [r["phases"] for r in repeats if "phases" in r]
    return {
        "context": context,
        "generated": generated,
        "seconds": time.monotonic() - t0,
        "stall": report.spread(stalls),
        "baseline": report.spread(baselines),
        "abort": report.spread([r["abort_s"] for r in repeats]),
        "rounds": report.spread([float(len(r["rounds"])) for r in repeats]),
        "decode_step_s": step,
        "quiet_resume": quiet,
        "checks": report.checks(context, stalls, baselines, step),
        "phases": report.phase_spreads(broken_down) if broken_down else {},
        "all_complete": all(r["complete"] for r in repeats),
        "repeats": repeats,
    }


def _add_breakdowns(repeats: list[dict[str, Any]], directory: Path) -> None:
    """Each migrated repeat's breakdown, and the moments it was read from (those around
    the stop and the resume: a decoding request is named in every batch it ran in)."""
    time.sleep(3 * request_moments.FLUSH_S)  # the servers' writers flush what they hold
    for r in repeats:
        if r["outcome"] != "migrated":
            continue
        rids = [r["source_rid"], r["resumed_rid"], r["baseline"]["rid"]]
        events = report.read_moments(directory, rids)
        r["phases"] = report.breakdown(r, events)
        start = r["moments"].get("stop_sent", 0.0) - 0.05
        end = (r["baseline"].get("first_token") or float("inf")) + 0.2
        r["moment_records"] = [e for e in events if start <= e["t"] <= end]


# --------------------------------------------------------------------------- main


def write(args: argparse.Namespace, run: dict[str, Any], rows: list[dict], errors: dict) -> Path:
    """The record: the arguments, where it ran (`run`: shape, card, versions, commit,
    the servers as started), every row so far and why any did not run."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / "bench_live_move.json"
    config = {**vars(args), **run}
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
    add("--row-timeout", type=float, default=240.0, help="seconds per row")
    add("--deadline-s", type=float, default=0.0, help="start no row after this (0: none)")
    add("--budget-s", type=float, default=0.0,
        help="start a row only if it is predicted to end within this many seconds of the "
        "start (from the 1K row at its context; 0: no prediction)")  # fmt: skip
    add("--moments-dir", default=str(OUT_DIR / "moments"),
        help="where the servers record request moments (the breakdown)")  # fmt: skip
    add("--no-moments", action="store_true", help="servers without the moments' hooks")
    add("--seed", type=int, default=0, help="prompt seed")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.gens = [1024], [256]
    if args.no_moments:
        args.moments_dir = ""
    if args.repeats < 1 or min(args.gens) < 1 or args.tail < 1 or args.stagger < 1:
        p.error("--repeats, --gens, --tail and --stagger must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    card = gpu_servers.require_gpu("bench_live_move")
    started = time.monotonic()
    base, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    context_len = max(args.contexts) + max(args.gens) + args.tail + 64
    shape = {**base, "max_position_embeddings": max(base["max_position_embeddings"], context_len)}
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}-live"))
    pool = report.pool_tokens(args.contexts, args.gens, args.repeats, args.tail, args.page_size)
    flags = [
        "--page-size", str(args.page_size), "--context-length", str(context_len),
        "--max-running-requests", str(max(8, args.repeats + 1)), "--enable-metrics",
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    # One after the other, each sized from the memory then free (`gpu_servers.py`): a
    # fixed --mem-fraction-static leaves the second server of an 80 GB card too small.
    specs = {
        "source": ServerSpec(30900, flags, cuda_graph=True),
        "target": ServerSpec(31000, flags, cuda_graph=True),
    }
    if args.moments_dir:  # the servers inherit it: their processes record request moments
        os.environ[request_moments.ENV] = args.moments_dir
        Path(args.moments_dir).mkdir(parents=True, exist_ok=True)
        for old in Path(args.moments_dir).glob("moments-*.jsonl"):
            old.unlink()  # an earlier run's, on a warm machine
    run = {"shape": name, "kv_tokens": pool, **gpu_servers.run_info(card)}
    path = write(args, run, rows, errors)
    with gpu_servers.sized_servers(model_dir, specs, shape, pool) as servers:
        urls = [server.url for server in servers]
        run["servers"] = [dataclasses.asdict(server) for server in servers]
        vocab = shape["vocab_size"]
        # Untimed: the first move opens the peer's KV buffers (CUDA IPC) and compiles
        # the kernels the rounds and the resume use.
        warm = argparse.Namespace(**{**vars(args), "repeats": 1})
        asyncio.run(run_repeats(*urls, [tokens(random.Random(1), 1024, vocab)], 64, warm))
        for context, generated in report.plan_rows(args.contexts, args.gens):
            key = f"{context}x{generated}"
            elapsed = time.monotonic() - started
            if args.deadline_s and elapsed > args.deadline_s:
                errors[key] = "not run: past --deadline-s"
                continue
            predicted = report.predicted_row_s(rows, context, generated, args)
            if args.budget_s and predicted is not None and elapsed + predicted > args.budget_s:
                errors[key] = f"not run: predicted {predicted:.0f} s, {elapsed:.0f} s gone"
                continue
            print(f"== {context} context, {generated} generated", flush=True)
            try:
                rows.append(run_row(urls, context, generated, args, vocab))
                print(json.dumps({k: rows[-1][k] for k in ("context", "generated", "stall",
                                                           "checks")}), flush=True)  # fmt: skip
            except Exception as e:  # report it and go on: the other rows still count
                errors[key] = f"{type(e).__name__}: {e}"
                print(f"{key}: {errors[key]}", flush=True)
            path = write(args, run, rows, errors)
    print(report.markdown(rows))
    broken_down = [row for row in rows if row["phases"]]
    if broken_down:
        print(report.markdown_breakdown(broken_down))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
