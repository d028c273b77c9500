"""The fleet simulation's record (`docs/sim/fleet_sim.json`) as results-page tables and a plot.

Pure reading and formatting: `benchmark/results.py` renders the page's `fleet-sim-*`
blocks with these functions, and `bench_fleet_sim.py` writes the record and the PNG.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "sim" / "fleet_sim.json"
PLOT = ROOT / "docs" / "fleet-sim.png"
POLICY_NAMES = {
    "default": "verl (sticky)",
    "repin_reprefill": "re-pin, re-prefill",
    "repin_migrate": "re-pin, migrate",
    "bound": "bound",
}


def load(path: Path = RECORD) -> dict[str, Any]:
    return json.loads(path.read_text())


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.0f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def validation_block(record: Mapping[str, Any]) -> str:
    """Measured beside simulated, per record and mode, and the error summary."""
    rows = []
    by_key: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in record["validation"]["rows"]:
        by_key.setdefault((r["record"], r["mode"]), {})[r["metric"]] = r
    for (name, mode), metrics in by_key.items():
        cells = []
        for metric in ("makespan_s", "high_p99_s", "low_p99_s"):
            m = metrics[metric]
            cells.append(f"{_num(m['measured'])} / {_num(m['simulated'])} ({_pct(m['error'])})")
        rows.append([Path(name).name.removesuffix(".json"), mode, *cells])
    head = [
        "record (one run each)",
        "mode",
        "makespan s: measured / sim (error)",
        "high p99 s",
        "low p99 s",
    ]
    summary = record["validation"]["summary"]
    lines = [
        f"- {metric}: median |error| {_pct(s.get('median_abs')).lstrip('+')}, largest "
        f"{_pct(s.get('max_abs')).lstrip('+')}, {s.get('within')} of {s.get('n')} within 15%"
        for metric, s in summary.items()
    ]
    noise = record["validation"]["same_work_spread"]
    lines.append(
        f"- run-to-run spread of the same work: A's {noise['requests']} identical low-priority "
        f"decodes finished after {_num(noise['min'])}–{_num(noise['max'])} s (median "
        f"{_num(noise['median'])}) across the {noise['n']} mode runs of the scene records; "
        f"simulated {_num(noise['sim_min'])}–{_num(noise['sim_max'])} s"
    )
    return _table(head, rows) + "\n\n" + "\n".join(lines)


def verl_block(record: Mapping[str, Any]) -> str:
    """Predicted makespans of `bench_verl_pattern.py` configurations, per arm."""
    rows = []
    for pred in record["verl_predictions"]:
        arms = pred["arms"]
        bound = arms["bound"]["makespan_s"]
        cells = [f"{arms[p]['makespan_s']:.1f}" for p in POLICY_NAMES]
        mig = arms["repin_migrate"]["makespan_s"]
        ratios = (
            f"{mig / arms['repin_reprefill']['makespan_s']:.2f} / "
            f"{mig / arms['default']['makespan_s']:.2f}"
        )
        moves = ", ".join(f"{k} {v}" for k, v in arms["repin_migrate"]["moves"].items()) or "—"
        rows.append([pred["label"], *cells, ratios, moves, f"{mig / bound:.2f}"])
    head = [
        "configuration",
        *(f"{n} s" for n in POLICY_NAMES.values()),
        "migrate / re-prefill / verl (targets 0.8 / 0.85)",
        "migrate arm's moves",
        "migrate / bound",
    ]
    return _table(head, rows)


def _ratio(row: Mapping[str, Any], policy: str) -> float:
    pol = row["policies"]
    return pol[policy]["makespan_s"] / pol["bound"]["makespan_s"]


def sweep_block(record: Mapping[str, Any]) -> str:
    """Per context and skew: each policy's makespan over the bound at every fleet size,
    then what the whole sweep says."""
    rows_in = record["sweep"]["rows"]
    sizes = sorted({r["servers"] for r in rows_in})
    cells: dict[tuple[int, float], dict[int, Mapping[str, Any]]] = {}
    for r in rows_in:
        cells.setdefault((r["context"], r["hot_load"]), {})[r["servers"]] = r
    rows = []
    for (context, load), by_size in sorted(cells.items()):
        largest = by_size[max(by_size)]
        ratios = [
            " / ".join(f"{_ratio(by_size[n], p):.2f}" for n in sizes if n in by_size)
            for p in POLICY_NAMES
            if p != "bound"
        ]
        moves = ", ".join(
            f"{k} {v:,}" for k, v in largest["policies"]["repin_migrate"]["moves"].items()
        )
        bound = largest["policies"]["bound"]["makespan_s"]
        rows.append([f"{context // 1024}K", f"{load:g}×", f"{bound:.1f}", *ratios, moves or "—"])
    per = " / ".join(str(n) for n in sizes)
    head = [
        "context",
        "hot quarter's load",
        f"bound s ({sizes[-1]} servers)",
        *(f"{POLICY_NAMES[p]} / bound ({per} servers)" for p in POLICY_NAMES if p != "bound"),
        f"migrate arm's re-pins ({sizes[-1]} servers)",
    ]
    return _table(head, rows) + "\n\n" + "\n".join(sweep_headline(rows_in))


def sweep_headline(rows: list[Mapping[str, Any]]) -> list[str]:
    """What the sweep says, computed: each policy's range over the bound, and in how many
    skewed cells migration beats re-prefill and verl's sticky placement."""
    skewed = [r for r in rows if r["hot_load"] > 1]
    balanced = [r for r in rows if r["hot_load"] <= 1]
    lines = []
    for policy in ("repin_migrate", "repin_reprefill", "default"):
        vals = [_ratio(r, policy) for r in skewed]
        lines.append(
            f"- {POLICY_NAMES[policy]}, skewed cells: {min(vals):.2f}–{max(vals):.2f}× the bound"
        )
    mig = lambda r: r["policies"]["repin_migrate"]["makespan_s"]  # noqa: E731
    beats_re = sum(mig(r) < r["policies"]["repin_reprefill"]["makespan_s"] for r in skewed)
    beats_verl = sum(mig(r) < r["policies"]["default"]["makespan_s"] for r in skewed)
    lines.append(
        f"- re-pin with migration is faster than re-pin with re-prefill in {beats_re} "
        f"of {len(skewed)} skewed cells, and than verl's sticky placement in "
        f"{beats_verl} of {len(skewed)}"
    )
    if balanced:
        moved = sum(sum(r["policies"]["repin_migrate"]["moves"].values()) for r in balanced)
        worst = max(_ratio(r, "repin_migrate") for r in balanced)
        lines.append(
            f"- without skew: {moved:,} re-pins over {len(balanced)} cells, the "
            f"migrate arm at most {worst:.2f}× the bound"
        )
    return lines


def plot(record: Mapping[str, Any], path: Path = PLOT) -> bool:
    """Makespan over the bound against skew, one panel per context, at the largest fleet."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = record["sweep"]["rows"]
    largest = max(r["servers"] for r in rows)
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), sharey=True)
    for ax, ctx in zip(axes if len(contexts) > 1 else [axes], contexts, strict=True):
        mine = sorted(
            (r for r in rows if r["servers"] == largest and r["context"] == ctx),
            key=lambda r: r["hot_load"],
        )
        for policy, name in POLICY_NAMES.items():
            ys = [
                r["policies"][policy]["makespan_s"] / r["policies"]["bound"]["makespan_s"]
                for r in mine
            ]
            ax.plot([r["hot_load"] for r in mine], ys, "o-", label=name)
        ax.set_title(f"{largest} servers, {ctx // 1024}K context")
        ax.set_xlabel("load on the hot quarter (x mean)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    first = axes[0] if len(contexts) > 1 else axes
    first.set_ylabel("makespan / bound")
    first.legend()
    fig.suptitle("Fleet simulation: verl's placement vs re-pinning (re-prefill / migrate)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True
