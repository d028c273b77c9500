"""Median-with-range summaries that the benchmarks' pure report modules share (the busy
source's, the host landing's, the flag cost's and verl's pattern's). Nothing here talks
to a server."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median with min and max of the values present (None: not measured)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def rounded_spread(values: Sequence[float], digits: int) -> dict[str, Any] | None:
    """`{"median", "min", "max", "n"}` of per-repeat values, rounded to `digits`; None
    when there are none."""
    if not values:
        return None
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }
