"""The host-tier landing between two real servers on one host (CPU): a target whose GPU
pool is full takes the prefix into its host tier through shared memory, never the host
path's Mooncake TCP, and serves it as a host hit.

ServerPair are `mini_server` processes (real HiRadixCache, our scheduler hooks and
handlers, our routes on uvicorn, the allocate channel and mailbox, Mooncake TCP for the
host path), each keeping its host pool in a memory file as a server offering the
shared-host path does (`HarnessConfig.shared_host_pool`); the target also runs the
`/generate` stand-in, which reports `cached_tokens_details` as SGLang does. The client is
the real `MigrationClient` with the auto path: these CPU servers offer no device path,
so auto takes shared_host first (the device path's refusal of a full GPU pool, and the
order it is tried in, are `test/unit/test_path_selection.py`'s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import cpu_harness
import httpx
import pytest
import torch
from generate_standin import StandinConfig, standin_factory
from mini_server import ServerPair, ServerSpec, serving
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed

PAGE = 16
HTTP_TIMEOUT_S = 60.0


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


SEQ_BYTES = _seq(50_000, 24 * PAGE)  # on the source's GPU: the byte-for-byte check
SEQ_SERVED = _seq(51_000, 24 * PAGE)  # on the source's GPU: served by the target
SEQ_HOST_TIER = _seq(52_000, 20 * PAGE)  # only in the source's host tier
SEQ_HOSTILE = _seq(53_000, 8 * PAGE)
TAIL = [7, 8, 9]  # a partial page: never migrated


def _harness() -> cpu_harness.HarnessConfig:
    return cpu_harness.HarnessConfig(
        page_size=PAGE, device_tokens=2048, shared_host_pool=True, load_back_threshold=1
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    source = ServerSpec(harness=_harness(), preload=[(SEQ_HOST_TIER, 3)])
    target = ServerSpec(
        harness=_harness(), extension=standin_factory(StandinConfig(capacity_tokens=1024))
    )
    with serving([source, target]) as handles:
        pair = ServerPair(*handles)
        pair.source.ask(0, "evict_device")  # the preload: host tier only
        pair.source.ask(0, "insert", SEQ_BYTES, 1)
        pair.source.ask(0, "insert", SEQ_SERVED, 2)
        pair.source.ask(0, "insert", SEQ_HOSTILE, 4)
        yield pair


@pytest.fixture
def full_target(servers: ServerPair) -> Iterator[ServerPair]:
    """The target's GPU pool held whole by its own work for the length of a test."""
    assert servers.target.ask(0, "hold_device_pool") > 0
    try:
        yield servers
    finally:
        servers.target.ask(0, "release_device_pool")


def _paths(url: str) -> list[str]:
    info = httpx.post(url + "/get_transfer_session_info", json={}, timeout=HTTP_TIMEOUT_S)
    assert info.status_code == 200, info.text
    return list(info.json()["ranks"][0]["paths"])


def test_both_servers_offer_the_shared_host_path(servers: ServerPair):
    # No CUDA here: no device path; the host path stays the cross-host one.
    assert _paths(servers.source.url) == _paths(servers.target.url) == ["shared_host", "host"]


def test_a_full_target_gpu_takes_the_prefix_into_its_host_tier_byte_for_byte(
    full_target: ServerPair,
):
    source, target = full_target.source, full_target.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(source.url, target.url, SEQ_BYTES + TAIL)
    assert (result.path, result.landing_tier) == ("shared_host", "host"), result
    assert result.migrated_token_size == result.matched_after_commit == len(SEQ_BYTES)
    assert result.migrated_bytes > 0 and not result.plans[0]  # no transfer-engine plan
    # Host-only nodes on the target: its GPU had no room, and got none.
    assert target.ask(0, "held", SEQ_BYTES) == (0, len(SEQ_BYTES))
    assert target.ask(0, "pending") == 0
    target.ask(0, "release_device_pool")
    # HiCache loads them back as its own pages: the same bytes as the source's.
    landed, held = target.ask(0, "kv", SEQ_BYTES), source.ask(0, "kv", SEQ_BYTES)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(landed, held, strict=True)
    )


def test_the_target_serves_the_landed_prefix_as_a_host_hit(full_target: ServerPair):
    source, target = full_target.source, full_target.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(source.url, target.url, SEQ_SERVED + TAIL)
    assert result.path == "shared_host" and result.migrated_token_size == len(SEQ_SERVED)
    target.ask(0, "release_device_pool")  # the running work ends: room to load it back
    body = {"input_ids": SEQ_SERVED + TAIL, "sampling_params": {"max_new_tokens": 1}}
    served = httpx.post(target.url + "/generate", json=body, timeout=HTTP_TIMEOUT_S).json()
    meta = served["meta_info"]
    assert meta["cached_tokens"] == len(SEQ_SERVED)
    assert meta["cached_tokens_details"] == {"device": 0, "host": len(SEQ_SERVED)}


def test_a_prefix_on_the_sources_host_tier_lands_the_same_way(full_target: ServerPair):
    source, target = full_target.source, full_target.target
    assert source.ask(0, "held", SEQ_HOST_TIER) == (0, len(SEQ_HOST_TIER))
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        result = client.migrate(source.url, target.url, SEQ_HOST_TIER)
    assert (result.path, result.landing_tier) == ("shared_host", "host"), result
    assert target.ask(0, "held", SEQ_HOST_TIER) == (0, len(SEQ_HOST_TIER))
    target.ask(0, "release_device_pool")
    landed, held = target.ask(0, "kv", SEQ_HOST_TIER), source.ask(0, "kv", SEQ_HOST_TIER)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(landed, held, strict=True)
    )


def test_a_destination_the_target_did_not_publish_is_refused_by_the_grant(
    full_target: ServerPair,
):
    """A body that points the source at another file (here: another descriptor of the
    target's) is refused before anything moves, since the grant binds what the target
    published; the allocation is rolled back. Auto then moves on to the host path."""
    source, target = full_target.source, full_target.target
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        info = client.session_info(target.url)
        published = info.ranks[0].paths["shared_host"]
        forged = dataclasses.replace(info, ranks=[dataclasses.replace(info.ranks[0])])
        forged.ranks[0].paths = {**info.ranks[0].paths, "shared_host": {**published, "fd": 0}}
        client._sessions.put(target.url, forged)  # what a hostile caller would send
        before = target.ask(0, "pool_digest")
        with pytest.raises(MigrationFailed) as refused:
            client.migrate(source.url, target.url, SEQ_HOSTILE, path="shared_host")
        assert refused.value.rolled_back, refused.value
        assert "another destination" in str(refused.value)
        assert target.ask(0, "pool_digest") == before  # nothing was written
        assert target.ask(0, "pending") == 0
        result = client.migrate(source.url, target.url, SEQ_HOSTILE)
    assert result.path == "host" and "another destination" in result.fallback_reason
    assert target.ask(0, "held", SEQ_HOSTILE) == (0, len(SEQ_HOSTILE))
