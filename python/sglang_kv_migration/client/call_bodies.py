"""The calls that move the pages, built from a `Plan`: the target's allocate
(`allocate_call`), the source's transfer into what the target allocated
(`transfer_call`) and the transfer that allocates on the target first
(`one_trip_call`, feature "source_allocate"), with each target rank's entry: where to
write, its slots and its grant."""

from __future__ import annotations

from typing import TypeVar

from sglang_kv_migration.client.calls import ALLOCATE, TRANSFER_ROUTE, Call, with_ids
from sglang_kv_migration.client.path_choice import HOST, target_entry
from sglang_kv_migration.client.plan import Plan, both_list
from sglang_kv_migration.wire import bodies
from sglang_kv_migration.wire.convert import build
from sglang_kv_migration.wire.features import (
    BOUND_GRANTS,
    EPOCH_CHECK,
    PAGE_RANGES,
    SOURCE_COMMIT,
    SOURCE_DP_RANK,
)
from sglang_kv_migration.wire.messages import AllocateReply, RankSessionInfo, SessionInfoReply

A = TypeVar("A", bound=bodies.AllocateFields)


def _allocate_fields(plan: Plan, path: str, model: type[A]) -> A:
    """The allocate's fields but its ids: reserve slots on the target for what it lacks
    of the prefix, on `path`."""
    infos = (plan.source_info, plan.target_info)
    body = build(
        model,
        extra_key=plan.extra_key,
        source_fingerprints=[r.fingerprint for r in plan.source_info.ranks],
        path=path,
        index_format=_index_format(plan),
        nothing_ok=True,
    )
    # Each only where the target understands it (older ones refuse unknown fields).
    if BOUND_GRANTS in plan.target_info.features:
        # Name the source, so only it may use the grant.
        body.source_instance = plan.source_info.instance_id
    if plan.source_dp_rank is not None and SOURCE_DP_RANK in plan.target_info.features:
        # Name the source's DP rank too: only its scheduler claims the grants, and the
        # target takes receipts naming them from no other. (An allocate the source
        # forwards has no such field: only single-rank sources forward one.)
        if isinstance(body, bodies.AllocateBody):
            body.source_dp_rank = plan.source_dp_rank
    if _can_stage(plan, path):
        body.staging = True
    if plan.verify:
        body.verify = True
    if plan.page_owners is not None:
        # One owner per page of the ids this allocate sends (a round sends a prefix).
        body.page_owners = plan.page_owners[: len(plan.prefix) // _page_size(plan)]
    if both_list(*infos, SOURCE_COMMIT):
        body.source_commit = True
    if EPOCH_CHECK in plan.target_info.features:
        # A target whose epoch moved on since its info was read refuses before it
        # reserves anything (slots granted to a stale plan would be aborted unused and
        # sit out their write window: in a small landing arena, room the retry needs).
        body.expect_epoch = plan.target_info.server_epoch
    return body


def allocate_call(plan: Plan, path: str) -> Call:
    """Reserve slots on the target for what it lacks of the prefix, on `path`."""
    body = _allocate_fields(plan, path, bodies.AllocateBody)
    with_ids(body, plan.target_info, plan.prefix, plan.encoded)
    return Call(ALLOCATE, plan.target_url, "/allocate_token_for_transfer", body)


def one_trip_call(plan: Plan, path: str, digest: str = "") -> Call:
    """The transfer that allocates on the target first (`source_allocates`): the
    allocate's fields ride along, the source adds the transfer's ids."""
    # The channel is a free-form object of the target's session info.
    channel = plan.target_info.allocate_channel
    body = build(
        bodies.TransferBody,
        extra_key=plan.extra_key,
        target_per_rank=[target_entry(plan.target_info.ranks[0], path, digest)],
        allocate_on_target=build(
            bodies.AllocateOnTargetBody,
            address=channel["address"],
            secret=channel["secret"],
            allocate=_allocate_fields(plan, path, bodies.AllocateFields),
        ),
    )
    with_ids(body, plan.source_info, plan.prefix, plan.encoded)
    if plan.partial:
        body.partial_ok = True
    if plan.running_rid:
        body.running_rid = plan.running_rid
    return Call("transfer", plan.source_url, TRANSFER_ROUTE, body)


def transfer_call(plan: Plan, allocation: AllocateReply, path: str, digest: str = "") -> Call:
    """Ask the source to write the pages the target allocated (`allocation`); `digest`
    names the one device destination by its digest instead (`steps._transfer_step`)."""
    body = build(
        bodies.TransferBody,
        extra_key=plan.extra_key,
        matched_token_size=allocation.matched_token_size,
        extra_token_size=allocation.extra_token_size,
        migration_id=allocation.migration_id,
        target_per_rank=_targets(plan.target_info, allocation, path, digest),
    )
    with_ids(body, plan.source_info, plan.prefix, plan.encoded)
    if plan.partial:
        body.partial_ok = True
    if plan.source_dp_rank is not None:
        body.dp_rank = plan.source_dp_rank
    if plan.running_rid:
        body.running_rid = plan.running_rid
    return Call("transfer", plan.source_url, TRANSFER_ROUTE, body)


def _targets(
    target_info: SessionInfoReply, allocation: AllocateReply, path: str, digest: str = ""
) -> list[bodies.TargetRankBody]:
    slots = {(r.tp_rank, r.pp_rank): r for r in allocation.ranks}
    entries = []
    for rank in _dp_rank_ranks(target_info, allocation.dp_rank):
        granted = slots[(rank.tp_rank, rank.pp_rank)]
        entry = target_entry(rank, path, digest)
        entry.grant = granted.grant
        # Runs when the target sent them (both servers speak "page_ranges"), else pages.
        if granted.kv_page_ranges:
            entry.kv_page_ranges = granted.kv_page_ranges
        else:
            entry.kv_pages = granted.kv_pages
        if granted.staging:
            entry.staging = granted.staging
        entries.append(entry)
    return entries


def _dp_rank_ranks(info: SessionInfoReply, dp_rank: int | None) -> list[RankSessionInfo]:
    """The ranks of session info `info` that belong to DP rank `dp_rank` (feature
    "dp_ranks"; all of them for None, a server with one DP rank)."""
    if dp_rank is None:
        return info.ranks
    return [r for r in info.ranks if r.dp_rank == dp_rank]


def _index_format(plan: Plan) -> str:
    """How the target should list its slots: as `[first_page, count]` runs when both
    servers understand them (a fresh pool gives one run where a page list has one id
    per page), else as page ids."""
    return "ranges" if both_list(plan.source_info, plan.target_info, PAGE_RANGES) else "pages"


def _can_stage(plan: Plan, path: str) -> bool:
    """Ask the target for staging extents only when every source rank can write them and
    every target rank has an arena (servers without either never see the field)."""
    if path != HOST:
        return False
    sources, targets = plan.source_info.ranks, plan.target_info.ranks
    return all(r.stage_writer for r in sources) and all(r.staging_region for r in targets)


def _page_size(plan: Plan) -> int:
    return plan.source_info.ranks[0].page_size
