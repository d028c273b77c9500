"""The flag-cost benchmark's arithmetic (`benchmark/flag_cost_stats.py`) on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import flag_cost_stats as stats  # noqa: E402


def test_gaps_are_per_token_and_the_first_chunk_is_no_gap() -> None:
    stream = [(0.100, 1), (0.110, 2), (0.130, 4), (0.130, 4), (0.140, 5)]
    assert stats.token_gaps(stream) == pytest.approx([0.010, 0.010, 0.010])
    assert stats.itl_ms(stream) == pytest.approx(10.0)
    assert stats.itl_ms([(0.1, 1)]) is None
    assert stats.token_gaps(stream, start=0.105) == pytest.approx([0.010, 0.010])


def test_decode_window_counts_only_while_every_stream_decodes() -> None:
    # Stream a starts at 0.0 and ends at 1.0; b starts at 0.2 and ends at 1.2: the window
    # is 0.2..1.0. a gets a token every 0.1 s, b every 0.05 s.
    a = [(round(0.1 * i, 3), i + 1) for i in range(11)]
    b = [(round(0.2 + 0.05 * i, 3), i + 1) for i in range(21)]
    window = stats.decode_window([a, b])
    assert window["window_s"] == pytest.approx(0.8)
    # a: 11 - 3 = 8 tokens, b: 17 - 1 = 16 tokens, in 0.8 s.
    assert window["tok_s"] == pytest.approx(24 / 0.8)
    assert window["itl_ms"] == pytest.approx(50.0)  # 16 gaps of 50 ms, 8 of 100 ms
    assert stats.decode_window([a, []])["tok_s"] is None  # a stream got nothing
    late = [(2.0, 1), (2.1, 2)]
    assert stats.decode_window([a, late])["tok_s"] is None  # never all decoding at once


def _rounds(values: dict[str, list[float]], cell: str = "ttft_fresh_17") -> list[dict]:
    n = len(next(iter(values.values())))
    return [
        {"round": i, "cells": {cell: {s: {"value": v[i]} for s, v in values.items()}}}
        for i in range(n)
    ]


def test_costs_read_at_the_medians_and_the_verdict_allows_the_aa_spread() -> None:
    rounds = _rounds({
        stats.STOCK: [10.0, 10.2, 9.8],
        stats.HICACHE: [11.0, 10.8, 11.2],  # median 11, rounds 10.8-11.2: A/A 1.82%
        stats.FLAG: [11.3, 11.1, 11.2],  # median 11.2: +1.82%
    })  # fmt: skip
    (row,) = stats.summarize(rounds, [stats.STOCK, stats.HICACHE, stats.FLAG])["rows"]
    assert row["hicache_cost_pct"] == pytest.approx(10.0)
    assert row["flag_cost_pct"] == pytest.approx(1.82)
    assert (row["aa_pct"], row["aa_kind"]) == (pytest.approx(1.82), "rounds")
    assert row["met"] is True  # over 1%, within the A/A spread
    assert row["servers"][stats.FLAG] == {"median": 11.2, "min": 11.1, "max": 11.3, "n": 3}
    tight = _rounds({stats.HICACHE: [11.0, 11.0, 11.0], stats.FLAG: [11.3, 11.3, 11.3]})
    (missed,) = stats.summarize(tight, [stats.HICACHE, stats.FLAG])["rows"]
    assert missed["met"] is False and missed["allowed_pct"] == 1.0
    assert stats.verdict(missed) == "**missed by 1.73 points**"


def test_throughput_costs_are_positive_when_lower_and_a_twin_sets_the_aa() -> None:
    rounds = _rounds(
        {stats.HICACHE: [1000.0, 1010.0], stats.FLAG: [995.0, 1005.0],
         stats.TWIN: [1020.0, 1030.0]},
        cell="decode_64",
    )  # fmt: skip
    (row,) = stats.summarize(rounds, [stats.HICACHE, stats.FLAG, stats.TWIN])["rows"]
    assert row["unit"] == "tok/s" and row["label"] == "decode throughput, 64 concurrent"
    assert row["flag_cost_pct"] == pytest.approx(0.5)  # 1000 vs 1005 tokens/s: 0.5% fewer
    assert (row["aa_pct"], row["aa_kind"]) == (pytest.approx(1.99), "twin")
    assert row["hicache_cost_pct"] is None and row["met"] is True


def test_cells_are_ordered_and_unknown_names_refused() -> None:
    rounds = [{"cells": {"itl_64": {}, "decode_32": {}, "ttft_fresh_2k": {}, "itl_32": {}}}]
    names = [c.name for c in stats.cells_in(rounds)]
    assert names == ["ttft_fresh_2k", "decode_32", "itl_32", "itl_64"]
    assert stats.cell("itl_32").lower_is_better and not stats.cell("decode_8").lower_is_better
    with pytest.raises(ValueError):
        stats.cell("bogus")


def test_table_names_every_server_and_says_one_round() -> None:
    rounds = _rounds({stats.STOCK: [10.0], stats.HICACHE: [10.5], stats.FLAG: [10.5]})
    summary = stats.summarize(rounds, [stats.STOCK, stats.HICACHE, stats.FLAG])
    text = stats.table(summary)
    assert "| SGLang | + HiCache | + HiCache + flag |" in text
    assert "10.50 (one round)" in text and "+5.00%" in text and "+0.00%" in text
    assert summary["all_met"] is True
    assert stats.summarize([], [stats.FLAG]) == {
        "rounds": 0, "servers": [stats.FLAG], "rows": [], "all_met": False
    }  # fmt: skip


def test_paired_rounds_give_each_rounds_difference_and_who_was_slower() -> None:
    rounds = _rounds({
        stats.HICACHE: [120.0, 121.0, 130.0],
        stats.FLAG: [135.0, 146.5, 124.0],
    }, cell="ttft_cached_32k")  # fmt: skip
    for i, r in enumerate(rounds):
        r["order"] = [[stats.HICACHE, stats.FLAG], [stats.FLAG, stats.HICACHE]][i % 2]
    del rounds[1]["cells"]["ttft_cached_32k"][stats.HICACHE]  # a cell lost in round 1
    assert stats.paired(rounds, "ttft_cached_32k", stats.FLAG, stats.HICACHE) == [
        15.0, None, -6.0,
    ]  # fmt: skip
    table = stats.paired_table(rounds, ["ttft_cached_32k"]).splitlines()
    assert table[0] == "| row | round 0 (H,F) | round 1 (F,H) | round 2 (H,F) | F slower in |"
    assert table[2] == "| TTFT, 32K cached + 16 new (ms) | +15.00 | — | -6.00 | 1 of 2 |"
    # Throughput: higher is better, so a positive difference is the flag being faster.
    tput = _rounds({stats.HICACHE: [100.0, 100.0], stats.FLAG: [90.0, 110.0]}, "decode_32")
    assert stats.paired_table(tput, ["decode_32"]).endswith("| -10.00 | +10.00 | 1 of 2 |")
