"""Builds a rank's migration side, once, from the server args and the scheduler: every
collaborator is made here and handed to the ones that use it; none is attached after
construction.

Order (every rank runs the same steps, so the start-up collectives among them, marked
*, are entered by all ranks in the same order): the rank's identity (*the server's id),
its data paths (*which every rank can serve), the source role (*every rank's
fingerprint), the handler wrapping, the target role (*whether rank 0 has a mailbox),
the session info, the loop policy, and the facade over them.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths.factory import open_paths
from sglang_kv_migration.server.diag.rank_diagnostics import RankDiagnostics
from sglang_kv_migration.server.model_identity import server_model_identity
from sglang_kv_migration.server.rank.context import RankContext
from sglang_kv_migration.server.rank.dispatch import Dispatch
from sglang_kv_migration.server.rank.identity import RankIdentity, open_identity
from sglang_kv_migration.server.rank.settings import RankSettings, settings_from_server_args
from sglang_kv_migration.server.scheduler.idle_probe import IdleProbe
from sglang_kv_migration.server.scheduler.loop import RankLoop
from sglang_kv_migration.server.scheduler.scheduler_side import MigrationSchedulerSide
from sglang_kv_migration.server.scheduler.session_info import SessionInfo
from sglang_kv_migration.server.source.build import build_source
from sglang_kv_migration.server.source.running_slots import RunningSlots
from sglang_kv_migration.server.target.build import build_target

logger = logging.getLogger(__name__)


def compose_for_scheduler(scheduler: Any) -> MigrationSchedulerSide:
    """The migration side of the rank `scheduler` runs (`--enable-kv-migration`)."""
    view = sglang_adapter.SchedulerView.of(scheduler)
    args = view.server_args
    unsupported = sglang_adapter.cache_unsupported(view.tree_cache)
    if unsupported is not None:
        raise RuntimeError(unsupported)
    model, model_name = server_model_identity(sglang_adapter.effective_server_args(args))
    ctx = RankContext(
        tree_cache=view.tree_cache,
        tp_rank=view.tp_rank,
        tp_size=view.tp_size,
        pp_rank=view.pp_rank,
        pp_size=view.pp_size,
        # Handlers gather over the stage's TP ranks; each stage replies for itself.
        cpu_group=view.tp_cpu_group,
        model=model,
        model_name=model_name,
        send_output=view.send_output,
        world_group=view.world_cpu_group,
        # Every DP rank of one launch shares the server's identity (`server_epoch`).
        launch_id=args.kv_migration_launch_id if view.dp_size > 1 else "",
        dp_rank=view.dp_rank,
    )
    settings = settings_from_server_args(
        args,
        ctx.tp_rank,
        ctx.pp_rank,
        scheduler_idle=sglang_adapter.scheduler_idle_check(scheduler),
        input_waiting=sglang_adapter.input_waiting_check(scheduler),
        running_requests=(
            sglang_adapter.running_requests_of(scheduler)
            if view.pp_size == 1 and view.dp_size == 1
            else None
        ),
    )
    return compose_rank(ctx, settings)


class _PathSite:
    """What `paths/factory.py` reads of the rank that opens a path."""

    def __init__(self, ctx: RankContext, identity: RankIdentity, landing_bytes: int):
        self.ctx = ctx
        self.layout = identity.layout
        self.landing_bytes = landing_bytes


def compose_rank(ctx: RankContext, settings: RankSettings) -> MigrationSchedulerSide:
    """Every part of one rank's migration side, from `settings` (tests and benchmarks
    that drive a rank directly call this with their own)."""
    diagnostics = RankDiagnostics.of(settings.metrics, settings.profile)
    identity = open_identity(
        ctx, settings.grant_key, settings.attn_cp_size, host_path=settings.host_path
    )
    # Memory saver: the device path's target writes land in an arena of this size.
    landing_bytes = settings.landing_bytes if settings.enable_memory_saver else 0
    paths = open_paths(
        _PathSite(ctx, identity, landing_bytes),
        settings.path_names,
        settings.transport_config,
        settings.transport,
        settings.enable_memory_saver,
    )
    probe = IdleProbe(settings.scheduler_idle, settings.input_waiting)
    running_slots = (
        RunningSlots(settings.running_requests, identity.page_size)
        if settings.running_requests is not None
        else None
    )
    transfers = build_source(
        ctx, identity, paths, diagnostics, probe.requests_waiting, running_slots
    )

    def epoch_for(req: Any) -> str:
        """Changes on a restart, a weight update and a KV memory resume."""
        return transfers.epoch_of(req.weight_version)

    dispatch = Dispatch(ctx, diagnostics.loop_timer, settings.profile)
    target = build_target(ctx, identity, paths, diagnostics, dispatch, epoch_for, settings)
    session = SessionInfo(
        ctx,
        identity,
        paths,
        epoch_for,
        features=[*target.features(), *transfers.features()],
        allocate_channel=target.allocate_channel(),
        staging=target.staging,
        running_slots=running_slots,
    )
    loop = RankLoop(ctx, identity, paths, transfers, target, diagnostics, probe, settings.yield_gil)
    logger.info(
        "KV migration ready on tp_rank=%d pp_rank=%d: paths %s, page_size=%d",
        ctx.tp_rank,
        ctx.pp_rank,
        ", ".join(paths) or "none",
        identity.page_size,
    )
    return MigrationSchedulerSide(
        identity, paths, transfers, target, session, loop, dispatch, diagnostics
    )
