"""The RL scene's report (`bench_rl_scene.py`): the measured turns, each mode's row, the
result file, the table and the plot. Pure except for the file and the plot; the pooling
over repeats is `rl_scene_stats.py`'s.

The result file holds, per variant of the scene (`room`: the target's GPU has room for
the moved histories; `full`: the target's own decodes fill its GPU pool), the pooled
rows, the pooled ratios and each repeat's own (`repeat_ratios`), every repeat's rows,
and every turn's completion seconds (`turn_seconds`, what `--merge` pools); beside them
every turn and move of every run (`turns`, keyed "<variant>:<repeat>:<mode>").

Where each move landed: `landing_tier` is the tier the client's result says the target
wrote into (its `landing_tier` field, None while the client does not report one), and
`target_cached` what the target then served the moved turn from (the resumed piece's
`cached_tokens_details`: tokens from its GPU and from its host tier).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import rl_scene_stats as stats


@dataclass
class Turn:
    """One request of the measured phase, as the report needs it."""

    kind: str  # "high" (a conversation's next turn) or "low"
    key: int
    arrival_s: float  # since the mode started
    seconds: float = 0.0  # arrival -> whole output
    servers: list[str] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    held_tokens: int = 0  # what A held of the prompt at arrival (high turns)
    device_tokens: int = 0  # ... of it on A's GPU
    # Moved turns: what the target served the resumed request from ({"device", "host"}).
    target_cached: dict[str, int] = field(default_factory=dict)


@dataclass
class ModeResult:
    mode: str
    makespan_s: float
    turns: list[Turn]
    prefill_tokens: float | None
    rebalancer: dict[str, Any]


@dataclass(frozen=True)
class Run:
    """One mode of one repeat of one variant."""

    variant: str
    repeat: int
    result: ModeResult


def move_record(report: Any) -> dict[str, Any]:
    """A move as the file keeps it, from the request migrator's `MoveReport`."""
    m = report.migration
    reported = m.to_dict() if m else {}
    return {
        "outcome": report.outcome,
        "path": m.path if m else "",
        "landing_tier": reported.get("landing_tier"),
        "migrated_tokens": m.migrated_token_size if m else 0,
        "phases_s": m.timings if m else {},
        "move_s": report.seconds,
        "estimate": report.estimate.to_dict() if report.estimate else None,
        "failure": report.failure,
    }


def served_from(meta_info: dict[str, Any]) -> dict[str, int]:
    """`cached_tokens_details` of a reply's meta_info as device / host token counts."""
    details = meta_info.get("cached_tokens_details") or {}
    return {"device": int(details.get("device") or 0), "host": int(details.get("host") or 0)}


def landing(moves: list[dict[str, Any]]) -> dict[str, int]:
    """How many moves took each path and landing tier ("device path -> host tier"),
    "unreported" where the client named no tier."""
    counts = Counter(
        f"{m['path'] or m['outcome']} -> {m.get('landing_tier') or 'unreported'}" for m in moves
    )
    return dict(sorted(counts.items()))


def summarize(result: ModeResult, baseline: ModeResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": result.mode, "makespan_s": round(result.makespan_s, 2)}
    for kind in ("high", "low"):
        times = sorted(t.seconds for t in result.turns if t.kind == kind)
        row[f"{kind}_p50_s"] = round(stats.percentile(times, 50), 3) if times else None
        row[f"{kind}_p99_s"] = round(stats.percentile(times, 99), 3) if times else None
    row["prefill_tokens"] = result.prefill_tokens
    moves = [m for t in result.turns for m in t.moves]
    row["moves"] = len(moves)
    row["paths"] = sorted({m["path"] or m["outcome"] for m in moves})
    row["landing"] = landing(moves)
    highs = [t for t in result.turns if t.kind == "high"]
    moved = [t for t in highs if t.moves]
    row["target_cached"] = {
        tier: sum(t.target_cached.get(tier, 0) for t in moved) for tier in ("device", "host")
    }
    row["held_on_host_tokens"] = sum(t.held_tokens - t.device_tokens for t in highs)
    row["held_on_device_tokens"] = sum(t.device_tokens for t in highs)
    if baseline is not None:
        same = {t.key: t.output_ids for t in baseline.turns if t.kind == "high"}
        row["moved_outputs_identical"] = sum(t.output_ids == same.get(t.key) for t in moved)
        row["moved"] = len(moved)
    return row


def turn_seconds(runs: list[Run]) -> dict[str, dict[str, dict[str, dict]]]:
    """variant -> mode -> repeat (as a string: JSON keys) -> kind -> completion seconds."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for run in runs:
        kinds = {k: [t.seconds for t in run.result.turns if t.kind == k] for k in stats.KINDS}
        out.setdefault(run.variant, {}).setdefault(run.result.mode, {})[str(run.repeat)] = kinds
    return out


def variant_block(runs: list[Run], seconds: dict[str, Any]) -> dict[str, Any]:
    """One variant's rows (pooled over its repeats; makespan, prefill and moves their
    medians), ratios and each repeat's rows."""
    repeat_rows = []
    for rep in sorted({r.repeat for r in runs}):
        mine = [r.result for r in runs if r.repeat == rep]
        baseline = next((m for m in mine if m.mode == "none"), None)
        repeat_rows += [{"repeat": rep, **summarize(m, baseline)} for m in mine]
    rows = stats.pooled_rows(seconds)
    for row in rows:
        mine = [r for r in repeat_rows if r["mode"] == row["mode"]]
        for key in ("makespan_s", "prefill_tokens", "moves"):
            present = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(present) if present else None
        row["landing"] = dict(sum((Counter(r["landing"]) for r in mine), Counter()))
    return {
        "rows": rows,
        "ratios": stats.ratios(rows),
        "repeat_ratios": stats.repeat_ratios(seconds),
        "repeat_rows": repeat_rows,
        "turn_seconds": seconds,
    }


def result_file(
    config: dict[str, Any], scenes: dict[str, Any], runs: list[Run], errors: dict[str, str]
) -> dict[str, Any]:
    """The whole result file's content."""
    seconds = turn_seconds(runs)
    variants = {
        v: variant_block([r for r in runs if r.variant == v], seconds[v])
        for v in stats.VARIANTS
        if v in seconds
    }
    return {
        "config": config,
        "scenes": scenes,
        "variants": variants,
        "errors": errors,
        "turns": {
            f"{r.variant}:{r.repeat}:{r.result.mode}": [
                asdict(t) | {"output_ids": len(t.output_ids)} for t in r.result.turns
            ]
            for r in runs
        },
        "rebalancer": {
            f"{r.variant}:{r.repeat}:{r.result.mode}": r.result.rebalancer for r in runs
        },
    }


def write(path: Path, content: dict[str, Any]) -> None:
    """Rewrite the file whole (through a temporary file: a job cut at its limit never
    leaves half a JSON document)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(content, indent=1))
    tmp.replace(path)


COLUMNS = (
    "mode", "repeat", "repeats", "high_turns", "high_p50_s", "high_p99_s", "high_p99_spread_s",
    "low_p50_s", "low_p99_s", "low_p99_spread_s", "makespan_s", "prefill_tokens", "moves",
    "landing", "held_on_host_tokens", "moved_outputs_identical",
)  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = ["high_p50_s", "high_p99_s", "low_p50_s", "low_p99_s"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax1.bar([j + i * width for j in range(len(keys))], [row[k] or 0 for k in keys], width,
                label=row["mode"])  # fmt: skip
    ax1.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))],
                   [k.removesuffix("_s").replace("_", " ") for k in keys])  # fmt: skip
    ax1.set_ylabel("completion from arrival (s)")
    ax1.legend()
    ax2.bar([r["mode"] for r in rows], [r["makespan_s"] or 0 for r in rows], color="gray")
    ax2.set_ylabel("makespan (s)")
    ax2b = ax2.twinx()
    ax2b.plot([r["mode"] for r in rows], [r["prefill_tokens"] or 0 for r in rows], "o-", color="C3")
    ax2b.set_ylabel("prefill tokens computed", color="C3")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def print_final(content: dict[str, Any], out_dir: Path, stem: str, title: str) -> None:
    """Each variant's tables and ratios, and its plot."""
    for variant, block in content["variants"].items():
        print(f"## target GPU {variant}")
        print(markdown(block["rows"]))
        print(markdown(block["repeat_rows"]))
        print(json.dumps({"pooled": block["ratios"], "per_repeat": block["repeat_ratios"]}))
        png = out_dir / f"{stem}_{variant}.png"
        drawn = bool(block["rows"]) and plot(block["rows"], png, f"{title}, target GPU {variant}")
        print(f"plot: {png}" if drawn else "plot: matplotlib not installed (or no rows)")
