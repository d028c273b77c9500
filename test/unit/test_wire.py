"""The wire contract (`wire/`): one registry of features, replies that share `Reply` and
keep their JSON key order, and the client's request bodies and the servers' replies
passing through the same models."""

from __future__ import annotations

import orjson
from sglang_kv_migration import binary_ids, grants, page_ranges
from sglang_kv_migration.client.migration import (
    _allocate_call,
    _one_trip_call,
    _Plan,
    _transfer_call,
)
from sglang_kv_migration.fingerprint import KVCacheShape, LayoutFingerprint
from sglang_kv_migration.server.same_host import allocate_channel, mailbox
from sglang_kv_migration.server.source import known_destinations
from sglang_kv_migration.wire import bodies, features, messages

PAGE = 4


def test_every_feature_constant_is_a_registered_feature_and_servers_list_them_in_order():
    constants = [
        binary_ids.FEATURE,
        page_ranges.FEATURE,
        grants.FEATURE,
        grants.PARTIAL_FEATURE,
        grants.SOURCE_COMMIT_FEATURE,
        grants.SOURCE_ALLOCATE_FEATURE,
        grants.DESTINATION_DIGEST_FEATURE,
        mailbox.FEATURE,
        allocate_channel.FEATURE,
        known_destinations.FEATURE,
    ]
    assert set(constants) <= set(features.BY_NAME)
    assert len(features.BY_NAME) == len(features.REGISTRY) == 10
    # The session info's `features` list, as servers of this version have always sent it.
    assert messages.SessionInfoReply(success=True).features == [
        "page_ranges",
        "bound_grants",
        "partial_transfer",
        "binary_ids",
        "epoch_check",
        "transfer_batch",
        "dp_ranks",
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
    rank.paths = {"host": rank.to_wire()}
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


def test_client_bodies_and_server_replies_round_trip_through_the_wire_models():
    source, target = _session_info("src"), _session_info("dst")
    prefix = list(range(100, 100 + 3 * PAGE))
    plan = _Plan("http://s", "http://t", "key", source, target, prefix, {})

    allocate = bodies.validated(bodies.AllocateBody, _allocate_call(plan, "host").body)
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
    allocation = orjson.loads(orjson.dumps(messages.reply_content(granted)))
    transfer = bodies.validated(bodies.TransferBody, _transfer_call(plan, allocation, "host").body)
    [entry] = transfer.target_per_rank
    assert (entry.kv_page_ranges, entry.grant, transfer.migration_id) == ([[7, 2]], "g", "m1")
    assert entry.fingerprint == target["ranks"][0]["fingerprint"]

    one_trip = bodies.validated(bodies.TransferBody, _one_trip_call(plan, "host").body)
    assert one_trip.allocate_on_target is not None
    assert one_trip.allocate_on_target.allocate.index_format == "ranges"


def test_a_body_the_models_refuse_is_a_value_error_naming_the_field():
    try:
        bodies.validated(bodies.CommitBody, {"migration_id": "", "verify": "yes"})
    except ValueError as e:
        assert "migration_id" in str(e) and "verify" in str(e)
    else:
        raise AssertionError("an empty migration id and a string for a bool were accepted")
