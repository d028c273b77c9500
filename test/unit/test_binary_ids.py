"""Token ids as bytes (feature "binary_ids"): the encoding, its checks, and when the
client uses it."""

from __future__ import annotations

import base64

import pytest
from sglang_kv_migration.client.call_bodies import allocate_call, transfer_call
from sglang_kv_migration.client.plan import Plan
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.wire import binary_ids, features
from sglang_kv_migration.wire.convert import from_dict, to_wire
from sglang_kv_migration.wire.messages import AllocateReply, SessionInfoReply


def test_round_trip_and_the_exact_bytes():
    ids = [0, 1, 2**16, 2**32 - 1, 151_645]
    text = binary_ids.encode(ids)
    assert text is not None
    raw = binary_ids.decode(text, max_ids=8)
    assert raw == b"".join(i.to_bytes(4, "little") for i in ids)  # little-endian uint32
    assert binary_ids.count(raw) == len(ids) and binary_ids.to_list(raw) == ids


@pytest.mark.parametrize("ids", [[], [2**32], [-1, 3], [1, 2**64]])
def test_ids_the_encoding_cannot_carry_go_as_a_list(ids):
    assert binary_ids.encode(ids) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("!!!!", "not base64"),
        ("AQAA", "not whole 4-byte ids"),
        ("", "no ids"),
        (base64.b64encode(bytes(4 * 9)).decode(), "more than 8 ids"),
        ("A" * 100, "more than 8 ids"),
    ],
)
def test_decode_names_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        binary_ids.decode(text, max_ids=8)


def test_the_scheduler_makes_the_list_once():
    raw = binary_ids.decode(binary_ids.encode([5, 6, 7]), max_ids=8)
    req = TransferRequestKVCacheReqInput(input_ids=[], input_ids_u32=raw)
    binary_ids.unpack_request(req)
    assert req.input_ids == [5, 6, 7] and req.input_ids_u32 == b""
    binary_ids.unpack_request(req)  # nothing left to unpack: unchanged
    assert req.input_ids == [5, 6, 7]
    # A trailing partial id is ignored, never raised on the scheduler thread.
    assert binary_ids.to_list(raw + b"\x01") == [5, 6, 7]


def _plan(source_features: list[str], target_features: list[str], prefix: list[int]) -> Plan:
    rank = {"tp_rank": 0, "pp_rank": 0, "fingerprint": {}, "paths": {"host": {}}}
    host = {"session_id": "h:1", "host_kv_data_ptrs": [], "host_kv_data_lens": []}
    host["host_kv_item_lens"] = []
    rank["paths"]["host"] = host
    rank["page_size"] = 1
    source = {"features": source_features, "ranks": [rank], "instance_id": "s"}
    target = {"features": target_features, "ranks": [rank]}
    source, target = (from_dict(SessionInfoReply, {**i, "success": True}) for i in (source, target))
    return Plan("http://s", "http://t", None, source, target, prefix, {})


def test_the_client_sends_bytes_only_to_servers_that_list_the_feature():
    ids = list(range(1000, 1064))
    allocation = {
        "success": True,
        "matched_token_size": 0,
        "extra_token_size": 64,
        "migration_id": "m",
        "ranks": [{"tp_rank": 0, "pp_rank": 0, "kv_indices": [], "kv_pages": [0], "grant": "g"}],
    }
    allocation = from_dict(AllocateReply, allocation)
    plan = _plan([features.BINARY_IDS], [], ids)
    allocate = to_wire(allocate_call(plan, "host").body)
    transfer = to_wire(transfer_call(plan, allocation, "host").body)
    assert allocate["input_ids"] == ids and binary_ids.FIELD not in allocate  # older target
    assert "input_ids" not in transfer
    assert binary_ids.to_list(binary_ids.decode(transfer[binary_ids.FIELD], 64)) == ids
    # Ids the encoding cannot carry go as the list, even to a server that lists it.
    big = _plan([features.BINARY_IDS], [features.BINARY_IDS], [2**40] * 64)
    assert to_wire(transfer_call(big, allocation, "host").body)["input_ids"] == [2**40] * 64
