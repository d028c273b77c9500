"""The RL scene's aggregation over repeats (`bench_rl_scene.py`): pure, tested on CPU.

Each repeat gives, per mode, the completion seconds of every high- and low-priority
turn. The p99 is taken over all turns of all repeats together (24 turns x 3 repeats =
72 samples, not the max of 24), with its spread: the lowest and highest per-repeat p99;
beside the pooled ratios, each ratio of one repeat's own p99s, as median (min–max, n).
Each variant of the scene (the target's GPU with room, or full) is pooled on its own.
Files written by separate runs (one repeat per device call) merge the same way.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

KINDS = ("high", "low")
# The targets at every context.
TARGETS = {
    "high_p99_migrate_over_recompute": 0.4,  # <=
    "high_p99_migrate_over_none": 0.15,  # <=
    "low_p99_migrate_over_none": 1.05,  # <=
}

# mode -> repeat -> kind -> completion seconds of every turn of that kind
Seconds = Mapping[str, Mapping[Any, Mapping[str, Sequence[float]]]]
ROOM = "room"  # the target's GPU has room for the moved histories
FULL = "full"  # the target's own decodes fill its GPU pool
VARIANTS = (ROOM, FULL)
# Each ratio: (kind, mode over, mode under).
RATIO_PARTS = {
    "high_p99_migrate_over_recompute": ("high", "migrate", "recompute"),
    "high_p99_migrate_over_none": ("high", "migrate", "none"),
    "low_p99_migrate_over_none": ("low", "migrate", "none"),
}


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def pooled_rows(seconds: Seconds) -> list[dict[str, Any]]:
    """Per mode: p50 and p99 over every turn of every repeat, per kind, with the
    per-repeat p99s' min and max and the number of turns and repeats."""
    rows = []
    for mode, repeats in seconds.items():
        row: dict[str, Any] = {"mode": mode, "repeats": len(repeats)}
        for kind in KINDS:
            per_repeat = [list(r.get(kind, ())) for r in repeats.values()]
            pooled = [s for values in per_repeat for s in values]
            row[f"{kind}_turns"] = len(pooled)
            if not pooled:
                row.update({f"{kind}_p50_s": None, f"{kind}_p99_s": None})
                row[f"{kind}_p99_spread_s"] = None
                continue
            row[f"{kind}_p50_s"] = round(percentile(pooled, 50), 3)
            row[f"{kind}_p99_s"] = round(percentile(pooled, 99), 3)
            p99s = [percentile(v, 99) for v in per_repeat if v]
            row[f"{kind}_p99_spread_s"] = [round(min(p99s), 3), round(max(p99s), 3)]
        rows.append(row)
    return rows


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's three ratios of pooled p99s, each with its target and verdict."""
    by = {r["mode"]: r for r in rows}

    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in by or b not in by or not by[b].get(key) or by[a].get(key) is None:
            return None
        return round(by[a][key] / by[b][key], 3)

    values = {
        name: ratio(over, under, f"{kind}_p99_s")
        for name, (kind, over, under) in RATIO_PARTS.items()
    }
    return {
        name: {
            "value": value,
            "target_max": TARGETS[name],
            "met": None if value is None else value <= TARGETS[name],
        }
        for name, value in values.items()
    }


def repeat_ratios(seconds: Seconds) -> dict[str, dict[str, Any] | None]:
    """Each ratio of the issue per repeat (of that repeat's own p99s), over the repeats
    that ran both modes: `{"median", "min", "max", "n"}`, None where none did."""
    out: dict[str, dict[str, Any] | None] = {}
    for name, (kind, over, under) in RATIO_PARTS.items():
        values = []
        for rep, kinds in seconds.get(over, {}).items():
            mine, theirs = kinds.get(kind), seconds.get(under, {}).get(rep, {}).get(kind)
            if mine and theirs and percentile(theirs, 99) > 0:
                values.append(percentile(mine, 99) / percentile(theirs, 99))
        out[name] = None
        if values:
            out[name] = {
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
                "n": len(values),
            }
    return out


def variant_seconds(record: Mapping[str, Any]) -> dict[str, Any]:
    """variant -> `Seconds` of one result file; a file written before the variants
    holds the target-with-room scene only."""
    if "variants" in record:
        return {v: data.get("turn_seconds", {}) for v, data in record["variants"].items()}
    return {ROOM: record.get("turn_seconds", {})}


def merge(files: Iterable[Path]) -> dict[str, dict[str, dict[str, dict[str, list[float]]]]]:
    """Per variant, the turn seconds of several result files of one context, repeats
    kept apart (keyed "<file stem>:<repeat>" so two files' repeat 0 do not collide)."""
    merged: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for path in files:
        data = json.loads(Path(path).read_text())
        for variant, seconds in variant_seconds(data).items():
            for mode, repeats in seconds.items():
                for rep, kinds in repeats.items():
                    key = f"{Path(path).stem}:{rep}"
                    merged.setdefault(variant, {}).setdefault(mode, {})[key] = kinds
    return merged
