"""The flag-cost benchmark's arithmetic (`bench_flag_cost.py`): pure, tested on CPU.

Each round measures every cell once on every server, interleaved; a cell's value in a
round is the median of its samples there. Per server and cell: the median over rounds
with its min and max. Costs are read at the medians, as a percentage that is positive
when the server is worse (slower, or fewer tokens per second):

- the flag's cost: `flag` (HiCache + `--enable-kv-migration`) against `hicache` (the same
  server without the flag);
- HiCache's own cost: `hicache` against `stock` (SGLang without HiCache), beside it;
- the A/A spread: with a twin of the HiCache server, how far the twin's median is from
  the HiCache server's; without one, half the range of the HiCache server's rounds over
  their median (how far one interleaved repeat strays from the middle).

A row meets the target when the flag costs at most 1%, or at most the A/A spread.
Streams are lists of `(seconds, tokens received so far)` points, one per chunk.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spreads import rounded_spread

STOCK, HICACHE, FLAG, TWIN = "stock", "hicache", "flag", "hicache_twin"
TARGET_PCT = 1.0

Stream = Sequence[tuple[float, int]]


@dataclass(frozen=True)
class Cell:
    name: str
    label: str
    unit: str
    lower_is_better: bool = True


# The latency cells, in the table's order; `decode_N` / `itl_N` (N concurrent requests)
# follow them, by N.
CELLS = (
    Cell("ttft_fresh_17", "TTFT, fresh 17-token prompt", "ms"),
    Cell("ttft_fresh_2k", "TTFT, fresh 2K prompt", "ms"),
    Cell("ttft_cached_4k", "TTFT, 4K cached + 16 new", "ms"),
    Cell("ttft_cached_16k", "TTFT, 16K cached + 16 new", "ms"),
    Cell("ttft_cached_32k", "TTFT, 32K cached + 16 new", "ms"),
    Cell("itl_1", "inter-token latency, 1 request", "ms"),
)
BY_NAME = {c.name: c for c in CELLS}


def cell(name: str) -> Cell:
    """The cell of that name: a latency cell, `decode_N` or `itl_N`."""
    if name in BY_NAME:
        return BY_NAME[name]
    kind, _, n = name.partition("_")
    if kind == "decode" and n.isdigit():
        return Cell(name, f"decode throughput, {n} concurrent", "tok/s", lower_is_better=False)
    if kind == "itl" and n.isdigit():
        return Cell(name, f"inter-token latency, {n} concurrent", "ms")
    raise ValueError(f"no cell {name!r}")


def cells_in(rounds: Sequence[Mapping[str, Any]]) -> list[Cell]:
    """The cells the rounds measured, in the table's order."""
    names = {name for r in rounds for name in r.get("cells", {})}
    fixed = [c for c in CELLS if c.name in names]
    concurrent = sorted(
        (cell(n) for n in names if n not in BY_NAME),
        key=lambda c: (int(c.name.partition("_")[2]), c.name.startswith("itl")),
    )
    return fixed + concurrent


# ---------------------------------------------------------------- streams


def token_gaps(stream: Stream, start: float | None = None, end: float | None = None) -> list[float]:
    """Seconds per token between successive chunks (a chunk of k new tokens gives its
    gap / k), from the first chunk on (its wait is the TTFT, not a gap), between `start`
    and `end` when given."""
    gaps = []
    for (t0, n0), (t1, n1) in zip(stream, stream[1:], strict=False):
        if n1 <= n0 or (start is not None and t0 < start) or (end is not None and t1 > end):
            continue
        gaps.append((t1 - t0) / (n1 - n0))
    return gaps


def itl_ms(stream: Stream) -> float | None:
    """The median inter-token gap of one stream, ms; None below two chunks."""
    gaps = token_gaps(stream)
    return round(1e3 * statistics.median(gaps), 3) if gaps else None


def _received(stream: Stream, at: float) -> int:
    """Tokens the stream had received by `at`."""
    got = 0
    for t, n in stream:
        if t > at:
            break
        got = n
    return got


def decode_window(streams: Sequence[Stream]) -> dict[str, Any]:
    """Throughput while every stream decodes: from the moment the last one got its
    first token to the moment the first one got its last, the tokens all received in
    that window over its length; and the median inter-token gap inside it."""
    live = [s for s in streams if s]
    if len(live) < len(streams) or not live:
        return {"tok_s": None, "itl_ms": None, "window_s": None, "streams": len(live)}
    start = max(s[0][0] for s in live)
    end = min(s[-1][0] for s in live)
    if end <= start:
        return {"tok_s": None, "itl_ms": None, "window_s": 0.0, "streams": len(live)}
    tokens = sum(_received(s, end) - _received(s, start) for s in live)
    gaps = [g for s in live for g in token_gaps(s, start, end)]
    return {
        "tok_s": round(tokens / (end - start), 1),
        "itl_ms": round(1e3 * statistics.median(gaps), 3) if gaps else None,
        "window_s": round(end - start, 3),
        "streams": len(live),
    }


# ---------------------------------------------------------------- rounds


def cost_pct(value: float, base: float, lower_is_better: bool) -> float:
    """How much worse `value` is than `base`, percent (negative: better)."""
    ratio = value / base
    return round(100 * (ratio - 1 if lower_is_better else 1 - ratio), 2)


def round_values(rounds: Sequence[Mapping[str, Any]], cell: str, server: str) -> list[float]:
    """The cell's value for the server in every round that measured it."""
    values = []
    for r in rounds:
        entry = (r.get("cells", {}).get(cell) or {}).get(server) or {}
        if entry.get("value") is not None:
            values.append(float(entry["value"]))
    return values


def aa_pct(rounds: Sequence[Mapping[str, Any]], c: Cell) -> tuple[float | None, str]:
    """The A/A spread of a cell, percent, and how it was taken."""
    base = round_values(rounds, c.name, HICACHE)
    twin = round_values(rounds, c.name, TWIN)
    if base and twin:
        median_twin, median_base = statistics.median(twin), statistics.median(base)
        return abs(cost_pct(median_twin, median_base, c.lower_is_better)), "twin"
    if len(base) < 2:
        return None, "none"
    half_range = (max(base) - min(base)) / 2 / statistics.median(base)
    return round(100 * half_range, 2), "rounds"


def cell_row(rounds: Sequence[Mapping[str, Any]], c: Cell, servers: Sequence[str]) -> dict:
    """One row: every server's spread, the flag's and HiCache's costs, the A/A spread
    and the verdict."""
    medians: dict[str, float] = {}
    row: dict[str, Any] = {"cell": c.name, "label": c.label, "unit": c.unit}
    row["servers"] = {}
    for server in servers:
        values = round_values(rounds, c.name, server)
        row["servers"][server] = rounded_spread(values, 3)
        if values:
            medians[server] = statistics.median(values)

    def cost(a: str, b: str) -> float | None:
        if a not in medians or b not in medians or medians[b] == 0:
            return None
        return cost_pct(medians[a], medians[b], c.lower_is_better)

    row["flag_cost_pct"] = cost(FLAG, HICACHE)
    row["hicache_cost_pct"] = cost(HICACHE, STOCK)
    row["aa_pct"], row["aa_kind"] = aa_pct(rounds, c)
    flag = row["flag_cost_pct"]
    allowed = max(TARGET_PCT, row["aa_pct"] or 0.0)
    row["allowed_pct"] = allowed
    row["met"] = None if flag is None else flag <= allowed
    return row


def summarize(rounds: Sequence[Mapping[str, Any]], servers: Sequence[str]) -> dict[str, Any]:
    rows = [cell_row(rounds, c, servers) for c in cells_in(rounds)]
    rows = [r for r in rows if any(r["servers"].values())]
    judged = [r["met"] for r in rows if r["met"] is not None]
    return {
        "rounds": len(rounds),
        "servers": list(servers),
        "rows": rows,
        "all_met": bool(judged) and all(judged),
    }


# ---------------------------------------------------------------- table


def _cell(s: Mapping[str, Any] | None, digits: int) -> str:
    if not s:
        return "—"
    if s["n"] == 1:
        return f"{s['median']:,.{digits}f} (one round)"
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}–{s['max']:,.{digits}f}, n={s['n']})"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def verdict(row: Mapping[str, Any]) -> str:
    if row["met"] is None:
        return "—"
    if row["met"]:
        return "met"
    return f"**missed by {row['flag_cost_pct'] - row['allowed_pct']:.2f} points**"


def table(summary: Mapping[str, Any]) -> str:
    """Markdown for docs/benchmarks.md: each server's median (min–max, rounds), the two
    costs (positive: worse), the A/A spread and the verdict."""
    servers = summary["servers"]
    names = {STOCK: "SGLang", HICACHE: "+ HiCache", FLAG: "+ HiCache + flag",
             TWIN: "+ HiCache (twin)"}  # fmt: skip
    head = ["row", *(names.get(s, s) for s in servers), "HiCache's cost", "flag's cost",
            "A/A spread", "flag ≤ 1% or A/A"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rows"]:
        digits = 0 if row["unit"] == "tok/s" else 2
        cells = [_cell(row["servers"].get(s), digits) for s in servers]
        aa = "—" if row["aa_pct"] is None else f"{row['aa_pct']:.2f}% ({row['aa_kind']})"
        lines.append(
            "| " + " | ".join([f"{row['label']} ({row['unit']})", *cells,
                               _pct(row["hicache_cost_pct"]), _pct(row["flag_cost_pct"]),
                               aa, verdict(row)]) + " |"
        )  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------- per round


def paired(rounds: Sequence[Mapping[str, Any]], cell: str, a: str, b: str) -> list[float | None]:
    """Per round, `a`'s value less `b`'s (None where either was not measured): two servers
    measured in the same round, minutes apart at most, so drift over the run cancels."""
    out: list[float | None] = []
    for r in rounds:
        entries = r.get("cells", {}).get(cell) or {}
        va = (entries.get(a) or {}).get("value")
        vb = (entries.get(b) or {}).get("value")
        out.append(None if va is None or vb is None else round(float(va) - float(vb), 2))
    return out


def paired_table(
    rounds: Sequence[Mapping[str, Any]], cells: Sequence[str], a: str = FLAG, b: str = HICACHE
) -> str:
    """Markdown: per cell and round, `a` less `b` (the round's order of servers in the
    head, by initial), and in how many rounds `a` was the slower."""
    initials = {STOCK: "S", HICACHE: "H", FLAG: "F", TWIN: "T"}
    head = ["row"]
    for r in rounds:
        order = ",".join(initials.get(s, s) for s in r.get("order", []))
        head.append(f"round {r['round']} ({order})")
    head.append(f"{initials.get(a, a)} slower in")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in cells:
        c = cell(name)
        diffs = paired(rounds, name, a, b)
        shown = ["—" if d is None else f"{d:+.2f}" for d in diffs]
        measured = [d for d in diffs if d is not None]
        worse = sum((d > 0) == c.lower_is_better and d != 0 for d in measured)
        lines.append(f"| {c.label} ({c.unit}) | " + " | ".join(shown)
                     + f" | {worse} of {len(measured)} |")  # fmt: skip
    return "\n".join(lines)
