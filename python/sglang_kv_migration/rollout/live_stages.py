"""A live move's copies from the radix tree (``move_request(live=True)``): the stages
while the request keeps decoding on the source (`copy_while_decoding`; servers that both
list "running_slots" copy from the request's own slots instead, `live_rounds.py`) and,
after the stop, the delta: what the target still lacks, migrated or left to the target
to recompute when the cost model says so (`place_delta`).
"""

from __future__ import annotations

import time

import httpx

from sglang_kv_migration.client.results import AuthFailed, MigrationFailed
from sglang_kv_migration.rollout import live_rounds
from sglang_kv_migration.rollout.move import Migrator, MoveInProgress
from sglang_kv_migration.rollout.request_types import FailureTarget, MoveMode, MoveReport
from sglang_kv_migration.rollout.resume import fall_back, resume, worth_it


async def copy_while_decoding(
    migrator: Migrator, move: MoveInProgress, mode: MoveMode, path: str | None
) -> None:
    """The stages before the stop: copy what the source holds of the request (its
    prompt, once prefilled) while it keeps decoding; another stage only while the
    source holds `live_stage_tokens` more than the target, at most `live_max_stages`.
    A failure is recorded in `move.failure` (the request is still running). Servers
    that both list "running_slots" copy from the request's own slots instead, in
    rounds (`live_rounds.py`), and fall back to this when it does not run there."""
    handle = move.handle
    if await live_rounds.both_list_running_slots(migrator, move):
        page = await migrator.servers.page_size(move.target_url)
        if await live_rounds.copy_in_rounds(migrator, move, mode, path, page) or move.failure:
            return
    t0 = time.perf_counter()
    for index in range(1, migrator.live_max_stages + 1):
        stage_t0 = time.perf_counter()
        generated = handle.generated_so_far()
        ids = (handle.piece.input_ids + generated)[:-1]
        try:
            held = await migrator.servers.held_kv(move.source_url, ids, handle.piece.extra_key)
            fresh = held.matched_token_size - move.target_has
            if fresh <= 0 or (index > 1 and fresh < migrator.live_stage_tokens):
                break
            if (
                index == 1
                and mode == "auto"
                and not await worth_it(migrator, move, ids, held, path)
            ):
                break
            result = await migrator.servers.migrate(
                move.source_url, move.target_url, ids, handle.piece.extra_key, path, held
            )
        except AuthFailed:
            raise
        except (MigrationFailed, httpx.HTTPError) as failure:
            move.failed_while_decoding(f"stage {index}", generated, stage_t0, failure)
            break
        move.copied_while_decoding(generated, stage_t0, result)
    move.seconds["live"] = time.perf_counter() - t0


async def place_delta(
    migrator: Migrator,
    move: MoveInProgress,
    generated: list[int],
    on_failure: FailureTarget,
    mode: MoveMode,
    path: str | None,
) -> MoveReport:
    """After the stop: move what the target lacks of ``(prompt + generated)[:-1]`` (the
    pages produced since the last stage; the migration tops the target up), or with
    ``mode="auto"`` let the target recompute it when the cost model says so (no
    round trips), then resume on the target."""
    handle, target_url = move.handle, move.target_url
    rest = handle.piece.continuation(generated)
    ids = rest.input_ids[:-1]
    t0 = time.perf_counter()
    index = len(move.stages) + 1
    delta = await _delta_tokens(migrator, move, len(ids))
    if delta <= 0 or (mode == "auto" and _delta_decision(migrator, move, delta) == "recompute"):
        move.add_stage(False, generated, t0, decision="recompute")
        move.seconds["migrate"] = time.perf_counter() - t0
        report = move.report("migrated", target_url, len(generated))
        return resume(migrator, move, rest, target_url, "migrated", report)
    try:
        held = await migrator.servers.held_kv(move.source_url, ids, rest.extra_key)
        result = await migrator.servers.migrate(
            move.source_url, target_url, ids, rest.extra_key, path, held
        )
    except (MigrationFailed, httpx.HTTPError) as failure:
        move.add_stage(False, generated, t0, decision="failed", failure=str(failure))
        move.seconds["migrate"] = time.perf_counter() - t0
        return fall_back(migrator, move, generated, on_failure, f"stage {index}: {failure}")
    move.seconds["migrate"] = time.perf_counter() - t0
    move.migration = result
    move.add_stage(False, generated, t0, result)
    report = move.report("migrated", target_url, len(generated))
    return resume(migrator, move, rest, target_url, "migrated", report)


async def _delta_tokens(migrator: Migrator, move: MoveInProgress, length: int) -> int:
    """Page-aligned tokens of a `length`-token prefix the target lacks after the
    stages (page size from the target's session info, which is cached)."""
    page = await migrator.servers.page_size(move.target_url)
    return length // page * page - move.target_has


def _delta_decision(migrator: Migrator, move: MoveInProgress, delta: int) -> str:
    """The cost model's verdict on the delta, priced from what stage 1 moved (bytes
    per token, path) without asking the servers anything."""
    result = move.migration
    per_token = None
    if result is not None and result.migrated_token_size:
        per_token = result.migrated_bytes / result.migrated_token_size
    path = result.path if result is not None else None
    try:
        nbytes = round(delta * per_token) if per_token else None
        return migrator.cost_model.estimate(delta, nbytes, path=path or None).decision
    except ValueError:  # bytes unknown: migrate, as the caller asked for a live move
        return "migrate"
