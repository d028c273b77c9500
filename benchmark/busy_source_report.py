"""The pure parts of `bench_busy_source.py`: spreads, ratios, decode rates, the result file.

Nothing here talks to a server, so all of it is tested on CPU
(`test/unit/test_bench_busy_source.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spreads import spread

LENGTHS = (1024, 8192, 32768)
TIERS = ("gpu", "host")  # where the source holds the prefix it moves
SOURCES = ("idle", "busy")  # the source decodes nothing / a full batch meanwhile
# The targets: a move on a busy source <= 2x the same move between idle servers;
# the source's decode throughput during a stream of moves >= 95% of without.
BUSY_OVER_IDLE_MAX = 2.0
DECODE_KEPT_MIN = 0.95


def counter_rate(samples: Sequence[tuple[float, float]]) -> float | None:
    """Rate of a counter SGLang adds to in steps (at each log interval), from `(time,
    value)` samples: between the first and the last sample at which it changed, so the
    partial intervals at both ends of the window do not count. None when it changed
    fewer than twice."""
    changes = [samples[i] for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]]
    if len(changes) < 2:
        return None
    (t0, v0), (t1, v1) = changes[0], changes[-1]
    return (v1 - v0) / (t1 - t0) if t1 > t0 else None


def move_row(
    result: Any, wall_s: float, ttft_s: float, held: dict[str, Any], expected_tokens: int
) -> dict[str, Any]:
    """One move as the result file keeps it: the client's `MigrationResult` fields the
    replies already report (phases, per-trip `steps_ms`: scheduler trips and their waits,
    the copy), its wall time, and what the source held where when it was asked. `whole`:
    it moved the prefix's `expected_tokens` (its whole pages); a move of less (the source
    had already evicted the prefix) is kept in the file but left out of the summary."""
    return {
        "whole": result.migrated_token_size == expected_tokens,
        "expected_tokens": expected_tokens,
        "path": result.path,
        "fallback_reason": result.fallback_reason,
        "migrated_tokens": result.migrated_token_size,
        "bytes": result.migrated_bytes,
        "total_ms": result.timings.get("total", wall_s) * 1e3,
        "client_wall_ms": wall_s * 1e3,
        "timings_ms": {k: v * 1e3 for k, v in result.timings.items()},
        "copy_ms": result.copy_seconds * 1e3,
        "steps_ms": result.steps_ms,
        "transfer_steps_ms": result.transfer_steps_ms,
        "ttft_after_ms": ttft_s * 1e3,
        "held_tokens": held.get("matched_token_size", 0),
        "held_device_tokens": held.get("device_token_size", 0),
    }


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: re-prefill on the target, and per (tier, source state) the move's
    total, copy and wall time as median with min-max over the moves that moved the whole
    prefix (`not_whole` counts the others), the busy/idle ratio of the medians and
    whether it meets `BUSY_OVER_IDLE_MAX`."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == n]
        entry: dict[str, Any] = {
            "tokens": n,
            "reprefill_ms": spread([r.get("reprefill_ms") for r in mine]),
        }
        for tier in TIERS:
            per_state = {}
            for state in SOURCES:
                moves = [r[state][tier] for r in mine if tier in r.get(state, {})]
                whole = [m for m in moves if m.get("whole", True)]
                per_state[state] = {
                    key: spread([m.get(key) for m in whole])
                    for key in ("total_ms", "copy_ms", "client_wall_ms", "ttft_after_ms")
                }
                per_state[state]["not_whole"] = len(moves) - len(whole)
            ratio = _ratio(per_state["busy"]["total_ms"], per_state["idle"]["total_ms"])
            entry[tier] = {
                **per_state,
                "busy_over_idle": ratio,
                "met": None if ratio is None else ratio <= BUSY_OVER_IDLE_MAX,
                "busy_over_reprefill": _ratio(per_state["busy"]["total_ms"], entry["reprefill_ms"]),
            }
        out.append(entry)
    return out


def decode_kept(windows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The source's decode throughput with a stream of moves over without, per pair of
    windows and over their medians; `met` against `DECODE_KEPT_MIN`."""
    without = spread([w.get("without_tok_s") for w in windows])
    during = spread([w.get("with_moves_tok_s") for w in windows])
    ratio = _ratio(during, without)
    return {
        "without_tok_s": without,
        "with_moves_tok_s": during,
        "per_window": [_div(w.get("with_moves_tok_s"), w.get("without_tok_s")) for w in windows],
        "kept": ratio,
        "met": None if ratio is None else ratio >= DECODE_KEPT_MIN,
        "moves_in_windows": sum(w.get("moves", 0) for w in windows),
    }


# Six concurrent 8K moves against one: <= 1.5x between idle servers and on a busy
# source (issue 49, item 5), <= 2x from a source decoding a full batch (issue 53).
CONCURRENT_OVER_ONE_MAX = 1.5
BUSY_CONCURRENT_OVER_ONE_MAX = 2.0
CONCURRENT_WAYS = ("threads", "one_call")  # six from six threads; six in one call


def concurrent_move(
    result: Any, wall_s: float, where: dict[str, Any], expected_tokens: int
) -> dict[str, Any]:
    """One move of a concurrency round: its wall time, where the source held the prefix
    just before (`tier`: all on its GPU, all in its host tier, or both), whether it moved
    the whole prefix, the copy, and the loop iterations of its trip on each side (from
    `steps_ms`: `polls`, `first_poll`, `target_iteration`; `allocate_ahead`: the source's
    HTTP layer asked the target), with the trip's steps as they came."""
    steps = result.steps_ms.get("transfer", {})
    on_gpu = where.get("device_token_size", 0)
    held_tokens = where.get("matched_token_size", 0)
    tier = "gpu" if on_gpu >= held_tokens else ("host" if on_gpu == 0 else "mixed")
    return {
        "wall_ms": wall_s * 1e3,
        "whole": result.migrated_token_size == expected_tokens,
        "path": result.path,
        "fallback_reason": result.fallback_reason,
        "migrated_tokens": result.migrated_token_size,
        "tier": tier,
        "held_device_tokens": on_gpu,
        "copy_ms": result.copy_seconds * 1e3,
        "polls": steps.get("polls"),
        "first_poll": steps.get("first_poll"),
        "target_iteration": steps.get("target_iteration"),
        "allocate_ahead_ms": steps.get("allocate_ahead"),
        "steps_ms": result.steps_ms,
    }


def concurrency_summary(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per source state (idle / busy) and way of sending six (`CONCURRENT_WAYS`): the
    one move's and the six's wall times and each round's ratio, as median with min-max
    over the rounds; the verdicts; and per round the most source iterations of a move,
    the source and target iterations the six were taken up and allocated in, the tiers
    they were copied from, how many moved less than their prefix and how many failed
    (with why). A verdict needs every move of every round to have moved its whole
    prefix: with a move failed or short the six did less than six moves' work, and
    `met` is None (not measured) whatever the ratio."""
    out: dict[str, Any] = {}
    for state in SOURCES:
        mine = [r for r in rounds if r.get("state") == state]
        one = [r["one"] for r in mine]
        out[state] = {
            "one_ms": spread([m["wall_ms"] for m in one]),
            "one_source_iterations": [m.get("polls") for m in one],
            "one_tiers": _tiers(one),
        }
        limit = BUSY_CONCURRENT_OVER_ONE_MAX if state == "busy" else CONCURRENT_OVER_ONE_MAX
        for way in CONCURRENT_WAYS:
            done = [r for r in mine if way in r]
            ratios = [r[way]["wall_ms"] / r["one"]["wall_ms"] for r in done]
            ratio = spread(ratios)
            moves = _iterations([r[way]["moves"] for r in done])
            judged = ratio["median"] is not None and moves["moved"] == moves["moves"]
            out[state][way] = {
                "wall_ms": spread([r[way]["wall_ms"] for r in done]),
                "over_one": ratio,
                "met_1_5": ratio["median"] <= 1.5 if judged else None,
                "met": ratio["median"] <= limit if judged else None,
                "limit": limit,
                **moves,
            }
    return out


def _iterations(per_round: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    def distinct(moves: Sequence[dict[str, Any]], key: str) -> int:
        return len({m[key] for m in moves if m.get(key) is not None})

    return {
        "source_iterations_max": [
            max((m.get("polls") or 0 for m in ms), default=0) for ms in per_round
        ],
        "taken_up_in": [distinct(ms, "first_poll") for ms in per_round],
        "allocated_in": [distinct(ms, "target_iteration") for ms in per_round],
        "tiers": _tiers([m for ms in per_round for m in ms]),
        "not_whole": sum(not m.get("whole", True) for ms in per_round for m in ms),
        "moves": sum(len(ms) for ms in per_round),
        "moved": sum(bool(m.get("whole", True)) for ms in per_round for m in ms),
        "failures": failures([m for ms in per_round for m in ms]),
    }


def _tiers(moves: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Where the source held each prefix that a move was made from; a move that failed
    has no tier (the client raised before it said one) and is counted in `failures`."""
    counts: dict[str, int] = {}
    for m in moves:
        if "failed" not in m:
            counts[m.get("tier", "?")] = counts.get(m.get("tier", "?"), 0) + 1
    return counts


def failures(moves: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Why moves failed, each reason with its count (the client's message, as it came)."""
    counts: dict[str, int] = {}
    for m in moves:
        if "failed" in m:
            counts[m["failed"]] = counts.get(m["failed"], 0) + 1
    return counts


def concurrency_markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| source | six sent | one move ms | six ms | six / one | target | source iterations "
        "per move (one; six, most) | six taken up in | six allocated in | moved | tiers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    reasons: dict[str, int] = {}
    for state, s in summary.items():
        for way in CONCURRENT_WAYS:
            c = s[way]
            met = "not measured" if c["met"] is None else c["met"]
            lines.append(
                f"| {state} | {way} | {_cell(s['one_ms'])} | {_cell(c['wall_ms'])} "
                f"| {_cell(c['over_one'], 2)} | <= {c['limit']}: {met} "
                f"| {s['one_source_iterations']}; {c['source_iterations_max']} "
                f"| {c['taken_up_in']} | {c['allocated_in']} | {c['moved']} of {c['moves']} "
                f"| {c['tiers']} |"
            )
            for reason, n in c["failures"].items():
                reasons[reason] = reasons.get(reason, 0) + n
    lines += [f"\nfailed {n}x: {reason}" for reason, n in reasons.items()]
    return "\n".join(lines)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Rewritten whole after every row (small): a run cut at its limit keeps what it
    measured, with `complete` false."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def markdown(summary: Sequence[dict[str, Any]], decode: dict[str, Any] | None) -> str:
    lines = [
        "| prefix | tier | re-prefill ms | idle move ms (min-max) | busy move ms (min-max) "
        "| busy / idle | busy copy ms | met (<= 2x) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in summary:
        for tier in TIERS:
            t = entry[tier]
            lines.append(
                f"| {entry['tokens']} | {tier} | {_cell(entry['reprefill_ms'])} "
                f"| {_moves_cell(t['idle'])} | {_moves_cell(t['busy'])} "
                f"| {_num(t['busy_over_idle'], 2)} | {_cell(t['busy']['copy_ms'])} "
                f"| {t['met']} |"
            )
    if decode is not None:
        lines.append(
            f"\nsource decode throughput: {_cell(decode['without_tok_s'])} tok/s alone, "
            f"{_cell(decode['with_moves_tok_s'])} during moves: kept {_num(decode['kept'], 3)} "
            f"(target >= {DECODE_KEPT_MIN}: {decode['met']})"
        )
    return "\n".join(lines)


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return _div(a.get("median"), b.get("median"))


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _moves_cell(state: dict[str, Any]) -> str:
    """The moves' total; moves of less than the whole prefix are named, not counted."""
    cell = _cell(state["total_ms"])
    left_out = state.get("not_whole", 0)
    return cell if not left_out else f"{cell} [{left_out} moved less than the prefix]"


def _cell(s: dict[str, Any], digits: int = 1) -> str:
    if s.get("median") is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
