"""Where a short prompt's time to first token goes, server by server (GPU only).

The move-latency rows time a fresh 17-token prompt's re-prefill at ~66 ms on an H200,
far above one forward of an 8B model on a few tokens. This takes that time apart on
four servers started one after the other, each alone on the GPU (Llama-3-8B shape,
dummy weights, page 16, Triton attention, the move-latency rows' pool and context), in
this order:

    kvmig         HiCache + --enable-kv-migration, eager: the move-latency rows' server
    stock         SGLang without HiCache, eager (no CUDA graphs)
    hicache       stock + --enable-hierarchical-cache, eager
    kvmig-graphs  kvmig with CUDA graphs on: the live move's server

Every server runs with ``--enable-metrics`` (SGLang's own `meta_info` timestamps) and
with the request moments on (`SGLANG_KV_MIGRATION_MOMENTS_DIR`: the scheduler's receipt
of the request, its prefill batch's launch and result), so each request is taken apart
as `live_move_report.resume_phases` does: the client's send -> the tokenizer manager
(HTTP, JSON, checks) -> the scheduler -> a batch (match, allocate) -> the prefill's
launch (eager: one Python call per layer's kernels) and its result (the device, and with
the overlap schedule the next batch's launch first) -> the first chunk -> the client.
Per server, `--repeats` of each:

    fresh17_call_client   17 fresh tokens, max_new_tokens=1, `httpx.post` (a client per
                          call, as the move-latency rows timed it until now; its SSL
                          context is built first: `client_build_ms`)
    fresh17_kept_client   the same through one kept client
    fresh17_after_flush   the same right after /flush_cache (as each move-latency round)
    fresh17_stream        the same streamed (as the request migrator sends a piece)
    cached_4096 ...       SGLang's own cached resume: a prompt of that length served once,
                          then the same prompt + one token, streamed
and one decode step (the median gap between 33 streamed tokens of a cached prompt).

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_ttft_split.py --budget-s 530

Writes `$KVMIG_GPU_OUT/bench_ttft_split.json` after each server (a run cut at its limit
keeps the servers it finished) and prints a markdown table per server. `--budget-s`:
start a server only when the one before predicts it ends in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.rollout.request_migration import new_rid
from sglang_kv_migration.server.diag import request_moments

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
import gpu_servers  # noqa: E402
import live_move_report as report  # noqa: E402
from bench_live_move import cached_resume  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    flush_cache,
    running_servers,
    write_model,
)

# In the order they run: the move-latency rows' server first, then what it is built on.
SERVERS = {
    "kvmig": {"migration": True, "hicache": True, "cuda_graph": False},
    "stock": {"migration": False, "hicache": False, "cuda_graph": False},
    "hicache": {"migration": False, "hicache": True, "cuda_graph": False},
    "kvmig-graphs": {"migration": True, "hicache": True, "cuda_graph": True},
}
FRESH_TOKENS = 17  # one page at page 16 and the token SGLang computes in any case


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(n)]


def _body(input_ids: list[int], rid: str, n: int = 1) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": input_ids, "sampling_params": params, "rid": rid}


def timed_call(url: str, input_ids: list[int], client: httpx.Client | None) -> dict[str, Any]:
    """One non-streamed `/generate` (max_new_tokens=1: its time to first token), through
    `client`, or through a client made for the call when None (what `httpx.post` does)."""
    rid = new_rid()
    start = time.time()
    own = client is None
    http = httpx.Client(timeout=600) if own else client
    built = time.time()
    try:
        r = http.post(url + "/generate", json=_body(input_ids, rid))
        r.raise_for_status()
        reply = r.json()
    finally:
        if own:
            http.close()
    done = time.time()
    meta = reply.get("meta_info") or {}
    return {
        "rid": rid,
        "sent": built,
        "first_token": done,
        "ttft_s": done - start,
        "client_build_ms": (built - start) * 1e3,
        "meta": report.meta_stamps(meta),
        "cached_tokens": meta.get("cached_tokens"),
    }


def measure(url: str, rng: random.Random, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every kind of request above, `args.repeats` each, on the server at `url`."""
    kept = httpx.Client(timeout=600)
    kinds = ("fresh17_call_client", "fresh17_kept_client", "fresh17_after_flush",
             "fresh17_stream")  # fmt: skip
    out: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        out["fresh17_call_client"].append(timed_call(url, _tokens(rng, FRESH_TOKENS), None))
        out["fresh17_kept_client"].append(timed_call(url, _tokens(rng, FRESH_TOKENS), kept))
        flush_cache(url)
        out["fresh17_after_flush"].append(timed_call(url, _tokens(rng, FRESH_TOKENS), kept))
        stream = asyncio.run(cached_resume(url, _tokens(rng, FRESH_TOKENS)))
        out["fresh17_stream"].append(stream)
    for length in args.lengths:
        prompt = _tokens(rng, length)
        timed_call(url, prompt, kept)  # untimed: now the server holds it
        out[f"cached_{length}"] = [
            asyncio.run(cached_resume(url, prompt + _tokens(rng, 1))) for _ in range(args.repeats)
        ]
    step = asyncio.run(cached_resume(url, prompt + _tokens(rng, 1), 33))
    out["decode_step"] = [{"decode_step_s": report.decode_step_s(step.pop("token_times"))}]
    kept.close()
    return out


def summarize(measured: dict[str, list[dict]], moments_dir: Path | None) -> dict[str, Any]:
    """Per kind: the client's TTFT spread, and each phase's (ms) from the three clocks."""
    rows: dict[str, Any] = {}
    for kind, calls in measured.items():
        if kind == "decode_step":
            rows[kind] = calls[0]
            continue
        for call in calls:
            call.pop("token_times", None)
            events = report.read_moments(moments_dir, [call["rid"]]) if moments_dir else []
            call["phases"] = report.resume_phases(
                call["sent"], call["first_token"], call["meta"], events
            )
            call["moment_records"] = events
        rows[kind] = {
            "ttft": report.spread([c["ttft_s"] for c in calls]),
            "client_build_ms": report.spread([c.get("client_build_ms") for c in calls]),
            "phases": {
                name: report.spread([c["phases"][name] for c in calls])
                for name in report.RESUME_PHASES
            },
            "calls": calls,
        }
    return rows


def markdown(name: str, rows: dict[str, Any]) -> str:
    head = ["request", "TTFT ms", *report.RESUME_PHASES]
    lines = [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, row in rows.items():
        if kind == "decode_step":
            continue
        cells = [report.cell(row["ttft"])]
        cells += [report.cell(row["phases"][p], 1.0) for p in report.RESUME_PHASES]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    step = rows.get("decode_step", {}).get("decode_step_s")
    lines.append("")
    lines.append(f"decode step: {'—' if step is None else f'{step * 1e3:.1f} ms'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    add("--repeats", type=int, default=8, help="requests of each kind per server")
    add("--lengths", type=int, nargs="+", default=[4096, 16384, 32768],
        help="cached prompts' lengths")  # fmt: skip
    add("--budget-s", type=float, default=0.0, help="start no server predicted to end later")
    add("--moments-dir", default="/tmp/kvmig-ttft-moments",
        help="where the servers record request moments")  # fmt: skip
    add("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    card = gpu_servers.require_gpu("bench_ttft_split")
    started = time.monotonic()
    context = max(40960, max(args.lengths) + 64)
    shape = {**LLAMA3_8B, "max_position_embeddings": context}
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    flags = ["--page-size", "16", "--mem-fraction-static", "0.4", "--max-total-tokens",
             "106496", "--context-length", str(context), "--enable-metrics"]  # fmt: skip
    moments_dir = Path(args.moments_dir)
    moments_dir.mkdir(parents=True, exist_ok=True)
    for old in moments_dir.glob("moments-*.jsonl"):
        old.unlink()
    os.environ[request_moments.ENV] = str(moments_dir)
    config = {**vars(args), "flags": flags, **gpu_servers.run_info(card)}
    record: dict[str, Any] = {"config": config, "servers": {}}
    errors: dict[str, str] = {}
    last_s = 0.0
    for i, name in enumerate(args.servers):
        elapsed = time.monotonic() - started
        if args.budget_s and elapsed + last_s > args.budget_s:
            errors[name] = f"not run: the one before took {last_s:.0f} s, {elapsed:.0f} s gone"
            continue
        spec = ServerSpec(30700 + 10 * i, flags, **SERVERS[name])
        t0 = time.monotonic()
        try:
            with running_servers(model_dir, [spec]) as (url,):
                rng = random.Random(args.seed + i)
                for _ in range(2):  # untimed: the kernels compile, the first calls settle
                    timed_call(url, _tokens(rng, 2048), None)
                measured = measure(url, rng, args)
                time.sleep(3 * request_moments.FLUSH_S)  # its writer flushes what it holds
                record["servers"][name] = summarize(measured, moments_dir)
            print(markdown(name, record["servers"][name]), flush=True)
        except Exception as e:  # report it and go on: the other servers still count
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: {errors[name]}", flush=True)
        last_s = time.monotonic() - t0
        record["errors"] = errors
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "bench_ttft_split.json").write_text(json.dumps(record, indent=1))
    print(f"results: {OUT_DIR / 'bench_ttft_split.json'}")


if __name__ == "__main__":
    main()
