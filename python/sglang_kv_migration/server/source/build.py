"""The source role of one rank, as `server/scheduler/compose.py` builds it: its transfers, with
what a single-rank source has besides (the target's allocate, feature "source_allocate":
`target_asks.py`; device destinations named by digest, feature "destination_digest")
and the mailbox it delivers commits to (feature "source_commit")."""

from __future__ import annotations

import functools
from collections.abc import Callable

from sglang_kv_migration.paths.base import DataPath
from sglang_kv_migration.server.diag.rank_diagnostics import RankDiagnostics
from sglang_kv_migration.server.rank.context import RankContext
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.same_host.allocate_channel import ChannelCaller
from sglang_kv_migration.server.same_host.mailbox import Deliverer
from sglang_kv_migration.server.source.known_destinations import KnownDestinations
from sglang_kv_migration.server.source.owned_pages import run_pattern
from sglang_kv_migration.server.source.running_slots import RunningSlots
from sglang_kv_migration.server.source.target_asks import TargetAsks
from sglang_kv_migration.server.source.transfers import SourceTransfers
from sglang_kv_migration.server.source.validation import TransferChecks


def build_source(
    ctx: RankContext,
    identity: RankIdentity,
    paths: dict[str, DataPath],
    diagnostics: RankDiagnostics,
    requests_waiting: Callable[[], bool],
    running_slots: RunningSlots | None = None,
) -> SourceTransfers:
    """One start-up collective over every rank (their fingerprints, for stage 0's checks
    of later stages' entries)."""
    single_rank = ctx.tp_size == 1 and ctx.pp_size == 1
    # Moves sent together ask their targets before any is prepared: only a source that
    # asks through the channel has prepares to leave for later.
    asks = (
        TargetAsks(ChannelCaller(), lambda: transfers.paths, requests_waiting)
        if single_rank
        else None
    )
    destinations = KnownDestinations() if single_rank else None
    deliverer = Deliverer()
    owner_pattern = None
    if identity.cp_owners is not None:
        # Owner-sharded CP: each rank sends only the pages it owns (`owned_pages.py`).
        owner_pattern = functools.partial(run_pattern, ctx.tree_cache, identity.cp_owners)
    checks = TransferChecks(
        ctx,
        identity.fingerprint,
        {(fp.tp_rank, fp.pp_rank): fp for fp in ctx.all_gather_world(identity.fingerprint)},
        paths,
        identity.signer,
        identity.server_epoch,
        identity.num_slots,
        destinations,
        delivers=True,
        running_slots=running_slots,
        owner_pattern=owner_pattern,
        cp_rank=identity.cp_rank,
    )
    transfers = SourceTransfers(
        ctx,
        checks,
        diagnostics.metrics,
        deliverer=deliverer,
        asks=asks,
        log_later=diagnostics.log_later,
    )
    return transfers
