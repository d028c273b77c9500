"""Feature "source_allocate" against real servers on 127.0.0.1: the transfer that asks the
target's allocate channel for its slots (one client call), its hostile bodies, new
weights on the target, and a target channel that never answers.

ServerPair are `mini_server` processes (see `test_http_api.py`): real HiRadixCache, our
scheduler hooks and handlers, our routes on uvicorn, Mooncake TCP, the real channel.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import cpu_harness
import httpx
import orjson
import pytest
import zmq
from mini_server import ServerHandle, ServerPair, ServerSpec, serving
from sglang_kv_migration import grants
from sglang_kv_migration.client import path_choice
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.server.same_host.allocate_channel import ALLOCATE_TIMEOUT_S
from sglang_kv_migration.server.same_host.mailbox import SHM_DIR, pid_namespace
from sglang_kv_migration.wire.convert import from_dict, to_wire
from sglang_kv_migration.wire.messages import RankSessionInfo

PAGE = 16
HTTP_TIMEOUT_S = 30.0


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


SEQ_HOSTILE = _seq(20000, 2 * PAGE)
SEQ_WEIGHTS = _seq(21000, 2 * PAGE)
SEQ_STALLED = _seq(22000, 2 * PAGE)
SEQ_BESIDE = _seq(23000, 2 * PAGE)
SEQ_HELD = _seq(24000, 2 * PAGE)
SEQ_FALLBACK = _seq(25000, 2 * PAGE)


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    preload = [(SEQ_HOSTILE, 1), (SEQ_WEIGHTS, 2), (SEQ_STALLED, 3), (SEQ_BESIDE, 4),
               (SEQ_HELD, 5), (SEQ_FALLBACK, 6)]  # fmt: skip
    with serving([ServerSpec(preload=preload), ServerSpec(preload=[(SEQ_HELD, 5)])]) as handles:
        yield ServerPair(*handles)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _info(http: httpx.Client, server: ServerHandle) -> dict[str, Any]:
    r = http.post(server.url + "/get_transfer_session_info", json={})
    assert r.status_code == 200, r.text
    return r.json()


def _body(http: httpx.Client, servers: ServerPair, ids: list[int], **changes: Any) -> dict:
    """A one-trip transfer body as the client builds it (`call_bodies.one_trip_call`)."""
    source, target = _info(http, servers.source), _info(http, servers.target)
    allocate = {
        "source_fingerprints": [r["fingerprint"] for r in source["ranks"]],
        "path": "host",
        "index_format": "ranges",
        "nothing_ok": True,
        "source_instance": source["instance_id"],
        "source_commit": True,
        "expect_epoch": target["server_epoch"],
    }
    channel = target["allocate_channel"]
    rank = from_dict(RankSessionInfo, target["ranks"][0])
    body = {
        "input_ids": ids,
        "target_per_rank": [to_wire(path_choice.target_entry(rank, "host"))],
        "partial_ok": True,
        "allocate_on_target": {
            "address": channel["address"],
            "secret": channel["secret"],
            "allocate": allocate,
        },
    }
    for key, value in changes.items():
        if key.startswith("allocate."):
            body["allocate_on_target"]["allocate"][key.split(".", 1)[1]] = value
        elif key.startswith("channel."):
            body["allocate_on_target"][key.split(".", 1)[1]] = value
        else:
            body[key] = value
    return body


def test_both_servers_advertise_the_channel(servers: ServerPair, http: httpx.Client) -> None:
    for server in (servers.source, servers.target):
        info = _info(http, server)
        assert "source_allocate" in info["features"]
        channel = info["allocate_channel"]
        assert channel["address"].startswith(f"ipc://{SHM_DIR}/kvmig-alloc-")
        assert len(channel["secret"]) == 32 and channel["host"]
    assert _info(http, servers.source)["allocate_channel"]["host"] == channel["host"]


def test_a_one_trip_transfer_moves_the_prefix(servers: ServerPair, http: httpx.Client) -> None:
    r = http.post(
        servers.source.url + "/transfer_request_kvcache", json=_body(http, servers, SEQ_BESIDE)
    )
    assert r.status_code == 200, r.text
    reply = r.json()
    allocation = reply["allocation"]
    assert allocation["success"] and allocation["extra_token_size"] == len(SEQ_BESIDE)
    [[first, count]] = allocation["ranks"][0]["kv_page_ranges"]  # asked for, as runs
    assert count == len(SEQ_BESIDE) // PAGE and first >= 0
    assert reply["transferred_token_size"] == len(SEQ_BESIDE)
    assert reply["delivered"] and allocation["source_commit"]  # the target committed
    assert sum(servers.target.ask(0, "held", SEQ_BESIDE)) == len(SEQ_BESIDE)
    assert servers.target.ask(0, "pending") == 0
    steps = reply["steps_ms"]
    assert steps["allocate"] <= steps["waited"] + 0.01
    # Where the time after the target's answer went, in order, within the scheduler's part.
    after_answer = [steps[k] for k in ("answer", "start", "copy_wait", "finish")]
    assert all(v >= 0 for v in after_answer)
    assert steps["allocate"] + sum(after_answer) <= steps["scheduler"] + 0.05

    # The target holds it all now: the allocate grants nothing and nothing is sent.
    r = http.post(
        servers.source.url + "/transfer_request_kvcache", json=_body(http, servers, SEQ_HELD)
    )
    assert r.status_code == 200, r.text
    assert r.json()["allocation"]["extra_token_size"] == 0
    assert r.json()["transferred_token_size"] == 0


def _a_secret_not_theirs() -> str:
    return secrets.token_hex(16)


def _missing_channel() -> str:
    return f"ipc://{SHM_DIR}/kvmig-alloc-{pid_namespace()}-1-{'d' * 32}/s"


HOSTILE = [
    ({"channel.secret": "not-hex"}, 400, "secret"),
    ({"channel.address": "ipc:///tmp/anything/s"}, 400, "not an allocate channel address"),
    ({"channel.address": "tcp://127.0.0.1:1"}, 400, "not an allocate channel address"),
    ({"extra_token_size": 2 * PAGE}, 400, "come from the target"),
    ({"migration_id": "mine"}, 400, "come from the target"),
    ({"allocate.bogus": 1}, 400, "bogus"),
    ({"allocate.migration_id": "x"}, 400, "migration_id"),
    ({"allocate.source_fingerprints": []}, 400, "source_fingerprints"),
]


@pytest.mark.parametrize("changes, status, needle", HOSTILE)
def test_a_hostile_one_trip_body_is_refused_and_nothing_is_held(
    servers: ServerPair, http: httpx.Client, changes: dict, status: int, needle: str
) -> None:
    before = servers.target.ask(0, "snapshot")
    r = http.post(
        servers.source.url + "/transfer_request_kvcache",
        json=_body(http, servers, SEQ_HOSTILE, **changes),
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["message"], r.text
    assert servers.target.ask(0, "snapshot") == before
    assert servers.target.ask(0, "pending") == 0


@pytest.mark.parametrize(
    "changes, status, needle",
    [
        ({"channel.secret": "SECRET"}, 403, "secret"),
        ({"channel.address": "MISSING"}, 400, "not on this host"),
        ({"allocate.source_fingerprints": [{"page_size": 1}]}, 400, "the target refused"),
        ({"allocate.expect_epoch": "old"}, 409, "the target refused"),
        ({"target_per_rank": "SLOTS"}, 400, "names no slots"),
    ],
)
def test_what_only_the_target_or_the_channel_can_refuse_is_refused_by_name(
    servers: ServerPair, http: httpx.Client, changes: dict, status: int, needle: str
) -> None:
    replace = {"SECRET": _a_secret_not_theirs(), "MISSING": _missing_channel()}
    changes = {k: replace.get(v, v) if isinstance(v, str) else v for k, v in changes.items()}
    if changes.get("target_per_rank") == "SLOTS":
        body = _body(http, servers, SEQ_HOSTILE)
        body["target_per_rank"][0]["kv_page_ranges"] = [[0, 2]]
    else:
        body = _body(http, servers, SEQ_HOSTILE, **changes)
    before = servers.target.ask(0, "snapshot")
    r = http.post(servers.source.url + "/transfer_request_kvcache", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["message"], r.text
    assert not r.json().get("allocation", {}).get("success")
    assert servers.target.ask(0, "snapshot") == before
    assert servers.target.ask(0, "pending") == 0


def test_new_weights_on_the_target_refuse_the_channel_until_its_http_layer_stamps_again(
    servers: ServerPair, http: httpx.Client
) -> None:
    src, dst = servers.source, servers.target
    body = _body(http, servers, SEQ_WEIGHTS)
    dst.ask(0, "new_weights")  # the scheduler sees a weight update; the stamp is stale
    r = http.post(src.url + "/transfer_request_kvcache", json=body)
    assert r.status_code == 409, r.text
    assert "new weights" in r.json()["message"]
    assert dst.ask(0, "pending") == 0

    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        # The client reads the target's session info (a stamp after the update)...
        result = client.migrate(src.url, dst.url, SEQ_WEIGHTS)
    assert result.migrated_token_size == len(SEQ_WEIGHTS)
    assert "allocate" not in result.timings  # ... so one trip was enough again
    assert sum(dst.ask(0, "held", SEQ_WEIGHTS)) == len(SEQ_WEIGHTS)


class _SilentChannel:
    """A socket named like a target's channel that takes requests and never answers."""

    def __init__(self) -> None:
        name = f"kvmig-alloc-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        self.directory = os.path.join(SHM_DIR, name)
        os.mkdir(self.directory, 0o700)
        self.address = f"ipc://{self.directory}/s"
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)

    def close(self) -> None:
        self.context.destroy(linger=0)
        for entry in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, entry))
        os.rmdir(self.directory)


def test_a_target_channel_that_never_answers_fails_only_its_own_transfer(
    servers: ServerPair, http: httpx.Client
) -> None:
    silent = _SilentChannel()
    try:
        body = _body(http, servers, SEQ_STALLED, **{"channel.address": silent.address})
        replies: list[httpx.Response] = []
        started = time.monotonic()
        stalled = threading.Thread(
            target=lambda: replies.append(
                httpx.post(
                    servers.source.url + "/transfer_request_kvcache",
                    json=body,
                    timeout=ALLOCATE_TIMEOUT_S + HTTP_TIMEOUT_S,
                )
            )
        )
        stalled.start()
        time.sleep(0.2)
        with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
            other = client.migrate(servers.source.url, servers.target.url, SEQ_STALLED[:PAGE])
        assert other.migrated_token_size == PAGE
        # Done while the silent channel's transfer still waits (it ends only at the
        # allocate's timeout): the other was not queued behind it, by order, not seconds.
        assert stalled.is_alive(), "the silent channel's transfer ended early"
        stalled.join(ALLOCATE_TIMEOUT_S + HTTP_TIMEOUT_S)
        assert not stalled.is_alive()
    finally:
        silent.close()
    [reply] = replies
    assert reply.status_code == 503, reply.text
    assert "did not answer the allocate" in reply.json()["message"]
    assert time.monotonic() - started >= ALLOCATE_TIMEOUT_S - 0.5


FORGED = {
    "success": True,
    "migration_id": "forged",
    "matched_token_size": 0,
    "extra_token_size": 2 * PAGE,
    "ranks": [{"tp_rank": 0, "pp_rank": 0, "kv_page_ranges": [[0, 2]], "grant": "forged"}],
}


@pytest.mark.parametrize(
    "answer, status, needle",
    [
        (orjson.dumps(FORGED), 403, "grant"),
        (orjson.dumps({**FORGED, "ranks": [{**FORGED["ranks"][0], "tp_rank": 1}]}), 502,
         "another rank"),
        (orjson.dumps({**FORGED, "extra_token_size": -1}), 502, "malformed"),
        (orjson.dumps({**FORGED, "ranks": [{**FORGED["ranks"][0], "kv_pages": "x"}]}), 502,
         "not a list"),
        (b"not json", 502, "not JSON"),
    ],
)  # fmt: skip
def test_a_channel_that_answers_with_a_forged_or_malformed_allocation_writes_nothing(
    servers: ServerPair, http: httpx.Client, answer: bytes, status: int, needle: str
) -> None:
    """What a target's channel answers is checked like a client-relayed allocation: a
    grant the source cannot verify, or a reply of the wrong shape, moves no byte."""
    lying = _SilentChannel()
    stop = threading.Event()

    def answer_every_request() -> None:
        while not stop.is_set():
            if lying.socket.poll(50):
                route_and_call = lying.socket.recv_multipart()[:2]
                lying.socket.send_multipart([*route_and_call, answer])

    responder = threading.Thread(target=answer_every_request)
    responder.start()
    try:
        body = _body(http, servers, SEQ_HOSTILE, **{"channel.address": lying.address})
        before = servers.source.ask(0, "snapshot")
        r = http.post(servers.source.url + "/transfer_request_kvcache", json=body)
    finally:
        stop.set()
        responder.join(10)
        lying.close()
    assert r.status_code == status, r.text
    assert needle in r.json()["message"], r.text
    assert r.json()["transferred_token_size"] == 0
    # Nothing pinned or sent: the source's tree and pools are as they were.
    assert servers.source.ask(0, "snapshot") == before


def test_the_client_falls_back_to_two_trips_when_the_channel_is_unreachable(
    servers: ServerPair,
) -> None:
    """A target in another mount namespace (its /dev/shm not ours) advertises a channel
    the source cannot open: the client allocates itself."""
    with MigrationClient(timeout=HTTP_TIMEOUT_S) as client:
        info = client.session_info(servers.target.url)
        info.allocate_channel = {**info.allocate_channel, "address": _missing_channel()}
        result = client.migrate(servers.source.url, servers.target.url, SEQ_FALLBACK)
    assert result.migrated_token_size == len(SEQ_FALLBACK)
    assert "allocate" in result.timings  # the client's own allocate trip
    assert sum(servers.target.ask(0, "held", SEQ_FALLBACK)) == len(SEQ_FALLBACK)
    assert servers.target.ask(0, "pending") == 0


def _device_entry(target_info: dict[str, Any], **fields: Any) -> dict[str, Any]:
    entry = {
        "tp": 0,
        "pp": 0,
        "path": "device",
        "fingerprint": target_info["ranks"][0]["fingerprint"],
    }
    return {**entry, **fields}


def test_a_destination_named_by_digest_resolves_only_once_sent_in_full(
    servers: ServerPair, http: httpx.Client
) -> None:
    """Feature "destination_digest" on a real source: an unknown digest is refused before
    anything is asked or pinned (409, `destination_unknown`); a description sent in full
    in a transfer the source refused (these CPU servers have no device path) is not kept,
    so the digest still names nothing (a verified grant makes the source keep one:
    `test/unit/test_refused_transfers_keep_nothing.py`)."""
    target = _info(http, servers.target)
    device_kv = {"host_identity": "h", "gpu_uuid": "GPU-x", "instance_id": secrets.token_hex(8),
                 "row_bytes": [64], "num_rows": [8], "buffers": [{"handle": "x"}]}  # fmt: skip
    digest = grants.destination_digest(device_kv)
    url = servers.source.url + "/transfer_request_kvcache"
    sized = {"matched_token_size": 0, "extra_token_size": 2 * PAGE, "migration_id": "m"}

    def post(entry: dict[str, Any], one_trip: bool) -> httpx.Response:
        body = _body(http, servers, SEQ_HOSTILE)
        body["target_per_rank"] = [entry]
        if not one_trip:
            del body["allocate_on_target"]
            body.update(sized)
            entry.update(kv_page_ranges=[[0, 2]], grant="g")
        return http.post(url, json=body)

    before = servers.source.ask(0, "snapshot"), servers.target.ask(0, "snapshot")
    for one_trip in (True, False):
        r = post(_device_entry(target, device_kv_digest=digest), one_trip)
        assert r.status_code == 409 and r.json()["destination_unknown"], r.text
        assert "send device_kv in full" in r.json()["message"]
        assert not r.json()["allocation"]  # the target was not asked
    assert (servers.source.ask(0, "snapshot"), servers.target.ask(0, "snapshot")) == before
    assert servers.target.ask(0, "pending") == 0
    r = post(_device_entry(target, device_kv=device_kv), one_trip=False)
    assert r.status_code == 409 and "data path 'device' is not available" in r.text, r.text
    assert not r.json()["destination_unknown"]
    # Sent in full but refused (no grant verified it): not kept, the digest names nothing.
    r = post(_device_entry(target, device_kv_digest=digest), one_trip=False)
    assert r.status_code == 409 and r.json()["destination_unknown"], r.text
    assert servers.source.ask(0, "snapshot") == before[0]


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"device_kv": {"a": 1}, "device_kv_digest": "0" * 64}, "exactly one of device_kv"),
        ({}, "exactly one of device_kv"),
        ({"device_kv_digest": "XYZ"}, "device_kv_digest"),
        ({"path": "host", "device_kv_digest": "0" * 64}, "device_kv_digest is for path"),
    ],
)
def test_a_malformed_destination_digest_is_refused(
    servers: ServerPair, http: httpx.Client, fields: dict, needle: str
) -> None:
    body = _body(http, servers, SEQ_HOSTILE)
    entry = body["target_per_rank"][0]
    if fields.get("path") != "host":
        entry = _device_entry(_info(http, servers.target))
    entry.update(fields)
    body["target_per_rank"] = [entry]
    r = http.post(servers.source.url + "/transfer_request_kvcache", json=body)
    assert r.status_code == 400 and needle in r.json()["message"], r.text


def test_harness_page_size_is_the_one_these_bodies_assume() -> None:
    assert cpu_harness.HarnessConfig().page_size == PAGE
