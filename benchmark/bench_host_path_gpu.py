"""Host path on real servers (GPU machine only): churned pools, source stall, idle overhead.

Three measurements of the host path (`--kv-migration-paths host` on both servers, so the
client cannot pick the device path), each side by side in one run, Llama-3-8B shape with
dummy weights, all servers on one GPU:

``table``
    For each prefix length: the target's re-prefill of a fresh prompt, the migration of a
    prefix the source holds (client in-process: its own phase timings) and the target's
    request served from the migrated pages; first on **fresh** servers (flushed), then on
    **churned** ones: mixed multi-turn traffic with shared system prefixes on both servers
    first, so both host pools were evicted and refilled and their free lists are broken
    up. Each row keeps the transfer reply's per-rank statistics (plan and write entries
    where the source reports them).
``stall``
    A steady greedy decode stream on the source (one request, streamed token by token)
    and its inter-token gaps while nothing migrates vs while a ~4 GiB migration (32,768
    tokens × 128 KiB) leaves the same source; p50/p99 of both and their ratio.
``overhead``
    SGLang's own `python -m sglang.bench_serving` (random-ids dataset, token ids in,
    fixed lengths) against a server started with `--enable-kv-migration` and an idle
    migration plane, and one started without it, same flags otherwise, on the same GPU at
    the same time, runs alternating off/on; output-token throughput of each and on/off.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_host_path_gpu.py --parts table stall overhead

Results go to `$KVMIG_GPU_OUT/bench_host_path_gpu.json`, rewritten after every part, so a
run cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    flush_cache,
    generate,
    launch,
    stop,
    wait_ready,
    write_model,
    write_tokenizer,
)

VOCAB = LLAMA3_8B["vocab_size"]
STALL_TOKENS = 32768  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB/token


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Results:
    def __init__(self, path: Path, config: dict[str, Any]):
        self.path, self.data = path, {"config": config}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"[result] {key}: {json.dumps(value)[:3000]}", flush=True)


# --------------------------------------------------------------------------- table


def table_row(client: MigrationClient, source: str, target: str, n: int, rng) -> dict:
    fresh = rand_ids(rng, n)
    t0 = time.perf_counter()
    base = generate(target, fresh, 1)
    prefill_s = time.perf_counter() - t0
    prompt = rand_ids(rng, n)
    generate(source, prompt, 1)
    t0 = time.perf_counter()
    result = client.migrate(source, target, prompt[:-1], path="host")
    migrate_wall_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    served = generate(target, prompt, 1)
    cached_s = time.perf_counter() - t0
    row = {
        "tokens": n,
        "prefill_ms": round(prefill_s * 1e3, 1),
        "prefill_cached_tokens": base["meta_info"].get("cached_tokens"),
        "migrate_ms": round(migrate_wall_s * 1e3, 1),
        "phases_ms": {k: round(v * 1e3, 2) for k, v in result.timings.items()},
        "copy_ms": round(result.copy_seconds * 1e3, 1),
        "cached_request_ms": round(cached_s * 1e3, 1),
        "cached_tokens": served["meta_info"].get("cached_tokens"),
        "migrated_tokens": result.migrated_token_size,
        "bytes": result.migrated_bytes,
        "path": result.path,
        "plans": result.plans,  # per source rank: direct / gather / staged
        "entries": result.entries,  # transfer-engine write entries, all ranks
        # Per source rank, where the transfer's time went (host copies, queue, first
        # contact, planning, wire; first and slowest engine batch), ms.
        "transfer_steps_ms": result.transfer_steps_ms,
    }
    row["migrate_plus_cached_over_prefill"] = round(
        (row["migrate_ms"] + row["cached_request_ms"]) / row["prefill_ms"], 3
    )
    return row


def churn(urls: list[str], rng: random.Random, conversations: int, turns: int) -> dict:
    """Mixed multi-turn traffic with shared system prefixes on every server at once: each
    conversation is a shared system prompt, its own document and short appended turns,
    ~300K distinct tokens per server with the defaults (the host pools hold 2x the device
    pools' 110K), so both tiers evict and refill."""
    systems = [rand_ids(rng, rng.choice((512, 1024, 2048))) for _ in range(8)]
    plans = [
        (
            url,
            rng.choice(systems) + rand_ids(rng, rng.randrange(2048, 4096)),
            [rand_ids(rng, rng.randrange(64, 768)) for _ in range(turns)],
        )
        for url in urls
        for _ in range(conversations)
    ]
    tokens, failed = [0], []
    lock = threading.Lock()

    def conversation(plan) -> None:
        url, system, observations = plan
        history = list(system)
        for obs in observations:
            try:
                out = generate(url, history + obs, 16)
            except httpx.HTTPError as exc:  # counted, not fatal: churn is only a preload
                failed.append(repr(exc)[:200])
                return
            history = history + obs + out["output_ids"]
            with lock:
                tokens[0] += len(history)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(conversation, plans))
    return {"requests": len(plans) * turns, "prompt_tokens": tokens[0], "failed": failed[:5],
            "failed_count": len(failed), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def part_table(res: Results, source: str, target: str, lengths: list[int], args) -> None:
    rng = random.Random(11)
    with MigrationClient(timeout=600) as client:
        for url in (source, target):
            flush_cache(url)
        # Each length `--table-repeats` times in a row: the first migration of a run also
        # pays one-off costs (first contact with the peer), the later ones do not.
        reps = range(args.table_repeats)
        fresh = [table_row(client, source, target, n, rng) for n in lengths for _ in reps]
        res.put("table_fresh", fresh)
        churn_stats = churn([source, target], rng, args.churn_conversations, args.churn_turns)
        res.put("churn", churn_stats)
        churned = [table_row(client, source, target, n, rng) for n in lengths for _ in reps]
        res.put("table_churned", churned)


# --------------------------------------------------------------------------- stall


def part_stall(res: Results, source: str, target: str, args) -> None:
    rng = random.Random(12)
    prefixes = [rand_ids(rng, STALL_TOKENS + 1) for _ in range(args.stall_migrations)]
    for p in prefixes:  # prefilled before the stream starts: only migrations overlap it
        generate(source, p, 1)
    flush_cache(target)
    stamps: list[float] = []
    windows: list[tuple[float, float, dict]] = []
    stop_flag = threading.Event()

    def stream() -> None:
        body = {
            "input_ids": rand_ids(rng, 64),
            "sampling_params": {"max_new_tokens": 20000, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", source + "/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    stamps.append(time.perf_counter())
                if stop_flag.is_set():
                    break

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    time.sleep(args.stall_quiet_s)  # baseline first
    with MigrationClient(timeout=600) as client:
        for p in prefixes:
            t0 = time.perf_counter()
            result = client.migrate(source, target, p[:-1], path="host")
            windows.append((t0, time.perf_counter(), {
                "bytes": result.migrated_bytes, "copy_ms": round(result.copy_seconds * 1e3, 1),
                "phases_ms": {k: round(v * 1e3, 1) for k, v in result.timings.items()},
            }))  # fmt: skip
            time.sleep(args.stall_quiet_s)
    stop_flag.set()
    thread.join(timeout=30)

    during, quiet = [], []
    for a, b in zip(stamps, stamps[1:], strict=False):
        gap = (b - a) * 1e3
        if any(s <= b and a <= e for s, e, _ in windows):
            during.append(gap)
        elif all(b < s or a > e + 0.5 for s, e, _ in windows):
            quiet.append(gap)  # not right after a migration either

    def pct(xs: list[float], q: int) -> float | None:
        if len(xs) < 2:
            return None
        return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 3)

    out = {
        "tokens_streamed": len(stamps),
        "migrations": [w[2] for w in windows],
        "migration_seconds": [round(e - s, 3) for s, e, _ in windows],
        "quiet": {"n": len(quiet), "p50_ms": pct(quiet, 50), "p99_ms": pct(quiet, 99),
                  "max_ms": round(max(quiet), 2) if quiet else None},
        "during": {"n": len(during), "p50_ms": pct(during, 50), "p99_ms": pct(during, 99),
                   "max_ms": round(max(during), 2) if during else None},
    }  # fmt: skip
    if out["quiet"]["p99_ms"] and out["during"]["p99_ms"]:
        out["p99_during_over_quiet"] = round(out["during"]["p99_ms"] / out["quiet"]["p99_ms"], 3)
        out["p50_during_over_quiet"] = round(out["during"]["p50_ms"] / out["quiet"]["p50_ms"], 3)
    res.put("stall", out)


# --------------------------------------------------------------------------- overhead


# `sglang.bench_serving` imports Hugging Face `datasets` at module level for its MMMU and
# LongBench loaders; the GPU image does not have it and the random-ids dataset never uses
# it. Without it, a placeholder that fails if called stands in; SGLang's code runs as is.
_BENCH_SERVING = """
import importlib.util, runpy, sys, types
if importlib.util.find_spec("datasets") is None:
    placeholder = types.ModuleType("datasets")
    def load_dataset(*args, **kwargs):
        raise RuntimeError("Hugging Face datasets is not installed")
    placeholder.load_dataset = load_dataset
    sys.modules["datasets"] = placeholder
sys.argv[0] = "bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


def bench_serving(port: int, model_dir: Path, run: str, args) -> dict:
    out_file = OUT_DIR / f"bench_serving_{run}.jsonl"
    cmd = [
        sys.executable, "-c", _BENCH_SERVING, "--backend", "sglang",
        "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
        "--tokenizer", str(model_dir), "--dataset-name", "random-ids", "--tokenize-prompt",
        "--random-input-len", str(args.serving_input), "--random-output-len",
        str(args.serving_output), "--random-range-ratio", "1.0",
        "--num-prompts", str(args.serving_prompts), "--max-concurrency",
        str(args.serving_concurrency), "--request-rate", "inf", "--seed", "1",
        "--disable-tqdm", "--output-file", str(out_file),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving {run}: {proc.stderr[-3000:]}{proc.stdout[-2000:]}")
    line = out_file.read_text().strip().splitlines()[-1]
    data = json.loads(line)
    keys = ("output_throughput", "request_throughput", "input_throughput", "median_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "completed", "duration")  # fmt: skip
    return {k: data.get(k) for k in keys}


POLL_SERIES = (
    "sglang:kv_migration_poll_seconds_total",
    "sglang:kv_migration_poll_iterations_total",
)


def poll_counters(port: int) -> dict[str, float]:
    """The plugin's per-iteration poll account on a server (summed over ranks)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    sums = dict.fromkeys(POLL_SERIES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def part_overhead(res: Results, on_port: int, off_port: int, model_dir: Path, args) -> None:
    """Alternating off/on rounds of bench_serving; for the "on" runs also what the plugin's
    poll cost the scheduler thread during the run (its own counters): the share of the
    run's wall time bounds the throughput the flag can take while idle."""
    runs: list[dict] = []
    for i in range(args.serving_rounds):
        for name, port in (("off", off_port), ("on", on_port)):
            flush_cache(f"http://127.0.0.1:{port}")
            before = poll_counters(port) if name == "on" else None
            row = {
                "run": f"{name}{i}",
                "flag": name,
                **bench_serving(port, model_dir, f"{name}{i}", args),
            }
            if before is not None:
                after = poll_counters(port)
                seconds = after[POLL_SERIES[0]] - before[POLL_SERIES[0]]
                iterations = after[POLL_SERIES[1]] - before[POLL_SERIES[1]]
                row["poll_seconds"] = seconds
                row["poll_iterations"] = iterations
                row["poll_us_per_iteration"] = seconds / iterations * 1e6 if iterations else None
                row["poll_share_of_wall"] = seconds / row["duration"] if row["duration"] else None
            runs.append(row)
            res.put("overhead_runs", runs)
    on = [r["output_throughput"] for r in runs if r["flag"] == "on"]
    off = [r["output_throughput"] for r in runs if r["flag"] == "off"]
    shares = [r["poll_share_of_wall"] for r in runs if r.get("poll_share_of_wall") is not None]
    res.put("overhead", {
        "on_output_tok_s": on, "off_output_tok_s": off,
        "on_over_off_mean": round(statistics.mean(on) / statistics.mean(off), 4),
        "on_over_off_median": round(statistics.median(on) / statistics.median(off), 4),
        "on_over_off_per_round": [round(a / b, 4) for a, b in zip(on, off, strict=True)],
        "off_spread": round(max(off) / min(off) - 1, 4),
        "poll_share_of_wall_max": max(shares, default=None),
    })  # fmt: skip


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["table", "stall", "overhead"],
                        choices=["table", "stall", "overhead"])  # fmt: skip
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--max-total-tokens", type=int, default=110_000)
    parser.add_argument(
        "--mem-fraction-static", type=float, nargs=3, default=[0.28, 0.4, 0.65],
        help="per server (source, target, off; started in that order): what each may fill",
    )  # fmt: skip
    parser.add_argument(
        "--staging-mb", type=int, default=None,
        help="--kv-migration-staging-mb for the plugin's servers (the default arena, 256 MiB, "
        "holds 2K tokens of this shape: longer migrations write directly)",
    )  # fmt: skip
    parser.add_argument("--table-repeats", type=int, default=1)
    parser.add_argument(
        "--port-base", type=int, default=31000,
        help="source port; target +100, off +200 (two runs on one machine need two bases)",
    )  # fmt: skip
    parser.add_argument("--churn-conversations", type=int, default=64)
    parser.add_argument("--churn-turns", type=int, default=4)
    parser.add_argument("--stall-migrations", type=int, default=3)
    parser.add_argument("--stall-quiet-s", type=float, default=3.0)
    parser.add_argument("--serving-rounds", type=int, default=2)
    parser.add_argument("--serving-prompts", type=int, default=128)
    parser.add_argument("--serving-input", type=int, default=1024)
    parser.add_argument("--serving-output", type=int, default=128)
    parser.add_argument("--serving-concurrency", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")

    shape = dict(LLAMA3_8B, max_position_embeddings=65536)
    # One directory per run: two runs on one machine must not write the same files.
    model_dir = write_model(shape, Path(f"/tmp/kvmig-llama3-8b-tok-{args.port_base}"))
    if "overhead" in args.parts:
        write_tokenizer(model_dir, VOCAB)
    res = Results(OUT_DIR / "bench_host_path_gpu.json", vars(args))
    common = [
        "--page-size", str(args.page_size), "--max-total-tokens", str(args.max_total_tokens),
        "--context-length", "40960",
    ]  # fmt: skip
    if "overhead" in args.parts:
        common.append("--enable-metrics")  # on every server: the poll account is read there
    host_only = ["--kv-migration-paths", "host"]  # with the plugin's other flags
    if args.staging_mb is not None:
        host_only += ["--kv-migration-staging-mb", str(args.staging_mb)]
    base = args.port_base
    ports = {"source": base, "target": base + 100, "off": base + 200}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    with_tok = "overhead" in args.parts
    # (name, plugin on, tokenizer) in start order; the "off" server only for `overhead`.
    servers = [("source", True, with_tok)]
    servers += [("target", True, False)] if {"table", "stall"} & set(args.parts) else []
    servers += [("off", False, True)] if with_tok else []
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        # One after the other: SGLang sizes each KV pool from the GPU memory free when that
        # server starts (`--mem-fraction-static` is a share of it), so the later servers
        # get larger shares; `--max-total-tokens` caps every pool at the same size. The
        # first server compiles the Triton kernels, the others reuse its cache.
        fraction = dict(zip(("source", "target", "off"), args.mem_fraction_static, strict=True))
        for name, plugin, tokenizer in servers:
            extra = [*common, "--mem-fraction-static", str(fraction[name])]
            extra += host_only if plugin else []
            procs.append(launch(ports[name], model_dir, extra, migration=plugin,
                                tokenizer=tokenizer))  # fmt: skip
            wait_ready(url[name], procs[-1])
        rng = random.Random(0)
        for name, _, _ in servers:
            generate(url[name], rand_ids(rng, 2048), 4)  # warm-up: kernels compiled
        res.put("startup_s", round(time.perf_counter() - t0, 1))
        for part in args.parts:
            t0 = time.perf_counter()
            try:
                if part == "table":
                    part_table(res, url["source"], url["target"], args.lengths, args)
                elif part == "stall":
                    part_stall(res, url["source"], url["target"], args)
                else:
                    part_overhead(res, ports["source"], ports["off"], model_dir, args)
            except Exception as exc:  # one part failing must not lose the others
                res.put(f"{part}_error", repr(exc)[:3000])
            res.put(f"{part}_s", round(time.perf_counter() - t0, 1))
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
