"""`scripts/h200_runs.sh`'s named jobs of the adoption figures: each name becomes the
benchmark command it says (context, variants, first repeat, the deadline 40 s inside
the budget), and every argument of that command is one its benchmark accepts."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))
import bench_flag_cost  # noqa: E402
import bench_live_move  # noqa: E402
import bench_rl_scene  # noqa: E402
import bench_ttft_split  # noqa: E402
import bench_verl_pattern  # noqa: E402

PARSERS = {
    "bench_flag_cost.py": bench_flag_cost.parse_args,
    "bench_verl_pattern.py": bench_verl_pattern.parse_args,
    "bench_rl_scene.py": bench_rl_scene.parse_args,
    "bench_live_move.py": bench_live_move.parse_args,
    "bench_ttft_split.py": bench_ttft_split.parse_args,
}


def _jobs(tmp_path: Path, name: str) -> list[str]:
    """The arguments `h200_runs.sh NAME` hands to gpu_jobs.sh (a stub that prints them)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    for script in ("h200_runs.sh", "gpu_job_commands.sh"):  # the second: sourced by the first
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts")
    (tmp_path / "scripts" / "gpu_jobs.sh").write_text('for a in "$@"; do echo "$a"; done\n')
    out = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "h200_runs.sh"), name],
        capture_output=True, text=True, timeout=60, check=True,
        env={"PATH": "/usr/bin:/bin", "KVMIG_BUDGET_S": "500"},
    )  # fmt: skip
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    ("name", "script", "expected"),
    [
        ("flagcost", "bench_flag_cost.py", {"deadline_s": 460.0, "twin": "off"}),
        ("flagcost-twin", "bench_flag_cost.py", {"twin": "on"}),
        ("verl64", "bench_verl_pattern.py", {"repeat_start": 0, "sessions": 64}),
        ("verl64-r3", "bench_verl_pattern.py", {"repeat_start": 3, "deadline_s": 460.0}),
        ("rl8k-both-r0", "bench_rl_scene.py",
         {"context": 8192, "target_gpu": ["room", "full"], "repeat_start": 0, "repeats": 1}),
        ("rl16k-full-r2", "bench_rl_scene.py",
         {"context": 16384, "target_gpu": ["full"], "repeat_start": 2}),
        ("rl4k-room-r1", "bench_rl_scene.py", {"context": 4096, "target_gpu": ["room"]}),
        ("ttftsplit", "bench_ttft_split.py", {"budget_s": 460.0}),
        ("35", "bench_live_move.py",
         {"budget_s": 470.0, "moments_dir": "/tmp/kvmig-live-moments"}),
    ],
)  # fmt: skip
def test_named_job_runs_its_benchmark_with_valid_arguments(
    tmp_path: Path, name: str, script: str, expected: dict
) -> None:
    budget, job = _jobs(tmp_path, name)
    assert budget == "500"
    gpus, _, command = job.split(":", 2)
    argv = shlex.split(command)
    assert gpus == "0" and argv[:2] == ["python3", f"benchmark/{script}"]
    args = PARSERS[script](argv[2:])
    for key, value in expected.items():
        assert getattr(args, key) == value, key


def test_an_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        _jobs(tmp_path, "rl8x")
