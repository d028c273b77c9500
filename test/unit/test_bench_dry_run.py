"""The GPU benchmarks of the adoption figures run dry on CPU: each parses its arguments
(`--help`), and without a GPU stops before starting anything, with status 2 and one line
saying so; the result files of split runs merge without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"
SCRIPTS = ("bench_flag_cost.py", "bench_verl_pattern.py", "bench_rl_scene.py",
           "bench_live_move.py", "bench_ttft_split.py")  # fmt: skip


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVMIG_NVIDIA_SMI": str(tmp_path / "no-nvidia-smi"),
           "KVMIG_GPU_OUT": str(tmp_path / "out")}  # fmt: skip
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_arguments_parse_and_no_gpu_stops_cleanly(script: str, tmp_path: Path) -> None:
    shown = _run([str(BENCHMARK / script), "--help"], tmp_path)
    assert shown.returncode == 0 and "usage:" in shown.stdout
    stopped = _run([str(BENCHMARK / script)], tmp_path)
    assert stopped.returncode == 2, stopped.stderr
    assert stopped.stderr.strip().splitlines() == [
        f"{script.removesuffix('.py')}: needs a GPU machine (no GPU found: "
        f"{tmp_path / 'no-nvidia-smi'} could not be run: [Errno 2] No such file or "
        f"directory: '{tmp_path / 'no-nvidia-smi'}')"
    ]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    bad = _run([str(BENCHMARK / script), "--bogus"], tmp_path)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr


def test_split_runs_merge_without_a_gpu(tmp_path: Path) -> None:
    step = {"makespan_s": 10.0, "turns": [{"latency_s": 1.0}], "moves": {}, "repeat": 0}
    verl = tmp_path / "verl.json"
    verl.write_text(json.dumps({"steps": {"repin_migrate": [step]}, "mismatched_turns": {}}))
    out = _run([str(BENCHMARK / "bench_verl_pattern.py"), "--merge", str(verl)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "| repin_migrate | 1 | 10.00 (10.00–10.00) |" in out.stdout
    scene = tmp_path / "bench_rl_scene_8192.json"
    seconds = {"none": {"0": {"high": [10.0], "low": [20.0]}},
               "migrate": {"0": {"high": [1.0], "low": [20.0]}}}  # fmt: skip
    scene.write_text(json.dumps({"variants": {"full": {"turn_seconds": seconds}}}))
    out = _run([str(BENCHMARK / "bench_rl_scene.py"), "--merge", str(scene)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "## target GPU full" in out.stdout and '"high_p99_migrate_over_none"' in out.stdout
