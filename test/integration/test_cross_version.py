"""A migration between a SGLang 0.5.12 server and a SGLang 0.5.23 server: two processes,
one per version's venv (`scripts/install-cpu.sh` builds `.venv` and `.venv-0.5.23`), each
with the real caches of its SGLang and a real Mooncake engine over TCP on 127.0.0.1.

What decides whether KV may cross is what makes it valid on the target: the layout
fingerprint (model, KV dtype, heads, head dim, page size, host layout, ...), never the
SGLang version. Equal fingerprints: the pages move byte for byte and the target serves
them as a cache hit after its own load-back. A differing field: refused, naming it.
"""

from __future__ import annotations

import contextlib
import json
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


class Peer:
    def __init__(self, conn: Any, process: subprocess.Popen, info: dict) -> None:
        self.conn, self.process, self.info = conn, process, info

    def do(self, command: str, *args: Any) -> Any:
        self.conn.send((command, *args))
        assert self.conn.poll(REPLY_S), f"no reply to {command}"
        status, value = self.conn.recv()
        assert status == "ok", value
        return value


@contextlib.contextmanager
def peer(version: str, **cfg: Any) -> Iterator[Peer]:
    from sglang_kv_migration import sglang_adapter

    # The suite's own Python for its own version (wherever its venv lies).
    python = Path(sys.executable) if sglang_adapter.sglang_version() == version else None
    python = python or VENVS[version] / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no SGLang {version} venv: bash scripts/install-cpu.sh {version}")
    authkey = secrets.token_bytes(16)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO / "test" / "support")]),
        }
        fields = {"layer_num": 3, "load_back_threshold": 1, **cfg}
        code = (
            "import _cross_version_peer as p; "
            f"p.main({listener.address!r}, {authkey.hex()!r}, {json.dumps(fields)!r})"
        )
        process = subprocess.Popen([str(python), "-c", code], env=env)
        conn = None
        try:
            conn = listener.accept()
            assert conn.poll(START_S), f"the SGLang {version} peer did not start"
            ready, info = conn.recv()
            assert ready == "ready"
            assert info["sglang"] == version
            yield Peer(conn, process, info)
        finally:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(("quit",))
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


# Each case starts two SGLang processes (~30 s each on a 2-core machine): both
# directions, each with one host layout, keep the suite's time in bounds.
@pytest.mark.parametrize(
    ("direction", "layout"),
    [(("0.5.12", "0.5.23"), "layer_first"), (("0.5.23", "0.5.12"), "page_first")],
)
def test_a_move_between_versions_is_byte_exact_and_a_cache_hit(direction, layout) -> None:
    source_version, target_version = direction
    with (
        peer(source_version, host_layout=layout) as src,
        peer(target_version, host_layout=layout) as dst,
    ):
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


def test_a_differing_layout_field_is_refused_by_name() -> None:
    with (
        peer("0.5.12", host_layout="layer_first") as src,
        peer("0.5.23", host_layout="page_first") as dst,
    ):
        refused = dst.do("allocate", "m1", TOKENS, src.info["fingerprint"])
        assert refused == {"refused": "host_layout: source=layer_first target=page_first"}
