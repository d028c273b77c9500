"""`benchmark/bench_device_path.py` keeps what it measured when its job is cut: the result
file is rewritten after every row and round, and says whether the run completed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import bench_device_path  # noqa: E402


class _Cut(Exception):
    """The job's time limit, as the benchmark would meet it."""


def _run(monkeypatch, tmp_path: Path, argv: list[str], pair) -> dict:
    monkeypatch.setattr(bench_device_path, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench_device_path, "write_model", lambda shape, path: tmp_path)
    monkeypatch.setattr(bench_device_path, "_run_pair", pair)
    monkeypatch.setattr(sys, "argv", ["bench_device_path.py", "--no-host", *argv])
    try:
        bench_device_path.main()
    except _Cut:
        pass
    return json.loads((tmp_path / "bench_device_path.json").read_text())


def test_a_cut_run_keeps_its_rows_and_says_it_did_not_complete(monkeypatch, tmp_path):
    def pair(args, model_dir, specs, lengths, repeats, calibration, config, save, label):
        row = {"tokens": 17, "repeat": 0}
        save(label, {"warmup": {}, "concurrency": [], "rows": [row], "medians": []})
        if label:  # the compared pair is cut after its first row
            raise _Cut

    result = _run(monkeypatch, tmp_path, ["--compare-env", "X=0"], pair)
    assert result["complete"] is False
    assert result["rows"] == [{"tokens": 17, "repeat": 0}]  # the first pair, at the top
    assert list(result["compare_env"]) == ["X=0"]
    assert result["compare_env"]["X=0"]["rows"][0]["tokens"] == 17


def test_a_whole_run_completes(monkeypatch, tmp_path, capsys):
    def pair(args, model_dir, specs, lengths, repeats, calibration, config, save, label):
        save(label, {"warmup": {}, "concurrency": [], "rows": [], "medians": []})

    result = _run(monkeypatch, tmp_path, ["--lengths", "17"], pair)
    assert result["complete"] is True
    assert result["compare_env"] == {}
    assert "wall time" in capsys.readouterr().out


@pytest.mark.parametrize("labels", [[""], ["", "Y=1"]])
def test_every_pair_is_written_under_its_label(monkeypatch, tmp_path, labels):
    seen: list[str] = []

    def pair(args, model_dir, specs, lengths, repeats, calibration, config, save, label):
        seen.append(label)
        save(label, {"warmup": {"label": label}, "concurrency": [], "rows": [], "medians": []})

    argv = [a for label in labels[1:] for a in ("--compare-env", label)]
    result = _run(monkeypatch, tmp_path, argv, pair)
    assert seen == labels
    assert result["warmup"] == {"label": ""}
    assert {k: v["warmup"]["label"] for k, v in result["compare_env"].items()} == {
        k: k for k in labels[1:]
    }
