"""The pure parts of `bench_live_move.py` (tested on CPU by `test/unit/test_bench_live_move.py`):
which rows run in which order, how large the servers' KV pools must be, a decode step
from streamed token times, medians with their range, the targets' checks and the table.

The targets, per row (context × generated tokens, the median over the repeats):
stall ≤ 40 ms, and stall ≤ abort latency + 10 ms + one decode step of the target.
"""

from __future__ import annotations

import statistics
from typing import Any

STALL_CAP_S = 0.040  # the stall's absolute target
STALL_SLACK_S = 0.010  # what the move may add beyond the abort and one target decode step


def plan_rows(contexts: list[int], gens: list[int]) -> list[tuple[int, int]]:
    """(context, generated) per row, the shortest runs first: a job cut at its time limit
    keeps the rows it finished (the result file is rewritten after each)."""
    return sorted(((c, g) for g in gens for c in contexts), key=lambda cg: (cg[1], cg[0]))


def pool_tokens(contexts: list[int], gens: list[int], repeats: int, tail: int, page: int) -> int:
    """The KV pool (tokens) a server needs: the repeats of the largest row decode at
    once on the source and finish on the target, each in whole pages, plus one page per
    request of slack (the page being written) and SGLang's own reserve (a page per
    request again)."""
    per_request = max(contexts) + max(gens) + tail
    per_request = -(-per_request // page) * page + 2 * page
    return repeats * per_request


def decode_step_s(token_times: list[float]) -> float | None:
    """The median time between consecutive streamed tokens (one decode step each);
    None with fewer than two tokens."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max of the values present (None: a repeat that did not measure
    it), and how many there were."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def checks(stalls: list[float | None], aborts: list[float | None], step: float | None) -> dict:
    """The row's targets on the medians, and how many repeats met both on their own."""
    stall, abort = spread(stalls)["median"], spread(aborts)["median"]
    out: dict[str, Any] = {"stall_cap_s": STALL_CAP_S, "bound_s": None, "met": False}
    if stall is None:
        return out
    out["under_cap"] = stall <= STALL_CAP_S
    if abort is not None and step is not None:
        out["bound_s"] = abort + STALL_SLACK_S + step
        out["under_bound"] = stall <= out["bound_s"]
        out["met"] = out["under_cap"] and out["under_bound"]
        out["repeats_met"] = sum(
            1
            for s, a in zip(stalls, aborts, strict=True)
            if s is not None and a is not None and s <= min(STALL_CAP_S, a + STALL_SLACK_S + step)
        )
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table: medians with [min–max] in ms."""

    def ms(s: dict[str, Any]) -> str:
        if s["median"] is None:
            return "—"
        return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f}–{s['max'] * 1e3:.1f}]"

    head = ["context", "generated", "repeats", "stall ms", "abort ms", "target decode step ms",
            "bound ms", "rounds", "met"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        step = row["decode_step_s"]
        bound = row["checks"].get("bound_s")
        cells = [
            f"{row['context']:,}",
            f"{row['generated']:,}",
            str(row["stall"]["n"]),
            ms(row["stall"]),
            ms(row["abort"]),
            "—" if step is None else f"{step * 1e3:.1f}",
            "—" if bound is None else f"{bound * 1e3:.1f}",
            _count(row["rounds"]),
            str(row["checks"]["met"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _count(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "—"
    return f"{s['median']:g} [{s['min']:g}–{s['max']:g}]"
