"""The fleet simulation from the command line: validate, predict, sweep (CPU only).

    python3 benchmark/bench_fleet_sim.py validate      # the end-to-end GPU records, and
                                                       # bench_verl_pattern's predictions
    python3 benchmark/bench_fleet_sim.py compare OUT/bench_verl_pattern.json
                                                       # a verl-pattern record: exit 1 if an
                                                       # arm's makespan is off by > 15%
    python3 benchmark/bench_fleet_sim.py sweep --servers 8 64 --contexts 8192
    python3 benchmark/bench_fleet_sim.py sweep --router prefill_seconds_per_token=3e-5
    python3 benchmark/bench_fleet_sim.py all --write   # all of it: docs/sim/fleet_sim.json
                                                       # and docs/fleet-sim.png (matplotlib)

Run from the repository root with the package importable (`PYTHONPATH=python`); the
costs come from the records `benchmark/results.py` quotes (`fleet_costs.py`). `all` is
what the results page's fleet-simulation section shows (`results.py --write` renders it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fleet_costs
import fleet_report
import fleet_validate
from fleet_policies import POLICIES
from fleet_sim import FleetSpec, Rollout, run_rollout

HOT_FRACTION = 4  # the hot servers are a quarter of the fleet


def verl_config(flags: list[str]) -> dict[str, Any]:
    """`bench_verl_pattern.py`'s config for these flags, from its own parser."""
    import bench_verl_pattern

    argv = sys.argv
    sys.argv = ["bench_verl_pattern.py", *flags]
    try:
        args = bench_verl_pattern.parse_args()
    finally:
        sys.argv = argv
    _, default = bench_verl_pattern.verl_balancer_class()
    config = {k: v for k, v in vars(args).items() if k != "t0"}
    return {**config, "model": "llama3-8b", "servers": 2, "gpus": 1, "default_balancer": default}


# The configurations predicted on the page: the job scripted today, and the scale.
VERL_RUNS = {
    "job 36 as scripted: 16 sessions (12 pinned) x 4 turns, 8K": [],
    "64 sessions (48 pinned) x 4 turns, 8K": ["--sessions", "64", "--skewed", "48"],
    "64 sessions (48 pinned) x 4 turns, 16K": [
        "--sessions",
        "64",
        "--skewed",
        "48",
        "--context",
        "16384",
    ],
}


def verl_predictions(costs: Any) -> list[dict[str, Any]]:
    out = []
    for label, flags in VERL_RUNS.items():
        config = verl_config(flags)
        out.append(
            {"label": label, "flags": flags, "arms": fleet_validate.predict_verl(config, costs)}
        )
    return out


def same_work_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A's low-priority decodes are the same work in every scene record and mode: how far
    their completion spread between runs, beside the simulation's."""
    measured, simulated = [], []
    for name in fleet_validate.SCENE_RECORDS:
        record = json.loads((fleet_validate.RUNS_DIR / name).read_text())
        measured += [r["low_p50_s"] for r in record["rows"]]
    simulated = [
        r["simulated"]
        for r in rows
        if r["metric"] == "low_p50_s" and r["record"] in fleet_validate.SCENE_RECORDS
    ]
    return {
        "requests": 8,
        "n": len(measured),
        "median": statistics.median(measured),
        "min": min(measured),
        "max": max(measured),
        "sim_min": min(simulated),
        "sim_max": max(simulated),
    }


def validation() -> dict[str, Any]:
    rows = fleet_validate.validate_existing()
    return {
        "rows": rows,
        "summary": {m: fleet_validate.error_summary(rows, m) for m in fleet_validate.METRICS},
        "same_work_spread": same_work_spread(rows),
    }


def sweep(args: argparse.Namespace, costs: Any) -> dict[str, Any]:
    """Every fleet size x context x skew, every policy (see `fleet_sim`'s docstring)."""
    rows = []
    for servers in args.servers:
        sessions = servers * args.sessions_per_server
        hot = max(1, servers // HOT_FRACTION)
        for context in args.contexts:
            for load in args.hot_loads:
                # The hot quarter holds its pinned sessions and an even share of the rest
                # (`resume_all`): its load over the mean is 1 + 3 * pinned / sessions.
                pinned = round(sessions * (load - 1) / (servers / hot - 1))
                spec = FleetSpec(servers=servers, mem_fraction_static=args.mem_fraction_static)
                rollout = Rollout(
                    sessions=sessions,
                    turns=args.turns,
                    context=context,
                    user_tokens=args.user_tokens,
                    new_tokens=args.new_tokens,
                    pinned=pinned,
                    hot_servers=hot,
                    resume_all=True,
                    seed=args.seed,
                )
                started = time.monotonic()
                config = {"verl": args.verl, "router": args.router}
                policies = {
                    p: run_rollout(spec, rollout, p, costs, config).summary() for p in POLICIES
                }
                rows.append(
                    {
                        "servers": servers,
                        "sessions": sessions,
                        "context": context,
                        "hot_load": load,
                        "pinned": pinned,
                        "policies": policies,
                    }
                )
                ratio = {
                    p: round(v["makespan_s"] / policies["bound"]["makespan_s"], 3)
                    for p, v in policies.items()
                }
                print(
                    f"{servers} servers, {context} ctx, hot x{load}: {ratio} "
                    f"({time.monotonic() - started:.1f} s)",
                    flush=True,
                )
    params = {
        k: getattr(args, k)
        for k in (
            "servers",
            "contexts",
            "hot_loads",
            "turns",
            "sessions_per_server",
            "user_tokens",
            "new_tokens",
            "mem_fraction_static",
            "seed",
            "verl",
            "router",
        )
    }
    return {"params": params, "rows": rows}


def commit() -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=fleet_report.ROOT,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "benchmark", "python"],
            capture_output=True,
            text=True,
            cwd=fleet_report.ROOT,
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("validate", "compare", "sweep", "all"))
    p.add_argument("record", nargs="?", type=Path, help="compare: a bench_verl_pattern result")
    p.add_argument("--servers", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument(
        "--hot-loads",
        type=float,
        nargs="+",
        default=[1.0, 1.5, 2.0, 4.0],
        help="load of the hot quarter over the mean (1: balanced)",
    )
    p.add_argument("--sessions-per-server", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-verl",
        dest="verl",
        action="store_false",
        help="verl's arm: KVMigrationLoadBalancer with re-pinning off (as "
        "bench_verl_pattern does without verl) instead of verl's own class",
    )
    p.add_argument(
        "--router",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="sweep: router YAML keys for KVMigrationLoadBalancer beyond the "
        "benchmark's arms, e.g. prefill_seconds_per_token=3e-5 (values read as JSON)",
    )
    p.add_argument("--write", action="store_true", help="all: write the record and the plot")
    args = p.parse_args(argv)
    if args.what == "compare" and args.record is None:
        p.error("compare needs a bench_verl_pattern.json")
    try:
        args.router = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.router)}
    except ValueError as e:
        p.error(f"--router takes KEY=VALUE with a JSON value: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    graphs = fleet_costs.derive(cuda_graphs=True)
    if args.what == "compare":
        out = fleet_validate.compare_verl_record(json.loads(args.record.read_text()), graphs)
        print(json.dumps(out, indent=1))
        return 0 if out["all_within"] else 1
    record: dict[str, Any] = {
        "commit": commit(),
        "command": " ".join(["bench_fleet_sim.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    if args.what in ("validate", "all"):
        record["validation"] = validation()
        record["verl_predictions"] = verl_predictions(graphs)
        print(fleet_report.validation_block(record) + "\n")
        print(fleet_report.verl_block(record) + "\n")
    if args.what in ("sweep", "all"):
        record["sweep"] = sweep(args, graphs)
        print(fleet_report.sweep_block(record))
    if args.what == "all" and args.write:
        record["costs"] = {
            "cuda_graphs": graphs.to_dict(),
            "eager": fleet_costs.derive(cuda_graphs=False).to_dict(),
        }
        fleet_report.RECORD.parent.mkdir(parents=True, exist_ok=True)
        fleet_report.RECORD.write_text(json.dumps(record, indent=1) + "\n")
        plotted = fleet_report.plot(record)
        print(
            f"wrote {fleet_report.RECORD}"
            + (
                f" and {fleet_report.PLOT}"
                if plotted
                else " (no plot: matplotlib is not installed)"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
