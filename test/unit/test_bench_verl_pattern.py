"""The verl-pattern benchmark's aggregation (`benchmark/verl_pattern_stats.py`) on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import verl_pattern_stats as stats  # noqa: E402


def _step(makespan: float, latencies: list[float], moves: dict | None = None) -> dict:
    return {
        "makespan_s": makespan,
        "turns": [{"latency_s": v} for v in latencies],
        "moves": moves or {},
    }


def _steps(default: float, reprefill: float, migrate: float) -> dict[str, list[dict]]:
    lat = [0.1 * i for i in range(1, 65)]
    return {
        stats.DEFAULT: [_step(default + d, lat) for d in (0.0, 1.0, -1.0)],
        stats.REPREFILL: [_step(reprefill + d, lat, {"recompute": 8}) for d in (0.0, 0.5, -0.5)],
        stats.MIGRATE: [_step(migrate + d, lat, {"migrated": 8}) for d in (0.0, 0.2, -0.2)],
    }


def test_arm_summary_gives_median_and_range_over_repeats_and_sums_moves() -> None:
    steps = [_step(10.0, [1.0, 2.0, 3.0]), _step(12.0, [1.0, 9.0]), _step(11.0, [4.0])]
    steps[0]["moves"] = {"migrated": 2}
    steps[2]["moves"] = {"migrated": 1, "failed": 1}
    row = stats.arm_summary(steps)
    assert row["makespan_s"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 3}
    assert row["turn_p50_s"]["median"] == 4.0  # per-repeat p50s 2.0, 5.0, 4.0
    assert row["turn_p99_s"]["max"] == stats.percentile([1.0, 9.0], 99)
    assert (row["repeats"], row["turns"]) == (3, 6)
    assert row["moves"] == {"migrated": 3, "failed": 1}


def test_ratios_and_targets_met_and_missed() -> None:
    met = stats.summarize(_steps(default=20.0, reprefill=15.0, migrate=11.0), {0: [], 1: []})
    assert met["ratios"]["makespan_migrate_over_reprefill"] == round(11 / 15, 4)
    assert met["ratios"]["makespan_migrate_over_default"] == round(11 / 20, 4)
    assert met["ratios"]["p99_migrate_over_default"] == 1.0
    assert met["targets"] == {
        "makespan_migrate_over_reprefill": True,
        "makespan_migrate_over_default": True,
        "identical_greedy_outputs": True,
    }
    # 13 / 15 = 0.87 > 0.8; 13 / 14 = 0.93 > 0.85; one repeat's outputs differed.
    missed = stats.summarize(_steps(default=14.0, reprefill=15.0, migrate=13.0), {0: ["s3/2"]})
    assert missed["targets"] == {
        "makespan_migrate_over_reprefill": False,
        "makespan_migrate_over_default": False,
        "identical_greedy_outputs": False,
    }
    assert missed["mismatched_turns"] == {"0": ["s3/2"]}


def test_missing_arm_leaves_its_ratio_and_target_unmeasured() -> None:
    steps = _steps(20.0, 15.0, 11.0)
    del steps[stats.DEFAULT]
    out = stats.summarize(steps, {})
    assert out["ratios"]["makespan_migrate_over_default"] is None
    assert out["targets"]["makespan_migrate_over_default"] is None
    assert out["targets"]["makespan_migrate_over_reprefill"] is True
    assert out["targets"]["identical_greedy_outputs"] is False  # nothing compared


def test_output_mismatches_name_differing_and_missing_turns() -> None:
    outputs = {
        stats.DEFAULT: {"s0/0": [1, 2], "s0/1": [3, 4], "s1/0": [5]},
        stats.REPREFILL: {"s0/0": [1, 2], "s0/1": [3, 9], "s1/0": [5]},
        stats.MIGRATE: {"s0/0": [1, 2], "s0/1": [3, 4]},
    }
    assert stats.output_mismatches(outputs) == ["s0/1", "s1/0"]
    same = {arm: {"s0/0": [7, 8]} for arm in stats.ARMS}
    assert stats.output_mismatches(same) == []


def test_write_result_rewrites_the_whole_file_and_table_renders(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench_verl_pattern.json"
    stats.write_result(path, {"complete": False})
    summary = stats.summarize(_steps(20.0, 15.0, 11.0), {0: []})
    stats.write_result(path, {"complete": True, "summary": summary})
    assert json.loads(path.read_text())["summary"]["arms"][stats.MIGRATE]["repeats"] == 3
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    text = stats.table(summary)
    assert "| repin_migrate | 3 | 11.00 (10.80–11.20) |" in text
    assert "migrated 24" in text


def test_context_lengths_are_skewed_whole_pages_between_the_bounds() -> None:
    assert stats.context_lengths(0, 4, 8192, None) == [8192] * 4
    lengths = stats.context_lengths(0, 64, 2048, 12288)
    assert lengths == stats.context_lengths(0, 64, 2048, 12288)  # the seed decides
    assert all(2048 <= n <= 12288 and n % 16 == 0 for n in lengths)
    # Most are short, a few long: the median below the midpoint, the longest well above it.
    assert sorted(lengths)[32] < (2048 + 12288) / 2 < max(lengths)
    assert lengths != stats.context_lengths(1, 64, 2048, 12288)


def test_the_bound_arm_and_each_repeats_own_ratio() -> None:
    steps = _steps(default=20.0, reprefill=15.0, migrate=12.0)
    lat = [0.1 * i for i in range(1, 9)]
    steps[stats.BOUND] = [_step(10.0 + d, lat) for d in (0.0, 0.5, -0.5)]
    for arm_steps in steps.values():
        for i, step in enumerate(arm_steps):
            step["repeat"] = i
    out = stats.summarize(steps, {0: [], 1: [], 2: []})
    assert out["ratios"]["makespan_migrate_over_bound"] == round(12 / 10, 4)
    # Per repeat: 12/15, 12.2/15.5, 11.8/14.5 over re-prefill.
    per = out["repeat_ratios"]["makespan_migrate_over_reprefill"]
    assert per["n"] == 3 and per["median"] == round(12 / 15, 4)
    assert per["min"] == round(12.2 / 15.5, 4) and per["max"] == round(11.8 / 14.5, 4)
    assert "| balanced_bound | 3 | 10.00 (9.50–10.50) |" in stats.table(out)


def test_merge_keeps_each_files_repeats_and_mismatches_apart() -> None:
    first = {"steps": {stats.MIGRATE: [_step(11.0, [1.0]) | {"repeat": 0}]},
             "mismatched_turns": {"0": []}}  # fmt: skip
    old = {"steps": {stats.MIGRATE: [_step(12.0, [1.0]) | {"repeat": 0}]},
           "summary": {"mismatched_turns": {"0": ["s1/2"]}}}  # fmt: skip
    merged = stats.merge([("a", first), ("b_r2", old)])
    assert [s["repeat"] for s in merged["steps"][stats.MIGRATE]] == ["a:0", "b_r2:0"]
    assert merged["mismatches"] == {"a:0": [], "b_r2:0": ["s1/2"]}
    summary = stats.summarize(merged["steps"], merged["mismatches"])
    assert summary["arms"][stats.MIGRATE]["repeats"] == 2
    assert summary["targets"]["identical_greedy_outputs"] is False
