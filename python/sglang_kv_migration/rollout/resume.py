"""Where the rest of a stopped request runs (steps 3 and 4 of `request_migration`):
priced by the cost model (`price`; `worth_it` for a live move's first copy), migrated
and resumed on the target (`place`), re-prefilled there or resumed on the source after a
failure (`fall_back`), or left running on the source when it never stopped
(`keep_on_source`). `resume` sends the next piece, routed to the DP rank that holds its
KV, and sets the report's stall when its first token arrives.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import httpx

from sglang_kv_migration.client.plan import predict_path
from sglang_kv_migration.client.results import MigrationFailed
from sglang_kv_migration.rollout.cost_model import CostEstimate, bytes_per_token_from_session_info
from sglang_kv_migration.rollout.dp_routing import routed_body
from sglang_kv_migration.rollout.generate_stream import PieceProgress, wall_clock
from sglang_kv_migration.rollout.move import Migrator, MoveInProgress
from sglang_kv_migration.rollout.request_types import (
    FailureTarget,
    GenerateRequest,
    MoveMode,
    MoveReport,
    SegmentKind,
)
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply

logger = logging.getLogger(__name__)


async def place(
    migrator: Migrator,
    move: MoveInProgress,
    generated: list[int],
    on_failure: FailureTarget,
    mode: MoveMode,
    path: str | None,
) -> MoveReport:
    """Price, migrate and resume the rest of the request (steps 3 and 4)."""
    handle, source_url, target_url = move.handle, move.source_url, move.target_url
    rest = handle.piece.continuation(generated)
    ids = rest.input_ids[:-1]  # SGLang computes the last token in any case
    t0 = time.perf_counter()
    if mode == "recompute":
        move.seconds["migrate"] = 0.0
        report = move.report("recomputed", target_url, len(generated))
        return resume(migrator, move, rest, target_url, "reprefill", report)
    try:
        # One size query per move: it prices the move and the migration reuses it.
        held = await migrator.servers.held_kv(source_url, ids, rest.extra_key)
        estimate = await price(migrator, source_url, target_url, ids, held, rest.extra_key, path)
        if mode == "auto" and estimate.decision == "recompute":
            move.seconds["migrate"] = time.perf_counter() - t0
            report = move.report("recomputed", target_url, len(generated), estimate=estimate)
            return resume(migrator, move, rest, target_url, "reprefill", report)
        result = await migrator.servers.migrate(
            source_url, target_url, ids, rest.extra_key, path, held
        )
    except (MigrationFailed, httpx.HTTPError) as failure:
        move.seconds["migrate"] = time.perf_counter() - t0
        return fall_back(migrator, move, generated, on_failure, str(failure))
    move.seconds["migrate"] = time.perf_counter() - t0
    report = move.report(
        "migrated", target_url, len(generated), estimate=estimate, migration=result
    )
    return resume(migrator, move, rest, target_url, "migrated", report)


async def price(
    migrator: Migrator,
    source_url: str,
    target_url: str,
    ids: list[int],
    held: ExtraTokenSizeReply,
    extra_key: str | None,
    path: str | None = None,
) -> CostEstimate:
    """The cost model's verdict on the tokens the source holds beyond the target
    (`held`: the source's size query), priced on the path the migration will take
    (`client.predict_path`); session info comes from the client's cache."""
    source_held = held.matched_token_size
    target_held = 0
    if source_held:
        on_target = await migrator.servers.held_kv(target_url, ids[:source_held], extra_key)
        target_held = on_target.matched_token_size
    tokens = max(0, source_held - target_held)
    if not tokens:
        return migrator.cost_model.estimate(0)
    source_info = await migrator.servers.session_info(source_url)
    target_info = await migrator.servers.session_info(target_url)
    chosen = predict_path(source_info, target_info, held, path) or None
    nbytes = None
    if migrator.cost_model.costs_for(chosen).bytes_per_token is None:
        nbytes = tokens * bytes_per_token_from_session_info(source_info)
    return migrator.cost_model.estimate(tokens, nbytes, path=chosen, held=held)


async def worth_it(
    migrator: Migrator,
    move: MoveInProgress,
    ids: list[int],
    held: ExtraTokenSizeReply,
    path: str | None,
) -> bool:
    """mode="auto": the cost model prices stage 1 like a whole move; a `recompute`
    verdict makes the move an ordinary one (priced again after the stop)."""
    move.estimate = await price(
        migrator, move.source_url, move.target_url, ids, held, move.handle.piece.extra_key, path
    )
    return move.estimate.decision == "migrate"


def keep_on_source(move: MoveInProgress) -> MoveReport:
    """A stage failed while decoding and ``on_failure="source"``: the request never
    stopped, so it simply keeps running there."""
    move.handle.end_move()
    generated = len(move.handle.generated_so_far())
    report = move.report("fell_back", move.source_url, generated, failure=move.failure)
    report.seconds["stall"] = 0.0
    return report


def fall_back(
    migrator: Migrator,
    move: MoveInProgress,
    generated: list[int],
    on_failure: FailureTarget,
    failure: str,
) -> MoveReport:
    """Resume by re-prefill on the target (which keeps what earlier stages moved) or
    on the source, whose cache still holds the request's KV."""
    handle = move.handle
    rest = handle.piece.continuation(generated)
    fallback = move.target_url if on_failure == "target" else move.source_url
    kind: SegmentKind = "reprefill" if on_failure == "target" else "resumed_on_source"
    logger.warning("moving %s: %s; resuming on %s", handle.request.rid, failure, fallback)
    move.seconds.setdefault("migrate", 0.0)
    report = move.report("fell_back", fallback, len(generated), failure=failure)
    return resume(migrator, move, rest, fallback, kind, report)


def resume(
    migrator: Migrator,
    move: MoveInProgress,
    rest: GenerateRequest,
    url: str,
    kind: SegmentKind,
    report: MoveReport,
) -> MoveReport:
    """Send `rest` to `url` as the handle's next piece; its first token sets the
    report's stall (from the source's last streamed token, else the stop's start).
    A migrated piece goes to the target's DP rank that holds its KV (`dp_routing.py`)."""
    if kind == "migrated" or url != move.source_url:
        migration = move.migration if kind == "migrated" else None
        dp_rank = migration.target_dp_rank if migration is not None else None
        rest = dataclasses.replace(rest, extra_body=routed_body(rest.extra_body, dp_rank))
    since = move.last_source_token or move.stop_started or time.monotonic()

    def first_token(at: float) -> None:
        report.seconds["stall"] = max(0.0, at - since)
        report.moments["first_token"] = wall_clock(at)
        if progress.sent_at is not None:
            report.moments["resume_sent"] = wall_clock(progress.sent_at)

    progress = PieceProgress(on_first_token=first_token)
    move.handle.resume_on(url, rest, kind, migrator.servers.generate(url, rest, progress), progress)
    return report
