"""The opt-in scheduler-rank profile (`server/diag/profiling.py`): off without its variable;
with it, the wrapped calls and the garbage collections land in its two files."""

from __future__ import annotations

import gc
import json
import pstats

from sglang_kv_migration.server.diag import profiling


def test_no_profile_without_the_variable(monkeypatch):
    monkeypatch.delenv(profiling.ENV, raising=False)
    assert profiling.rank_profile(30000, 0, 0) is None


def _a_handler_to_find(req: int) -> int:
    return sum(range(req))


def test_wrapped_calls_and_collections_are_written(monkeypatch, tmp_path):
    monkeypatch.setenv(profiling.ENV, str(tmp_path / "prof"))
    profile = profiling.rank_profile(30001, 1, 0)
    assert profile is not None
    try:
        handler = profile.wrap(_a_handler_to_find)
        assert handler(1000) == sum(range(1000))
        with profile:  # nested: the inner exit must not stop the outer profile
            with profile:
                gc.collect()
            assert handler(10) == 45
    finally:
        profile.close()
    assert profile not in gc.callbacks and profile._on_gc not in gc.callbacks
    stats = pstats.Stats(str(tmp_path / "prof" / "scheduler-30001-tp1-pp0.prof"))
    calls = {name[2]: counts[1] for name, counts in stats.stats.items()}
    assert calls["_a_handler_to_find"] == 2
    report = json.loads((tmp_path / "prof" / "scheduler-30001-tp1-pp0-gc.json").read_text())
    assert report["by_generation"]["2"]["count"] >= 1  # gc.collect() is a full collection


def test_files_are_written_only_once_idle(monkeypatch, tmp_path):
    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    profile = profiling.rank_profile(30002, 0, 0)
    assert profile is not None
    written = tmp_path / "scheduler-30002-tp0-pp0.prof"
    try:
        profile.wrap(_a_handler_to_find)(5)
        profile.idle()  # busy a moment ago: nothing written in the middle of the work
        assert not written.exists()
        monkeypatch.setattr(profiling, "IDLE_BEFORE_DUMP_S", 0.0)
        profile.idle()
        assert written.exists()
    finally:
        profile.close()


def test_gc_only_writes_no_call_profile(monkeypatch, tmp_path):
    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    monkeypatch.setenv(profiling.GC_ONLY_ENV, "1")
    profile = profiling.rank_profile(30003, 0, 0)
    assert profile is not None
    with profile:
        gc.collect()
    profile.close()
    assert not (tmp_path / "scheduler-30003-tp0-pp0.prof").exists()
    report = json.loads((tmp_path / "scheduler-30003-tp0-pp0-gc.json").read_text())
    assert report["by_generation"]["2"]["count"] >= 1


def test_the_report_names_this_process_threads(monkeypatch, tmp_path):
    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    profile = profiling.rank_profile(30004, 0, 0)
    assert profile is not None
    profile.close()
    report = json.loads((tmp_path / "scheduler-30004-tp0-pp0-gc.json").read_text())
    assert "MainThread" in report["python_threads"]
    assert report["threads"] and all(t["cpu_s"] >= 0 for t in report["threads"])


def test_an_idle_rank_calibrates_once_for_each_new_label(monkeypatch, tmp_path):
    from sglang_kv_migration.server.diag import thread_costs

    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    monkeypatch.setenv(profiling.GC_ONLY_ENV, "1")
    monkeypatch.setenv(thread_costs.ENV, "1")
    monkeypatch.setattr(profiling, "CALIBRATE_CHECK_S", 0.0)
    monkeypatch.setattr(thread_costs, "REPEATS", 5)
    profile = profiling.rank_profile(30005, 0, 0)
    assert profile is not None
    written = tmp_path / "scheduler-30005-tp0-pp0-calibration.json"
    try:
        profile.idle()
        assert not written.exists()  # no label asked for yet
        (tmp_path / "calibrate").write_text("before")
        profile.idle()
        profile.idle()  # the same label: not again
        (tmp_path / "calibrate").write_text("after")
        profile.idle()
    finally:
        profile.close()
    entries = json.loads(written.read_text())
    assert [e["when"] for e in entries] == ["before", "after"]
    costs = entries[0]["costs_us"]
    assert costs["torch_cpu_cumsum_64"]["p50"] > 0 and costs["python_loop_1000"]["p50"] > 0
    assert entries[0]["cold_costs_us"]["torch_cpu_cumsum_64"]["p50"] > 0
    assert 0 < entries[0]["cpu_share"] <= 1.01
    assert entries[0]["state"]["thread"] == "MainThread"
