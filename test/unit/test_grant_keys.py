"""Which secrets sign grants: never the `--api-key` every inference client holds.

A fleet started with only `--api-key` is attacked the way a client of `/generate` could:
it derives a signing key from the API key it holds, forges a grant naming the host slots
of a prefix the server committed, and asks the server (as source, loopback over real
Mooncake TCP) to write another prefix's KV there. The server is built by the real
scheduler hook from real `KVMigrationServerArgs`, as `launch_server` builds it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from cpu_harness import HarnessConfig
from mini_server import ServerSpec, _MiniScheduler
from sglang_kv_migration import grants
from side_helpers import transfer_to_self

API_KEY = "every-client-holds-this"
PAGE = 16


def _key_a_client_can_derive(secret: str) -> bytes:
    # What the old server signed with when only --api-key was set: sha256 of a public
    # context string and the key, computable by anyone holding the key.
    return hashlib.sha256(b"sglang-kv-migration grant key\x00" + secret.encode()).digest()


def _server(harness_factory, caplog, **keys: str):
    """A one-rank server side built by the real scheduler hook from these keys."""
    from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks

    cfg = HarnessConfig(page_size=PAGE)
    harness = harness_factory(cfg)
    scheduler = _MiniScheduler(ServerSpec(harness=cfg, **keys), 0, harness, None)
    replies: list = []
    scheduler.send_to_tokenizer = SimpleNamespace(send_output=lambda out, req: replies.append(out))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        scheduler_hooks.after_init_request_dispatcher(None, scheduler)
    side = scheduler.kv_migration
    side.replies = replies
    side.startup_warning = " ".join(
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )
    side.harness = harness
    return side


@pytest.fixture
def api_key_only_server(harness_factory, caplog):
    side = _server(harness_factory, caplog, api_key=API_KEY)
    yield side
    side.close()


def _send(side, request):
    side.replies.clear()
    assert side.transfer_request_kvcache(request) is None
    deadline = time.monotonic() + 30  # bounded: loopback TCP finishes in milliseconds
    while time.monotonic() < deadline:
        side.poll()
        if side.replies:
            return side.replies[0]
        time.sleep(0.001)
    raise AssertionError("no reply")


def _host_slots_of(harness, ids: list[int]) -> torch.Tensor:
    match = harness.match(ids)
    assert match.host_hit_length == 0 and len(match.device_indices) == len(ids)
    node = match.last_device_node
    assert node.host_value is not None and len(node.host_value) == len(ids)
    return node.host_value.to(torch.int64)


def _host_bytes(side, slots: torch.Tensor) -> str:
    pool = side.identity.host_pool.kv_buffer
    # layer_first layout: (2, layers, slots, heads, dim); the slots' KV of every layer.
    return hashlib.sha256(pool[:, :, slots].contiguous().view(torch.uint8).numpy()).hexdigest()


def test_a_client_with_the_api_key_cannot_forge_a_signed_grant(api_key_only_server) -> None:
    side = api_key_only_server
    victim = list(range(7000, 7000 + 4 * PAGE))  # a committed prefix others reuse
    attacker = list(range(9000, 9000 + 4 * PAGE))  # the KV the client wants there
    side.harness.insert_random(victim, seed=1)
    side.harness.insert_random(attacker, seed=2)
    side.harness.write_back_all()
    victim_slots = _host_slots_of(side.harness, victim)
    before = _host_bytes(side, victim_slots)

    forged = grants.Signer(_key_a_client_can_derive(API_KEY)).encode(
        grants.Grant(
            migration_id="forged",
            tp=0,
            pp=0,
            path="host",
            slots_digest=grants.slots_digest(victim_slots),
            num_tokens=len(victim),
            expires_at=time.time() + 10,
            tokens_digest=grants.tokens_digest(attacker, None),
            destination=grants.destination_digest(side.paths["host"].advertise()),
            source=side.identity.server_epoch,
        )
    )
    request = transfer_to_self(side, attacker, victim_slots.tolist(), migration_id="forged")
    request.target_per_rank[0].grant = forged
    reply = _send(side, request)

    overwritten = _host_bytes(side, victim_slots) != before
    assert (reply.success, overwritten) == (False, False), reply.message
    assert reply.error_kind == "forbidden", reply.message
    assert reply.transferred_bytes == 0
    assert not side.identity.signer.signed  # no key derives from --api-key
    # The start-up warning says the fleet is unsigned, that the API key does not sign,
    # and what a forged grant can do.
    warning = side.startup_warning
    assert "UNSIGNED" in warning
    assert "--api-key never signs" in warning
    assert "overwrite KV" in warning and "committed prefixes" in warning


def test_the_admin_key_signs_and_its_grants_verify(harness_factory, caplog) -> None:
    side = _server(harness_factory, caplog, api_key=API_KEY, admin_api_key="operators-only")
    try:
        assert side.identity.signer.key == _key_a_client_can_derive("operators-only")
        assert side.identity.signer.key != _key_a_client_can_derive(API_KEY)
        assert "UNSIGNED" not in side.startup_warning
    finally:
        side.close()
