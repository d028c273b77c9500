"""The flag works wherever SGLang is embedded, and an in-process engine gives and takes KV.

- `sglang.Engine(..., enable_kv_migration=True)`: the engine loads SGLang's plugins
  before it builds its args, with a class bound when `Engine` was defined; the plugin
  replaces that binding too. SGLang's `ServerArgs` is still its own before the engine.
- `ServerArgs(enable_kv_migration=True)` built by the process itself (slime's actors,
  any embedding that builds args before SGLang loads plugins): works after the one line
  `import sglang_kv_migration.sglang_flags`, before or after SGLang's `server_args`; the
  package's other modules do not replace anything.
- An in-process engine with no SGLang HTTP server (ROLL, AReaL) serves the six routes on
  a port of its own (`server/embedded.py`); KV moves from a CPU mini server to it and
  from it to another mini server, and each side reports the prefix held.

The engine runs in a fresh interpreter (`embedded_engine.py`): real `Engine`, tokenizer
manager, plugin hooks and routes; only its scheduler and detokenizer processes are CPU
stand-ins (`engine_standins.py`), passed the way `Engine` allows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cpu_harness
import pytest
from engine_standins import PRELOAD_IDS
from mini_server import ServerHandle, ServerSpec, serving
from sglang_kv_migration.client.migration import MigrationClient

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "test" / "support"
HARNESS = cpu_harness.HarnessConfig()
PAGE = HARNESS.page_size
# What a CPU machine needs besides the flags: no GPU attention backend, the harness's
# host layout, a small staging arena.
CPU_KWARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "page_size": PAGE,
    "hicache_mem_layout": HARNESS.host_layout,
    "hicache_io_backend": HARNESS.effective_io_backend(),
    "kv_migration_staging_mb": 4,
    "skip_tokenizer_init": True,
    "log_level": "error",
}
FROM_MINI = list(range(900, 900 + 3 * PAGE))


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO / "python"), str(SUPPORT)])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "KVM_STANDIN_PRELOAD": "1"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, list[ServerHandle]]]:
    """The embedded engine (started first: its start is the longest) and two CPU mini
    servers started meanwhile, without a served name as the engine has none (a name is
    compared only where both set one)."""
    model = tmp_path_factory.mktemp("model")
    kwargs = {
        "model_path": cpu_harness.write_tiny_model_dir(str(model)),
        "enable_hierarchical_cache": True,
        "enable_kv_migration": True,
        **CPU_KWARGS,
    }
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "embedded_engine.py"), json.dumps(kwargs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        text=True,
    )
    try:
        specs = [ServerSpec(preload=[(FROM_MINI, 3)], served_model_name=None)]
        specs.append(ServerSpec(served_model_name=None))
        with serving(specs) as minis:
            started = _first_json_line(proc, 240)
            assert "error" not in started, started.get("trace", started)
            yield started, minis
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _first_json_line(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            return json.loads(line)
    proc.kill()
    raise TimeoutError("embedded_engine.py printed no result")


def test_sglang_engine_takes_the_flag_with_nothing_done_first(servers: tuple) -> None:
    embedded, _ = servers
    assert embedded["server_args_class"].endswith(".KVMigrationServerArgs")
    assert embedded["engine_args_class"].endswith(".KVMigrationServerArgs")


def test_an_in_process_engine_gives_and_takes_kv(servers: tuple) -> None:
    embedded, (source, target) = servers
    engine = embedded["url"]
    with MigrationClient() as client:
        # The engine's stand-in scheduler holds PRELOAD_IDS: it gives them ...
        given = client.migrate(engine, target.url, PRELOAD_IDS + [1])
        # ... and takes a prefix a mini server holds.
        taken = client.migrate(source.url, engine, FROM_MINI + [1])
        held = client.call(engine, "/get_request_extra_token_size", {"input_ids": FROM_MINI})
    assert given.migrated_token_size == len(PRELOAD_IDS), given
    assert max(target.ask(0, "held", PRELOAD_IDS)) == len(PRELOAD_IDS)
    assert taken.migrated_token_size == len(FROM_MINI), taken
    assert held["matched_token_size"] == len(FROM_MINI)


SERVER_ARGS = (
    "args = server_args.ServerArgs(model_path={model!r}, enable_hierarchical_cache=True, "
    "enable_kv_migration=True, device='cpu', skip_tokenizer_init=True)\n"
    "print(type(args).__name__, args.enable_kv_migration)\n"
)


def test_server_args_take_the_flag_after_the_one_line_opt_in(tmp_path: Path) -> None:
    """Before or after SGLang's `server_args` is imported; and importing the package's
    client alone replaces nothing (three fresh interpreters, run side by side)."""
    model = cpu_harness.write_tiny_model_dir(str(tmp_path))
    imports = ["import sglang_kv_migration.sglang_flags", "from sglang.srt import server_args"]
    client_only = ["import sglang_kv_migration.client", "from sglang.srt import server_args"]
    runs = []
    for order in (imports, imports[::-1], client_only):
        code = "\n".join(order) + "\n" + SERVER_ARGS.format(model=model)
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for run in runs[:2]:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert out.split()[-2:] == ["KVMigrationServerArgs", "True"], out
    out, err = runs[2].communicate(timeout=300)
    assert runs[2].returncode != 0 and "unexpected keyword argument 'enable_kv_migration'" in err
