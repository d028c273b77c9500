"""The live-move benchmark's pure parts (`benchmark/live_move_report.py`) on CPU, and
its argument checks (`benchmark/bench_live_move.py`, imported without a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_live_move as bench  # noqa: E402
import live_move_report as report  # noqa: E402


def test_rows_run_shortest_first() -> None:
    rows = report.plan_rows([32768, 4096, 16384], [8192, 1024])
    assert rows == [(4096, 1024), (16384, 1024), (32768, 1024),
                    (4096, 8192), (16384, 8192), (32768, 8192)]  # fmt: skip


def test_pool_holds_every_repeat_of_the_largest_row_in_whole_pages() -> None:
    tokens = report.pool_tokens([4096, 32768], [1024, 8192], repeats=3, tail=32, page=16)
    per_request = 32768 + 8192 + 32  # 40,992: already whole pages of 16
    assert tokens == 3 * (per_request + 2 * 16)
    assert report.pool_tokens([100], [10], 1, 1, 16) == 112 + 32  # 111 rounded up to 112


def test_decode_step_is_the_median_gap_between_tokens() -> None:
    assert report.decode_step_s([1.0, 1.010, 1.020, 1.050, 1.060]) == pytest.approx(0.010)
    assert report.decode_step_s([1.0]) is None


def test_spread_is_median_with_range_of_the_values_present() -> None:
    assert report.spread([0.03, None, 0.01, 0.02]) == {
        "median": 0.02, "min": 0.01, "max": 0.03, "n": 3
    }  # fmt: skip
    assert report.spread([None])["median"] is None


def test_checks_apply_both_targets_to_the_medians() -> None:
    # Stall 25 ms: under 40 ms and under abort 12 + 10 + step 8 = 30 ms.
    met = report.checks([0.025, 0.024, 0.033], [0.012, 0.011, 0.013], 0.008)
    assert met["met"] and met["bound_s"] == pytest.approx(0.030)
    assert met["repeats_met"] == 2  # 33 ms is over its own 13 + 10 + 8
    # Under the bound but over the 40 ms cap: not met.
    capped = report.checks([0.045] * 3, [0.040] * 3, 0.010)
    assert capped["under_bound"] and not capped["under_cap"] and not capped["met"]
    # Under the cap but over abort + 10 ms + one step: not met.
    bound = report.checks([0.035] * 3, [0.005] * 3, 0.010)
    assert bound["under_cap"] and not bound["under_bound"] and not bound["met"]
    assert not report.checks([None], [None], None)["met"]


def test_markdown_row_shows_medians_with_ranges() -> None:
    row = {
        "context": 16384,
        "generated": 8192,
        "stall": report.spread([0.02, 0.03, 0.025]),
        "abort": report.spread([0.01, 0.012, 0.011]),
        "rounds": report.spread([3.0, 4.0, 3.0]),
        "decode_step_s": 0.0075,
        "checks": report.checks([0.02, 0.03, 0.025], [0.01, 0.012, 0.011], 0.0075),
    }
    line = report.markdown([row]).splitlines()[2]
    assert line.startswith("| 16,384 | 8,192 | 3 | 25.0 [20.0–30.0] | 11.0 [10.0–12.0] | 7.5 |")
    assert "| 28.5 | 3 [3–4] | True |" in line


def test_arguments() -> None:
    args = bench.parse_args([])
    assert (args.contexts, args.gens, args.repeats) == ([4096, 16384, 32768], [1024, 8192], 3)
    assert bench.parse_args(["--quick"]).gens == [256]
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
