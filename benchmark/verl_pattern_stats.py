"""The verl-pattern benchmark's aggregation (`bench_verl_pattern.py`): pure, tested on CPU.

Each repeat runs one rollout step per arm and gives, per arm, the step's makespan and
every turn's latency and greedy output. Per arm: the makespan and the per-repeat p50 and
p99 of the turn latencies, each as the median over repeats with its min and max; the
ratios of the medians against the targets and against the bound (balanced from the
start, every turn served from its own server's cache: no skew to undo); and whether
every turn's output is the same token list in every arm of the same repeat. Result
files of separate runs (a few repeats per device call) merge into one summary.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spreads import rounded_spread

DEFAULT = "default"  # verl's balancer: sticky + least in flight, never re-pins
REPREFILL = "repin_reprefill"  # re-pins; the new server re-prefills the history
MIGRATE = "repin_migrate"  # re-pins; the history's KV migrates first
BOUND = "balanced_bound"  # no skew: sessions spread from their first turn, never re-pinned
ARMS = (DEFAULT, REPREFILL, MIGRATE, BOUND)
# The targets on the median step makespan.
TARGETS = {
    "makespan_migrate_over_reprefill": 0.8,  # <=
    "makespan_migrate_over_default": 0.85,  # <=
}


def context_lengths(seed: int, n: int, shortest: int, longest: int | None) -> list[int]:
    """Each session's first prompt length: `shortest` for all without `longest`; else
    skewed toward `shortest` with a long tail up to `longest` (shortest + span * u**3,
    u uniform: the mean sits a quarter of the way up), in whole pages of 16, shuffled."""
    if longest is None or longest <= shortest:
        return [shortest] * n
    rng = random.Random(f"lengths/{seed}")
    span = longest - shortest
    lengths = [shortest + int(span * rng.random() ** 3) // 16 * 16 for _ in range(n)]
    rng.shuffle(lengths)
    return lengths


def percentile(values: Sequence[float], q: float) -> float:
    """The inclusive q-th percentile (q in 1..99); one value is its own percentile."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def arm_summary(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One arm over its repeats. Each step: `makespan_s` and `turns`, a list of
    `{"latency_s": ...}`; optional `moves` (outcome -> count) are summed."""
    makespans = [float(s["makespan_s"]) for s in steps]
    p50s = [percentile([t["latency_s"] for t in s["turns"]], 50) for s in steps]
    p99s = [percentile([t["latency_s"] for t in s["turns"]], 99) for s in steps]
    moves: dict[str, int] = {}
    for step in steps:
        for outcome, count in (step.get("moves") or {}).items():
            moves[outcome] = moves.get(outcome, 0) + int(count)
    return {
        "repeats": len(steps),
        "turns": sum(len(s["turns"]) for s in steps),
        "makespan_s": rounded_spread(makespans, 4),
        "turn_p50_s": rounded_spread(p50s, 4),
        "turn_p99_s": rounded_spread(p99s, 4),
        "moves": moves,
    }


def _median(summary: Mapping[str, Any] | None, key: str) -> float | None:
    if not summary or not summary.get(key):
        return None
    return summary[key]["median"]


def ratios(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Median makespan and p99 of re-pin-with-migration over the other arms (over the
    bound: how far from it migration stays)."""
    out: dict[str, float | None] = {}
    for key, short in (("makespan_s", "makespan"), ("turn_p99_s", "p99")):
        mine = _median(summaries.get(MIGRATE), key)
        for other, name in ((REPREFILL, "reprefill"), (DEFAULT, "default"), (BOUND, "bound")):
            theirs = _median(summaries.get(other), key)
            ok = mine is not None and theirs
            out[f"{short}_migrate_over_{name}"] = round(mine / theirs, 4) if ok else None
    return out


def repeat_ratios(steps: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Each repeat's own makespan of re-pin-with-migration over the other arms', over
    the repeats that ran both (steps without a `repeat` pair up by position):
    `{"median", "min", "max", "n"}` or None."""

    def by_repeat(arm: str) -> dict[Any, float]:
        return {
            s.get("repeat", i): float(s["makespan_s"]) for i, s in enumerate(steps.get(arm, ()))
        }

    mine = by_repeat(MIGRATE)
    out: dict[str, Any] = {}
    for other, name in ((REPREFILL, "reprefill"), (DEFAULT, "default"), (BOUND, "bound")):
        theirs = by_repeat(other)
        values = [mine[r] / theirs[r] for r in mine if theirs.get(r)]
        out[f"makespan_migrate_over_{name}"] = rounded_spread(values, 4)
    return out


def output_mismatches(outputs: Mapping[str, Mapping[str, Sequence[int]]]) -> list[str]:
    """Turn keys (`session/turn`) whose output differs between arms of one repeat, or that
    one arm has and another lacks. `outputs`: arm -> turn key -> output token ids."""
    keys = sorted({k for per_arm in outputs.values() for k in per_arm})
    bad = []
    for key in keys:
        seen = [tuple(per_arm[key]) if key in per_arm else None for per_arm in outputs.values()]
        if len(set(seen)) > 1:
            bad.append(key)
    return bad


def targets(ratio: Mapping[str, float | None], identical: bool) -> dict[str, bool | None]:
    """Each target met (True), missed (False) or not measured (None)."""
    met: dict[str, bool | None] = {}
    for key, limit in TARGETS.items():
        value = ratio.get(key)
        met[key] = None if value is None else value <= limit
    met["identical_greedy_outputs"] = identical
    return met


def summarize(
    steps: Mapping[str, Sequence[Mapping[str, Any]]],
    mismatches: Mapping[Any, Sequence[str]],
) -> dict[str, Any]:
    """The result's summary: per-arm rows, ratios, target verdicts. `steps`: arm -> one
    step per repeat; `mismatches`: repeat -> turn keys whose outputs differed."""
    summaries = {arm: arm_summary(steps[arm]) for arm in ARMS if steps.get(arm)}
    ratio = ratios(summaries)
    compared = len(mismatches) > 0
    identical = compared and not any(mismatches.values())
    return {
        "arms": summaries,
        "ratios": ratio,
        "repeat_ratios": repeat_ratios(steps),
        "mismatched_turns": {str(k): list(v) for k, v in mismatches.items()},
        "targets": targets(ratio, identical),
    }


def merge(records: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The steps and mismatches of several result files (`(name, record)` pairs), each
    repeat keyed "<name>:<repeat>" so that two files' repeat 0 stay apart."""
    steps: dict[str, list[dict[str, Any]]] = {}
    mismatches: dict[str, list[str]] = {}
    for name, record in records:
        for arm, arm_steps in record.get("steps", {}).items():
            for step in arm_steps:
                steps.setdefault(arm, []).append({**step, "repeat": f"{name}:{step['repeat']}"})
        compared = record.get("mismatched_turns")
        if compared is None:  # files written before the field moved out of the summary
            compared = record.get("summary", {}).get("mismatched_turns", {})
        for repeat, keys in compared.items():
            mismatches[f"{name}:{repeat}"] = list(keys)
    return {"steps": steps, "mismatches": mismatches}


def write_result(path: Path, result: Mapping[str, Any]) -> None:
    """Rewrite the whole result file (small), through a temporary file so that a job cut
    at its limit never leaves half a JSON document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def table(summary: Mapping[str, Any]) -> str:
    """Markdown rows for docs/benchmarks.md: median (min–max) per arm."""

    def cell(value: Mapping[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
        if not value:
            return "—"
        m, lo, hi = (value[k] * scale for k in ("median", "min", "max"))
        return f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"

    lines = [
        "| arm | repeats | step makespan s | turn p50 ms | turn p99 ms | moves |",
        "|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        moves = ", ".join(f"{k} {v}" for k, v in sorted(row["moves"].items())) or "—"
        lines.append(
            f"| {arm} | {row['repeats']} | {cell(row['makespan_s'])} | "
            f"{cell(row['turn_p50_s'], 1000, 0)} | {cell(row['turn_p99_s'], 1000, 0)} | {moves} |"
        )
    return "\n".join(lines)
