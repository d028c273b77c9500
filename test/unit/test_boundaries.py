"""Boundaries the package keeps: what one module may change of the process it runs in."""

from __future__ import annotations

import os

import pytest
from sglang_kv_migration.paths.host.mooncake import MooncakeTransport, TransportConfig


@pytest.mark.parametrize("before", [None, "0"])
def test_engine_start_leaves_mc_force_tcp_as_it_was(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    """The tcp protocol forces TCP for this engine's start only, not for the process."""
    if before is None:
        monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    else:
        monkeypatch.setenv("MC_FORCE_TCP", before)
    transport = MooncakeTransport(TransportConfig(hostname="127.0.0.1", protocol="tcp"))
    try:
        assert transport.session_id.startswith("127.0.0.1:")
        assert os.environ.get("MC_FORCE_TCP") == before
    finally:
        transport.close()
