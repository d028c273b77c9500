"""The RL scene's pooling over repeats (`benchmark/rl_scene_stats.py`) on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import rl_scene_stats as stats  # noqa: E402


def _turns(base: float, n: int = 24) -> list[float]:
    return [base + i / 100 for i in range(n)]


def test_p99_is_over_every_turn_of_every_repeat_with_the_per_repeat_spread() -> None:
    seconds = {
        "none": {"0": {"high": _turns(10.0), "low": _turns(20.0)},
                 "1": {"high": _turns(12.0), "low": _turns(21.0)},
                 "2": {"high": _turns(11.0), "low": _turns(22.0)}},
        "migrate": {"0": {"high": _turns(1.0), "low": _turns(20.5)},
                    "1": {"high": _turns(1.2) + [9.0], "low": _turns(21.0)},
                    "2": {"high": _turns(1.1), "low": _turns(21.5)}},
    }  # fmt: skip
    none, migrate = stats.pooled_rows(seconds)
    assert (none["repeats"], none["high_turns"], migrate["high_turns"]) == (3, 72, 73)
    pooled = sorted(v for r in seconds["migrate"].values() for v in r["high"])
    assert migrate["high_p99_s"] == round(stats.percentile(pooled, 99), 3)
    # The one slow turn of repeat 1 is the pooled p99's tail, and its repeat's p99 the
    # spread's top; repeats 0 and 2 stay near their 24 turns' own.
    low_p99, high_p99 = migrate["high_p99_spread_s"]
    assert low_p99 == round(stats.percentile(_turns(1.0), 99), 3)
    assert high_p99 == round(stats.percentile(_turns(1.2) + [9.0], 99), 3)
    assert migrate["high_p99_s"] < high_p99
    ratios = stats.ratios([none, migrate])
    assert ratios["high_p99_migrate_over_none"]["value"] == round(
        migrate["high_p99_s"] / none["high_p99_s"], 3
    )
    assert ratios["high_p99_migrate_over_none"]["met"] is False  # 0.16 > 0.15
    assert ratios["low_p99_migrate_over_none"]["met"] is True
    assert ratios["high_p99_migrate_over_recompute"] == {
        "value": None,
        "target_max": 0.4,
        "met": None,
    }


def test_a_mode_without_turns_of_a_kind_reports_none() -> None:
    (row,) = stats.pooled_rows({"none": {"0": {"high": [], "low": [3.0]}}})
    assert row["high_p99_s"] is None and row["high_p99_spread_s"] is None
    assert row["low_p99_s"] == 3.0 and row["low_p99_spread_s"] == [3.0, 3.0]


def test_merge_keeps_each_files_repeats_apart(tmp_path: Path) -> None:
    first, second = (
        tmp_path / "bench_rl_scene_16384.json",
        tmp_path / "bench_rl_scene_16384_r2.json",
    )
    # A file written before the variants holds the target-with-room scene only.
    first.write_text(json.dumps({"turn_seconds": {"none": {"0": {"high": [1.0]}}}}))
    later = {"none": {"0": {"high": [2.0]}}, "migrate": {"2": {"high": [0.5]}}}
    full = {"migrate": {"2": {"high": [4.0]}}}
    second.write_text(json.dumps({"variants": {"room": {"turn_seconds": later},
                                               "full": {"turn_seconds": full}}}))  # fmt: skip
    merged = stats.merge([first, second])
    assert merged == {
        "room": {
            "none": {"bench_rl_scene_16384:0": {"high": [1.0]},
                     "bench_rl_scene_16384_r2:0": {"high": [2.0]}},
            "migrate": {"bench_rl_scene_16384_r2:2": {"high": [0.5]}},
        },
        "full": {"migrate": {"bench_rl_scene_16384_r2:2": {"high": [4.0]}}},
    }  # fmt: skip
    assert [r["high_turns"] for r in stats.pooled_rows(merged["room"])] == [2, 1]


def test_repeat_ratios_pair_each_repeats_own_p99s() -> None:
    seconds = {
        "none": {"0": {"high": [10.0], "low": [20.0]}, "1": {"high": [20.0], "low": [20.0]}},
        "recompute": {"0": {"high": [4.0]}, "1": {"high": [5.0]}},
        "migrate": {"0": {"high": [1.0], "low": [21.0]}, "1": {"high": [4.0], "low": [19.0]},
                    "2": {"high": [9.0]}},  # no repeat 2 of the others: left out
    }  # fmt: skip
    out = stats.repeat_ratios(seconds)
    assert out["high_p99_migrate_over_none"] == {"median": 0.15, "min": 0.1, "max": 0.2, "n": 2}
    assert out["high_p99_migrate_over_recompute"] == {
        "median": 0.525, "min": 0.25, "max": 0.8, "n": 2
    }  # fmt: skip
    assert out["low_p99_migrate_over_none"]["n"] == 2
    assert stats.repeat_ratios({"none": seconds["none"]}) == {name: None for name in stats.TARGETS}
