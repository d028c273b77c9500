"""What one migration attempt knows before it moves anything (`Plan`), and what it
decides from the two servers' session info alone: the data paths it tries in turn
(`paths_to_try`, from `path_choice.py`; the first priced ahead by `predict_path`),
whether the size query can be skipped (`partial_ok`), whether the source allocates on
the target itself (`source_allocates`) and whether the allocate must carry the source's
page owners (`owner_sharded`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_kv_migration.client.path_choice import (
    PATHS,
    SAME_HOST_PATHS,
    NoCommonPath,
    common_paths,
    path_order,
    reads_host_tier,
)
from sglang_kv_migration.client.results import MigrationFailed
from sglang_kv_migration.client.sessions import SessionCache
from sglang_kv_migration.fingerprint import CP_SHARDED, LayoutFingerprint
from sglang_kv_migration.wire.features import (
    OWNER_PATTERN,
    PARTIAL_TRANSFER,
    SOURCE_ALLOCATE,
    SOURCE_DP_RANK,
)
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply


@dataclass
class Plan:
    """What one attempt knows before it moves anything."""

    source_url: str
    target_url: str
    extra_key: str | None
    source_info: SessionInfoReply
    target_info: SessionInfoReply
    prefix: list[int]  # the page-aligned prefix the source holds
    timings: dict[str, float]
    verify: bool = False  # the target checks a digest of what landed before inserting
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # per phase, ms
    # No size query was made: `prefix` is the whole page-aligned request and the source
    # sends what it holds of it (feature "partial_transfer").
    partial: bool = False
    # The prefix's ids as `binary_ids` text, by length (allocate and transfer send the
    # same ids: encoded once); None where they cannot be sent so.
    encoded: dict[int, str | None] = field(default_factory=dict)
    sessions: SessionCache | None = None  # what sources know (feature "destination_digest")
    # Feature "dp_ranks": the source's DP rank holding the prefix, from its size query
    # (None: not asked; the source finds it itself).
    source_dp_rank: int | None = None
    # Feature "running_slots": the running request whose own slots the source reads.
    running_rid: str = ""
    # Feature "owner_pattern": an owner-sharded source's owner of each page of `prefix`
    # (its size query's), passed to the target's allocate; None for other sources.
    page_owners: list[int] | None = None


def check_path(path: str | None) -> None:
    if path not in (None, "auto", *PATHS):
        raise ValueError(f"path must be one of auto, {', '.join(PATHS)}; got {path!r}")


def partial_ok(
    requested: str | None, source_info: SessionInfoReply, target_info: SessionInfoReply
) -> bool:
    """Skip the source's size query: both servers take partial transfers, the path
    does not depend on where the source holds the pages (a source whose device path
    reads only its GPU would need the query to fall back to the host path up front),
    and the grants need not name a DP rank of the source (feature "source_dp_rank")."""
    if not both_list(source_info, target_info, PARTIAL_TRANSFER):
        return False
    if source_info.dp_size > 1 and SOURCE_DP_RANK in target_info.features:
        # Ask which DP rank of the source holds the prefix: the grants then name it.
        return False
    if requested in PATHS:
        return True
    common = common_paths(source_info, target_info)
    return all(reads_host_tier(p, source_info) for p in SAME_HOST_PATHS if p in common)


def source_allocates(plan: Plan, path: str) -> bool:
    """Feature "source_allocate": both servers list it, each is a single rank, and they
    share a host (the target's channel is a local socket)."""
    source, target = plan.source_info, plan.target_info
    if not both_list(source, target, SOURCE_ALLOCATE):
        return False
    if len(source.ranks) != 1 or len(target.ranks) != 1:
        return False
    channels = source.allocate_channel or {}, target.allocate_channel or {}
    return bool(channels[1].get("address")) and channels[0].get("host") == channels[1].get("host")


def paths_to_try(
    requested: str | None,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> tuple[list[str], str]:
    """`path_choice.path_order`, its refusal a failed migration."""
    try:
        return path_order(requested, source_info, target_info, held)
    except NoCommonPath as e:
        raise MigrationFailed("session_info", str(e)) from None


def choose_path(
    requested: str | None,
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
) -> tuple[str, str]:
    """(the path tried first, why the ones auto prefers were left out: "" if none was)."""
    order, reason = paths_to_try(requested, source_info, target_info, held)
    return order[0], reason


def predict_path(
    source_info: SessionInfoReply,
    target_info: SessionInfoReply,
    held: ExtraTokenSizeReply,
    requested: str | None = None,
) -> str:
    """The path `migrate` will try first for what the source holds (`held`: its
    `/get_request_extra_token_size` reply), "" when the servers share none. For pricing
    a move before it is made (`request_migration`, `rebalancer`)."""
    try:
        return choose_path(requested, source_info, target_info, held)[0]
    except MigrationFailed:
        return ""


def both_list(source_info: SessionInfoReply, target_info: SessionInfoReply, feature: str) -> bool:
    """Both servers' session info lists `feature`."""
    return feature in source_info.features and feature in target_info.features


def owner_sharded(source_info: SessionInfoReply, target_info: SessionInfoReply) -> bool:
    """The source's CP ranks own disjoint pages (its fingerprint says so; the target's
    agrees, `sessions._check_compatible`): the allocate must carry its owner pattern
    (feature "owner_pattern"), which both servers must understand."""
    fingerprint = LayoutFingerprint.from_dict(source_info.ranks[0].fingerprint)
    if fingerprint.attn_cp_mode != CP_SHARDED:
        return False
    for name, info in (("source", source_info), ("target", target_info)):
        if OWNER_PATTERN not in info.features:
            raise MigrationFailed(
                "session_info",
                f"the source's CP ranks own disjoint pages (cp_owner={fingerprint.cp_owner}), "
                f"which needs page_owners on the allocate; the {name} does not list "
                f"{OWNER_PATTERN!r}",
            )
    return True
