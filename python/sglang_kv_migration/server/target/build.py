"""The target role of one rank, as `server/scheduler/compose.py` builds it: the host path's staging
arena, the pending migrations (which give extents and mailbox slots back), commits,
the mailbox of same-host sources, allocations, and on a single-rank server the
allocate channel."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths import factory as path_factory
from sglang_kv_migration.paths.base import HOST, DataPath, TargetStaging
from sglang_kv_migration.server.diag.rank_diagnostics import RankDiagnostics
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext
from sglang_kv_migration.server.rank.dispatch import Dispatch
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.rank.settings import RankSettings
from sglang_kv_migration.server.target.allocations import TargetAllocations
from sglang_kv_migration.server.target.channel_allocations import open_channel_allocations
from sglang_kv_migration.server.target.commits import Commits
from sglang_kv_migration.server.target.mailbox_commits import SourceCommits
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.server.target.role import TargetRole

logger = logging.getLogger(__name__)


def build_target(
    ctx: RankContext,
    identity: RankIdentity,
    paths: dict[str, DataPath],
    diagnostics: RankDiagnostics,
    dispatch: Dispatch,
    epoch_for: Callable[[Any], str],
    settings: RankSettings,
) -> TargetRole:
    """One start-up collective over every rank (whether rank 0 has a mailbox)."""
    metrics = diagnostics.metrics
    staging = open_staging(ctx, identity, paths, settings.staging_bytes)
    pending = PendingMigrations(
        ctx.tree_cache,
        settings.watchdog_timeout_s,
        release_staging=staging.release if staging is not None else None,
        # (only rank 0's migrations hold a mailbox slot, and only with a mailbox open)
        release_mailbox=lambda slot, not_before: source_commits.give_back(slot, not_before),
    )
    commits = Commits(
        ctx,
        pending,
        identity.signer,
        metrics,
        staging,
        identity.bytes_per_token,
        dispatch.reply_later,
        log_later=diagnostics.log_later,
    )
    # Feature "source_commit": same-host sources hand their receipts to the mailbox.
    source_commits = SourceCommits(
        ctx, pending, commits, metrics, sglang_adapter.weight_update_types()
    )
    allocations = TargetAllocations(
        ctx,
        identity,
        paths,
        pending,
        source_commits,
        metrics,
        epoch_for,
        grant_ttl_s=settings.grant_ttl_s,
        verify_all=settings.verify,
        staging=staging,
    )
    channel = open_channel_allocations(
        ctx.tp_size == 1 and ctx.pp_size == 1,
        path_factory.host_identity,
        sglang_adapter.weight_update_types(),
        dispatch.dispatched(
            dispatch.answering(allocations.allocate_token_for_transfer),
            AllocateTokenForTransferReqOutput,
        ),
    )
    return TargetRole(ctx, metrics, pending, commits, source_commits, allocations, channel, staging)


def open_staging(
    ctx: RankContext, identity: RankIdentity, paths: dict[str, DataPath], nbytes: int
) -> TargetStaging | None:
    """The staging arena of the host path's target role (None: staging off)."""
    if nbytes <= 0 or HOST not in paths:
        return None
    layout = identity.layout
    assert layout is not None, "the host path is on: its layout was built"
    if ctx.pp_size > 1:
        # A staged commit answers later, but PP stages agree through the request as it
        # passes (`pp_stages.py`): a scatter failing on stage 0 could not stop a later
        # stage that already inserted. Direct writes only under PP.
        logger.info("KV migration staging is off under PP (--pp-size > 1)")
        return None
    return path_factory.open_staging(paths[HOST], layout, nbytes)
