"""Which data paths a migration tries, in order, from the two servers' session info and
what the source holds; and where a transfer on each path writes (`target_entry`).

Auto (no path asked for): the target's GPU first (`device`), then its host tier through
memory both servers map (`shared_host`), then the cross-host path (`host`, Mooncake),
each where every rank of both servers offers it and, for the two same-host paths, where
the servers share a host and the source reads every tier it holds the prefix in (its
`tiers`). The client moves on to the next path when one fails, e.g. a device path whose
allocate finds the target's GPU pool full; so a full GPU lands the prefix in the
target's host tier at memory speed, never over TCP while both servers share the host.
"""

from __future__ import annotations

from sglang_kv_migration.targets import HostTarget
from sglang_kv_migration.wire import bodies
from sglang_kv_migration.wire.convert import build
from sglang_kv_migration.wire.messages import (
    ExtraTokenSizeReply,
    RankSessionInfo,
    SessionInfoReply,
)

DEVICE, SHARED_HOST, HOST = "device", "shared_host", "host"
PATHS = (DEVICE, SHARED_HOST, HOST)  # auto's order
SAME_HOST_PATHS = (DEVICE, SHARED_HOST)
# Where each path lands the pages on the target (`MigrationResult.landing_tier`).
LANDING_TIERS = {DEVICE: "gpu", SHARED_HOST: "host", HOST: "host"}


class NoCommonPath(ValueError):
    """No path both servers offer can move this prefix (the message says why)."""


def common_paths(source_info: SessionInfoReply, target_info: SessionInfoReply) -> list[str]:
    """Paths every rank of both servers offers, in the source's order of preference."""
    ranks = [*source_info.ranks, *target_info.ranks]
    order = list(source_info.ranks[0].paths or {HOST: {}})
    return [p for p in order if all(p in (r.paths or {HOST: {}}) for r in ranks)]


def path_order(
    requested: str | None,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> tuple[list[str], str]:
    """The paths to try in turn and why the ones auto prefers were left out ("" when
    none was); raises NoCommonPath."""
    common = common_paths(source_info, target_info)
    if requested in PATHS:
        if requested not in common:
            raise NoCommonPath(
                f"path {requested!r} is not offered by both servers (common: "
                f"{', '.join(common) or 'none'})"
            )
        return [requested], ""
    order: list[str] = []
    skipped: list[str] = []
    for name in PATHS:
        if name not in common:
            if name != HOST:
                skipped.append(f"{name} path not offered by both servers")
            continue
        reason = same_host_refusal(name, source_info, target_info, held)
        if reason:
            skipped.append(reason if name == DEVICE else f"{name} path: {reason}")
            continue
        order.append(name)
    if not order:
        raise NoCommonPath("no common data path: " + "; ".join(skipped))
    return order, "" if order[0] == DEVICE else "; ".join(skipped)


def same_host_refusal(
    path: str,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> str:
    """Why a same-host path (`SAME_HOST_PATHS`) cannot move what `held` says the
    source holds ("" when it can; other paths: always "")."""
    if path not in SAME_HOST_PATHS:
        return ""
    hosts = {r.paths[path].get("host_identity") for r in source_info.ranks}
    hosts |= {r.paths[path].get("host_identity") for r in target_info.ranks}
    if len(hosts) != 1:
        return "servers are on different hosts"
    host_only = held.matched_token_size - held.device_token_size
    # A source that reads its host pool in place (`tiers` lists "host") sends host-only
    # pages on a same-host path too; sources without that tier read device pages only.
    if host_only > 0 and not reads_host_tier(path, source_info):
        return f"source holds {host_only} of the tokens on host only (it reads device pages only)"
    return ""


def reads_host_tier(path: str, source_info: SessionInfoReply) -> bool:
    """Every source rank sends host-only pages on `path` (its `tiers` list "host")."""
    return all(HOST in r.paths[path].get("tiers", ()) for r in source_info.ranks)


def target_entry(rank: RankSessionInfo, path: str, digest: str = "") -> bodies.TargetRankBody:
    """A transfer's target rank entry without its slots and grant: where to write (a
    device destination by its digest when `digest` is given)."""
    entry = build(
        bodies.TargetRankBody,
        tp=rank.tp_rank,
        pp=rank.pp_rank,
        path=path,
        fingerprint=rank.fingerprint,
    )
    if path == DEVICE and digest:
        entry.device_kv_digest = digest
    elif path == DEVICE:
        entry.device_kv = rank.paths[DEVICE]
    elif path == SHARED_HOST:
        entry.shared_host_kv = rank.paths[SHARED_HOST]
    else:
        host = HostTarget.from_wire(rank.paths[HOST])
        entry.session_id = host.session_id
        entry.host_kv_data_ptrs = host.host_kv_data_ptrs
        entry.host_kv_data_lens = host.host_kv_data_lens
        entry.host_kv_item_lens = host.host_kv_item_lens
    return entry
