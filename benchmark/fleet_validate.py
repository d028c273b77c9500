"""The simulation against end-to-end GPU records: what it predicts beside what was measured.

- `compare_verl_record(record)`: a `bench_verl_pattern.py` result (issue target: every
  arm's makespan within 15%), simulated with the record's own config, plus the bound;
- `validate_existing()`: every end-to-end record there is today: the RL scene
  (`bench_rl_scene.py`) at 4K / 8K / 16K and rollout rebalancing
  (`bench_rollout_rebalance.py`), mode by mode.

Errors are ``simulated / measured - 1``. The records' constants are not fitted to these
runs: `fleet_costs` reads only single-operation rows (prefill, decode steps, moves).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import fleet_costs
import fleet_scenes
import verl_pattern_stats as arms
from fleet_policies import BOUND
from fleet_sim import FleetSpec, Rollout, run_rollout

RUNS_DIR = Path(__file__).resolve().parent.parent / "docs" / "gpu-runs"
# End-to-end records the simulation is checked against (scene records: any context).
SCENE_RECORDS = (
    "2026-12-01/scene4k-bench_rl_scene_4096.json",
    "2026-12-01/scene8k-bench_rl_scene_8192.json",
    "2026-12-01/scene16k-bench_rl_scene_16384.json",
)
ROLLOUT_RECORDS = ("2026-11-30-rollout-rebalance-llama3-8b.json",)
TOLERANCE = 0.15  # the issue's: predicted makespans within 15%
METRICS = ("makespan_s", "high_p99_s", "low_p50_s", "low_p99_s")


def error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or not measured:
        return None
    return round(simulated / measured - 1.0, 4)


# ---------------------------------------------------------------------------- verl


def verl_setup(config: dict[str, Any]) -> tuple[FleetSpec, Rollout, dict[str, Any]]:
    """The fleet, workload and balancer config a `bench_verl_pattern.py` record ran: two
    servers started one after the other on one GPU, CUDA graphs on."""
    if config.get("quick") or config.get("model") == "tiny":
        raise ValueError("a --quick record (tiny model): the costs are Llama-3-8B's")
    servers = int(config.get("servers", 2))
    gpus = int(config.get("gpus", 1))
    spec = FleetSpec(
        servers=servers,
        servers_per_gpu=max(1, servers // gpus),
        mem_fraction_static=float(config["mem_fraction_static"]),
        hicache_ratio=2.0,  # bench_verl_pattern.server_flags
        max_running=2 * int(config["sessions"]),
    )
    rollout = Rollout(
        sessions=int(config["sessions"]),
        turns=int(config["turns"]),
        context=int(config["context"]),
        user_tokens=int(config["user_tokens"]),
        new_tokens=int(config["new_tokens"]),
        pinned=int(config["skewed"]),
        hot_servers=1,
        seed=int(config.get("seed", 0)),
    )
    verl = str(config.get("default_balancer", "verl.")).startswith("verl.")
    return spec, rollout, {**config, "verl": verl}


def predict_verl(config: dict[str, Any], costs: Any = None) -> dict[str, dict[str, Any]]:
    """Every arm of `bench_verl_pattern.py` and the bound, simulated for `config`."""
    spec, rollout, balancer = verl_setup(config)
    costs = costs or fleet_costs.derive(cuda_graphs=True)
    return {
        p: run_rollout(spec, rollout, p, costs, balancer).summary() for p in (*arms.ARMS, BOUND)
    }


def compare_verl_record(record: dict[str, Any], costs: Any = None) -> dict[str, Any]:
    """Per arm: the measured makespan (median, min, max over repeats), the simulated one,
    the error and whether it is within `TOLERANCE`; the bound's makespan beside them."""
    predicted = predict_verl(record["config"], costs)
    measured = record["summary"]["arms"]
    rows = []
    for arm in arms.ARMS:
        got = (measured.get(arm) or {}).get("makespan_s")
        sim = predicted[arm]["makespan_s"]
        err = error(sim, got["median"] if got else None)
        rows.append(
            {
                "arm": arm,
                "measured_s": got,
                "simulated_s": sim,
                "error": err,
                "within": None if err is None else abs(err) <= TOLERANCE,
                "simulated_moves": predicted[arm]["moves"],
                "measured_moves": (measured.get(arm) or {}).get("moves"),
            }
        )
    return {
        "rows": rows,
        "bound_s": predicted[BOUND]["makespan_s"],
        "all_within": all(r["within"] for r in rows if r["within"] is not None),
    }


# ---------------------------------------------------------------------------- scenes


def scene_graphs(config: dict[str, Any]) -> bool:
    """Whether a scene record's servers ran CUDA graphs: records from before the option
    existed ran the servers eager (`real_servers` passed --disable-cuda-graph then)."""
    return "no_cuda_graph" in config and not config["no_cuda_graph"]


def compare_rows(
    name: str, measured_rows: list[dict[str, Any]], simulate: Any
) -> list[dict[str, Any]]:
    out = []
    for row in measured_rows:
        sim = simulate(row["mode"])
        for metric in METRICS:
            out.append(
                {
                    "record": name,
                    "mode": row["mode"],
                    "metric": metric,
                    "measured": row.get(metric),
                    "simulated": sim.get(metric),
                    "error": error(sim.get(metric), row.get(metric)),
                }
            )
    return out


def validate_existing(runs_dir: Path = RUNS_DIR) -> list[dict[str, Any]]:
    """Every end-to-end record's modes, measured beside simulated (see the module
    docstring)."""
    rows: list[dict[str, Any]] = []
    profiles = {g: fleet_costs.derive(cuda_graphs=g) for g in (False, True)}
    for name in SCENE_RECORDS:
        record = json.loads((runs_dir / name).read_text())
        costs = profiles[scene_graphs(record["config"])]
        rows += compare_rows(
            name,
            record["rows"],
            lambda m, r=record, c=costs: fleet_scenes.simulate_rl_scene(r, m, c),
        )
    for name in ROLLOUT_RECORDS:
        record = json.loads((runs_dir / name).read_text())
        costs = profiles[scene_graphs(record["config"])]
        rows += compare_rows(
            name,
            record["rows"],
            lambda m, r=record, c=costs: fleet_scenes.simulate_rollout(r, m, c),
        )
    return rows


def error_summary(rows: list[dict[str, Any]], metric: str = "makespan_s") -> dict[str, Any]:
    """Median and largest absolute error of one metric over the rows, and how many are
    within `TOLERANCE`."""
    errs = [abs(r["error"]) for r in rows if r["metric"] == metric and r["error"] is not None]
    if not errs:
        return {"n": 0}
    return {
        "n": len(errs),
        "median_abs": round(statistics.median(errs), 4),
        "max_abs": round(max(errs), 4),
        "within": sum(e <= TOLERANCE for e in errs),
    }
