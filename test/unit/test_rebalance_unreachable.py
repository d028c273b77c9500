"""`sglang-kv-migrate rebalance` against a server nobody listens on (127.0.0.1, a port
just closed), run as a user would, in a fresh interpreter: failures are named in the
summary and on stderr in one line each, never as tracebacks, and watch mode stops by
itself after `--max-failed-rounds` rounds in which no server answered."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed: connections are refused


def _rebalance(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "sglang_kv_migration.cli", "rebalance", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "never retrieved" not in stderr, stderr[-3000:]


def test_batch_mode_reports_an_unreachable_server_in_its_summary(dead_url, tmp_path) -> None:
    requests = tmp_path / "work.jsonl"
    lines = [{"server": dead_url, "input_ids": [1, 2, 3], "rid": f"r{i}"} for i in range(2)]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    proc = _rebalance(
        "--server", dead_url, "--requests", str(requests), "--output", str(out),
        "--interval", "0.05", "--drain-timeout", "10",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["requests"], summary["finished"]) == (2, 0)
    errors = summary["errors"]
    assert f"{dead_url}: load unavailable" in errors
    for rid in ("r0", "r1"):
        assert any(e.startswith(f"{rid}: GenerateFailed") and dead_url in e for e in errors)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["success"] for r in results] == [False, False]


def test_watch_mode_stops_after_rounds_with_no_answer(dead_url) -> None:
    proc = _rebalance(
        "--server", dead_url, "--interval", "0.01", "--max-failed-rounds", "3",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    rounds = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]  # not the default 1200
    assert all(not r["loads"][dead_url]["ok"] for r in rounds)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: no server answered in 3 rounds in a row ({dead_url}); stopping"
