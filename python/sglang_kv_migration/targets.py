"""Each data path's destination on one target rank, as typed data and as its wire dict.

`HostTarget` is the host path's (transfer session and host-pool buffers: the fields
`wire.host_fields.HostFields` declares, which protocol 1 puts at top level of
session-info ranks and transfer targets), `DeviceTarget` the device path's (`device_kv` in a
transfer target, `paths["device"]` in session info), `SharedHostTarget` the shared-host
path's (`shared_host_kv`, `paths["shared_host"]`). The JSON field names are the wire
format and do not change. Plain data, importable without SGLang or torch (clients too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_kv_migration.wire.host_fields import HOST_FIELD_NAMES, HostFields


@dataclass(kw_only=True)
class HostTarget(HostFields):
    """The host path's destination on one target rank: its transfer session and host-pool
    buffers (`HostPath.advertise`), the fields `HostFields` declares for the wire."""

    def to_wire(self) -> dict[str, Any]:
        return self.host_wire()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> HostTarget:
        """The host fields of a wire dict (missing ones empty, as protocol 1 allows)."""
        return cls(**{name: d[name] for name in HOST_FIELD_NAMES if name in d})


@dataclass
class DeviceTarget:
    """The device path's destination on one target rank (`DevicePath.advertise`), which a
    transfer body's target entry carries as `device_kv`: the rank's host and GPU, its
    instance, and its KV buffers exported through CUDA IPC (`cuda_ipc.py`)."""

    host_identity: str
    gpu_uuid: str
    instance_id: str  # a restarted server is a new peer
    row_bytes: list[int]  # per buffer: bytes of one token row
    num_rows: list[int]  # per buffer: token rows
    buffers: list[dict[str, Any]]  # cuda_ipc.export_tensor() per buffer
    # Tiers this rank copies from as a source (None: an older server, device pages only).
    tiers: list[str] | None = None
    # > 0: the buffers are a landing arena of this many token rows, not the KV pool (a
    # target with --enable-memory-saver, `landing.py`); one migration moves at most this
    # many tokens, so a client sends a longer prefix in rounds.
    landing_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "host_identity": self.host_identity,
            "gpu_uuid": self.gpu_uuid,
            "instance_id": self.instance_id,
            "row_bytes": self.row_bytes,
            "num_rows": self.num_rows,
            "buffers": self.buffers,
        }
        if self.tiers is not None:
            d["tiers"] = self.tiers
        if self.landing_tokens:
            d["landing_tokens"] = self.landing_tokens
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> DeviceTarget:
        """Parse a `device_kv` dict; raises KeyError, TypeError or ValueError for one
        that is not a device target."""
        return cls(
            host_identity=str(d["host_identity"]),
            gpu_uuid=str(d["gpu_uuid"]),
            instance_id=str(d["instance_id"]),
            row_bytes=[int(x) for x in d["row_bytes"]],
            num_rows=[int(x) for x in d["num_rows"]],
            buffers=list(d["buffers"]),
            tiers=d.get("tiers"),  # read by clients only
            landing_tokens=int(d.get("landing_tokens", 0)),
        )


@dataclass
class SharedHostTarget:
    """The shared-host path's destination on one target rank (`SharedHostPath.advertise`),
    which a transfer body's target entry carries as `shared_host_kv`: the rank's host, its
    host pool's memory file (``/proc/<pid>/fd/<fd>``, checked by its inode and size) and
    the pool's layout, which the source checks against its own before it writes."""

    host_identity: str
    instance: str  # a restarted server is a new peer
    pid: int
    fd: int
    inode: int
    nbytes: int
    attention: str  # "mha" or "mla"
    layout: str  # the host pool's hicache_mem_layout
    layer_num: int
    page_num: int
    page_tokens: int  # tokens per page
    row_bytes: int  # one token of one layer (one plane)
    # Tiers this rank copies from as a source ("device", and "host" where it reads its
    # host pool in place).
    tiers: list[str] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "host_identity": self.host_identity,
            "instance": self.instance,
            "pid": self.pid,
            "fd": self.fd,
            "inode": self.inode,
            "nbytes": self.nbytes,
            "attention": self.attention,
            "layout": self.layout,
            "layer_num": self.layer_num,
            "page_num": self.page_num,
            "page_tokens": self.page_tokens,
            "row_bytes": self.row_bytes,
            "tiers": self.tiers,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SharedHostTarget:
        """Parse a `shared_host_kv` dict; raises KeyError, TypeError or ValueError for one
        that is not a shared-host target (counts must be non-negative ints)."""
        counts = ("pid", "fd", "inode", "nbytes", "layer_num", "page_num", "page_tokens")
        for name in (*counts, "row_bytes"):
            value = d[name]
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        return cls(
            host_identity=str(d["host_identity"]),
            instance=str(d["instance"]),
            pid=d["pid"],
            fd=d["fd"],
            inode=d["inode"],
            nbytes=d["nbytes"],
            attention=str(d["attention"]),
            layout=str(d["layout"]),
            layer_num=d["layer_num"],
            page_num=d["page_num"],
            page_tokens=d["page_tokens"],
            row_bytes=d["row_bytes"],
            tiers=[str(t) for t in d.get("tiers", [])],
        )
