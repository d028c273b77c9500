"""Owner-sharded CP pages: the named owner functions (`cp_owners.py`) over literal page
lists, and how the fingerprint carries one and refuses a peer whose function differs."""

from __future__ import annotations

import dataclasses

import pytest
from sglang_kv_migration.cp_owners import (
    PageOwners,
    cp_rank_of,
    owned_pages,
    owned_positions,
    pattern_digest,
)
from sglang_kv_migration.fingerprint import (
    CP_REPLICATED,
    CP_SHARDED,
    KVCacheShape,
    LayoutFingerprint,
)

SHAPE = KVCacheShape(
    attention="mla",
    kv_dtype="bfloat16",
    start_layer=0,
    end_layer=3,
    kv_heads=1,
    head_dim=0,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    page_size=64,
    host_layout="layer_first",
)
PLACE = {"model": "m", "tp_size": 2, "tp_rank": 1, "pp_size": 1, "pp_rank": 0}


def test_round_robin_deals_logical_pages_to_cp_ranks_in_turns():
    one = PageOwners(cp_size=2)
    assert one.owners([0, 1, 2, 3, 4]) == [0, 1, 0, 1, 0]
    three = PageOwners(cp_size=3, pages_per_turn=2)
    assert three.owners([0, 1, 2, 3, 4, 5, 6, 7]) == [0, 0, 1, 1, 2, 2, 0, 0]
    # Device pages of a prefix are wherever the allocator put them, not 0, 1, 2..
    assert one.owners([7, 12, 3, 40]) == [1, 0, 1, 0]


def test_a_run_that_starts_mid_pattern_splits_by_its_own_pages():
    """A matched prefix of 3 pages ends mid-turn (turns of 2 over CP 2): the extra pages
    [3, 8) start with rank 0's second page; positions are relative to the run."""
    owners = PageOwners(cp_size=2, pages_per_turn=2)
    pattern = owners.owners([3, 4, 5, 6, 7])
    assert pattern == [1, 0, 0, 1, 1]
    assert owned_positions(pattern, 0) == [1, 2]
    assert owned_positions(pattern, 1) == [0, 3, 4]
    # Every page is owned exactly once.
    assert sorted(owned_positions(pattern, 0) + owned_positions(pattern, 1)) == list(range(5))
    assert owned_positions([], 0) == []


def test_a_target_allocation_must_reproduce_the_pattern():
    owners = PageOwners(cp_size=2)
    pattern = owners.owners([3, 4, 5])  # [1, 0, 1]
    assert owners.allocation_matches([9, 10, 11], pattern)
    assert not owners.allocation_matches([10, 11, 12], pattern)  # [0, 1, 0]
    assert not owners.allocation_matches([9, 10], pattern)


def test_describe_and_parse_round_trip():
    for owners in (PageOwners(cp_size=2), PageOwners(cp_size=4, pages_per_turn=8)):
        assert PageOwners.parse(owners.describe(), owners.cp_size) == owners
    assert PageOwners(cp_size=2).describe() == "round_robin:1"


@pytest.mark.parametrize(
    "description",
    [
        "",
        "round_robin",
        "round_robin:",
        "round_robin:0",
        "round_robin:-1",
        "round_robin:01",
        "round_robin:1.5",
        "round_robin: 1",
        "blocks:1",
        "lambda p: p % 2",
        "round_robin:9999999",
    ],
)
def test_only_named_known_functions_parse(description):
    with pytest.raises(ValueError, match="cp_owner"):
        PageOwners.parse(description, 2)


def test_bad_ranks_and_pages_are_refused():
    owners = PageOwners(cp_size=2)
    with pytest.raises(ValueError, match="CP rank"):
        owners.check_pattern([0, 1, 2])
    with pytest.raises(ValueError, match="CP rank"):
        owners.check_pattern([0, True])
    owners.check_pattern([0, 1, 1])
    with pytest.raises(ValueError, match="logical page"):
        owners.owner_of(-1)
    with pytest.raises(ValueError, match="attn_cp_size"):
        PageOwners(cp_size=1)


def test_fingerprint_carries_the_owner_function_by_name():
    sharded = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2), **PLACE
    )
    assert (sharded.attn_cp_mode, sharded.cp_owner) == (CP_SHARDED, "round_robin:1")
    wire = sharded.to_dict()
    assert (wire["attn_cp_mode"], wire["cp_owner"]) == ("sharded", "round_robin:1")
    assert LayoutFingerprint.from_dict(wire) == sharded
    # A replicated (stock SGLang) server publishes no owner function: older peers read it.
    replicated = LayoutFingerprint.from_shape(SHAPE, attn_cp_size=2, **PLACE)
    assert replicated.attn_cp_mode == CP_REPLICATED and "cp_owner" not in replicated.to_dict()
    with pytest.raises(ValueError, match="CP ranks"):
        LayoutFingerprint.from_shape(
            SHAPE, attn_cp_size=4, cp_owners=PageOwners(cp_size=2), **PLACE
        )


def test_a_peer_whose_owner_function_differs_is_refused_naming_the_field():
    mine = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2), **PLACE
    )
    theirs = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2, pages_per_turn=4), **PLACE
    )
    assert mine.first_mismatch(theirs) == "cp_owner: source=round_robin:1 target=round_robin:4"
    replicated = LayoutFingerprint.from_shape(SHAPE, attn_cp_size=2, **PLACE)
    assert mine.first_mismatch(replicated) == "attn_cp_mode: source=sharded target=replicated"


@pytest.mark.parametrize(
    ("mode", "owner", "match"),
    [
        ("sharded", "", "not a known owner function"),
        ("sharded", "lambda p: 0", "not a known owner function"),
        ("replicated", "round_robin:1", "only for attn_cp_mode=sharded"),
        ("", "round_robin:1", "only for attn_cp_mode=sharded"),
    ],
)
def test_a_hostile_fingerprint_owner_field_is_refused(mode, owner, match):
    wire = LayoutFingerprint.from_shape(SHAPE, attn_cp_size=2, **PLACE).to_dict()
    wire.update(attn_cp_mode=mode, cp_owner=owner)
    with pytest.raises(ValueError, match=match):
        LayoutFingerprint.from_dict(wire)


def test_replace_keeps_the_checks():
    sharded = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2), **PLACE
    )
    with pytest.raises(ValueError, match="cp_owner"):
        dataclasses.replace(sharded, cp_owner="round_robin:x")


def test_sharded_ranks_with_one_function_pair_and_another_function_is_refused():
    """Both sides sharded with the same function agree (each then moves its own pages);
    a peer whose function differs is refused with a 409 naming cp_owner, and a
    replicated peer one naming attn_cp_mode."""
    from sglang_kv_migration.errors import ErrorKind, MigrationError
    from sglang_kv_migration.server.rank.context import check_peer_fingerprint

    mine = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2), **PLACE
    )
    check_peer_fingerprint(mine, [mine.to_dict()], role="source")
    other = LayoutFingerprint.from_shape(
        SHAPE, attn_cp_size=2, cp_owners=PageOwners(cp_size=2, pages_per_turn=2), **PLACE
    )
    with pytest.raises(MigrationError, match="cp_owner: source=round_robin:2") as refused:
        check_peer_fingerprint(mine, [other.to_dict()], role="source")
    assert refused.value.kind is ErrorKind.CONFLICT
    replicated = LayoutFingerprint.from_shape(SHAPE, attn_cp_size=2, **PLACE)
    with pytest.raises(MigrationError, match="attn_cp_mode: source=replicated"):
        check_peer_fingerprint(mine, [replicated.to_dict()], role="source")
    check_peer_fingerprint(replicated, [replicated.to_dict()], role="source")


def test_cp_rank_numbering_follows_sglang():
    """tp_rank = cp_rank * attn_tp_size + attn_tp_rank."""
    assert [cp_rank_of(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [cp_rank_of(r, 2, 2) for r in range(2)] == [0, 1]


def test_owned_pages_are_token_offsets_of_a_ranks_pages_in_the_run():
    # A run of 3 pages of 4 tokens starting on rank 1's page: [1, 0, 1].
    assert owned_pages([1, 0, 1], 0, 4, 12) == [4, 5, 6, 7]
    assert owned_pages([1, 0, 1], 1, 4, 12) == [0, 1, 2, 3, 8, 9, 10, 11]
    # A send cut after two pages keeps the owned pages inside it.
    assert owned_pages([1, 0, 1], 1, 4, 8) == [0, 1, 2, 3]
    assert owned_pages([0, 0], 1, 4, 8) == []


def test_pattern_digest_names_the_pattern_and_its_length():
    assert pattern_digest([0, 1, 0]) == pattern_digest((0, 1, 0))
    assert pattern_digest([0, 1, 0]) != pattern_digest([1, 0, 1])
    assert pattern_digest([1, 0]) != pattern_digest([10])
    assert pattern_digest([]) != pattern_digest([0])


@pytest.mark.parametrize("pattern", [[0, True], [0, 1.0], [0, "1"], [-1], "01", {"0": 1}])
def test_an_allocate_body_takes_only_a_list_of_non_negative_ints(pattern):
    from sglang_kv_migration.wire import bodies

    body = {"input_ids": [1, 2], "source_fingerprints": [{}], "page_owners": pattern}
    with pytest.raises(ValueError, match="page_owners"):
        bodies.validated(bodies.AllocateBody, body)
    body["page_owners"] = [0, 1]
    assert bodies.validated(bodies.AllocateBody, body).page_owners == [0, 1]
    del body["page_owners"]
    assert bodies.validated(bodies.AllocateBody, body).page_owners is None
