"""The host-landing benchmark on CPU: its pure parts (`benchmark/host_landing_report.py`),
the order of its run with the server calls replaced (a record after every row, the
placement checked per repeat, the deadline), its stop without a GPU, and the named job
`scripts/h200_runs.sh landing`."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from served_cache import ServedCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_host_landing as bench  # noqa: E402
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


def test_a_failed_move_and_a_tier_left_unplaced_are_left_out() -> None:
    row = _row(0, 40.0, 20.0, 600.0)
    row["landing"]["gpu"] = report.failed_move("every path failed", {}, 8176)
    del row["landing"]["host"], row["device"]["host"]  # its prompt was not placed
    row["unplaced"] = {"host": {"matched_token_size": 8176, "device_token_size": 8176}}
    summary = report.summarize([row, _row(1, 50.0, 20.0, 600.0)])
    gpu = next(e for e in summary if e["tier"] == "gpu")
    assert gpu["landing_ms"]["n"] == 1 and gpu["left_out"] == 1
    assert gpu["landing_tiers"] == ["host"]
    host = next(e for e in summary if e["tier"] == "host")
    assert host["landing_ms"]["n"] == host["device_ms"]["n"] == 1 and host["left_out"] == 2


# ---------------------------------------------------------------- the run's order (dry)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dry_run(monkeypatch, tmp_path: Path, checks: list[bool], *argv: str):
    """`Run.rows` with the server calls replaced: each row takes 10 s of a fake clock
    (the wall clock too, from 1000) and reads the record as it was when the row began."""
    monkeypatch.setattr(bench, "RESULT", tmp_path / "bench_host_landing.json")
    clock, seen, placements = _Clock(), [], []

    def place(client, source, lengths, rng, size):
        placements.append(clock.now)
        prompts = {(n, t): [n] for n in lengths for t in report.TIERS}
        return prompts, {"placed": {f"{n}/{t}": True for n in lengths for t in report.TIERS}}

    def row(args, client, source, target, prompts, placed, n, rep, rng):
        saved = bench.RESULT.read_text() if bench.RESULT.exists() else "{}"
        seen.append((rep, n, len(json.loads(saved).get("rows", []))))
        clock.now += 10.0
        return {**_row(rep, 40.0, 20.0, 600.0), "tokens": n}

    monkeypatch.setattr(bench, "_place_prefixes", place)
    monkeypatch.setattr(bench, "_row", row)
    monkeypatch.setattr(bench, "_still_placed", lambda *a: checks.pop(0))
    args = bench.parse_args(["--repeats", "3", *argv])
    result = {"config": {}, "rows": [], "placements": []}
    run = bench.Run(args, result, clock=clock, wall_clock=lambda: 1000.0 + clock.now)
    run.rows(None, "src", "dst", [8192, 32768], 3, random.Random(0))
    return run, seen, placements


def test_the_record_is_rewritten_after_every_row_and_placement_is_checked_per_repeat(
    monkeypatch, tmp_path: Path
) -> None:
    run, seen, placements = _dry_run(monkeypatch, tmp_path, [True, False])
    # Each row found the rows before it in the file.
    assert seen == [(0, 8192, 0), (0, 32768, 1), (1, 8192, 2), (1, 32768, 3),
                    (2, 8192, 4), (2, 32768, 5)]  # fmt: skip
    assert json.loads(bench.RESULT.read_text())["rows"][-1]["repeat"] == 2
    # Placed once, kept for repeat 1 (the check passed), placed again for repeat 2.
    assert placements == [0.0, 40.0]
    assert [p["repeat"] for p in run.result["placements"]] == [0, 2]
    assert "stopped_at_deadline" not in run.result


def test_no_row_starts_after_the_deadline_and_the_rows_before_it_stay(
    monkeypatch, tmp_path: Path
) -> None:
    run, seen, _ = _dry_run(monkeypatch, tmp_path, [True, True], "--deadline-s", "25")
    assert [(rep, n) for rep, n, _ in seen] == [(0, 8192), (0, 32768), (1, 8192)]
    assert run.result["stopped_at_deadline"] == {"repeat": 1, "tokens": 32768}
    assert len(json.loads(bench.RESULT.read_text())["rows"]) == 3


def test_no_row_starts_that_would_not_end_by_the_end_at_time(monkeypatch, tmp_path: Path):
    """Rows of 10 s from 1000 (the first, before any was timed, expected to take 20 s):
    the fourth would end at 1040, past 1035."""
    monkeypatch.setattr(bench, "FIRST_ROW_S", 20.0)
    run, seen, _ = _dry_run(monkeypatch, tmp_path, [True], "--end-at", "1035")
    assert [(rep, n) for rep, n, _ in seen] == [(0, 8192), (0, 32768), (1, 8192)]
    assert run.result["stopped_at_deadline"] == {"repeat": 1, "tokens": 32768}
    _, none, _ = _dry_run(monkeypatch, tmp_path, [], "--end-at", "1019")
    assert none == []


def test_without_a_gpu_the_benchmark_stops_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "KVMIG_NVIDIA_SMI": str(tmp_path / "none"),
           "KVMIG_GPU_OUT": str(tmp_path / "out")}  # fmt: skip
    script = str(Path(bench.__file__))
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                           env=env, timeout=120)  # fmt: skip
    assert shown.returncode == 0 and "--deadline-s" in shown.stdout
    stopped = subprocess.run([sys.executable, script], capture_output=True, text=True,
                             env=env, timeout=120)  # fmt: skip
    assert stopped.returncode == 2
    assert stopped.stderr.startswith("bench_host_landing: needs a GPU machine")
    assert not (tmp_path / "out").exists()


def test_the_landing_job_runs_the_gpu_test_then_the_benchmark_to_the_budget_s_end(
    tmp_path: Path,
) -> None:
    """`scripts/h200_runs.sh landing`: the GPU test first, then the benchmark, whose
    arguments parse and whose rows must end 25 s before the budget does."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "scripts").mkdir()
    for script in ("h200_runs.sh", "gpu_job_commands.sh"):  # the second: sourced by the first
        shutil.copy(root / "scripts" / script, tmp_path / "scripts")
    (tmp_path / "scripts" / "gpu_jobs.sh").write_text('for a in "$@"; do echo "$a"; done\n')
    before = time.time()
    out = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "h200_runs.sh"), "landing"],
        capture_output=True, text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    budget, test_job, bench_job = out.stdout.splitlines()
    assert budget == "560"
    assert test_job.startswith("0:landtest:") and "test/gpu/test_gpu_host_landing.py" in test_job
    gpus, name, command = bench_job.split(":", 2)
    argv = shlex.split(command)
    assert (gpus, name, argv[:2]) == (
        "0",
        "landing",
        ["python3", "benchmark/bench_host_landing.py"],
    )
    args = bench.parse_args(argv[2:])
    assert args.repeats >= 3 and args.lengths == [8192, 32768]
    assert int(before) + 560 - 25 <= args.end_at <= time.time() + 560 - 25


# ------------------------------------------- the placement against SGLang's eviction (CPU)


def _bench_on(monkeypatch, served: ServedCache) -> None:
    """The benchmark's server calls answered by a harness cache (`served_cache.py`)."""
    monkeypatch.setattr(bench, "flush_cache", lambda url: served.h.cache.reset())
    monkeypatch.setattr(bench, "kv_pool_usage", lambda url: {"max_total_num_tokens": 1024})
    monkeypatch.setattr(bench, "generate", lambda url, ids, n=1: served.serve(ids))
    monkeypatch.setattr(bench, "_held", lambda client, url, ids: served.held(ids))
    monkeypatch.setattr(bench, "FLOOD_TOKENS", 256)
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)


@pytest.fixture
def served(harness_factory) -> ServedCache:
    return ServedCache(harness_factory(page_size=16, device_tokens=1024, hicache_ratio=2.0))


def test_the_benchmark_places_each_prompt_in_its_tier(monkeypatch, served: ServedCache) -> None:
    _bench_on(monkeypatch, served)
    prompts, record = bench._place_prefixes(None, "src", [256, 512], random.Random(0), 16)
    assert record["placed"] == {"256/host": True, "512/host": True,
                                "256/gpu": True, "512/gpu": True}  # fmt: skip
    assert record["held_after"]["512/host"] == {"matched_token_size": 496, "device_token_size": 0}
    assert record["held_after"]["512/gpu"]["device_token_size"] == 496
    assert record["host_room_tokens"] > 0 and len(record["attempts"]) == 1
    assert bench._still_placed(None, "src", prompts, 16)
    served.serve(prompts[(256, "host")])  # a request for it loads it back to the GPU
    assert not bench._still_placed(None, "src", prompts, 16)


def test_the_benchmark_records_prompts_its_host_pool_cannot_keep(
    monkeypatch, served: ServedCache
) -> None:
    """Host-tier prompts that do not fit beside a flood (`host_room` < 0) are lost at each
    attempt: recorded as not placed, and their rows are skipped, not fatal."""
    _bench_on(monkeypatch, served)
    prompts, record = bench._place_prefixes(None, "src", [512, 768], random.Random(0), 16)
    assert record["host_room_tokens"] < 0
    assert len(record["attempts"]) == bench.tier_placement.ATTEMPTS
    assert not all(record["placed"][f"{n}/host"] for n in (512, 768)), record
    monkeypatch.setattr(bench, "timed_generate", lambda url, ids, n=1: ({}, 0.5))
    row = bench._row(bench.parse_args([]), None, "src", "dst", prompts,
                     {**record["placed"], "512/gpu": False, "512/host": False},
                     512, 0, random.Random(1))  # fmt: skip
    assert set(row["unplaced"]) == {"gpu", "host"} and row["device"] == row["landing"] == {}
    assert row["reprefill_ms"] == 500.0
