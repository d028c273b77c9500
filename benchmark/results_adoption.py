"""The results page's blocks for what an RL team would adopt the package for: what the
flag costs a server that never moves (`bench_flag_cost.py`), verl's pattern at scale
(`bench_verl_pattern.py`) and the RL scene per context and target variant
(`bench_rl_scene.py`). Each is computed from the raw records, through the benchmark's
own pure stats module, never from a summary the run wrote.

A block joins `results.py`'s page once its records are named in `RUNS` below (paths
under `docs/gpu-runs/`; a list, because a figure may pool the repeats of several device
calls); until then it is not rendered, and `--check` ignores it. Before naming a fresh
record, see its block with

    python3 benchmark/results.py --show flag-cost PATH.json
    python3 benchmark/results.py --show verl-scale A.json B.json
    python3 benchmark/results.py --show rl-scenes 8192=A.json 8192=B.json 16384=C.json

then add `<!-- results:NAME -->` / `<!-- /results:NAME -->` markers to the page and
`--write`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flag_cost_stats
import rl_scene_stats
import verl_pattern_stats

# Block name -> the records it reads (empty: not measured yet, the block stays off the
# page). rl-scenes: "<context>=<path>", several files of one context pooled.
RUNS: dict[str, list[str]] = {
    "flag-cost": ["2026-12-06/flagcost-bench_flag_cost.json"],
    "verl-scale": [],
    "rl-scenes": [],
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _card(record: Mapping[str, Any]) -> str:
    card = record.get("config", {}).get("card") or {}
    return card.get("name") or "card not recorded"


def _spread(s: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not s:
        return "—"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f} (one run)"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f}, n={s['n']})"


def _verdict(value: float | None, limit: float) -> str:
    if value is None:
        return "not measured"
    return "met" if value <= limit else f"**missed by {value - limit:.3f}**"


# ---------------------------------------------------------------- flag cost


def block_flag_cost(paths: Sequence[Path]) -> str:
    """Every server's median (min–max, rounds) per row, HiCache's and the flag's costs,
    the A/A spread and the verdict; the servers' start-up times, how the A/A spread was
    taken and the cells an error lost below; then, per TTFT row and round, the flag's
    server less the HiCache server in that round (the servers' order in the round)."""
    (path,) = paths  # one run: its servers' rounds are interleaved, never pooled
    record = _load(path)
    servers = [s["name"] for s in record["servers"]]
    summary = flag_cost_stats.summarize(record["rounds"], servers)
    starts = ", ".join(f"{s['name']} {s['startup_s']:.0f} s" for s in record["servers"])
    aa = (
        "a twin HiCache server's median against the HiCache server's"
        if flag_cost_stats.TWIN in servers
        else "no twin server: half the range of the HiCache server's own rounds over their median"
    )
    errors = record.get("errors") or {}
    lost = "; ".join(f"round {k.replace(':', ', ', 1).replace(':', ' on ')}: {v}"
                     for k, v in sorted(errors.items()))  # fmt: skip
    ttft = [c.name for c in flag_cost_stats.cells_in(record["rounds"]) if c.name.startswith("ttft")]
    return (
        flag_cost_stats.table(summary)
        + f"\n\n{_card(record)}, {summary['rounds']} interleaved rounds, "
        f"{record['config'].get('kv_tokens')} KV tokens per server; start-ups: {starts}. "
        f"Every row within 1% or the A/A spread: {'yes' if summary['all_met'] else 'no'}. "
        f"A/A spread: {aa}. Cells lost to errors ({len(errors)}): {lost or 'none'}.\n\n"
        "Per round, the flag's server less the HiCache server, ms (S: SGLang, H: + HiCache, "
        "F: + HiCache + flag, in the round's order):\n\n"
        + flag_cost_stats.paired_table(record["rounds"], ttft)
        + "\n\nThe same for SGLang without HiCache or the plugin (S) less the HiCache server:"
        "\n\n" + flag_cost_stats.paired_table(record["rounds"], ttft, flag_cost_stats.STOCK)
    )


# ---------------------------------------------------------------- verl pattern


def block_verl_scale(paths: Sequence[Path]) -> str:
    """Per arm the makespan and turn p50/p99 over the pooled repeats, then the targets
    on the median of each repeat's own ratio (the ratio of the medians beside it)."""
    records = [(p.stem, _load(p)) for p in paths]
    merged = verl_pattern_stats.merge(records)
    summary = verl_pattern_stats.summarize(merged["steps"], merged["mismatches"])
    per_repeat, pooled = summary["repeat_ratios"], summary["ratios"]
    lines = [verl_pattern_stats.table(summary), ""]
    for key, limit in (*verl_pattern_stats.TARGETS.items(), ("makespan_migrate_over_bound", None)):
        value = per_repeat.get(key)
        goal = f" ≤ {limit}" if limit is not None else ""
        verdict = "" if limit is None else f" — {_verdict(value and value['median'], limit)}"
        lines.append(
            f"- {key.replace('_', ' ')}{goal}: {_spread(value)} per repeat "
            f"(medians' ratio {pooled.get(key)}){verdict}"
        )
    identical = summary["targets"]["identical_greedy_outputs"]
    config = records[0][1]["config"]
    lines.append(
        f"- greedy outputs identical in every arm of every repeat: {'yes' if identical else 'no'}"
        f" ({config['sessions']} sessions, {config['skewed']} pinned to A, {config['turns']} "
        f"turns; {_card(records[0][1])})"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- RL scene


def _moves(records: Sequence[Mapping[str, Any]], variant: str) -> str:
    """The migrate mode's moves by path and landing tier, over every record."""
    counts: Counter[str] = Counter()
    for record in records:
        for key, turns in record.get("turns", {}).items():
            parts = key.split(":")
            if len(parts) == 3 and parts[0] == variant and parts[2] == "migrate":
                for turn in turns:
                    for move in turn["moves"]:
                        tier = move.get("landing_tier") or "unreported"
                        counts[f"{move['path'] or move['outcome']} → {tier}"] += 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "—"


def block_rl_scenes(entries: Sequence[str], runs_dir: Path) -> str:
    """Per context and variant: the three p99 ratios pooled over every turn of every
    repeat, each repeat's own ratio as median (min–max, n), the verdict on the pooled
    one, and the migrate mode's moves by path and landing tier."""
    by_context: dict[int, list[Path]] = {}
    for entry in entries:
        context, _, rel = entry.partition("=")
        by_context.setdefault(int(context), []).append(runs_dir / rel)
    head = ["context", "target GPU", "repeats"]
    head += [f"{k.replace('_', ' ')} ≤ {v}" for k, v in rl_scene_stats.TARGETS.items()]
    head += ["migrate's moves (path → landing tier)"]
    rows = []
    for context in sorted(by_context):
        files = by_context[context]
        records = [_load(f) for f in files]
        for variant, seconds in rl_scene_stats.merge(files).items():
            pooled = rl_scene_stats.ratios(rl_scene_stats.pooled_rows(seconds))
            per_repeat = rl_scene_stats.repeat_ratios(seconds)
            repeats = len(seconds.get("migrate", {}))
            cells = []
            for key in rl_scene_stats.TARGETS:
                value = pooled[key]["value"]
                shown = "—" if value is None else f"{value:.3f}"
                cells.append(f"{shown}; per repeat {_spread(per_repeat[key])} "
                             f"({_verdict(value, pooled[key]['target_max'])})")  # fmt: skip
            rows.append([f"{context // 1024}K", variant, str(repeats), *cells,
                         _moves(records, variant)])  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- registry


def ready_blocks(runs_dir: Path) -> dict[str, Callable[[], str]]:
    """The blocks whose records are named in `RUNS`, as `results.py` renders them."""
    blocks: dict[str, Callable[[], str]] = {}
    if RUNS["flag-cost"]:
        blocks["flag-cost"] = lambda: block_flag_cost([runs_dir / p for p in RUNS["flag-cost"]])
    if RUNS["verl-scale"]:
        blocks["verl-scale"] = lambda: block_verl_scale([runs_dir / p for p in RUNS["verl-scale"]])
    if RUNS["rl-scenes"]:
        blocks["rl-scenes"] = lambda: block_rl_scenes(RUNS["rl-scenes"], runs_dir)
    return blocks


def show(name: str, args: Sequence[str]) -> str:
    """A block from files given on the command line (paths as they are, not under
    docs/gpu-runs/; rl-scenes takes "<context>=<path>")."""
    if name == "flag-cost":
        return block_flag_cost([Path(a) for a in args])
    if name == "verl-scale":
        return block_verl_scale([Path(a) for a in args])
    if name == "rl-scenes":
        return block_rl_scenes(args, Path("."))
    raise SystemExit(f"--show: no block {name!r} (flag-cost, verl-scale, rl-scenes)")
