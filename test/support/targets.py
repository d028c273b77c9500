"""Transfer targets as the client builds them, for tests that call the source directly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_kv_migration.wire.messages import RankSessionInfo, TransferRequestKVCacheTarget

# What a target rank publishes about its host pool (`HostPath.advertise()`).
HOST_FIELDS = ("session_id", "host_kv_data_ptrs", "host_kv_data_lens", "host_kv_item_lens")


def host_target(
    tp: int, pp: int, host: Mapping[str, Any], **fields: Any
) -> TransferRequestKVCacheTarget:
    """The host-path target of rank (tp, pp), whose host pool `host` describes (its
    `HostPath.advertise()`, or `published_host` of its session info); `fields`: the slots,
    grant, fingerprint and the rest."""
    return TransferRequestKVCacheTarget(tp=tp, pp=pp, **{k: host[k] for k in HOST_FIELDS}, **fields)


def published_host(info: RankSessionInfo) -> dict[str, Any]:
    """The host-pool fields a session-info rank carries at top level (protocol 1)."""
    return {
        "session_id": info.session_id,
        "host_kv_data_ptrs": info.host_kv_data_ptrs,
        "host_kv_data_lens": info.host_kv_data_lens,
        "host_kv_item_lens": info.host_kv_item_lens,
    }
