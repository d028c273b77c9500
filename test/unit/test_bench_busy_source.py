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


def _concurrent(wall_ms: float, polls: int = 2, tier: str = "gpu", **steps: int) -> dict:
    held = {"matched_token_size": 8176, "device_token_size": 8176 if tier == "gpu" else 0}
    result = _Result(
        migrated_token_size=8176,
        steps_ms={"transfer": {"polls": polls, **steps}},
    )
    return report.concurrent_move(result, wall_ms / 1e3, held, 8176)


def _round(state: str, one: float, threads: float, one_call: float) -> dict:
    six = [_concurrent(threads, first_poll=7 + i // 4, target_iteration=3) for i in range(6)]
    batch = [_concurrent(one_call, polls=1, first_poll=9, target_iteration=5) for _ in range(6)]
    return {
        "state": state,
        "one": _concurrent(one),
        "threads": {"wall_ms": threads, "moves": six},
        "one_call": {"wall_ms": one_call, "moves": batch},
    }


def test_a_concurrent_move_keeps_its_tier_and_the_iterations_of_its_trip() -> None:
    move = _concurrent(12.0, polls=1, first_poll=4, target_iteration=9, allocate_ahead=2)
    assert move["tier"] == "gpu" and move["whole"] and move["wall_ms"] == 12.0
    assert (move["polls"], move["first_poll"], move["target_iteration"]) == (1, 4, 9)
    assert move["allocate_ahead_ms"] == 2
    assert _concurrent(12.0, tier="host")["tier"] == "host"
    mixed = report.concurrent_move(
        _Result(), 0.01, {"matched_token_size": 8176, "device_token_size": 100}, 8192
    )
    assert mixed["tier"] == "mixed" and mixed["whole"]  # (the _Result moved 8192)


def test_concurrency_summary_per_source_state_and_way() -> None:
    rounds = [
        _round("idle", 10.0, 14.0, 12.0),
        _round("idle", 12.0, 30.0, 13.0),
        _round("idle", 11.0, 16.5, 12.0),
        _round("busy", 20.0, 44.0, 30.0),
    ]
    summary = report.concurrency_summary(rounds)
    idle = summary["idle"]
    assert idle["one_ms"]["median"] == 11.0 and idle["one_source_iterations"] == [2, 2, 2]
    threads = idle["threads"]
    assert threads["over_one"]["median"] == 1.5 and threads["over_one"]["n"] == 3
    assert threads["met"] is True and threads["limit"] == 1.5  # 1.4, 2.5, 1.5
    assert threads["source_iterations_max"] == [2, 2, 2]
    assert threads["taken_up_in"] == [2, 2, 2] and threads["allocated_in"] == [1, 1, 1]
    assert threads["tiers"] == {"gpu": 18} and threads["not_whole"] == 0
    assert idle["one_call"]["source_iterations_max"] == [1, 1, 1]
    busy = summary["busy"]  # from a busy source: 2x is the target, 1.5x the other one
    assert busy["threads"]["over_one"]["median"] == 2.2 and busy["threads"]["met"] is False
    assert busy["one_call"]["over_one"]["median"] == 1.5 and busy["one_call"]["met"] is True
    assert busy["one_call"]["met_1_5"] is True and busy["threads"]["limit"] == 2.0
    assert report.concurrency_summary([])["busy"]["threads"]["met"] is None
    table = report.concurrency_markdown(summary)
    assert "| busy | threads |" in table and "<= 2.0: False" in table


def test_a_failed_or_partial_move_is_counted_apart_and_leaves_the_target_unjudged() -> None:
    """A round whose six did less than six moves' work (a move refused, or one that moved
    less than its prefix) gives its ratio but no verdict; a failed move has no tier and
    is counted with its reason."""
    full = "allocate failed (HTTP 503): device KV pool is full: 8176 token slots needed"
    row = _round("busy", 20.0, 30.0, 30.0)
    row["one_call"]["moves"][0] = {"failed": full, "whole": False, "wall_ms": 30.0}
    row["one_call"]["moves"][3] = {"failed": full, "whole": False, "wall_ms": 30.0}
    row["threads"]["moves"][1]["whole"] = False
    summary = report.concurrency_summary([row])["busy"]
    one_call, threads = summary["one_call"], summary["threads"]
    assert one_call["not_whole"] == 2 and threads["not_whole"] == 1
    assert one_call["tiers"] == {"gpu": 4} and one_call["failures"] == {full: 2}
    assert (one_call["moved"], one_call["moves"]) == (4, 6)
    assert (threads["moved"], threads["failures"]) == (5, {})
    assert one_call["over_one"]["median"] == 1.5 and one_call["met"] is None
    assert threads["met"] is None and threads["met_1_5"] is None
    table = report.concurrency_markdown(report.concurrency_summary([row]))
    assert "| busy | one_call |" in table and "<= 2.0: not measured" in table
    assert "| 4 of 6 | {'gpu': 4} |" in table and f"failed 2x: {full}" in table


def test_both_servers_get_one_planned_pool_that_holds_what_a_round_moves() -> None:
    """On an 80 GB card both servers get the same pool (not the second a fifth of the
    first's, as one --mem-fraction-static gave: three 8K prefixes on the target); a card
    that cannot hold a concurrency round's seven 8K prefixes on the target is refused."""
    import argparse

    import bench_busy_source as bench
    import busy_concurrency
    import gpu_servers
    import pytest
    from real_servers import LLAMA3_8B

    assert busy_concurrency.target_tokens() == 7 * 8176
    args = argparse.Namespace(max_total_tokens=163840, only_concurrency=True, lengths=[8192])
    h100 = gpu_servers.Card("NVIDIA H100 80GB HBM3", 81559, 81079, "580.159.04", "0")
    assert bench._pool(args, h100, dict(LLAMA3_8B)) == 163840
    small = gpu_servers.Card("a 40 GB card", 40960, 40000, "580.159.04", "0")
    with pytest.raises(SystemExit, match="4096-token KV pool; the run needs 57232"):
        bench._pool(args, small, dict(LLAMA3_8B))
