"""A migration between a SGLang 0.5.12 server and a SGLang 0.5.23 server: two processes,
one per version's venv (`scripts/install-cpu.sh` builds `.venv` and `.venv-0.5.23`), each
with the real caches of its SGLang and a real Mooncake engine over TCP on 127.0.0.1.

What decides whether KV may cross is what makes it valid on the target: the layout
fingerprint (model, KV dtype, heads, head dim, page size, host layout, ...), never the
SGLang version. Equal fingerprints: the pages move byte for byte and the target serves
them as a cache hit after its own load-back. A differing field: refused, naming it.

The two processes serve every case of the module (each start is an SGLang import, most
of the module's time): a case rebuilds their caches and engines (`setup`, small pools).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VENVS = {"0.5.12": REPO / ".venv", "0.5.23": REPO / ".venv-0.5.23"}
START_S = 240.0
REPLY_S = 120.0
TOKENS = list(range(3000, 3000 + 80))  # 5 pages of 16
# A case's pools: a few hundred tokens, three layers.
SMALL = {"layer_num": 3, "load_back_threshold": 1, "device_tokens": 512}


class Peer:
    def __init__(self, version: str, conn: Any) -> None:
        self.version, self.conn = version, conn
        self.info: dict = {}

    def do(self, command: str, *args: Any) -> Any:
        self.conn.send((command, *args))
        assert self.conn.poll(REPLY_S), f"SGLang {self.version}: no reply to {command}"
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def setup(self, **cfg: Any) -> Peer:
        """A fresh cache and engine in this version's process."""
        self.info = self.do("setup", {**SMALL, **cfg})
        assert self.info["sglang"] == self.version
        return self


def _python_of(version: str) -> Path:
    from sglang_kv_migration import sglang_adapter

    # The suite's own Python for its own version (wherever its venv lies).
    if sglang_adapter.sglang_version() == version:
        return Path(sys.executable)
    python = VENVS[version] / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no SGLang {version} venv: bash scripts/install-cpu.sh {version}")
    return python


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    """One process per version, both started at once."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO / "test" / "support")]),
    }
    pythons = {version: _python_of(version) for version in VENVS}
    with contextlib.ExitStack() as stack:
        waiting = []
        for version, python in pythons.items():
            authkey = secrets.token_bytes(16)
            listener = stack.enter_context(Listener(("127.0.0.1", 0), authkey=authkey))
            code = (
                f"import _cross_version_peer as p; p.main({listener.address!r}, {authkey.hex()!r})"
            )
            process = subprocess.Popen([str(python), "-c", code], env=env)
            stack.callback(_stop, process)
            waiting.append((version, listener))
        started = {}
        for version, listener in waiting:
            conn = listener.accept()
            stack.callback(_quit, conn)
            assert conn.poll(START_S), f"the SGLang {version} peer did not start"
            assert conn.recv() == ("ready", version)
            started[version] = Peer(version, conn)
        yield started


def _quit(conn: Any) -> None:
    with contextlib.suppress(OSError):
        conn.send(("quit",))


def _stop(process: subprocess.Popen) -> None:
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.mark.parametrize(
    ("direction", "layout"),
    [
        (("0.5.12", "0.5.23"), "layer_first"),
        (("0.5.23", "0.5.12"), "page_first"),
        (("0.5.12", "0.5.23"), "page_first_direct"),
    ],
)
def test_a_move_between_versions_is_byte_exact_and_a_cache_hit(peers, direction, layout) -> None:
    source_version, target_version = direction
    src = peers[source_version].setup(host_layout=layout)
    dst = peers[target_version].setup(host_layout=layout)
    assert src.info["fingerprint"] == dst.info["fingerprint"]
    sent_digest = src.do("insert", TOKENS, 7)
    dst.do("insert", TOKENS[:32], 9)  # the target holds the first two pages already
    alloc = dst.do("allocate", "m1", TOKENS, src.info["fingerprint"])
    assert alloc["matched"] == 32 and len(alloc["slots"]) == 48
    target = {k: dst.info[k] for k in ("session_id", "layout", "regions")}
    assert src.do("send", TOKENS, 32, target, alloc["slots"]) > 0
    assert dst.do("commit", "m1") == 0
    held, host_only, digest = dst.do("loaded_digest", TOKENS)
    # The moved pages are host-only nodes until SGLang's own load-back serves them.
    assert (held, host_only) == (80, 48)
    # Its first two pages are its own (seed 9), the three moved ones the source's.
    _, _, src_digest = src.do("loaded_digest", TOKENS)
    assert src_digest == sent_digest and digest != sent_digest
    # A prefix the target did not hold at all: every byte it serves is the source's.
    other = list(range(5000, 5000 + 64))
    sent_other = src.do("insert", other, 11)
    alloc = dst.do("allocate", "m2", other, src.info["fingerprint"])
    assert alloc["matched"] == 0
    src.do("send", other, 0, target, alloc["slots"])
    dst.do("commit", "m2")
    assert dst.do("loaded_digest", other)[2] == sent_other


@pytest.mark.parametrize(
    ("source_cfg", "target_cfg", "refusal"),
    [
        (
            {"host_layout": "layer_first"},
            {"host_layout": "page_first"},
            "host_layout: source=layer_first target=page_first",
        ),
        ({"page_size": 16}, {"page_size": 32}, "page_size: source=16 target=32"),
    ],
)
def test_a_differing_layout_field_is_refused_by_name(
    peers, source_cfg, target_cfg, refusal
) -> None:
    src = peers["0.5.12"].setup(**source_cfg)
    dst = peers["0.5.23"].setup(**target_cfg)
    assert dst.do("allocate", "m1", TOKENS[:64], src.info["fingerprint"]) == {"refused": refusal}
