"""Every optional wire feature, by name, with what it adds and which servers list it.

A server lists in its session info `features` what it understands beyond its protocol
version (`version.py`); a client uses a feature only when both servers list it, and
sends none of its fields to a server that does not (older servers refuse unknown
fields). The names are the wire format and never change.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_RANGES = "page_ranges"
BOUND_GRANTS = "bound_grants"
PARTIAL_TRANSFER = "partial_transfer"
BINARY_IDS = "binary_ids"
EPOCH_CHECK = "epoch_check"
TRANSFER_BATCH = "transfer_batch"
SOURCE_COMMIT = "source_commit"
SOURCE_ALLOCATE = "source_allocate"
DESTINATION_DIGEST = "destination_digest"
DP_RANKS = "dp_ranks"
RUNNING_SLOTS = "running_slots"
OWNER_PATTERN = "owner_pattern"
SOURCE_DP_RANK = "source_dp_rank"


@dataclass(frozen=True)
class Feature:
    name: str
    adds: str  # what a peer that lists it may send or receive
    listed_by: str  # which servers of this version list it
    # The wire fields it adds (bodies, replies, session info): with the name, what a
    # module's code names when it takes part in the feature (test_package_rules counts
    # those modules per feature, so a feature's reach cannot grow unnoticed).
    fields: tuple[str, ...] = ()
    # Its shortcut talks to one scheduler rank directly, outside the HTTP layer's routing
    # to DP ranks: a server with several DP ranks does not list it (`dp_ranks.py`).
    one_dp_rank: bool = False


EVERY_SERVER = "every server"

REGISTRY: tuple[Feature, ...] = (
    Feature(
        PAGE_RANGES,
        'allocate takes `index_format: "ranges"`; transfer targets take `kv_page_ranges`, '
        "[first_page, count] runs (`page_ranges.py`)",
        EVERY_SERVER,
        fields=("kv_page_ranges",),
    ),
    Feature(
        BOUND_GRANTS,
        "allocate takes `source_instance` (the source's session info `instance_id`); "
        "grants bind their destination and source (`grants.py`)",
        EVERY_SERVER,
        fields=("source_instance", "instance_id"),
    ),
    Feature(
        PARTIAL_TRANSFER,
        "a transfer takes `partial_ok` and sends what the source holds of the granted "
        "range; its receipts say how many tokens, and commit inserts those",
        EVERY_SERVER,
        fields=("partial_ok",),
    ),
    Feature(
        BINARY_IDS,
        "bodies may carry the ids as little-endian uint32, base64 (`input_ids_u32`; "
        "`binary_ids.py`)",
        EVERY_SERVER,
        fields=("input_ids_u32",),
    ),
    Feature(
        EPOCH_CHECK,
        "allocate takes `expect_epoch` (the target's session info `server_epoch`) and "
        "refuses a stale one before it reserves anything",
        EVERY_SERVER,
        fields=("expect_epoch",),
    ),
    Feature(
        TRANSFER_BATCH,
        '`/transfer_request_kvcache` takes `{"moves": [transfer, ...]}`, several '
        "transfers in one call (`server/http/routes.py`)",
        EVERY_SERVER,
        fields=("moves",),
    ),
    Feature(
        SOURCE_COMMIT,
        "allocate takes `source_commit`; the source hands its receipts to the target's "
        "mailbox and the target commits by itself (`server/same_host/mailbox.py`)",
        "servers with a mailbox",
        fields=("source_commit", "delivered"),
        one_dp_rank=True,
    ),
    Feature(
        SOURCE_ALLOCATE,
        "a transfer takes `allocate_on_target`; the source asks the target's allocate "
        "channel for the slots itself (`server/same_host/allocate_channel.py`)",
        "single-rank servers with an allocate channel",
        fields=("allocate_on_target", "allocation", "channel_error", "allocate_channel"),
        one_dp_rank=True,
    ),
    Feature(
        DESTINATION_DIGEST,
        "a device-path target entry may name its `device_kv` by the digest grants bind "
        "(`device_kv_digest`), once the source was sent it in full "
        "(`server/source/known_destinations.py`)",
        "servers with the device path",
        fields=("device_kv_digest", "destination_unknown"),
    ),
    Feature(
        DP_RANKS,
        "session info lists every data-parallel rank's scheduler ranks (`dp_rank` per rank, "
        "`dp_size`); size query, allocate and transfer take an optional `dp_rank` and their "
        "replies name the DP rank they used (`server/http/dp_ranks.py`)",
        EVERY_SERVER,
        fields=("dp_rank", "dp_size", "dp_load"),
    ),
    Feature(
        RUNNING_SLOTS,
        "size query and transfer take `running_rid`: the source reads the range from that "
        "running request's own token slots (its prompt + output so far, checked against "
        "`input_ids`), not from its radix tree; the size query's reply adds "
        "`running_token_size` (`server/source/running_slots.py`)",
        "servers with one PP stage and one DP rank",
        fields=("running_rid", "running_token_size"),
    ),
    Feature(
        OWNER_PATTERN,
        "the size query's reply of an owner-sharded CP server adds `page_owners` (the CP "
        "rank owning each page of its device prefix); allocate takes `page_owners`, the "
        "source's owners of every page of the request, and grants bind the run's "
        "(`cp_owners.py`); a server that does not shard refuses the field by name",
        EVERY_SERVER,
        fields=("page_owners",),
    ),
    Feature(
        SOURCE_DP_RANK,
        "allocate takes `source_dp_rank` (the DP rank of the source holding the prefix, "
        "from its size query); each grant then binds it: only that DP rank of the source "
        "claims it, its receipts name it (`dp_rank`), and the target takes receipts "
        "naming the grant only from it (`grants.py`)",
        EVERY_SERVER,
        fields=("source_dp_rank",),
    ),
)

BY_NAME: dict[str, Feature] = {f.name: f for f in REGISTRY}

# What every server of this version lists, in the order session info lists them (the
# conditional ones follow, each when its condition holds).
ALWAYS: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.listed_by == EVERY_SERVER)
# What a server with several DP ranks leaves out of its session info.
ONE_DP_RANK: frozenset[str] = frozenset(f.name for f in REGISTRY if f.one_dp_rank)
