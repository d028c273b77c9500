"""`sglang-kv-migrate demo`, run as a newcomer runs it after the install: the console
script's module in a fresh interpreter that finds only the package (no test support on
its path, another working directory). It starts its two CPU servers, moves a prefix and
prints what moved, each step's time and the target serving it from cache; exit 0 only
when each step did what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_moves_a_prefix_and_the_target_serves_it_from_cache(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    done = subprocess.run(
        [sys.executable, "-m", "sglang_kv_migration.cli", "demo", "--tokens", "512"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert re.search(r"starting \.\.\. +\d+ s {2}\(A \w+, B \w+\)", out), out  # progress
    assert re.search(r"A http://127\.0\.0\.1:\d+ +B http://127\.0\.0\.1:\d+ +\(ready in", out)
    assert "held now: A 512 tokens, B 0 tokens" in out, out
    assert "2. Migrate A -> B: 512 tokens, 256.0 KiB, over the host path" in out, out
    assert re.search(r"total +\d+\.\d ms", out), out
    assert "512 of 513 from cache (512 loaded back from its host pool" in out, out
    assert "the KV it serves is A's, byte for byte: yes" in out, out
    assert "Stopped both servers." in out
