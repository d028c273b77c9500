"""The busy-source benchmark's pure parts (`benchmark/busy_source_report.py`) on CPU."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import busy_source_report as report  # noqa: E402


def _move(total_ms: float, copy_ms: float = 1.0) -> dict:
    return {"total_ms": total_ms, "copy_ms": copy_ms, "client_wall_ms": total_ms + 1}


def _row(n: int, rep: int, idle: float, busy: float, reprefill: float) -> dict:
    return {
        "tokens": n,
        "repeat": rep,
        "reprefill_ms": reprefill,
        "idle": {"gpu": _move(idle), "host": _move(2 * idle)},
        "busy": {"gpu": _move(busy), "host": _move(2 * busy + 10)},
    }


def test_summary_gives_medians_with_min_max_and_busy_over_idle() -> None:
    rows = [_row(8192, r, idle, busy, 500.0 + r) for r, (idle, busy) in enumerate(
        [(10.0, 15.0), (12.0, 30.0), (11.0, 18.0)]
    )]  # fmt: skip
    rows.append(_row(1024, 0, 4.0, 9.0, 50.0))
    summary = report.summarize(rows)
    assert [s["tokens"] for s in summary] == [1024, 8192]
    gpu = summary[1]["gpu"]
    assert gpu["idle"]["total_ms"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 3}
    assert gpu["busy"]["total_ms"] == {"median": 18.0, "min": 15.0, "max": 30.0, "n": 3}
    assert gpu["busy_over_idle"] == 18.0 / 11.0 and gpu["met"] is True
    assert summary[1]["reprefill_ms"]["median"] == 501.0
    assert gpu["busy_over_reprefill"] == 18.0 / 501.0
    host = summary[1]["host"]  # busy 2x+10 of idle 2x: over the target
    assert host["busy_over_idle"] == 46.0 / 22.0 and host["met"] is False
    assert summary[0]["gpu"]["busy_over_idle"] == 9.0 / 4.0 and summary[0]["gpu"]["met"] is False


def test_a_row_cut_short_counts_what_it_measured() -> None:
    partial = {"tokens": 1024, "repeat": 0, "reprefill_ms": 40.0, "idle": {"gpu": _move(5.0)}}
    (entry,) = report.summarize([partial])
    assert entry["gpu"]["idle"]["total_ms"]["median"] == 5.0
    assert entry["gpu"]["busy"]["total_ms"]["n"] == 0
    assert entry["gpu"]["busy_over_idle"] is None and entry["gpu"]["met"] is None
    assert entry["host"]["idle"]["total_ms"]["median"] is None
    assert "1024 | gpu" in report.markdown([entry], None)


def test_a_move_of_less_than_the_prefix_is_counted_apart_not_measured() -> None:
    # The busy source had evicted the host-tier prefix: the move moved nothing, fast.
    rows = [_row(8192, r, 10.0, 20.0, 500.0) for r in range(3)]
    for row in rows:
        row["busy"]["host"].update(total_ms=1.0, whole=False)
    (entry,) = report.summarize(rows)
    assert entry["host"]["busy"]["total_ms"]["n"] == 0
    assert entry["host"]["busy"]["not_whole"] == 3
    assert entry["host"]["busy_over_idle"] is None and entry["host"]["met"] is None
    assert entry["gpu"]["busy"]["not_whole"] == 0
    assert "[3 moved less than the prefix]" in report.markdown([entry], None)


def test_counter_rate_uses_only_whole_intervals_between_steps() -> None:
    # The counter steps at t=1.0 (100 -> 150), 2.0 (-> 250), 3.0 (-> 350); samples also
    # before the first step and after the last: only 1.0 .. 3.0 counts.
    samples = [(0.0, 100.0), (0.5, 100.0), (1.0, 150.0), (1.5, 150.0), (2.0, 250.0),
               (2.5, 250.0), (3.0, 350.0), (3.5, 350.0)]  # fmt: skip
    assert report.counter_rate(samples) == 100.0
    assert report.counter_rate([(0.0, 1.0), (1.0, 2.0)]) is None  # one change: no rate
    assert report.counter_rate([]) is None


def test_decode_kept_against_the_target() -> None:
    windows = [
        {"without_tok_s": 1000.0, "with_moves_tok_s": 960.0, "moves": 5},
        {"without_tok_s": 1100.0, "with_moves_tok_s": 1000.0, "moves": 4},
        {"without_tok_s": 1050.0, "with_moves_tok_s": None, "moves": 0},
    ]
    kept = report.decode_kept(windows)
    assert kept["kept"] == 980.0 / 1050.0 and kept["met"] is False  # medians: 93%
    assert kept["per_window"] == [0.96, 1000.0 / 1100.0, None]
    assert kept["moves_in_windows"] == 9
    assert report.decode_kept(windows[:1])["met"] is True  # 96%
    assert report.decode_kept([])["kept"] is None


@dataclass
class _Result:
    path: str = "device"
    fallback_reason: str = ""
    migrated_token_size: int = 8192
    migrated_bytes: int = 8192 * 131072
    timings: dict = field(default_factory=lambda: {"transfer": 0.004, "total": 0.006})
    copy_seconds: float = 0.002
    steps_ms: dict = field(default_factory=lambda: {"transfer": {"waited": 1.5}})
    transfer_steps_ms: list = field(default_factory=list)


def test_move_row_keeps_what_the_replies_report() -> None:
    row = report.move_row(_Result(), 0.007, 0.05, {"matched_token_size": 8192}, 8192)
    assert row["whole"] is True and row["expected_tokens"] == 8192
    assert row["total_ms"] == 6.0 and row["client_wall_ms"] == 7.0
    assert row["copy_ms"] == 2.0 and row["timings_ms"]["transfer"] == 4.0
    assert row["steps_ms"] == {"transfer": {"waited": 1.5}}
    assert (row["held_tokens"], row["held_device_tokens"]) == (8192, 0)
    assert row["ttft_after_ms"] == 50.0


def test_move_row_says_whether_the_whole_prefix_moved() -> None:
    # The source had evicted the prefix: the move moved nothing.
    row = report.move_row(_Result(migrated_token_size=0), 0.002, 0.05, {}, 8176)
    assert row["whole"] is False and row["migrated_tokens"] == 0


def test_the_result_file_is_rewritten_whole(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench_busy_source.json"
    report.write_result(path, {"rows": [1], "complete": False})
    report.write_result(path, {"rows": [1, 2], "complete": True})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "complete": True}
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_concurrency_summary_per_target_state() -> None:
    rounds = [
        {"target": "idle", "one_ms": 10.0, "all_ms": 14.0},
        {"target": "idle", "one_ms": 12.0, "all_ms": 20.0},
        {"target": "idle", "one_ms": 11.0, "all_ms": 15.0},
        {"target": "busy", "one_ms": 20.0, "all_ms": 40.0},
    ]
    summary = report.concurrency_summary(rounds)
    assert summary["idle"]["one_ms"]["median"] == 11.0
    assert summary["idle"]["concurrent_over_one"] == 15.0 / 11.0
    assert summary["idle"]["met"] is True
    assert summary["busy"]["concurrent_over_one"] == 2.0 and summary["busy"]["met"] is False
    assert report.concurrency_summary([])["busy"]["met"] is None
