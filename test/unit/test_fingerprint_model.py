"""The model part of the layout fingerprint on the wire and in a refusal: the served name
is sent only where one was set (so peers of the previous release read the fingerprint of
a server without one unchanged), and a refusal says which flag or file sets the field."""

from __future__ import annotations

import pytest
from sglang_kv_migration import PROTOCOL_VERSION
from sglang_kv_migration.errors import MigrationError
from sglang_kv_migration.fingerprint import SET_BY, LayoutFingerprint, explain
from sglang_kv_migration.server.rank.context import check_peer_fingerprint

WIRE = {
    "protocol_version": PROTOCOL_VERSION,
    "model": "LlamaForCausalLM:0123456789abcdef",
    "kv_dtype": "bfloat16",
    "attention": "mha",
    "start_layer": 0,
    "end_layer": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
    "page_size": 16,
    "host_layout": "layer_first",
    "tp_size": 1,
    "tp_rank": 0,
    "pp_size": 1,
    "pp_rank": 0,
}


def test_the_served_name_is_on_the_wire_only_where_it_was_set() -> None:
    unnamed = LayoutFingerprint.from_dict(WIRE)
    assert unnamed.model_name == "" and "model_name" not in unnamed.to_dict()
    named = LayoutFingerprint.from_dict({**WIRE, "model_name": "policy-a"})
    assert named.to_dict()["model_name"] == "policy-a"
    assert LayoutFingerprint.from_dict(named.to_dict()) == named
    with pytest.raises(ValueError, match="model_name must be str"):
        LayoutFingerprint.from_dict({**WIRE, "model_name": 7})


@pytest.mark.parametrize(
    ("theirs", "field", "flag"),
    [
        ({"model_name": "policy-b"}, "model_name", "--served-model-name"),
        ({"model": "LlamaForCausalLM:fedcba9876543210"}, "model", "config.json"),
        ({"weight_version": "7"}, "weight_version", "--weight-version"),
        ({"page_size": 64}, "page_size", "--page-size"),
    ],
)
def test_a_refusal_names_what_sets_the_field(theirs: dict, field: str, flag: str) -> None:
    mine = LayoutFingerprint.from_dict({**WIRE, "model_name": "policy-a"})
    peer = {**mine.to_dict(), **theirs}
    with pytest.raises(MigrationError) as refused:
        check_peer_fingerprint(mine, [peer], role="source")
    assert f"{field}: source=" in str(refused.value) and flag in str(refused.value)
    assert flag in SET_BY[field]


def test_explain_leaves_fields_nothing_sets_as_they_are() -> None:
    assert explain("kv_heads: source=2 target=4") == "kv_heads: source=2 target=4"
    assert explain("page_size: source=16 target=64").endswith("(set by --page-size)")
