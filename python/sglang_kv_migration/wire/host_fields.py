"""The host path's destination fields, declared once.

Protocol 1 put a target rank's host-path destination at the top level of two wire
objects: a session-info rank (`messages.RankSessionInfo`) and a transfer body's target
entry (`messages.TransferRequestKVCacheTarget`, `bodies.TargetRankBody`). Both derive
their four fields from `HostFields`; `targets.HostTarget`, the host path's destination
as typed data, does too. The names are the wire format and do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(kw_only=True)
class HostFields:
    """A target rank's transfer session and host-pool buffers (`HostPath.advertise`);
    empty where the rank has no host path."""

    session_id: str = ""  # "<ip>:<rpc_port>" of the rank's transfer engine
    host_kv_data_ptrs: list[int] = field(default_factory=list)
    host_kv_data_lens: list[int] = field(default_factory=list)
    host_kv_item_lens: list[int] = field(default_factory=list)

    def host_wire(self) -> dict[str, Any]:
        """Just the four fields, as the wire dict of the host path's destination."""
        return {
            "session_id": self.session_id,
            "host_kv_data_ptrs": self.host_kv_data_ptrs,
            "host_kv_data_lens": self.host_kv_data_lens,
            "host_kv_item_lens": self.host_kv_item_lens,
        }

    def buffer_count_problem(self) -> str | None:
        """Why the three buffer lists do not describe one set of buffers (None: they do)."""
        return buffer_count_problem(
            self.host_kv_data_ptrs, self.host_kv_data_lens, self.host_kv_item_lens
        )


HOST_FIELD_NAMES = tuple(f.name for f in fields(HostFields))


def buffer_count_problem(ptrs: list[int], lens: list[int], item_lens: list[int]) -> str | None:
    """Why buffer lists of these lengths do not describe one set of buffers (None: they
    do); for a body that carries the fields (`bodies.TargetRankBody`) too."""
    if len({len(ptrs), len(lens), len(item_lens)}) != 1:
        return (
            "host_kv_data_ptrs, host_kv_data_lens and host_kv_item_lens must have the same length"
        )
    return None
