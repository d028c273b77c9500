"""`docs/benchmarks.md`'s generated tables are what `benchmark/results.py` computes from
the raw records under `docs/gpu-runs/` (a figure edited by hand, or a record moved,
fails here)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import results  # noqa: E402


def test_every_record_the_page_quotes_is_there():
    missing = [rel for rel in results.RUNS.values() if not (results.RUNS_DIR / rel).is_file()]
    assert missing == []


def test_the_pages_tables_are_computed_from_the_records():
    page = results.PAGE.read_text()
    assert results.render(page) == page


def test_a_figure_edited_by_hand_is_caught():
    page = results.PAGE.read_text()
    start = page.index("<!-- results:targets -->")
    edited = page[:start] + page[start:].replace("5.39 ms", "4.40 ms", 1)
    assert edited != page
    assert results.render(edited) != edited


def test_spread_gives_the_median_and_the_range_and_says_when_there_is_one_value():
    assert results.spread([3.0, 1.0, 2.0], " ms") == "2.00 ms (1.00–3.00, n=3)"
    assert results.spread([2.5], "%", 1) == "2.5% (one run)"
    assert results.verdict([5.39], 5.0, " ms") == "**missed by 0.39 ms**"
    assert results.verdict([48.2], 45.0, " GB/s", below=False) == "met"
