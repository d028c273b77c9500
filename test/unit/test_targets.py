"""Each path's target descriptor: typed once (`targets.py`), the same JSON on the wire."""

from __future__ import annotations

import dataclasses

import pytest
from sglang_kv_migration.targets import DeviceTarget, HostTarget
from sglang_kv_migration.wire.host_fields import HostFields
from sglang_kv_migration.wire.messages import RankSessionInfo, TransferRequestKVCacheTarget

HOST_WIRE = {
    "session_id": "127.0.0.1:1234",
    "host_kv_data_ptrs": [4096, 8192],
    "host_kv_data_lens": [1024, 1024],
    "host_kv_item_lens": [64, 64],
}
DEVICE_WIRE = {
    "host_identity": "host-a",
    "gpu_uuid": "GPU-1",
    "instance_id": "abc",
    "row_bytes": [128, 128],
    "num_rows": [32, 32],
    "buffers": [{"handle": "x"}, {"handle": "y"}],
    "tiers": ["device", "host"],
}


def test_host_target_wire_round_trip_keeps_the_protocol_1_names():
    target = HostTarget.from_wire(HOST_WIRE)
    assert target.to_wire() == HOST_WIRE
    assert list(target.to_wire()) == list(HOST_WIRE)
    assert HostTarget.from_wire({}).to_wire() == {
        "session_id": "",
        "host_kv_data_ptrs": [],
        "host_kv_data_lens": [],
        "host_kv_item_lens": [],
    }


def test_session_info_and_transfer_targets_carry_the_host_fields_at_top_level():
    rank = RankSessionInfo(tp_rank=0, pp_rank=0, page_size=16, fingerprint={}, **HOST_WIRE)
    target = TransferRequestKVCacheTarget(tp=0, pp=0, **HOST_WIRE)
    for obj in (rank, target):
        assert obj.host_wire() == HostTarget.from_wire(HOST_WIRE).to_wire() == HOST_WIRE
        names = {f.name for f in dataclasses.fields(obj)}
        assert set(HOST_WIRE) <= names
        # The wire types share the fields' declaration (`HostFields`), not the host
        # path's destination type.
        assert isinstance(obj, HostFields) and not isinstance(obj, HostTarget)
    assert [f.name for f in dataclasses.fields(HostFields)] == list(HOST_WIRE)


def test_host_target_buffer_counts_must_agree():
    assert HostTarget.from_wire(HOST_WIRE).buffer_count_problem() is None
    bad = HostTarget.from_wire({**HOST_WIRE, "host_kv_item_lens": [64]})
    assert "must have the same length" in bad.buffer_count_problem()


def test_device_target_wire_round_trip():
    assert DeviceTarget.from_wire(DEVICE_WIRE).to_wire() == DEVICE_WIRE
    older = {k: v for k, v in DEVICE_WIRE.items() if k != "tiers"}
    assert DeviceTarget.from_wire(older).tiers is None
    assert DeviceTarget.from_wire(older).to_wire() == older


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"gpu_uuid": None}, None),  # str(None): the copy's checks refuse it later
        ({"row_bytes": ["x"]}, ValueError),
        ({"num_rows": 3}, TypeError),
    ],
)
def test_device_target_from_wire_raises_what_the_device_path_reports(change, error):
    wire = {**DEVICE_WIRE, **change}
    if error is None:
        DeviceTarget.from_wire(wire)
    else:
        with pytest.raises(error):
            DeviceTarget.from_wire(wire)
    with pytest.raises(KeyError):
        DeviceTarget.from_wire({k: v for k, v in DEVICE_WIRE.items() if k != "buffers"})
