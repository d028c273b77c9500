"""`integrations.gateway` is what a rollout process without SGLang loads: it must import
with SGLang made unimportable, and refuse a policy it cannot pin with a usable message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_kv_migration.integrations.gateway import ModelGateway, default_pin

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def test_imports_without_sglang() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import sglang_kv_migration.integrations.gateway as g\n"
        "assert not any(m.startswith(('sglang.', 'sglang_kv_migration.server',"
        " 'sglang_kv_migration.paths')) for m in sys.modules), sorted(sys.modules)\n"
        "print(g.TARGET_WORKER_HEADER)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "X-SMG-Target-Worker"


@pytest.mark.parametrize("policy", ["manual", "cache_aware", "round_robin"])
def test_a_policy_without_a_pin_header_says_what_works(policy: str) -> None:
    with pytest.raises(ValueError, match="consistent_hashing.*--enable-rl"):
        default_pin(policy)
    gateway = ModelGateway("http://127.0.0.1:9", policy=policy, pin="rl_passthrough")
    assert gateway.pin == "rl_passthrough"
    assert default_pin("consistent_hashing") == "target_worker"
