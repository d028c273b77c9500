"""The host-landing benchmark's pure parts (`benchmark/host_landing_report.py`) on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import host_landing_report as report  # noqa: E402


def _result(path: str, tokens: int = 8176, copy_s: float = 0.02) -> SimpleNamespace:
    tier = {"device": "gpu", "shared_host": "host", "host": "host"}[path]
    return SimpleNamespace(
        migrated_token_size=tokens,
        path=path,
        landing_tier=tier,
        fallback_reason="device path failed at allocate: device KV pool is full"
        if path != "device"
        else "",
        migrated_bytes=tokens * 131072,
        timings={"total": 0.05},
        copy_seconds=copy_s,
        steps_ms={},
        transfer_steps_ms=[],
    )


def _served(host: int) -> dict:
    return {"meta_info": {"cached_tokens": host, "cached_tokens_details": {"host": host}}}


def _move(path: str, wall_ms: float, tokens: int = 8176) -> dict:
    held = {"matched_token_size": 8176, "device_token_size": 0}
    return report.move_row(_result(path, tokens), wall_ms / 1e3, _served(tokens), 0.1, held, 8176)


def _row(rep: int, landing_ms: float, device_ms: float, reprefill_ms: float) -> dict:
    return {
        "tokens": 8192,
        "repeat": rep,
        "reprefill_ms": reprefill_ms,
        "device": {"gpu": _move("device", device_ms), "host": _move("device", 2 * device_ms)},
        "landing": {"gpu": _move("shared_host", landing_ms), "host": _move("shared_host", 90.0)},
    }


def test_a_move_row_keeps_the_path_the_landing_tier_and_the_host_hit() -> None:
    row = _move("shared_host", 40.0)
    assert (row["path"], row["landing_tier"], row["whole"]) == ("shared_host", "host", True)
    assert row["served_cached_details"] == {"host": 8176}
    assert row["copy_gb_s"] == 8176 * 131072 / 0.02 / 1e9
    assert "device KV pool is full" in row["fallback_reason"]
    assert (
        report.move_row(_result("shared_host", 4096), 0.04, _served(0), 0.1, {}, 8176)["whole"]
        is False
    )


def test_summary_gives_medians_with_min_max_and_the_ratios_against_the_targets() -> None:
    rows = [_row(r, landing, 20.0 + r, 600.0) for r, landing in enumerate([40.0, 55.0, 45.0])]
    summary = report.summarize(rows)
    gpu = next(e for e in summary if e["tier"] == "gpu")
    assert gpu["landing_ms"] == {"median": 45.0, "min": 40.0, "max": 55.0, "n": 3}
    assert gpu["device_ms"]["median"] == 21.0
    assert gpu["over_device"] == 45.0 / 21.0 and gpu["meets_device_target"] is True
    assert gpu["over_reprefill"] == 45.0 / 600.0 and gpu["meets_reprefill_target"] is True
    assert gpu["landing_tiers"] == ["host"] and gpu["served_host_tokens"]["median"] == 8176
    host = next(e for e in summary if e["tier"] == "host")
    assert host["over_device"] == 90.0 / 42.0 and host["meets_device_target"] is True
    slow = report.summarize([_row(0, 200.0, 20.0, 600.0)])
    assert slow[0]["meets_device_target"] is False and slow[0]["meets_reprefill_target"] is False
    assert "| 8192 | gpu |" in report.markdown(summary)


def test_a_move_on_another_path_or_of_part_of_the_prefix_is_left_out() -> None:
    row = _row(0, 40.0, 20.0, 600.0)
    row["landing"]["gpu"] = _move("host", 900.0)  # fell back to Mooncake: not the landing
    row["device"]["host"] = _move("device", 10.0, tokens=4096)
    summary = report.summarize([row])
    gpu = next(e for e in summary if e["tier"] == "gpu")
    assert gpu["landing_ms"]["n"] == 0 and gpu["left_out"] == 1 and gpu["over_device"] is None
    assert gpu["landing_tiers"] == ["host"]
    host = next(e for e in summary if e["tier"] == "host")
    assert host["device_ms"]["n"] == 0 and host["left_out"] == 1


def test_the_result_file_is_rewritten_whole(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench_host_landing.json"
    report.write_result(path, {"rows": [1], "complete": False})
    report.write_result(path, {"rows": [1, 2], "complete": True})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "complete": True}
    assert not list(path.parent.glob("*.part"))
