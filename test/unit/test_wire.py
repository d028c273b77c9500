"""The wire contract (`wire/`): one registry of features, replies that share `Reply` and
keep their JSON key order, and the client's request bodies and the servers' replies
passing through the same models."""

from __future__ import annotations

import orjson
import pytest
from sglang_kv_migration.client.call_bodies import allocate_call, one_trip_call, transfer_call
from sglang_kv_migration.client.calls import encode, size_query
from sglang_kv_migration.client.plan import Plan
from sglang_kv_migration.fingerprint import KVCacheShape, LayoutFingerprint
from sglang_kv_migration.wire import bodies, features, messages
from sglang_kv_migration.wire.convert import build, from_dict, to_wire

PAGE = 4


def test_every_feature_constant_is_a_registered_feature_and_servers_list_them_in_order():
    constants = {
        value
        for name, value in vars(features).items()
        if name.isupper() and isinstance(value, str) and name != "EVERY_SERVER"
    }
    assert constants == set(features.BY_NAME)
    assert len(features.BY_NAME) == len(features.REGISTRY) == 13
    # The session info's `features` list, as servers of this version have always sent it.
    assert messages.SessionInfoReply(success=True).features == [
        "page_ranges",
        "bound_grants",
        "partial_transfer",
        "binary_ids",
        "epoch_check",
        "transfer_batch",
        "dp_ranks",
        "owner_pattern",
        "source_dp_rank",
    ]


def test_replies_share_one_base_and_keep_their_json_key_order():
    replies = [
        messages.SessionInfoReply,
        messages.ExtraTokenSizeReply,
        messages.AllocateReply,
        messages.TransferReply,
        messages.CommitReply,
        messages.AbortReply,
    ]
    assert all(issubclass(r, messages.Reply) for r in replies)
    common = ["message", "error_kind", "steps_ms"]
    assert list(messages.reply_content(messages.AllocateReply(success=True))) == [
        "success", "migration_id", "matched_token_size", "extra_token_size", "ranks", "path",
        "page_size", "server_epoch", *common, "source_commit", "dp_rank",
    ]  # fmt: skip
    assert list(messages.reply_content(messages.TransferReply(success=False))) == [
        "success", "transferred_token_size", "transferred_bytes", "ranks", "path",
        "server_epoch", *common, "delivered", "allocation", "channel_error",
        "destination_unknown", "dp_rank",
    ]  # fmt: skip
    assert list(messages.reply_content(messages.SessionInfoReply(success=True))) == [
        "success", "ranks", "protocol_version", "server_epoch", *common, "features",
        "instance_id", "allocate_channel", "dp_size",
    ]  # fmt: skip
    assert list(messages.reply_content(messages.AbortReply(success=True))) == ["success", *common]
    assert list(messages.reply_content(messages.ExtraTokenSizeReply(success=True)))[-4:] == [
        *common, "page_owners",
    ]  # fmt: skip


def _fingerprint(rank: int = 0) -> dict:
    shape = KVCacheShape("bfloat16", "mha", 0, 1, 2, 16, 0, 0, PAGE, "layer_first")
    return LayoutFingerprint(2, "m", shape, 1, rank, 1, 0).to_dict()


def _session_info(instance: str) -> dict:
    """A server's session info as its route answers it (through the wire models)."""
    rank = messages.RankSessionInfo(
        session_id="127.0.0.1:17000",
        host_kv_data_ptrs=[1 << 20],
        host_kv_data_lens=[1 << 16],
        host_kv_item_lens=[256],
        tp_rank=0,
        pp_rank=0,
        page_size=PAGE,
        fingerprint=_fingerprint(),
    )
    rank.paths = {"host": rank.host_wire()}
    reply = messages.SessionInfoReply(
        success=True,
        ranks=[rank],
        protocol_version=2,
        server_epoch=f"{instance}-epoch",
        instance_id=instance,
        allocate_channel={"address": "ipc:///tmp/x", "secret": "a" * 32, "host": "h"},
    )
    reply.features.append(features.SOURCE_ALLOCATE)
    return orjson.loads(orjson.dumps(messages.reply_content(reply)))


def _sent(body: bodies.Body) -> dict:
    """The JSON object the client puts on the wire for `body`."""
    return orjson.loads(encode(body))


def test_client_bodies_and_server_replies_round_trip_through_the_wire_models():
    source, target = _session_info("src"), _session_info("dst")
    source_info, target_info = (from_dict(messages.SessionInfoReply, i) for i in (source, target))
    assert source_info.ranks[0].fingerprint == source["ranks"][0]["fingerprint"]
    prefix = list(range(100, 100 + 3 * PAGE))
    plan = Plan("http://s", "http://t", "key", source_info, target_info, prefix, {})

    sent = _sent(allocate_call(plan, "host").body)
    # The fields the client has always sent an allocate of this plan, and no others.
    assert set(sent) == {
        "input_ids_u32", "extra_key", "source_fingerprints", "path", "index_format",
        "nothing_ok", "source_instance", "expect_epoch",
    }  # fmt: skip
    allocate = bodies.validated(bodies.AllocateBody, sent)
    assert allocate.index_format == "ranges" and allocate.expect_epoch == "dst-epoch"
    assert allocate.source_instance == "src" and allocate.token_count == len(prefix)

    granted = messages.AllocateReply(
        success=True,
        migration_id="m1",
        matched_token_size=PAGE,
        extra_token_size=2 * PAGE,
        ranks=[messages.AllocatedRank(0, 0, [], kv_page_ranges=[[7, 2]], grant="g")],
        path="host",
        page_size=PAGE,
    )
    allocation = from_dict(
        messages.AllocateReply, orjson.loads(orjson.dumps(messages.reply_content(granted)))
    )
    assert allocation == granted
    sent = _sent(transfer_call(plan, allocation, "host").body)
    assert set(sent) == {
        "input_ids_u32", "extra_key", "matched_token_size", "extra_token_size",
        "migration_id", "target_per_rank",
    }  # fmt: skip
    transfer = bodies.validated(bodies.TransferBody, sent)
    [entry] = transfer.target_per_rank
    assert (entry.kv_page_ranges, entry.grant, transfer.migration_id) == ([[7, 2]], "g", "m1")
    assert entry.fingerprint == target["ranks"][0]["fingerprint"]
    assert entry.session_id == "127.0.0.1:17000"

    one_trip = bodies.validated(bodies.TransferBody, _sent(one_trip_call(plan, "host").body))
    assert one_trip.allocate_on_target is not None
    assert one_trip.allocate_on_target.allocate.index_format == "ranges"
    assert one_trip.allocate_on_target.address == "ipc:///tmp/x"

    batch = build(
        bodies.TransferBatchBody, moves=[transfer_call(plan, allocation, "host").body] * 2
    )
    assert len(bodies.validated(bodies.TransferBatchBody, _sent(batch)).moves) == 2


def test_a_body_sends_the_fields_its_builder_set_and_no_others():
    """`to_wire`: what the client sends is what it set, defaults included (the size
    query's `extra_key: null` as it has always gone), and nothing else."""
    assert _sent(size_query(None, [1, 2])) == {"input_ids": [1, 2], "extra_key": None}
    asked = to_wire(size_query(None, [0], headroom=True))
    assert asked == {"input_ids": [0], "extra_key": None, "headroom": True}
    body = build(bodies.CommitBody, migration_id="m", receipts=[])
    assert to_wire(body) == {"migration_id": "m", "receipts": []}
    body.verify = True
    assert bodies.validated(bodies.CommitBody, to_wire(body)).verify is True
    ids = list(range(5))
    assert to_wire(size_query(None, ids))["input_ids"] is ids  # no copy of a token list
    first, second = (build(bodies.CommitBody, migration_id="m") for _ in range(2))
    assert to_wire(first) == {"migration_id": "m"} and first.receipts == []
    assert first.receipts is not second.receipts  # defaults are fresh for each body


def test_every_reply_reads_back_from_its_json_into_its_model():
    replies = [
        messages.SessionInfoReply(
            success=True,
            ranks=[messages.RankSessionInfo(0, 0, PAGE, {"a": 1}, session_id="h:1")],
            features=["x"],
        ),
        messages.ExtraTokenSizeReply(success=True, matched_token_size=8, dp_rank=1),
        messages.TransferReply(
            success=False,
            message="no",
            ranks=[messages.RankTransferResult(0, 0, True, bytes=9, receipt="r")],
            allocation={"success": True, "migration_id": "m"},
        ),
        messages.CommitReply(success=True, matched_after_commit=16, steps_ms={"route": 1.0}),
        messages.AbortReply(success=True),
    ]
    for reply in replies:
        wire = orjson.loads(orjson.dumps(messages.reply_content(reply)))
        assert from_dict(type(reply), wire) == reply
    # An older server leaves fields out (defaults); a newer one adds some (ignored).
    older = from_dict(messages.ExtraTokenSizeReply, {"success": True, "novel": 1})
    assert older == messages.ExtraTokenSizeReply(success=True)
    # ... its session info lists no features (not this version's defaults).
    assert from_dict(messages.SessionInfoReply, {"success": True}).features == []
    for bad in ({"matched_token_size": 3}, "not an object", None):
        with pytest.raises(ValueError):
            from_dict(messages.ExtraTokenSizeReply, bad)
    with pytest.raises(ValueError, match="page_size"):
        from_dict(messages.RankSessionInfo, {"tp_rank": 0, "pp_rank": 0, "fingerprint": {}})


def test_a_body_the_models_refuse_is_a_value_error_naming_the_field():
    try:
        bodies.validated(bodies.CommitBody, {"migration_id": "", "verify": "yes"})
    except ValueError as e:
        assert "migration_id" in str(e) and "verify" in str(e)
    else:
        raise AssertionError("an empty migration id and a string for a bool were accepted")


def test_an_allocate_reply_is_read_back_checked_by_field() -> None:
    reply = messages.AllocateReply(
        success=True,
        migration_id="m",
        extra_token_size=32,
        ranks=[messages.AllocatedRank(0, 0, [], kv_page_ranges=[[7, 2]], grant="g")],
        steps_ms={"slots": 0.5},
    )
    content = messages.reply_content(reply)
    read = messages.AllocateReply.from_dict({**content, "added_by_a_newer_server": 1})
    assert read.ranks == reply.ranks and read.extra_token_size == 32
    assert read.steps_ms == {"slots": 0.5} and read.migration_id == "m"
    refused = messages.AllocateReply.from_dict({"success": False, "message": "no room"})
    assert not refused.success and refused.message == "no room"
    rank = content["ranks"][0]
    for bad, field_named in [
        ({**content, "extra_token_size": -1}, "extra_token_size"),
        ({**content, "success": 1}, "success"),
        ({k: v for k, v in content.items() if k != "migration_id"}, "migration_id"),
        ({**content, "ranks": [{**rank, "kv_pages": "x"}]}, "ranks.0.kv_pages is not a list"),
        ({**content, "ranks": [{**rank, "kv_indices": [True]}]}, "ranks.0.kv_indices"),
        ({**content, "ranks": [{**rank, "kv_page_ranges": [[1]]}]}, "kv_page_ranges"),
        ({**content, "ranks": [{**rank, "kv_pages": [1]}]}, "more than one"),
        ({**content, "ranks": [{**rank, "staging": [5]}]}, "ranks.0.staging"),
        ({**content, "ranks": [{**rank, "tp_rank": "0"}]}, "ranks.0.tp_rank"),
        ({**content, "ranks": ["x"]}, "ranks.0 is not an object"),
        ([], "not an object"),
    ]:
        with pytest.raises(ValueError, match=field_named):
            messages.AllocateReply.from_dict(bad)
