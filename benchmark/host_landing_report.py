"""The pure parts of `bench_host_landing.py`: one move's row, the summary per length and
tier against the issue's targets, the result file.

Nothing here talks to a server, so all of it is tested on CPU
(`test/unit/test_bench_host_landing.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spreads import spread

LENGTHS = (8192, 32768)
TIERS = ("gpu", "host")  # where the source holds the prefix it moves
# The targets: a move into a target whose GPU pool is full (it lands in the
# target's host tier) takes at most 3x the device-path move of the same length into a
# target with room, and at most 10% of re-prefilling the prompt on the target.
OVER_DEVICE_MAX = 3.0
OVER_REPREFILL_MAX = 0.10


def move_row(
    result: Any,
    wall_s: float,
    served: dict[str, Any],
    ttft_s: float,
    held: dict[str, Any],
    expected_tokens: int,
) -> dict[str, Any]:
    """One move as the result file keeps it: what the client's `MigrationResult` says
    (the path and landing tier it took and why, its phases and per-trip steps, the copy),
    its wall time, what the source held where, and how the target then served the prompt
    (its TTFT and `cached_tokens_details`). `whole`: it moved the prefix's
    `expected_tokens`; a move of less is kept in the file but left out of the summary."""
    details = served["meta_info"].get("cached_tokens_details") or {}
    return {
        "whole": result.migrated_token_size == expected_tokens,
        "expected_tokens": expected_tokens,
        "path": result.path,
        "landing_tier": result.landing_tier,
        "fallback_reason": result.fallback_reason,
        "migrated_tokens": result.migrated_token_size,
        "bytes": result.migrated_bytes,
        "client_wall_ms": wall_s * 1e3,
        "timings_ms": {k: v * 1e3 for k, v in result.timings.items()},
        "copy_ms": result.copy_seconds * 1e3,
        "copy_gb_s": result.migrated_bytes / result.copy_seconds / 1e9
        if result.copy_seconds > 0
        else None,
        "steps_ms": result.steps_ms,
        "transfer_steps_ms": result.transfer_steps_ms,
        "held_tokens": held.get("matched_token_size", 0),
        "held_device_tokens": held.get("device_token_size", 0),
        "served_ttft_ms": ttft_s * 1e3,
        "served_cached_tokens": int(served["meta_info"].get("cached_tokens") or 0),
        "served_cached_details": {k: int(v or 0) for k, v in details.items()},
    }


def failed_move(error: str, held: dict[str, Any], expected_tokens: int) -> dict[str, Any]:
    """A move the client gave up on (every path it tried failed): kept in the file with
    why, left out of the summary."""
    return {
        "failed": error,
        "whole": False,
        "expected_tokens": expected_tokens,
        "path": None,
        "landing_tier": None,
        "held_tokens": held.get("matched_token_size", 0),
        "held_device_tokens": held.get("device_token_size", 0),
    }


def _counts(row: dict[str, Any] | None, path: str) -> bool:
    """A move the summary counts: it moved the whole prefix on the path it had to."""
    return row is not None and row["whole"] and row["path"] == path


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length and tier: the landing move's wall time, the device-path move's and
    re-prefill's, as median with min-max over the repeats (moves that did not move the
    whole prefix on their path are counted in `left_out`), the ratios of the medians and
    whether they meet the targets."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == n]
        reprefill = spread([r.get("reprefill_ms") for r in mine])
        for tier in TIERS:
            landing = [r.get("landing", {}).get(tier) for r in mine]
            device = [r.get("device", {}).get(tier) for r in mine]
            kept_landing = [m for m in landing if _counts(m, "shared_host")]
            kept_device = [m for m in device if _counts(m, "device")]
            wall = spread([m["client_wall_ms"] for m in kept_landing])
            device_wall = spread([m["client_wall_ms"] for m in kept_device])
            entry: dict[str, Any] = {
                "tokens": n,
                "tier": tier,
                "landing_ms": wall,
                "landing_copy_ms": spread([m["copy_ms"] for m in kept_landing]),
                "landing_copy_gb_s": spread([m["copy_gb_s"] for m in kept_landing]),
                "device_ms": device_wall,
                "reprefill_ms": reprefill,
                "landing_tiers": sorted({m["landing_tier"] for m in landing if m and m["path"]}),
                "served_host_tokens": spread(
                    [m["served_cached_details"].get("host") for m in kept_landing]
                ),
                "left_out": len(landing) - len(kept_landing) + len(device) - len(kept_device),
            }
            entry.update(_ratios(wall["median"], device_wall["median"], reprefill["median"]))
            out.append(entry)
    return out


def _ratios(landing: Any, device: Any, reprefill: Any) -> dict[str, Any]:
    over_device = landing / device if landing and device else None
    over_reprefill = landing / reprefill if landing and reprefill else None
    return {
        "over_device": over_device,
        "over_reprefill": over_reprefill,
        "meets_device_target": None if over_device is None else over_device <= OVER_DEVICE_MAX,
        "meets_reprefill_target": None
        if over_reprefill is None
        else over_reprefill <= OVER_REPREFILL_MAX,
    }


def markdown(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a table (medians, min-max in brackets)."""

    def cell(s: dict[str, Any]) -> str:
        if s["median"] is None:
            return "-"
        return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] n={s['n']}"

    def ratio(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| tokens | source tier | landing ms | device-path ms | re-prefill ms | landing/device "
        "| landing/re-prefill |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        lines.append(
            f"| {e['tokens']} | {e['tier']} | {cell(e['landing_ms'])} | {cell(e['device_ms'])} "
            f"| {cell(e['reprefill_ms'])} | {ratio(e['over_device'])} "
            f"| {ratio(e['over_reprefill'])} |"
        )
    return "\n".join(lines)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Rewrite the result file whole (a run cut at its limit keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
