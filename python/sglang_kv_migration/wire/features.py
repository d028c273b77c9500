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


EVERY_SERVER = "every server"

REGISTRY: tuple[Feature, ...] = (
    Feature(
        PAGE_RANGES,
        'allocate takes `index_format: "ranges"`; transfer targets take `kv_page_ranges`, '
        "[first_page, count] runs (`page_ranges.py`)",
        EVERY_SERVER,
    ),
    Feature(
        BOUND_GRANTS,
        "allocate takes `source_instance` (the source's session info `instance_id`); "
        "grants bind their destination and source (`grants.py`)",
        EVERY_SERVER,
    ),
    Feature(
        PARTIAL_TRANSFER,
        "a transfer takes `partial_ok` and sends what the source holds of the granted "
        "range; its receipts say how many tokens, and commit inserts those",
        EVERY_SERVER,
    ),
    Feature(
        BINARY_IDS,
        "bodies may carry the ids as little-endian uint32, base64 (`input_ids_u32`; "
        "`binary_ids.py`)",
        EVERY_SERVER,
    ),
    Feature(
        EPOCH_CHECK,
        "allocate takes `expect_epoch` (the target's session info `server_epoch`) and "
        "refuses a stale one before it reserves anything",
        EVERY_SERVER,
    ),
    Feature(
        TRANSFER_BATCH,
        '`/transfer_request_kvcache` takes `{"moves": [transfer, ...]}`, several '
        "transfers in one call (`server/http/routes.py`)",
        EVERY_SERVER,
    ),
    Feature(
        SOURCE_COMMIT,
        "allocate takes `source_commit`; the source hands its receipts to the target's "
        "mailbox and the target commits by itself (`server/same_host/mailbox.py`)",
        "servers with a mailbox",
    ),
    Feature(
        SOURCE_ALLOCATE,
        "a transfer takes `allocate_on_target`; the source asks the target's allocate "
        "channel for the slots itself (`server/same_host/allocate_channel.py`)",
        "single-rank servers with an allocate channel",
    ),
    Feature(
        DESTINATION_DIGEST,
        "a device-path target entry may name its `device_kv` by the digest grants bind "
        "(`device_kv_digest`), once the source was sent it in full "
        "(`server/source/known_destinations.py`)",
        "servers with the device path",
    ),
    Feature(
        DP_RANKS,
        "session info lists every data-parallel rank's scheduler ranks (`dp_rank` per rank, "
        "`dp_size`); size query, allocate and transfer take an optional `dp_rank` and their "
        "replies name the DP rank they used (`server/http/dp_ranks.py`)",
        EVERY_SERVER,
    ),
    Feature(
        RUNNING_SLOTS,
        "size query and transfer take `running_rid`: the source reads the range from that "
        "running request's own token slots (its prompt + output so far, checked against "
        "`input_ids`), not from its radix tree; the size query's reply adds "
        "`running_token_size` (`server/source/running_slots.py`)",
        "servers with one PP stage and one DP rank",
    ),
    Feature(
        OWNER_PATTERN,
        "the size query's reply of an owner-sharded CP server adds `page_owners` (the CP "
        "rank owning each page of its device prefix); allocate takes `page_owners`, the "
        "source's owners of every page of the request, and grants bind the run's "
        "(`cp_owners.py`); a server that does not shard refuses the field by name",
        EVERY_SERVER,
    ),
    Feature(
        SOURCE_DP_RANK,
        "allocate takes `source_dp_rank` (the DP rank of the source holding the prefix, "
        "from its size query); each grant then binds it: only that DP rank of the source "
        "claims it, its receipts name it (`dp_rank`), and the target takes receipts "
        "naming the grant only from it (`grants.py`)",
        EVERY_SERVER,
    ),
)

BY_NAME: dict[str, Feature] = {f.name: f for f in REGISTRY}

# What every server of this version lists, in the order session info lists them (the
# conditional ones follow, each when its condition holds).
ALWAYS: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.listed_by == EVERY_SERVER)
