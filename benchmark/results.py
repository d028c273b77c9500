"""The figures of the results page (`docs/benchmarks.md`), computed from the raw records
under `docs/gpu-runs/` (the CPU blocks: `docs/cpu-runs/`): per figure the median over the
record's repeats, with the smallest and the largest, and how many repeats there were.

    python3 benchmark/results.py            # print every generated block
    python3 benchmark/results.py --check    # exit 1 when a block of the page differs
    python3 benchmark/results.py --write    # rewrite the page's blocks from the records
    python3 benchmark/results.py --show flag-cost FILE.json   # a new record's block

The page holds each block between `<!-- results:NAME -->` and `<!-- /results:NAME -->`;
everything else on the page is written by hand. After a new GPU run, copy its records
under `docs/gpu-runs/<date>/`, point `RUNS` at them and run `--write`. The blocks of
`results_adoption.py` (flag cost, verl's pattern at scale, the RL scene per variant)
name their records in its own `RUNS` and join the page once they have one. The `fleet-sim-*`
blocks come from the fleet simulation's record (`docs/sim/fleet_sim.json`, written by
`bench_fleet_sim.py all --write`, whose costs are read from the records `RUNS` names).
The `busy-concurrency*` blocks are `results_concurrency.py`'s, from the record
`RUNS["concurrency"]` names; `live-phases` is `live_move_report.py`'s phase table of the
live record.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fleet_report
import live_move_report
import results_adoption
import results_concurrency

ROOT = Path(__file__).resolve().parent.parent
RUNS_DIR = ROOT / "docs" / "gpu-runs"
PAGE = ROOT / "docs" / "benchmarks.md"

# The latest record of each benchmark the page quotes.
RUNS = {
    "device_p16": "2026-12-03/in-poll-off-device-path-page16.json",
    "device_p1": "2026-12-03/in-poll-off-device-path-page1.json",
    "anytier_p16": "2026-12-02/fast-http-anytier-page16.json",
    "anytier_p1": "2026-12-02/prepare-digest-anytier-page1.json",
    "two_gpus": "2026-11-30-bench-device-path-llama3-8b-two-gpus-page-ranges.json",
    "tp2": "2026-11-30-bench-device-path-llama3-8b-tp2.json",
    "host_table_p1": "2026-11-30-host-path-table-page1-gil-handoff.json",
    "host_stall": "2026-11-30-host-path-stall-overhead-llama3-8b.json",
    "scene8k": "2026-12-01/scene8k-bench_rl_scene_8192.json",
    "scene16k": "2026-12-01/scene16k-bench_rl_scene_16384.json",
    "live": "2026-12-06/live-bench_live_move.json",
    # The fleet simulation's constants all come from H200 records (`fleet_costs.py`):
    # its decode steps from the H200's live-move record, not the H100's above.
    "live_h200": "2026-12-05/live-bench_live_move.json",
    "busy": "2026-12-05/busy-bench_busy_source.json",
    "concurrency": "2026-12-06/conc-bench_busy_source_concurrency.json",
    "rollout": "2026-11-30-rollout-rebalance-llama3-8b.json",
}


# The CPU records the page's generated CPU blocks read.
CPU_RUNS_DIR = ROOT / "docs" / "cpu-runs"
CPU_RUNS = {
    "loop_iterations": "2026-12-06/bench_loop_iterations.json",
    "loop_iterations_idle_target": "2026-12-06/bench_loop_iterations-idle-target.json",
}


def load(name: str) -> dict[str, Any]:
    return json.loads((RUNS_DIR / RUNS[name]).read_text())


def load_cpu(name: str) -> dict[str, Any]:
    return json.loads((CPU_RUNS_DIR / CPU_RUNS[name]).read_text())


def spread(values: Iterable[float], unit: str = "", digits: int = 2, of: str = "") -> str:
    """`median unit (min–max, n=N)`; one value is said to be one. `of`: what the values
    are when they are not repeats of one measurement (cells of one run)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    med = f"{statistics.median(vals):,.{digits}f}{unit}"
    if len(vals) == 1:
        return f"{med} (one run)"
    count = f"{len(vals)} {of}" if of else f"n={len(vals)}"
    return f"{med} ({min(vals):,.{digits}f}–{max(vals):,.{digits}f}, {count})"


def verdict(
    values: list[float], limit: float, unit: str, below: bool = True, digits: int = 2
) -> str:
    """Met or missed by how much, read at the median."""
    med = statistics.median(values)
    if (med <= limit) if below else (med >= limit):
        return "met"
    return f"**missed by {abs(med - limit):,.{digits}f}{unit}**"


# ---------------------------------------------------------------- readers of one record


def device_repeats(record: dict[str, Any], tokens: int) -> dict[str, list[float]]:
    """`bench_device_path.py`: per repeat of one length, the device-path migration's
    total, its share of re-prefill, (total + TTFT) / re-prefill, copy GB/s."""
    out: dict[str, list[float]] = {"total": [], "share": [], "plus_ttft": [], "gbps": []}
    out["reprefill"] = []
    for row in record["rows"]:
        if row["tokens"] != tokens:
            continue
        dev, reprefill = row["device"], row["reprefill_ttft_ms"]
        total = dev["timings_ms"]["total"]
        out["total"].append(total)
        out["share"].append(100 * total / reprefill)
        out["plus_ttft"].append(100 * (total + dev["ttft_ms"]) / reprefill)
        out["gbps"].append(dev["copy_gb_s"])
        out["reprefill"].append(reprefill)
    return out


def concurrency_ratios(record: dict[str, Any]) -> dict[str, list[float]]:
    """Six 8K moves against one, per round: from six threads and in one `migrate_many`."""
    rounds = record.get("concurrency") or []
    if isinstance(rounds, dict):  # bench_any_tier.py: the first round, then later ones
        rounds = [rounds, *rounds.get("later_rounds", [])]
    return {
        "six threads": [r["ratio"] for r in rounds],
        "six in one call": [r["batch_ratio"] for r in rounds if "batch_ratio" in r],
    }


def any_tier_cell(record: dict[str, Any], tokens: int, tier: str) -> dict[str, float]:
    (row,) = [r for r in record["rows"] if r["tokens"] == tokens and r["tier"] == tier]
    dev, reprefill = row["device"], row["reprefill_ttft_ms"]
    total = dev["timings_ms"]["total"]
    return {
        "total": total,
        "share": 100 * total / reprefill,
        "plus_ttft": 100 * (total + dev["ttft_ms"]) / reprefill,
        "gbps": dev["copy_gb_s"],
    }


# ---------------------------------------------------------------------------- blocks


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


ONE_PAGE = {"device_p16": 17, "device_p1": 2}  # prompt length whose migration is one page


def block_control_plane() -> str:
    rows = []
    for name, page in (("device_p16", 16), ("device_p1", 1)):
        rec = load(name)
        for tokens in (ONE_PAGE[name], 1024, 2048, 32768):
            r = device_repeats(rec, tokens)
            label = f"{tokens} (1 page)" if tokens == ONE_PAGE[name] else f"{tokens:,}"
            rows.append([str(page), label, spread(r["total"], " ms"),
                         spread(r["share"], "%"), spread(r["plus_ttft"], "%", 1),
                         spread(r["reprefill"], " ms", 1)])  # fmt: skip
    head = ["page", "prompt tokens", "migration total", "total / re-prefill",
            "(total + TTFT) / re-prefill", "re-prefill TTFT"]  # fmt: skip
    return _table(head, rows)


def block_targets() -> str:
    p16, p1 = load("device_p16"), load("device_p1")
    rows = []
    for rec, page in ((p16, 16), (p1, 1)):
        t = device_repeats(rec, ONE_PAGE["device_p16" if page == 16 else "device_p1"])["total"]
        rows.append(["one-page move p50 ≤ 5 ms", f"page {page}", spread(t, " ms"),
                     verdict(t, 5.0, " ms")])  # fmt: skip
    for rec, page in ((p16, 16), (p1, 1)):
        t = device_repeats(rec, 1024)["total"]
        rows.append(["1K move ≤ 8 ms", f"page {page}", spread(t, " ms"), verdict(t, 8.0, " ms")])
    for rec, page in ((p16, 16), (p1, 1)):
        s = device_repeats(rec, 32768)["share"]
        rows.append(["32K move ≤ 1% of re-prefill", f"page {page}", spread(s, "%"),
                     verdict(s, 1.0, " points")])  # fmt: skip
    for rec, page in ((p16, 16), (p1, 1)):
        g = device_repeats(rec, 32768)["gbps"]
        rows.append(["copy ≥ 400 GB/s on one GPU (32K)", f"page {page}", spread(g, " GB/s", 0),
                     verdict(g, 400.0, " GB/s", below=False)])  # fmt: skip
    for rec, page in ((p16, 16), (p1, 1)):
        for tokens in (2048, 32768):
            s = device_repeats(rec, tokens)["plus_ttft"]
            goal = f"migration + TTFT < re-prefill from 2K up ({tokens // 1024}K)"
            rows.append([goal, f"page {page}", spread(s, "%", 1), verdict(s, 100.0, " points")])
    for rec, page in ((p16, 16), (p1, 1)):
        for way, ratios in concurrency_ratios(rec).items():
            rows.append([f"six concurrent 8K moves ≤ 1.5× one ({way})", f"page {page}",
                         spread(ratios, "×"), verdict(ratios, 1.5, "×")])  # fmt: skip
    return _table(["target", "where", "latest: median (min–max, repeats)", "verdict"], rows)


def block_any_tier() -> str:
    rows = []
    for name, page in (("anytier_p16", 16), ("anytier_p1", 1)):
        rec = load(name)
        for tokens in (4096, 16384, 32768):
            for tier in ("gpu", "host", "mixed"):
                c = any_tier_cell(rec, tokens, tier)
                rows.append([str(page), f"{tokens // 1024}K", tier, f"{c['total']:,.1f} ms",
                             f"{c['share']:.2f}%", f"{c['plus_ttft']:.1f}%",
                             f"{c['gbps']:,.0f}"])  # fmt: skip
    head = ["page", "prefix", "held on", "migration total", "total / re-prefill",
            "(total + TTFT) / re-prefill", "copy GB/s"]  # fmt: skip
    return _table(head, rows)


def block_any_tier_targets() -> str:
    rows = []
    for name, page in (("anytier_p16", 16), ("anytier_p1", 1)):
        rec = load(name)
        host = [any_tier_cell(rec, n, "host")["gbps"] for n in (4096, 16384, 32768)]
        cells = spread(host, " GB/s", 1, "cells of one run: 4K, 16K, 32K")
        rows.append(["host-tier copy ≥ 45 GB/s", f"page {page}", cells,
                     verdict(host, 45.0, " GB/s", below=False)])  # fmt: skip
        share = [any_tier_cell(rec, 32768, "host")["share"]]
        rows.append(["32K held on host ≤ 5% of re-prefill", f"page {page}", spread(share, "%"),
                     verdict(share, 5.0, " points")])  # fmt: skip
        worst = max(any_tier_cell(rec, n, t)["plus_ttft"]
                    for n in (4096, 16384, 32768) for t in ("gpu", "host", "mixed"))  # fmt: skip
        rows.append(["migration + TTFT < re-prefill, every tier, 4K up (worst of 9 cells)",
                     f"page {page}", f"{worst:.1f}% (one run)",
                     verdict([worst], 100.0, " points")])  # fmt: skip
    return _table(["target", "where", "latest (cells)", "verdict"], rows)


def block_two_gpus() -> str:
    rec, tp2 = load("two_gpus"), load("tp2")
    rows = []
    for tokens in (1024, 4096, 16384, 32768):
        r, t = device_repeats(rec, tokens), device_repeats(tp2, tokens)
        rows.append([f"{tokens:,}", spread(r["total"], " ms", 1), spread(r["share"], "%"),
                     spread(r["gbps"], "", 0), spread(t["total"], " ms", 1),
                     spread(t["share"], "%")])  # fmt: skip
    head = ["prefix", "GPU 0 → GPU 1: total", "/ re-prefill", "copy GB/s",
            "TP=2: total", "/ re-prefill"]  # fmt: skip
    at_32k = device_repeats(rec, 32768)
    share, gbps = at_32k["share"], at_32k["gbps"]
    return (
        _table(head, rows) + "\n\nGPU 0 → GPU 1 at 32K: whole migration ≤ 2% of re-prefill: "
        f"{spread(share, '%')}, {verdict(share, 2.0, ' points')}; copy ≥ 200 GB/s: "
        f"{spread(gbps, ' GB/s', 0)}, {verdict(gbps, 200.0, ' GB/s', below=False)}."
    )


def block_host_path() -> str:
    rec = load("host_table_p1")
    rows = []
    for pools in ("fresh", "churned"):
        for tokens in (1024, 4096, 16384, 32768):
            cells = [c for c in rec[f"table_{pools}"] if c["tokens"] == tokens]
            ratio = [(c["migrate_ms"] + c["cached_request_ms"]) / c["prefill_ms"] for c in cells]
            rows.append([pools, f"{tokens:,}", spread([c["migrate_ms"] for c in cells], " ms", 0),
                         spread([c["prefill_ms"] for c in cells], " ms", 0),
                         spread(ratio, "×")])  # fmt: skip
    head = ["pools", "prefix", "host-path migration", "re-prefill",
            "(migration + TTFT) / re-prefill"]  # fmt: skip
    stall = load("host_stall")["stall"]
    return (
        _table(head, rows) + "\n\nSource stall (one run): inter-token gap p50 during a 4 GiB "
        f"migration / quiet {stall['p50_during_over_quiet']:.3f}, p99 "
        f"{stall['p99_during_over_quiet']:.3f} (target ≤ 1.05: met)."
    )


def block_scenes() -> str:
    rows = []
    for name, ctx in (("scene8k", "8K"), ("scene16k", "16K")):
        r = load(name)["ratios"]

        def cell(key: str, limit: float, r: dict[str, float] = r) -> str:
            return f"{r[key]:.3f} ({verdict([r[key]], limit, '', digits=3)})"

        rows.append([ctx,
                     cell("high_p99_migrate_over_recompute", 0.5),
                     cell("high_p99_migrate_over_none", 0.2),
                     cell("low_p99_migrate_over_none", 1.1)])  # fmt: skip
    head = ["context (one run)", "high p99 migrate / recompute ≤ 0.5",
            "high p99 migrate / none ≤ 0.2", "low p99 migrate / none ≤ 1.1"]  # fmt: skip
    return _table(head, rows)


def block_live() -> str:
    """`bench_live_move.py` from the running request's slots: per context and tokens
    generated before the move, the stall over the repeats beside SGLang's own cached
    resume of the same request on the same target, the bound (that resume + 10 ms + one
    target decode step) and, at 4K, the 40 ms cap. Records made before the benchmark
    measured SGLang's own resume are read with their bound (the abort + 10 ms + step)."""
    record = load("live")
    if not any("baseline" in row for row in record["rows"]):
        return _block_live_before_baseline(record)
    rows = []
    for row in record["rows"]:
        done = [r for r in row["repeats"] if r.get("complete")]
        stalls = [r["stall_s"] * 1e3 for r in done]
        bases = [r["baseline_s"] * 1e3 for r in done if r.get("baseline_s") is not None]
        checks = row["checks"]
        bound, cap, added = checks.get("bound_s"), checks.get("stall_cap_s"), checks.get("added_s")
        limit = min(b for b in (bound, cap) if b is not None) * 1e3 if bound else None
        met = "—" if limit is None else verdict(stalls, limit, " ms", digits=1)
        if limit is not None and met != "met":
            met += " (the cap)" if cap is not None and cap < bound else " (the bound)"
        rows.append([f"{row['context']:,}", f"{row['generated']:,}", spread(stalls, " ms", 1),
                     spread(bases, " ms", 1), _ms(added), _ms(row["decode_step_s"]),
                     _ms(bound), _ms(cap, 0), met])  # fmt: skip
    head = ["context", "generated", "stall", "SGLang's own cached resume", "added (median)",
            "target decode step", "resume + 10 ms + step", "cap", "≤ both bounds"]  # fmt: skip
    quiet = [(row["context"], row.get("quiet_resume") or {}) for row in record["rows"]]
    quiet = [(n, q["ttft_s"]) for n, q in quiet if q.get("ttft_s") is not None]
    if not quiet:
        return _table(head, rows)
    said = ", ".join(f"{n // 1024}K {_ms(s)}" for n, s in quiet)
    return (
        _table(head, rows) + "\n\nSGLang's own cached resume on the target with nothing else "
        f"decoding (`quiet_resume`, one per row): {said}."
    )


def _ms(seconds: float | None, digits: int = 1) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def _block_live_before_baseline(record: dict[str, Any]) -> str:
    rows = []
    for row in record["rows"]:
        stalls = [r["stall_s"] * 1e3 for r in row["repeats"] if r.get("complete")]
        aborts = [r["abort_s"] * 1e3 for r in row["repeats"] if r.get("complete")]
        checks = row["checks"]
        rows.append([f"{row['context']:,}", f"{row['generated']:,}", spread(stalls, " ms", 1),
                     spread(aborts, " ms", 1), f"{row['decode_step_s'] * 1e3:.1f} ms",
                     f"{checks['bound_s'] * 1e3:.1f} ms",
                     verdict(stalls, min(checks["stall_cap_s"], checks["bound_s"]) * 1e3,
                             " ms", digits=1)])  # fmt: skip
    head = ["context", "generated", "stall", "abort", "target decode step",
            "abort + 10 ms + step", "≤ both bounds"]  # fmt: skip
    return _table(head, rows)


def _whole(move: dict[str, Any], tokens: int, page: int) -> bool:
    """Whether a busy-source move moved the prefix's whole pages (records made before
    the benchmark said so itself are read the same way)."""
    return move.get("whole", move["migrated_tokens"] == (tokens - 1) // page * page)


def block_busy() -> str:
    """`bench_busy_source.py`: per prefix and tier the move between idle servers and from
    a source decoding a full batch, over the moves that moved the whole prefix."""
    record = load("busy")
    page = record["config"]["page_size"]
    rows = []
    for n in sorted({r["tokens"] for r in record["rows"]}):
        mine = [r for r in record["rows"] if r["tokens"] == n]
        for tier in ("gpu", "host"):
            cells = []
            for state in ("idle", "busy"):
                moves = [r[state][tier] for r in mine]
                whole = [m["total_ms"] for m in moves if _whole(m, n, page)]
                short = len(moves) - len(whole)
                cells.append(spread(whole, " ms", 1) if whole else f"none of {short} moved it")
                cells[-1] += f"; {short} moved less" if whole and short else ""
            idle = [r["idle"][tier]["total_ms"] for r in mine if _whole(r["idle"][tier], n, page)]
            busy = [r["busy"][tier]["total_ms"] for r in mine if _whole(r["busy"][tier], n, page)]
            ratio = statistics.median(busy) / statistics.median(idle) if idle and busy else None
            rows.append([f"{n:,}", tier, spread([r["reprefill_ms"] for r in mine], " ms", 1),
                         *cells, "—" if ratio is None else f"{ratio:.2f}",
                         "—" if ratio is None else verdict([ratio], 2.0, "×")])  # fmt: skip
    head = ["prefix", "source tier", "re-prefill", "move, idle servers", "move, busy source",
            "busy / idle", "≤ 2×"]  # fmt: skip
    decode = record["decode"]
    kept = decode["per_window"]
    line = (f"\nDecode throughput of the busy batch with a stream of 8K moves over without: "
            f"{spread(kept, digits=3, of='windows')} — "
            f"{verdict(kept, 0.95, '', below=False, digits=3)} (≥ 0.95).")  # fmt: skip
    return _table(head, rows) + "\n" + line


_WAYS = {"one": "one alone", "one_call": "six in one call", "threads": "six from threads"}


def block_cpu_iterations() -> str:
    """`bench_loop_iterations.py`: per target loop (a fixed step, or idle), flow (the
    busy source's HTTP layer asks the target, or its scheduler does) and way of sending,
    the loop iterations a move took on each side, as min–max over the rounds, and the
    wall time over one move's."""

    def counts(values: list[int]) -> str:
        return "–".join(str(v) for v in sorted({min(values), max(values)})) if values else "—"

    rows = []
    targets = (("loop_iterations", "20 ms step"), ("loop_iterations_idle_target", "idle"))
    for name, target in targets:
        record = load_cpu(name)
        rounds = record["config"]["rounds"]
        for flow, cells in record["summary"].items():
            for way, c in cells.items():
                over = "1" if way == "one" else spread(c["wall_over_one"], "×")
                rows.append([target, flow, _WAYS[way], counts(c["source_iterations_max"]),
                             counts(c["taken_up_in"]), counts(c["allocated_in"]),
                             counts(c["committed_in"]), spread(c["wall_steps"]), over,
                             str(rounds)])  # fmt: skip
    head = ["target loop", "who asks the target", "moves", "source iterations per move",
            "taken up in (source iterations)", "allocated in (target iterations)",
            "committed in", "wall, steps", "wall / one move", "rounds"]  # fmt: skip
    return _table(head, rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "targets": block_targets,
    "control-plane": block_control_plane,
    "any-tier-targets": block_any_tier_targets,
    "any-tier": block_any_tier,
    "two-gpus": block_two_gpus,
    "host-path": block_host_path,
    "scenes": block_scenes,
    "live": block_live,
    "busy": block_busy,
    "busy-concurrency": lambda: results_concurrency.block_concurrency(load("concurrency")),
    "busy-concurrency-steps": lambda: results_concurrency.block_concurrency_steps(
        load("concurrency")
    ),
    "live-phases": lambda: live_move_report.markdown_breakdown(load("live")["rows"]),
    "fleet-sim-validation": lambda: fleet_report.validation_block(fleet_report.load()),
    "fleet-sim-verl": lambda: fleet_report.verl_block(fleet_report.load()),
    "fleet-sim-sweep": lambda: fleet_report.sweep_block(fleet_report.load()),
    "cpu-iterations": block_cpu_iterations,
}
BLOCKS |= results_adoption.ready_blocks(RUNS_DIR)


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- results:{re.escape(name)} -->)(.*?)(<!-- /results:{re.escape(name)} -->)",
        re.S,
    )


def render(page: str) -> str:
    unknown = sorted(set(re.findall(r"<!-- results:([\w-]+) -->", page)) - set(BLOCKS))
    if unknown:  # e.g. a results_adoption.py block whose records RUNS does not name
        raise SystemExit(f"{PAGE}: no records for block(s) {', '.join(unknown)}")
    for name, block in BLOCKS.items():
        text = block()
        page, n = _pattern(name).subn(lambda m, t=text: f"{m[1]}\n{t}\n{m[3]}", page)
        if n != 1:
            raise SystemExit(f"{PAGE}: block {name!r} found {n} times")
    return page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    mode.add_argument("--write", action="store_true", help="rewrite the page's blocks")
    mode.add_argument(
        "--show", nargs="+", metavar="ARG",
        help="BLOCK FILE...: one of results_adoption.py's blocks from these records",
    )  # fmt: skip
    args = ap.parse_args()
    if args.show:
        print(results_adoption.show(args.show[0], args.show[1:]))
        return
    if not (args.check or args.write):
        for name, block in BLOCKS.items():
            print(f"<!-- results:{name} -->\n{block()}\n<!-- /results:{name} -->\n")
        return
    page = PAGE.read_text()
    fresh = render(page)
    if args.write:
        PAGE.write_text(fresh)
    elif fresh != page:
        print(f"{PAGE} differs from its records: run benchmark/results.py --write", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
