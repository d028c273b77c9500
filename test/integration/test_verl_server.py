"""A verl 0.9.1 user turns migration on by configuration: SGLang started as verl starts it.

`verl_order_server.py` makes verl's calls in verl's order in a fresh interpreter (verl's
module and its `ServerArgs`, `Engine._launch_subprocesses`, verl's `run_uvicorn` on
SGLang's `app`), with the engine kwargs of docs/rl-integration.md's recipe. This
package's `verl.plugins` entry point is found as verl finds it, through installed
distribution metadata (a dist-info folder written from pyproject.toml's table, so the
declaration itself is what is tested). Only the scheduler and detokenizer processes are
CPU stand-ins (`engine_standins.py`); the tokenizer manager, our communicators and the
routes are SGLang's and ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cpu_harness
import httpx
import pytest
import verl_recipe
from engine_standins import PRELOAD_IDS
from sglang_kv_migration.client.migration import MigrationClient

pytest.importorskip("verl")

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "test" / "support"
HARNESS = cpu_harness.HarnessConfig()
# What only a CPU machine needs on top of the recipe: no GPU, no CUDA attention backend,
# no torch_memory_saver (verl passes enable_memory_saver=True), the harness's host layout,
# and a small staging arena.
CPU_ONLY_KWARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "enable_memory_saver": False,
    "page_size": HARNESS.page_size,
    "hicache_mem_layout": HARNESS.host_layout,
    "hicache_io_backend": HARNESS.effective_io_backend(),
    "kv_migration_staging_mb": 4,
}
ROUTES = (
    "/get_transfer_session_info",
    "/get_request_extra_token_size",
    "/allocate_token_for_transfer",
    "/transfer_request_kvcache",
    "/commit",
    "/abort_transfer",
)


def _entry_point_dist(root: Path) -> Path:
    """A dist-info folder declaring pyproject.toml's `verl.plugins` entry points."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    lines = ["[verl.plugins]"] + [f"{k} = {v}" for k, v in table["verl.plugins"].items()]
    dist = root / "kvm_verl_entry-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvm-verl-entry\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def _start(
    engine_kwargs: dict[str, Any],
    entry_points: Path | None,
    preload: bool = True,
    model_dir: str | None = None,
) -> tuple[Any, dict]:
    """Run verl_order_server.py; returns the process and its JSON line. Without
    `entry_points`, verl's plugin loading is off (`VERL_USE_EXTERNAL_PLUGINS=none`)."""
    path = [str(REPO / "python"), str(SUPPORT)]
    if entry_points is not None:
        path.insert(0, str(entry_points))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)  # verl's default: "auto"
    if entry_points is None:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    env["KVM_STANDIN_PRELOAD"] = "1" if preload else "0"
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "verl_order_server.py"), json.dumps(engine_kwargs)]
        + ([model_dir] if model_dir else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            return proc, json.loads(line)
    proc.kill()
    raise TimeoutError("verl_order_server.py printed no result")


def _stop(proc: Any) -> None:
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def verl_servers() -> Iterator[list[dict[str, Any]]]:
    """Two replicas of one model started as verl starts them; the first holds PRELOAD_IDS."""
    kwargs = {**verl_recipe.engine_kwargs(), **CPU_ONLY_KWARGS}
    with tempfile.TemporaryDirectory() as tmp:
        entry_points = _entry_point_dist(Path(tmp))
        (Path(tmp) / "model").mkdir()
        model_dir = cpu_harness.write_tiny_model_dir(str(Path(tmp) / "model"))
        procs, started = [], []
        try:
            for preload in (True, False):
                proc, info = _start(kwargs, entry_points, preload, model_dir)
                procs.append(proc)
                assert "error" not in info, info.get("trace", info)
                started.append(info)
            yield started
        finally:
            for proc in procs:
                _stop(proc)


@pytest.fixture(scope="module")
def verl_server(verl_servers: list[dict[str, Any]]) -> dict[str, Any]:
    return verl_servers[0]


def test_server_args_takes_the_recipes_flags_in_verls_order(verl_server: dict) -> None:
    assert verl_recipe.engine_kwargs()["enable_kv_migration"] is True
    assert verl_server["server_args_class"].endswith(".KVMigrationServerArgs")


def test_sglangs_app_answers_the_six_routes(verl_server: dict) -> None:
    url = verl_server["url"]
    info = httpx.post(url + "/get_transfer_session_info", timeout=30)
    assert info.status_code == 200 and info.json()["success"], info.text
    assert len(info.json()["ranks"]) == 1
    held = httpx.post(
        url + "/get_request_extra_token_size", json={"input_ids": PRELOAD_IDS}, timeout=30
    )
    assert held.status_code == 200, held.text
    assert held.json()["matched_token_size"] == len(PRELOAD_IDS)
    for route in ROUTES[1:]:
        bad = httpx.post(url + route, json={"input_ids": "not ids"}, timeout=30)
        assert bad.status_code == 400, (route, bad.text)
        assert bad.json()["success"] is False and bad.json()["message"], (route, bad.text)
    for route in ("/commit", "/abort_transfer"):
        unknown = httpx.post(url + route, json={"migration_id": "no-such-id"}, timeout=30)
        assert 400 <= unknown.status_code < 500, (route, unknown.text)
        assert unknown.json()["success"] is False, (route, unknown.text)


def test_kv_migrates_between_servers_verl_started(verl_servers: list[dict]) -> None:
    source, target = (s["url"] for s in verl_servers)
    ids = PRELOAD_IDS + [7, 8, 9]
    with MigrationClient() as client:
        result = client.migrate(source, target, ids)
    assert result.migrated_token_size == len(PRELOAD_IDS), result
    held = httpx.post(target + "/get_request_extra_token_size", json={"input_ids": ids}, timeout=30)
    assert held.json()["matched_token_size"] == len(PRELOAD_IDS)


def test_without_the_entry_point_verl_cannot_turn_migration_on() -> None:
    """The same start with verl's plugins off: SGLang's plugins load only inside
    `Engine._launch_subprocesses`, after verl built ServerArgs."""
    kwargs = {**verl_recipe.engine_kwargs(), **CPU_ONLY_KWARGS}
    proc, started = _start(kwargs, None)
    _stop(proc)
    assert "TypeError" in started.get("error", ""), started
    assert "enable_kv_migration" in started["error"] or "kv_migration" in started["error"]


def test_the_integrations_import_without_sglang() -> None:
    code = (
        "import sys\n"
        "import sglang_kv_migration.integrations.verl_plugin\n"
        "import sglang_kv_migration.integrations.verl_balancer\n"
        "loaded = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\n"
        "assert not loaded, loaded\n"
        "print('OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]
