"""The live-move benchmark's pure parts (`benchmark/live_move_report.py`) on CPU, and
its argument checks (`benchmark/bench_live_move.py`, imported without a GPU)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_checks_hold_the_stall_to_sglangs_own_resume_and_the_cap_at_4k() -> None:
    # Stall 60 ms beside SGLang's own cached resume of 52 ms: 8 ms added, under 52 + 10
    # + step 5 = 67 ms; a 16K row has no 40 ms cap.
    met = report.checks(16384, [0.060, 0.058, 0.075], [0.052, 0.050, 0.052], 0.005)
    assert met["met"] and met["bound_s"] == pytest.approx(0.067)
    assert met["added_s"] == pytest.approx(0.008) and met["stall_cap_s"] is None
    assert met["repeats_met"] == 2  # 75 ms is over its own 52 + 10 + 5
    # The same figures at 4K: under the bound, over the 40 ms cap.
    capped = report.checks(4096, [0.060, 0.058, 0.075], [0.052, 0.050, 0.052], 0.005)
    assert capped["under_bound"] and not capped["under_cap"] and not capped["met"]
    assert capped["repeats_met"] == 0
    # Under the cap but more than 10 ms + one step over SGLang's own resume: not met.
    bound = report.checks(4096, [0.035] * 3, [0.015] * 3, 0.006)
    assert bound["under_cap"] and not bound["under_bound"] and not bound["met"]
    assert not report.checks(4096, [None], [None], None)["met"]
    assert not report.checks(4096, [0.03], [None], 0.005)["met"]


def test_markdown_row_shows_medians_with_ranges() -> None:
    stalls, bases = [0.02, 0.03, 0.025], [0.015, 0.02, 0.018]
    row = {
        "context": 16384,
        "generated": 8192,
        "stall": report.spread(stalls),
        "baseline": report.spread(bases),
        "abort": report.spread([0.01, 0.012, 0.011]),
        "rounds": report.spread([3.0, 4.0, 3.0]),
        "decode_step_s": 0.0075,
        "checks": report.checks(16384, stalls, bases, 0.0075),
    }
    line = report.markdown([row]).splitlines()[2]
    assert line.startswith("| 16,384 | 8,192 | 3 | 25.0 [20.0–30.0] | 18.0 [15.0–20.0] | 7.0 |")
    assert "| 11.0 [10.0–12.0] | 7.5 | 35.5 | 3 [3–4] | True |" in line


def test_a_row_is_predicted_from_the_shorter_row_at_its_context() -> None:
    args = SimpleNamespace(stagger=160, repeats=3, tail=32)
    rows = [{"context": 4096, "generated": 1024, "seconds": 20.0}]
    # 1,376 tokens decoded took 20 s; 8,544 take 8,544 / 1,376 of it, and a quarter more.
    assert report.predicted_row_s(rows, 4096, 8192, args) == pytest.approx(
        20.0 * 8544 / 1376 * 1.25
    )
    assert report.predicted_row_s(rows, 32768, 8192, args) is None
    assert report.predicted_row_s(rows, 4096, 1024, args) is None


def _stamp(t0: float, ms: float) -> float:
    return t0 + ms / 1e3


def test_breakdown_lays_the_three_clocks_on_one_line(tmp_path) -> None:
    """A move read from the migrator's moments, SGLang's meta_info timestamps and the
    servers' moment files (written as `request_moments` writes them)."""
    t0 = 1000.0
    s = functools.partial(_stamp, t0)
    repeat = {
        "source_rid": "src",
        "resumed_rid": "res",
        "moments": {"stop_sent": s(0), "last_source_token": s(29), "stop_returned": s(30),
                    "resume_sent": s(31), "first_token": s(95)},
        "source_meta": {"request_finished_ts": s(28)},
        "resumed_meta": {"request_received_ts": s(34), "api_server_dispatch_finish_ts": s(35),
                         "forward_entry_time": s(40), "prefill_finished_time": s(88),
                         "response_sent_to_client_ts": s(92)},
        "baseline": {"rid": "base", "sent": s(200), "first_token": s(250),
                     "meta": {"request_received_ts": s(203)}},
    }  # fmt: skip
    source = [
        {"t": s(2), "event": "tm_abort", "rid": "src"},
        {"t": s(5), "event": "abort_seen", "rid": "src", "running": True},
        {"t": s(4), "event": "launched", "mode": "decode", "rids": ["src", "x"], "ms": 0.3},
        {"t": s(8), "event": "launched", "mode": "decode", "rids": ["src", "x"], "ms": 0.3},
        {"t": s(15), "event": "launched", "mode": "decode", "rids": ["src", "x"], "ms": 0.3},
        {"t": s(20), "event": "released", "rid": "src", "tokens": 5127, "ms": 4.0},
        {"t": s(22), "event": "launched", "mode": "decode", "rids": ["x"], "ms": 0.3},
    ]
    target = [
        {"t": s(37), "event": "received", "rid": "res", "tokens": 5127},
        {"t": s(41), "event": "launched", "mode": "extend", "rids": ["res"], "ms": 21.0},
        {"t": s(70), "event": "processed", "mode": "extend", "rids": ["res"], "ms": 17.5},
        {"t": s(201), "event": "received", "rid": "base", "tokens": 5127},
    ]
    lines = [json.dumps(e) for e in source + target]
    (tmp_path / "moments-1.jsonl").write_text("\n".join(lines[:7]) + "\n")
    (tmp_path / "moments-2.jsonl").write_text("\n".join(lines[7:]) + "\n")
    events = report.read_moments(tmp_path, ["src", "res", "base"])
    # By time, across files; a batch that ran none of them is left out.
    assert [e["t"] for e in events] == sorted(e["t"] for e in source[:-1] + target)
    assert len(report.read_moments(tmp_path, ["res"])) == 3  # only the lines naming it

    b = report.breakdown(repeat, events)
    want = {
        "stop.http": 2, "stop.to_scheduler": 3, "stop.in_batch": 15, "stop.release": 4.0,
        "stop.out": 4, "stop.to_client": 2, "stop.steps": 2,  # the batches at 8 and 15 ms
        "tail_to_stop": 1, "to_resume": 1, "resume.http_in": 3, "resume.tokenizer": 1,
        "resume.to_scheduler": 2, "resume.schedule": 3, "resume.prefill": 48,
        "resume.prefill_launch": 21.0, "resume.prefill_result": 17.5, "resume.out": 4,
        "resume.to_client": 3,
    }  # fmt: skip
    assert {k: b[k] for k in want} == pytest.approx(want)
    # The phases of the stall add up to it: last source token -> first token, 66 ms.
    stall = sum(
        b[k]
        for k in report.STALL_PHASES
        if k not in ("resume.prefill_launch", "resume.prefill_result")
    )
    assert stall == pytest.approx(66.0)
    assert b["baseline"]["resume.http_in"] == pytest.approx(3.0)
    assert b["baseline"]["resume.to_scheduler"] is None  # no dispatch stamp: not said
    assert b["baseline"]["resume.schedule"] is None

    spreads = report.phase_spreads([b, b])
    assert spreads["resume.prefill"]["median"] == pytest.approx(48.0)
    assert spreads["baseline"]["resume.http_in"]["n"] == 2
    row = {"context": 4096, "generated": 1024, "phases": spreads}
    table = report.markdown_breakdown([row])
    assert "| resume.prefill | 48.0 [48.0–48.0] |" in table
    assert "| stop.steps | 2 [2–2] |" in table
    assert "| baseline resume.http_in | 3.0 [3.0–3.0] |" in table


def test_meta_stamps_keep_only_sglangs_timestamps() -> None:
    meta = {"request_received_ts": 1.5, "cached_tokens": 9, "forward_entry_time": 2,
            "prefill_finished_time": None}  # fmt: skip
    assert report.meta_stamps(meta) == {"request_received_ts": 1.5, "forward_entry_time": 2.0}


def test_arguments() -> None:
    args = bench.parse_args([])
    assert (args.contexts, args.gens, args.repeats) == ([4096, 16384, 32768], [1024, 8192], 3)
    assert bench.parse_args(["--quick"]).gens == [256]
    assert bench.parse_args(["--no-moments"]).moments_dir == ""
    assert bench.parse_args([]).moments_dir.endswith("moments")
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
