"""A live move's copies from the running request's own slots (feature "running_slots").

SGLang 0.5.12 adds nothing to the radix tree while a request decodes, so a live move
that copies only what the tree holds moves the prompt and leaves every generated token
to the stop. When both servers list "running_slots", the move copies instead, while the
request keeps decoding, what the source's running request holds in its own slots
(prompt + output so far, whole pages): round after round, each moving what was
generated during the one before, until at most one page remains. Then the request
stops and the tail moves (or is recomputed) as in any live move.

Fallbacks, each to today's behaviour: a server without the feature, or a request that
does not run on the source when the first round asks (still queued, finished, unknown
rid), copies from the tree (`live_stages.copy_while_decoding`); a round refused because
the request finished or was aborted meanwhile ends the rounds, and the stop follows.
"""

from __future__ import annotations

import dataclasses
import time

import httpx

from sglang_kv_migration.client.results import AuthFailed, MigrationFailed
from sglang_kv_migration.rollout.move import Migrator, MoveInProgress
from sglang_kv_migration.rollout.resume import worth_it
from sglang_kv_migration.wire.features import RUNNING_SLOTS
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply


async def both_list_running_slots(migrator: Migrator, move: MoveInProgress) -> bool:
    """Whether source and target both list "running_slots" (cached session info)."""
    try:
        infos = [await migrator.servers.session_info(u) for u in (move.source_url, move.target_url)]
    except (MigrationFailed, httpx.HTTPError):
        return False
    return all(RUNNING_SLOTS in info.features for info in infos)


async def copy_in_rounds(
    migrator: Migrator, move: MoveInProgress, mode: str, path: str | None, page: int
) -> bool:
    """The rounds while decoding (module docstring). False when the first round found
    no running request to read (the caller copies from the tree instead); a failure is
    recorded in `move.failure` (the request is still running)."""
    handle = move.handle
    t0 = time.perf_counter()
    for index in range(1, migrator.live_max_rounds + 1):
        stage_t0 = time.perf_counter()
        generated = handle.generated_so_far()
        ids = (handle.piece.input_ids + generated)[:-1]
        extra_key = handle.piece.extra_key
        try:
            held = await migrator.servers.held_kv(
                move.source_url, ids, extra_key, running_rid=handle.rid
            )
            running = held.running_token_size
            if not isinstance(running, int) or running < 0:
                break  # not running there (queued, finished, unknown): see the return
            if running - move.target_has < page:
                break  # nothing whole to copy yet
            if (
                index == 1
                and mode == "auto"
                and not await worth_it(migrator, move, ids[:running], _as_held(held, running), path)
            ):
                break
            result = await migrator.servers.migrate(
                move.source_url,
                move.target_url,
                ids[:running],
                extra_key,
                path,
                _as_held(held, running),
                running_rid=handle.rid,
            )
        except AuthFailed:
            raise
        except (MigrationFailed, httpx.HTTPError) as failure:
            if _request_left(failure):
                break  # finished or aborted since the query: the stop finds out which
            move.failed_while_decoding(f"round {index}", generated, stage_t0, failure)
            break
        move.copied_while_decoding(generated, stage_t0, result)
        # What was generated during this round: another round unless one page is left.
        now = len(handle.piece.input_ids) + len(handle.generated_so_far()) - 1
        if now - now % page - move.target_has <= page:
            break
    move.seconds["live"] = time.perf_counter() - t0
    return bool(move.stages)


def _as_held(held: ExtraTokenSizeReply, running: int) -> ExtraTokenSizeReply:
    """The size query as `migrate` reads it: the running request's slots, on device."""
    return dataclasses.replace(held, matched_token_size=running, device_token_size=running)


def _request_left(failure: Exception) -> bool:
    """A transfer refused because the running request is gone (CONFLICT naming
    `running_rid`), not because the move failed."""
    reply = getattr(failure, "reply", None) or {}
    message = str(reply.get("message", "")) or str(failure)
    return "running_rid" in message and "does not run" in message
