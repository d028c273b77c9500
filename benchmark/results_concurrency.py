"""The results page's blocks for six concurrent 8K moves against one, idle and busy
source (`bench_busy_source.py --only-concurrency`, record
`bench_busy_source_concurrency.json`): the ratios and verdicts, computed from the
record's rounds through the benchmark's own `busy_source_report.concurrency_summary`
(never from the summary the run wrote), and where each move's time went, from the
`steps_ms` every moved move's reply carries (`server/diag/trace.py`,
`docs/protocol.md`).

A verdict needs every move of every round to have moved its whole prefix: where moves
were refused the six did less than six moves' work, so the block gives the ratio as
recorded, how many moved and why the others did not, and no verdict.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import busy_source_report as report

WAYS = {"threads": "six from threads", "one_call": "six in one call"}

# The transfer trip's steps, in the order a move passes them (`steps_ms["transfer"]`),
# with what each is; `copy_ms` is the GPU copy the source timed.
STEPS = (
    ("parse", "HTTP layer: body read and parsed"),
    ("allocate_ahead", "HTTP layer asks the target ahead (busy source)"),
    ("to_scheduler", "to the source's scheduler: its next loop iteration"),
    ("handler", "source: handler"),
    ("allocate", "source: waits for the target's answer"),
    ("target_queued", "target: allocate queued behind other work"),
    ("target_scheduler", "target: its scheduler's allocate work"),
    ("answer", "source: until the poll that takes the answer"),
    ("start", "source: checks, match, copy launch"),
    ("copy_ms", "the copy on the GPU"),
    ("copy_wait", "source: launch until the copy is seen done"),
    ("finish", "source: receipts, mailbox, reply"),
    ("replying", "source: the replying poll"),
    ("to_tokenizer", "back to the HTTP layer"),
    ("route", "the whole route (server side)"),
    ("outside", "the client's trip less the route"),
    ("wall_ms", "the move's wall time (client)"),
)


def _median_range(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    if not values:
        return "—"
    med = f"{statistics.median(values):,.{digits}f}{unit}"
    if len(values) == 1:
        return f"{med} (one run)"
    return f"{med} ({min(values):,.{digits}f}–{max(values):,.{digits}f}, n={len(values)})"


def _counts(values: Sequence[int]) -> str:
    present = sorted({v for v in values if v})
    if not present:
        return "—"
    return str(present[0]) if len(present) == 1 else f"{present[0]}–{present[-1]}"


def short_reason(reason: str) -> str:
    """A client's failure message without the URL and what follows its first `;`."""
    return re.sub(r"https?://\S+?: ", "", reason).split(";")[0]


def verdict(way: Mapping[str, Any]) -> str:
    """Met or missed by how much at the median of the rounds' own ratios; not measured
    (with the ratio as recorded) when a move of a round failed or moved less."""
    ratio, limit = way["over_one"]["median"], way["limit"]
    if ratio is None:
        return "—"
    if way["met"] is None:
        return (
            f"not measured ({way['moves'] - way['moved']} of {way['moves']} moves did not "
            f"move); as recorded {ratio - limit:.2f}× over"
        )
    return "met" if way["met"] else f"**missed by {ratio - limit:.2f}×**"


def _refused_walls(rounds: Sequence[Mapping[str, Any]], state: str) -> list[float]:
    """The wall times of the moves from threads that failed (a call's moves share the
    call's wall time)."""
    mine = [r for r in rounds if r["state"] == state]
    return [m["wall_ms"] for r in mine for m in r["threads"]["moves"] if "failed" in m]


def block_concurrency(record: Mapping[str, Any]) -> str:
    """Per source state and way of sending six: one move, the six, each round's own
    six / one, how many moved, the source loop iterations per move, the verdict; then
    why moves failed."""
    rounds = record["rounds"]
    summary = report.concurrency_summary(rounds)
    head = ["source", "six sent", "one move", "six (wall)", "six / one (each round's own)",
            "moved", "source iterations per move: one; six", "target", "verdict"]  # fmt: skip
    rows, reasons = [], {}
    for state, s in summary.items():
        for way, label in WAYS.items():
            c = s[way]
            if c["wall_ms"]["n"] == 0:
                continue
            rows.append([
                state, label, _median_range([r["one"]["wall_ms"] for r in rounds
                                             if r["state"] == state], " ms", 1),
                _median_range([r[way]["wall_ms"] for r in rounds if r["state"] == state],
                              " ms", 1),
                _median_range([r[way]["wall_ms"] / r["one"]["wall_ms"] for r in rounds
                               if r["state"] == state], "×"),
                f"{c['moved']} of {c['moves']}",
                f"{_counts(s['one_source_iterations'])}; {_counts(c['source_iterations_max'])}",
                f"≤ {c['limit']}×", verdict(c),
            ])  # fmt: skip
            for reason, n in c["failures"].items():
                reasons[short_reason(reason)] = reasons.get(short_reason(reason), 0) + n
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for reason, n in reasons.items():
        lines.append(f"\nMoves that did not move ({n}, every way and state): {reason}.")
    for state in summary:
        walls = _refused_walls(rounds, state)
        if walls:
            lines.append(f"The refused moves from threads, {state} source, took "
                         f"{_median_range(walls, ' ms', 1)} each.")  # fmt: skip
    return "\n".join(lines)


def moved_moves(record: Mapping[str, Any], state: str, way: str) -> list[dict[str, Any]]:
    """The moves of that state and way (`one`, or one of `WAYS`) that moved, over every
    round: the ones whose reply carries `steps_ms`."""
    out = []
    for r in record["rounds"]:
        if r["state"] != state:
            continue
        moves = [r["one"]] if way == "one" else r[way]["moves"]
        out += [m for m in moves if "failed" not in m and m.get("steps_ms")]
    return out


def step_values(moves: Sequence[Mapping[str, Any]], step: str) -> list[float]:
    """One step's ms per move (`copy_ms` and `wall_ms` are the move's own fields)."""
    if step in ("copy_ms", "wall_ms"):
        return [float(m[step]) for m in moves if m.get(step) is not None]
    values = [(m["steps_ms"].get("transfer") or {}).get(step) for m in moves]
    return [float(v) for v in values if v is not None]


def block_concurrency_steps(record: Mapping[str, Any]) -> str:
    """Per step of the transfer trip, its median over the moves that moved, one move
    alone beside the six of each way, per source state (ms; medians of each step, so the
    rows need not add up)."""
    groups = [(state, way) for state in report.SOURCES for way in ("one", *WAYS)]
    moves = {g: moved_moves(record, *g) for g in groups}
    groups = [g for g in groups if moves[g]]
    names = {"one": "one", **{w: "six: " + w.replace("_", " ") for w in WAYS}}
    head = ["step", *(f"{state}, {names[way]} (n={len(moves[(state, way)])})"
                      for state, way in groups)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, what in STEPS:
        cells = []
        for g in groups:
            values = step_values(moves[g], step)
            cells.append(f"{statistics.median(values):.2f}" if values else "—")
        if any(c != "—" for c in cells):
            lines.append(f"| `{step}`: {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
