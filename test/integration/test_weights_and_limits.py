"""KV never crosses a weight update, and no request body is large enough to stall a server.

Weight versions: SGLang's tokenizer manager knows the weight version (RL weight updates
set it); our communicators stamp it on every request, and the scheduler side puts it in
the fingerprint and the server epoch. Driven here on a real one-rank scheduler side
(`side_factory`), with the stamp set by hand as the communicator would.

Body limits: real HTTP against a CPU mini server (uvicorn + our routes + SGLang's
communicators): an oversized body is refused with 413 before it is read, oversized fields
with 400 naming them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from mini_server import ServerHandle, ServerSpec, start_server
from sglang_kv_migration.server.http.routes import MAX_BODY_BYTES
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqInput,
    CommitTransferRequestKVCacheReqInput,
    GetRequestExtraTokenSizeReqInput,
    GetTransferSessionInfoReqInput,
)
from sglang_kv_migration.wire.bodies import MAX_ID_CHARS
from side_helpers import transfer_to_self


def _ids(start: int, n: int = 64) -> list[int]:
    return list(range(start, start + n))


def _allocate(side, ids: list[int], mid: str, source_version: str, target_version: str):
    source_fp = side.fingerprint_for(GetTransferSessionInfoReqInput(weight_version=source_version))
    return side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=ids,
            migration_id=mid,
            source_fingerprints=[source_fp.to_dict()],
            weight_version=target_version,
        )
    )


# --------------------------------------------------------------------------- weights


def test_session_info_and_epoch_carry_the_weight_version(side) -> None:
    v1 = side.get_transfer_session_info(GetTransferSessionInfoReqInput(weight_version="v1"))
    v2 = side.get_transfer_session_info(GetTransferSessionInfoReqInput(weight_version="v2"))
    assert v1.ranks[0].fingerprint["weight_version"] == "v1"
    assert v2.ranks[0].fingerprint["weight_version"] == "v2"
    # A weight update changes the epoch, so clients drop cached session info.
    assert v1.server_epoch != v2.server_epoch
    size = side.get_request_extra_token_size(
        GetRequestExtraTokenSizeReqInput(input_ids=_ids(100), weight_version="v2")
    )
    assert size.server_epoch == v2.server_epoch


def test_allocate_refuses_a_source_on_other_weights(side) -> None:
    before = side.harness.snapshot()
    out = _allocate(side, _ids(1000), "m", source_version="v1", target_version="v2")
    assert not out.success
    assert out.error_kind == "conflict"
    assert "weight_version: source=v1 target=v2" in out.message
    assert side.harness.snapshot() == before


def test_commit_after_a_weight_update_drops_the_pages(side) -> None:
    ids = _ids(2000)
    before = side.harness.snapshot()
    out = _allocate(side, ids, "w", source_version="v1", target_version="v1")
    assert out.success, out.message
    commit = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="w", weight_version="v2")
    )
    assert not commit.success and commit.error_kind == "gone"
    assert "weight_version changed from 'v1' to 'v2'" in commit.message
    # Nothing was inserted; the lock is back, the slots wait in quarantine (a source on
    # the old weights may still be writing them) until their write window closes.
    assert side.harness.match(ids).host_hit_length == 0
    dropped = side.harness.snapshot()
    assert dropped.total_lock_ref == before.total_lock_ref
    assert dropped.host_available == before.host_available - len(ids)
    assert side.target.pending.release_quarantine(now=float("inf")) == ["w"]
    assert side.harness.snapshot() == before
    again = side.commit_transfer_request_kvcache(
        CommitTransferRequestKVCacheReqInput(migration_id="w", weight_version="v2")
    )
    assert again.error_kind == "gone" and "weights changed" in again.message


def test_source_refuses_a_target_on_other_weights(side) -> None:
    ids = _ids(3000)
    side.harness.insert_random(ids, seed=1)
    side.harness.write_back_all()
    alloc = _allocate(side, _ids(5000), "t", source_version="v1", target_version="v1")
    assert alloc.success, alloc.message
    request = transfer_to_self(
        side, ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant, migration_id="t"
    )
    request.target_per_rank[0].fingerprint["weight_version"] = "v1"
    request.weight_version = "v2"  # the source's weights moved on since
    assert side.transfer_request_kvcache(request) is None
    side.poll()
    assert len(side.replies) == 1
    reply = side.replies[0]
    assert not reply.success and reply.error_kind == "conflict"
    assert "weight_version" in reply.message
    assert reply.transferred_bytes == 0


# --------------------------------------------------------------------------- limits


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = start_server(ServerSpec())
    try:
        yield handle
    finally:
        handle.stop()


def test_oversized_body_is_refused_before_it_is_read(server: ServerHandle) -> None:
    body = b'{"input_ids": [' + b"1," * (MAX_BODY_BYTES // 2) + b"1]}"
    assert len(body) > MAX_BODY_BYTES
    r = httpx.post(
        server.url + "/get_request_extra_token_size",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert r.json()["error_kind"] == "too_large"
    assert str(MAX_BODY_BYTES) in r.json()["message"]
    # The server still answers promptly.
    ok = httpx.post(server.url + "/get_transfer_session_info", timeout=10)
    assert ok.status_code == 200


def test_oversized_body_without_content_length_is_refused(server: ServerHandle) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"input_ids": ['
        piece = b"1," * (1 << 20)
        for _ in range(MAX_BODY_BYTES // len(piece) + 2):
            yield piece
        yield b"1]}"

    r = httpx.post(
        server.url + "/get_request_extra_token_size",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text


@pytest.mark.parametrize("route", ["/commit", "/abort_transfer", "/transfer_request_kvcache"])
def test_oversized_migration_id_is_a_400_naming_the_field(server: ServerHandle, route) -> None:
    body = {"migration_id": "x" * (MAX_ID_CHARS + 1)}
    if route == "/transfer_request_kvcache":
        body |= {
            "input_ids": [1] * 16,
            "matched_token_size": 0,
            "extra_token_size": 16,
            "target_per_rank": [
                {
                    "tp": 0,
                    "pp": 0,
                    "session_id": "127.0.0.1:1",
                    "host_kv_data_ptrs": [1],
                    "host_kv_data_lens": [1],
                    "host_kv_item_lens": [1],
                    "kv_indices": list(range(16)),
                    "fingerprint": {},
                }
            ],
        }
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "migration_id" in r.json()["message"]


def test_oversized_extra_key_is_a_400(server: ServerHandle) -> None:
    r = httpx.post(
        server.url + "/get_request_extra_token_size",
        json={"input_ids": [1, 2, 3], "extra_key": "k" * 5000},
        timeout=30,
    )
    assert r.status_code == 400 and "extra_key" in r.json()["message"]
