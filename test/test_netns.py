"""Across hosts, as far as one machine allows: two servers in two network namespaces.

The test creates a network namespace and a veth pair with private addresses (and removes
them afterwards): the source runs in this namespace at 10.231.N.1, the target inside the
new one at 10.231.N.2, both advertising those addresses to each other. A migration moves
over the veth link with byte-identical KV; then the link is cut after allocate, so the
transfer fails, only that migration fails, and once the link is back every pool returns
to its baseline and the next migration works. Needs root (CI has it) and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang_kv_migration.client import MigrationClient, MigrationFailed

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)

PAGE = 16
FIRST = list(range(70_000, 70_000 + 32 * PAGE))
SECOND = list(range(80_000, 80_000 + 32 * PAGE))
THIRD = list(range(90_000, 90_000 + 8 * PAGE))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str, str, str]]:
    n = os.getpid() % 250 + 1
    ns, here, there = f"kvmig-{os.getpid()}", f"kvma{os.getpid()}", f"kvmb{os.getpid()}"
    here_ip, there_ip = f"10.231.{n}.1", f"10.231.{n}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here[:15], "type", "veth", "peer", "name", there[:15])
        _ip("link", "set", there[:15], "netns", ns)
        _ip("addr", "add", f"{here_ip}/24", "dev", here[:15])
        _ip("link", "set", here[:15], "up")
        _ip("-n", ns, "addr", "add", f"{there_ip}/24", "dev", there[:15])
        _ip("-n", ns, "link", "set", there[:15], "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, here[:15], here_ip, there_ip
    finally:
        subprocess.run(["ip", "link", "del", here[:15]], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def servers(hosts) -> Iterator[tuple[ServerHandle, ServerHandle]]:
    ns, _link, here_ip, there_ip = hosts
    # Mooncake's own per-batch timeout, so a write into a cut link fails in seconds.
    os.environ["MC_TRANSFER_TIMEOUT"] = "3"
    try:
        source, target = start_servers(
            [
                ServerSpec(host=here_ip, preload=[(FIRST, 1), (SECOND, 2), (THIRD, 3)]),
                ServerSpec(host=there_ip, netns=ns, watchdog_timeout_s=4.0, grant_ttl_s=1.0),
            ]
        )
    finally:
        os.environ.pop("MC_TRANSFER_TIMEOUT", None)
    try:
        yield source, target
    finally:
        source.stop()
        target.stop()


def test_migration_over_private_addresses(hosts, servers) -> None:
    _ns, _link, here_ip, there_ip = hosts
    source, target = servers
    with MigrationClient(timeout=30.0) as client:
        info = client.call(source.url, "/get_transfer_session_info")
        assert info["ranks"][0]["session_id"].startswith(here_ip + ":")  # advertised
        info = client.call(target.url, "/get_transfer_session_info")
        assert info["ranks"][0]["session_id"].startswith(there_ip + ":")
        result = client.migrate(source.url, target.url, FIRST)
    assert result.path == "host" and result.migrated_token_size == len(FIRST)
    assert _same_kv(source, target, FIRST)


def test_a_cut_link_fails_only_that_migration(hosts, servers) -> None:
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")

    def cut_after_allocate(request) -> None:
        if request.url.path == "/transfer_request_kvcache":
            _ip("link", "set", link, "down")

    import httpx

    try:
        with httpx.Client(timeout=15.0, event_hooks={"request": [cut_after_allocate]}) as h:
            with pytest.raises(MigrationFailed) as info:
                MigrationClient(http_client=h).migrate(source.url, target.url, SECOND)
        assert info.value.phase == "transfer"
    finally:
        _ip("link", "set", link, "up")
    # The source gave back its pins; the target's allocation is freed by the watchdog (the
    # abort could not reach it) and its slots after the write window.
    assert _wait_for(lambda: source.ask(0, "snapshot") == source_base, 30.0)
    assert _wait_for(lambda: target.ask(0, "snapshot") == target_base, 60.0)
    assert sum(target.ask(0, "held", SECOND)) == 0
    # The link is back: migrations work again once TCP has retransmitted on the old
    # connection (its back-off can outlast the first attempts), within a bounded wait.
    results: list = []

    def migrated() -> bool:
        with MigrationClient(timeout=30.0) as client:
            try:
                results.append(client.migrate(source.url, target.url, THIRD))
            except MigrationFailed:
                return False
        return True

    assert _wait_for(migrated, 90.0), "no migration succeeded after the link came back"
    assert results[-1].migrated_token_size == len(THIRD)
    assert _same_kv(source, target, THIRD)


def _same_kv(source: ServerHandle, target: ServerHandle, ids: list[int]) -> bool:
    import torch

    got, want = target.ask(0, "kv", ids), source.ask(0, "kv", ids)
    # Random KV bytes include NaN patterns: compare bytes, not values.
    return len(got) == len(want) and all(
        torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        for g, w in zip(got, want, strict=True)
    )
