"""`benchmark/read_concurrency.py`: the floor and the work sums it reads from a round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import read_concurrency  # noqa: E402


def _move(copy_ms: float, handler: float, start: float, finish: float, **extra: float) -> dict:
    steps = {"handler": handler, "start": start, "finish": finish, "answer": 9.0, **extra}
    return {"wall_ms": 0.0, "copy_ms": copy_ms, "steps_ms": {"transfer": steps}}


def _round() -> dict:
    one = {**_move(0.5, 0.1, 0.6, 0.1), "wall_ms": 8.0}
    moves = [
        {**_move(0.5, 0.1, 0.5, 0.1, target_scheduler=0.8), "transfer_steps_ms": [{"prepare": 0.4}]}
        for _ in range(6)
    ]
    return {"one": one, "concurrent": moves[:3], "concurrent_wall_ms": 16.0,
            "batch": {"wall_ms": 12.0, "moves": moves}}  # fmt: skip


def test_the_floor_is_one_move_and_the_other_moves_copies():
    (ways,) = read_concurrency.rounds({"concurrency": [_round()]})
    call = ways["one call"]
    assert call["ratio"] == pytest.approx(1.5)
    assert call["copies_ms"] == pytest.approx(3.0)
    assert call["floor_ms"] == pytest.approx(8.0 + 2.5)  # five more copies of 0.5
    # 1.5x of 8 ms = 12 ms, less the floor, over five extra moves
    assert call["budget_per_extra_move_ms"] == pytest.approx((12.0 - 10.5) / 5)
    # handler + start + finish + the rank's prepare; the waits (`answer`) are not work
    assert call["source_ms"] == pytest.approx(6 * (0.1 + 0.5 + 0.1 + 0.4))
    assert call["source_one_ms"] == pytest.approx(0.8)
    assert call["target_ms"] == pytest.approx(6 * 0.8)
    # The source thread adds 6 * 1.1 - 0.8 ms to one move's 8 ms: more than the GPU
    # (2.5) or the target (4.8 - 0 for one move without target steps) adds.
    assert call["bound_by"] == "source"
    assert call["bound_ms"] == pytest.approx(8.0 + 6 * 1.1 - 0.8)
    assert ways["threads"]["moves"] == 3 and ways["threads"]["ratio"] == pytest.approx(2.0)


def test_one_round_written_as_an_object_is_read_too(tmp_path):
    path = tmp_path / "round.json"
    path.write_text(json.dumps({"concurrency": _round()}))
    out = subprocess.run(
        [sys.executable, str(BENCHMARK / "read_concurrency.py"), str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| round.json | 1 | one call | 6 | 8.0 | 12.0 | 1.50x |" in out
    assert "| 13.8 (1.73x, source) |" in out
    assert "round.json: median ratio 1.75x over 2 rounds" in out


def test_a_compared_pairs_rounds_are_read_under_its_variable():
    data = {"concurrency": [_round()], "compare_env": {"X=0": {"concurrency": [_round()]}}}
    pairs = read_concurrency.runs(data)
    assert list(pairs) == ["", "X=0"]
    assert read_concurrency.rounds(pairs["X=0"])[0]["one call"]["ratio"] == pytest.approx(1.5)
