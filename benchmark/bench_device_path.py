"""Device path vs host path vs re-prefill, Llama-3-8B shape, two real SGLang servers.

Per prefix length N (default 1K/4K/16K/32K), each repeat runs side by side in one round,
on a flushed cache each time:
1. re-prefill: the target serves a fresh N-token prompt (max_new_tokens=1: its TTFT);
2. device path: the source prefills prompt A, the client migrates A[:-1] with
   `path="device"` (every phase from `result.timings`, `copy_seconds`, bytes, GB/s =
   bytes / copy_seconds), then the target serves A (TTFT, `cached_tokens_details`);
3. host path: the same for another prompt B with `path="host"` (Mooncake TCP on one host);
4. with `--two-trips`, the device path again for a prompt D, through a client that does
   not see feature "source_allocate": it allocates on the target itself (two trips)
   beside the one-trip default of row 2 (the source allocates through the target's
   channel);
5. with `--commit-trip`, the same for a prompt C through a client that sees neither
   "source_allocate" nor "source_commit": its own allocate and commit trips (three trips)
   (use these with `--no-host` at 32K: the target's pool holds the baseline and every
   migrated prefix of a round).
Migrations run through the Python client in this process (one client for the whole run,
so it may cache session info); no CLI start-up is timed. Medians over the repeats.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_device_path.py               # one GPU
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_device_path.py --target-gpu 1  # x2 machine
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_device_path.py --quick        # smoke run

Writes `$KVMIG_GPU_OUT/bench_device_path.json` (config, warm-up, every row, medians)
after every row and round, with `complete` false until the run ends (a job cut by its
time limit keeps its rows), and prints markdown tables for docs/benchmarks.md. Needs
nothing beyond the GPU wheel sets and this package. Budget on an H200: two start-ups
(~150 s + ~60 s; on one GPU the target starts after the source is ready, see
`running_servers`) plus ~2 min of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.server.diag import profiling, thread_costs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_moves import (  # noqa: E402
    SETTLE_S,
    concurrency_round,
    migrate_and_serve,
    random_tokens,
    timings_ms,
)
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    ServerSpec,
    cached_details,
    cached_tokens,
    flush_cache,
    generate,
    running_servers,
    timed_generate,
    write_model,
)

DEFAULT_LENGTHS = [1024, 4096, 16384, 32768]
QUICK_LENGTHS = [1024, 4096]
PHASES = ("session_info", "extra_token_size", "allocate", "transfer", "commit", "total")
# The targets for the longest prefix (one GPU, across GPUs).
TARGET_RATIO = {False: 0.01, True: 0.02}  # whole device migration / re-prefill
TARGET_COPY_GBPS = {False: 400.0, True: 200.0}  # keyed by "across GPUs"
COMMIT_TRIP = "device_commit_trip"  # row 5: the device path with the client's commit trip
TWO_TRIPS = "device_two_trips"  # row 4: the device path with the client's allocate trip
# Row 6: one call, the target's device_kv in full in every body (no "destination_digest").
FULL_DESTINATION = "device_full_destination"
ROW_KINDS = ("device", TWO_TRIPS, COMMIT_TRIP, FULL_DESTINATION, "host")
# Row -> the wire features its client is made not to see (as with older servers).
HIDDEN = {
    TWO_TRIPS: ("source_allocate",),
    COMMIT_TRIP: ("source_allocate", "source_commit"),
    FULL_DESTINATION: ("destination_digest",),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--target-gpu", type=int, default=0, help="1 on nvidia-h200-x2")
    parser.add_argument("--mem-fraction-static", type=float, default=0.4)
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=106496,
        help="GPU KV pool per server (tokens); the target must hold the re-prefill "
        "baseline, the device-migrated prefix and the host path's load-back of the "
        "longest length at once (3 x 32K + slack; 13 GiB of KV at 128 KiB/token)",
    )
    parser.add_argument("--context-length", type=int, default=40960)
    parser.add_argument(
        "--tp-size", type=int, default=1,
        help="2 on nvidia-h200-x2: both servers on GPUs 0+1, rank r copies to rank r",
    )  # fmt: skip
    parser.add_argument("--no-host", action="store_true", help="skip the host-path rows")
    parser.add_argument("--quick", action="store_true", help="1K and 4K, one repeat")
    parser.add_argument(
        "--commit-trip", action="store_true",
        help="also migrate on the device path with the client's allocate and commit trips "
        "(row 5)",
    )  # fmt: skip
    parser.add_argument(
        "--two-trips", action="store_true",
        help="also migrate on the device path with the client's allocate trip (row 4)",
    )  # fmt: skip
    parser.add_argument(
        "--full-destination", action="store_true",
        help="also migrate in one call with the target's device_kv in full in the body "
        "(row 6: a client that does not name it by digest)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-env", action="append", default=[], metavar="NAME=VALUE",
        help="then the same rounds on a fresh server pair started with NAME=VALUE in its "
        "environment (any setting a server reads there, e.g. "
        "SGLANG_KV_MIGRATION_PROFILE_DIR=DIR): side by side in one run",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency-rounds", type=int, default=0,
        help="after the rows, N rounds of bench_any_tier.py's concurrency on these servers "
        "(six 8K moves from six threads, then in one migrate_many, against one)",
    )  # fmt: skip
    parser.add_argument(
        "--calibrate", action="store_true",
        help="time small operations (`server/diag/thread_costs.py`) in this process and on "
        "both servers' scheduler threads, idle before the rows and after them",
    )  # fmt: skip
    args = parser.parse_args()
    calibration = _Calibration(OUT_DIR / "calibration") if args.calibrate else None
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    repeats = 1 if args.quick else args.repeats
    if max(lengths) + 8 > args.context_length:
        parser.error(f"--context-length {args.context_length} < longest prompt + output")
    across_gpus = args.target_gpu != 0
    if args.tp_size > 1 and across_gpus:
        parser.error("--tp-size > 1 puts both servers on GPUs 0..tp-1: drop --target-gpu")

    shape = dict(LLAMA3_8B, max_position_embeddings=max(args.context_length, 40960))
    model_dir = write_model(shape, Path("/tmp/kvmig-llama3-8b-40k"))
    extra = ["--page-size", str(args.page_size)]
    extra += ["--mem-fraction-static", str(args.mem_fraction_static)]
    extra += ["--max-total-tokens", str(args.max_total_tokens)]
    extra += ["--context-length", str(args.context_length)]
    extra += ["--tp-size", str(args.tp_size)]
    specs = [ServerSpec(30610, extra, gpu_id=0), ServerSpec(30620, extra, args.target_gpu)]
    config = {
        "shape": shape,
        "page_size": args.page_size,
        "source_gpu": 0,
        "target_gpu": args.target_gpu,
        "tp_size": args.tp_size,
        "lengths": lengths,
        "repeats": repeats,
        "server_flags": extra,
        "host_path": not args.no_host,
        "commit_trip_rows": args.commit_trip,
        "full_destination_rows": args.full_destination,
        "two_trip_rows": args.two_trips,
    }
    started = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}

    def save(label: str, run: dict[str, Any]) -> None:
        # Written after every row and round: a job cut by its time limit keeps what it
        # measured (`complete` false).
        runs[label] = run
        _write_result(config, runs, calibration, started, complete=False)

    _run_pair(args, model_dir, specs, lengths, repeats, calibration, config, save, "")
    for assignment in args.compare_env:
        # The same rounds on a fresh pair started with one more variable in its
        # environment (the servers inherit this process's): side by side in one run.
        name, _, value = assignment.partition("=")
        with mock.patch.dict(os.environ, {name: value}):
            _run_pair(args, model_dir, specs, lengths, repeats, None, {}, save, assignment)
    result = _write_result(config, runs, calibration, started, complete=True)
    _print_tables(runs[""]["medians"], config, across_gpus)
    for assignment, run in runs.items():
        if not assignment:
            continue
        print(f"\nThe same rounds on servers started with {assignment}:", flush=True)
        _print_tables(run["medians"], config, across_gpus)
    if calibration is not None:
        calibration.print_table()
    print(f"\nwall time {result['wall_s']:.0f} s", flush=True)


def _run_pair(
    args: argparse.Namespace,
    model_dir: Path,
    specs: list[ServerSpec],
    lengths: list[int],
    repeats: int,
    calibration: _Calibration | None,
    config: dict[str, Any],
    save: Callable[[str, dict[str, Any]], None],
    label: str,
) -> None:
    """Start the two servers, run the warm-up, every row and the concurrency rounds;
    hands them to `save` under `label` after each (`config` gets the start-up time)."""
    across_gpus = args.target_gpu != 0
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    warmup: dict[str, Any] = {}
    concurrency: list[dict[str, Any]] = []

    def medians() -> list[dict[str, Any]]:
        done = [n for n in lengths if any(r["tokens"] == n for r in rows)]
        return [_median_row(n, [r for r in rows if r["tokens"] == n]) for n in done]

    def progress() -> None:
        run = {"warmup": warmup, "concurrency": concurrency, "rows": rows}
        save(label, {**run, "medians": medians()})

    # Same GPUs: start one after the other (KV pool sizing measures free GPU memory).
    with (
        running_servers(model_dir, specs, sequential=not across_gpus) as (source, target),
        MigrationClient(timeout=600) as client,
        MigrationClient(timeout=600) as with_two_trips,
        MigrationClient(timeout=600) as with_commit_trip,
        MigrationClient(timeout=600) as with_full_destination,
    ):
        config["startup_s"] = time.monotonic() - started
        print(f"servers ready in {config['startup_s']:.0f} s", flush=True)
        rng = random.Random(0)
        warmup = _warm_up(client, source, target, rng, not args.no_host)
        print("warm-up:", json.dumps(warmup), flush=True)
        if calibration is not None:
            calibration.take("idle before the rows")
        others: dict[str, MigrationClient] = {}
        if args.two_trips:
            others[TWO_TRIPS] = with_two_trips
        if args.commit_trip:
            others[COMMIT_TRIP] = with_commit_trip
        if args.full_destination:
            others[FULL_DESTINATION] = with_full_destination
        for kind, other in others.items():
            for url in (source, target):  # the cached session info it plans from
                info = other.session_info(url)
                info.features = [f for f in info.features if f not in HIDDEN[kind]]
        for n in lengths:
            for rep in range(repeats):
                row = _round(client, source, target, n, rep, rng, not args.no_host, others)
                rows.append(row)
                print(json.dumps(row), flush=True)
                progress()
        if calibration is not None:
            calibration.take("idle after the rows")
        if args.concurrency_rounds:
            for _ in range(args.concurrency_rounds):
                concurrency.append(concurrency_round(client, source, target, 6, 8192, rng))
                progress()
    progress()


def _write_result(
    config: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    calibration: _Calibration | None,
    started: float,
    complete: bool,
) -> dict[str, Any]:
    """The result file: the first pair's run at the top, the `--compare-env` pairs'
    under `compare_env`; rewritten whole each time (small)."""
    result = {
        "config": config,
        **runs.get("", {"warmup": {}, "concurrency": [], "rows": [], "medians": []}),
        "calibration": calibration.report() if complete and calibration is not None else None,
        "compare_env": {k: v for k, v in runs.items() if k},
        "wall_s": time.monotonic() - started,
        "complete": complete,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_device_path.json").write_text(json.dumps(result, indent=1))
    return result


class _Calibration:
    """`--calibrate`: the same small operations timed in this process and on each
    server's scheduler thread (`thread_costs.py`; the servers run with the opt-in
    profile and `SGLANG_KV_MIGRATION_CALIBRATE=1`, set here before they start)."""

    def __init__(self, directory: Path):
        import os
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.directory = directory
        os.environ[profiling.ENV] = str(directory)
        os.environ[profiling.GC_ONLY_ENV] = "1"  # no cProfile: it would slow the handlers
        os.environ[thread_costs.ENV] = "1"
        self.here: dict[str, Any] = {}

    def take(self, label: str, timeout_s: float = 20.0) -> None:
        """This process first, then both schedulers (each once idle, within a second)."""
        self.here[label] = thread_costs.measure()
        (self.directory / "calibrate").write_text(label)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len([r for r in self._ranks().values() if label in r]) >= 2:
                return
            time.sleep(0.2)
        print(f"calibration {label!r}: not every scheduler answered", flush=True)

    def _ranks(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in sorted(self.directory.glob("*-calibration.json")):
            try:
                entries = json.loads(path.read_text())
            except ValueError:  # being written
                continue
            found[path.name.removesuffix("-calibration.json")] = {e["when"]: e for e in entries}
        return found

    def report(self) -> dict[str, Any]:
        return {"this_process": self.here, "schedulers": self._ranks()}

    def print_table(self) -> None:
        columns = [(f"here: {k}", v) for k, v in self.here.items()]
        for rank, entries in self._ranks().items():
            columns += [(f"{rank}: {k}", v) for k, v in entries.items()]
        if not columns:
            return
        print("\n### Calibration: p50 us per call (`thread_costs.py`)\n")
        print("| op | " + " | ".join(name for name, _ in columns) + " |")
        print("|---|" + "---|" * len(columns))
        for op in columns[0][1]["costs_us"]:
            cells = [str(c["costs_us"].get(op, {}).get("p50", "")) for _, c in columns]
            print(f"| {op} | " + " | ".join(cells) + " |")
        for key in ("cpu_share", "context_switches"):
            print(f"| {key} | " + " | ".join(str(c.get(key)) for _, c in columns) + " |")
        for _, c in columns:
            print(json.dumps(c["state"]))


def _warm_up(
    client: MigrationClient, source: str, target: str, rng: random.Random, host: bool
) -> dict[str, Any]:
    """Compile the Triton kernels (fresh and cached-prefix extends) on both servers and
    open each path once (CUDA IPC handles, Mooncake connections, cached session info).
    The first migrations' timings are kept: they show the one-off costs."""
    for url in (source, target):
        p = random_tokens(rng, 2048)
        generate(url, p, 1)
        generate(url, p, 1)
    out: dict[str, Any] = {}
    for name, path in (("device", "device"), ("auto", None), ("host", "host")):
        if name == "host" and not host:
            continue
        p = random_tokens(rng, 1024)
        generate(source, p, 1)
        r = client.migrate(source, target, p[:-1], path=path)
        served = generate(target, p, 1)
        out[name] = {
            "path": r.path,
            "fallback_reason": r.fallback_reason,
            "timings_ms": timings_ms(r.timings),
            "copy_ms": r.copy_seconds * 1e3,
            "cached_details": cached_details(served),
        }
    for url in (source, target):
        flush_cache(url)
    return out


def _round(
    client: MigrationClient,
    source: str,
    target: str,
    n: int,
    rep: int,
    rng: random.Random,
    host: bool,
    others: dict[str, MigrationClient] | None = None,
) -> dict[str, Any]:
    others = others or {}
    for url in (source, target):
        flush_cache(url)
    row: dict[str, Any] = {"tokens": n, "repeat": rep}

    baseline, prefill_s = timed_generate(target, random_tokens(rng, n), 1)
    assert cached_tokens(baseline) == 0, baseline["meta_info"]
    row["reprefill_ttft_ms"] = prefill_s * 1e3

    a = random_tokens(rng, n)
    b = random_tokens(rng, n) if host else []
    more = {kind: random_tokens(rng, n) for kind in others}
    for p in (a, b, *more.values()):
        if p:
            generate(source, p, 1)
    # Let the source finish with those requests (SGLang inserts a finished request into
    # its radix tree and queues its host backup after the reply is sent; at 32K tokens that
    # kept the first call of the next migration waiting ~30 ms on a TP=2 server). A
    # rollout moves a prefix computed earlier, not one whose request is still closing.
    time.sleep(SETTLE_S)

    row["device"] = migrate_and_serve(client, source, target, a, "device")
    if host:
        time.sleep(SETTLE_S)  # the target, too, finishes the request it just served
        row["host"] = migrate_and_serve(client, source, target, b, "host")
    for kind, other in others.items():
        time.sleep(SETTLE_S)
        row[kind] = migrate_and_serve(other, source, target, more[kind], "device")
    return row


def _median_row(n: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out: dict[str, Any] = {
        "tokens": n,
        "samples": len(rows),
        "reprefill_ttft_ms": med([r["reprefill_ttft_ms"] for r in rows]),
    }
    for path in ROW_KINDS:
        runs = [r[path] for r in rows if path in r]
        if not runs:
            continue
        m: dict[str, Any] = {
            "bytes": runs[0]["bytes"],
            "migrated_tokens": runs[0]["migrated_tokens"],
            "timings_ms": {
                k: med([run["timings_ms"].get(k) for run in runs])
                for k in PHASES
                if any(k in run["timings_ms"] for run in runs)
            },
            "copy_ms": med([run["copy_ms"] for run in runs]),
            "copy_gb_s": med([run["copy_gb_s"] for run in runs]),
            "transfer_gb_s": med([run["transfer_gb_s"] for run in runs]),
            "ttft_ms": med([run["ttft_ms"] for run in runs]),
            "cached_details": runs[-1]["cached_details"],
        }
        total = m["timings_ms"].get("total")
        prefill = out["reprefill_ttft_ms"]
        if total is not None and prefill:
            m["total_over_reprefill"] = total / prefill
            m["total_plus_ttft_over_reprefill"] = (total + m["ttft_ms"]) / prefill
        out[path] = m
    return out


def _print_tables(summary: list[dict[str, Any]], config: dict[str, Any], across: bool) -> None:
    where = f"GPU 0 -> GPU {config['target_gpu']}" if across else "one GPU"
    print(
        f"\nMedians of {config['repeats']} round(s), Llama-3-8B shape, page size "
        f"{config['page_size']}, {where}. ms; GB = 1e9 bytes; 'total' = the client's sum "
        "of phases; TTFT = the target serving the prompt with max_new_tokens=1.\n"
    )
    print(
        "| prefix tokens | re-prefill TTFT | device total (alloc / transfer / commit) "
        "| device copy ms | copy GB/s | TTFT after device (device/host cached) "
        "| device total / re-prefill | (total + TTFT) / re-prefill "
        "| host total | TTFT after host | host total / re-prefill |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        d, h = s.get("device", {}), s.get("host", {})
        dt = d.get("timings_ms", {})
        det = d.get("cached_details", {})
        print(
            f"| {s['tokens']} | {_f(s['reprefill_ttft_ms'])} "
            f"| {_f(dt.get('total'))} ({_f(dt.get('allocate'))} / {_f(dt.get('transfer'))} "
            f"/ {_f(dt.get('commit'))}) | {_f(d.get('copy_ms'), 2)} | {_f(d.get('copy_gb_s'), 0)} "
            f"| {_f(d.get('ttft_ms'))} ({det.get('device', '-')}/{det.get('host', '-')}) "
            f"| {_pct(d.get('total_over_reprefill'))} "
            f"| {_pct(d.get('total_plus_ttft_over_reprefill'))} "
            f"| {_f(h.get('timings_ms', {}).get('total'))} | {_f(h.get('ttft_ms'))} "
            f"| {_pct(h.get('total_over_reprefill'))} |"
        )
    print("\nEvery phase (median ms):\n")
    print("| prefix tokens | path | MiB | " + " | ".join(PHASES) + " | copy | copy GB/s |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 2))
    for s in summary:
        for path in ROW_KINDS:
            m = s.get(path)
            if not m:
                continue
            phases = " | ".join(_f(m["timings_ms"].get(k), 2) for k in PHASES)
            print(
                f"| {s['tokens']} | {path} | {m['bytes'] / 2**20:.0f} | {phases} "
                f"| {_f(m['copy_ms'], 2)} | {_f(m['copy_gb_s'], 1)} |"
            )
    longest = summary[-1].get("device") if summary else None
    if longest:
        ratio, gbps = longest.get("total_over_reprefill"), longest.get("copy_gb_s")
        want_ratio, want_gbps = TARGET_RATIO[across], TARGET_COPY_GBPS[across]
        print(
            f"\nTargets at {summary[-1]['tokens']} tokens: whole device migration "
            f"{_pct(ratio)} of re-prefill (target <= {want_ratio:.0%}: "
            f"{_met(ratio is not None and ratio <= want_ratio)}); copy {_f(gbps, 0)} GB/s "
            f"(target >= {want_gbps:.0f}: {_met(gbps is not None and gbps >= want_gbps)})"
        )


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
