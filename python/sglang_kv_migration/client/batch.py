"""Several migrations at once, their transfers to one source sent in one call.

`MigrationClient.migrate_many` runs one protocol generator per move
(`steps.migration_steps`, the same as `migrate`) in lock step: each round, every
unfinished move names its next HTTP call; the transfers bound for one source that lists
feature "transfer_batch" go as one `/transfer_request_kvcache` call with `moves`, every
other call as it is, and each move gets its own reply back. So a move never waits for a
trip another move does not make, and what the server shares between moves (its HTTP
parse and scheduler hop, the target's allocations on one channel, the copies) is paid
once per round instead of once per move.

A move's failure is its own: it is aborted, or falls back, as in `migrate`; the others
go on. Results come back in the order of the moves, a `MigrationFailed` where one failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_kv_migration.wire.bodies import TransferBatchBody
from sglang_kv_migration.wire.convert import build
from sglang_kv_migration.wire.features import TRANSFER_BATCH
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply

TRANSFER_ROUTE = "/transfer_request_kvcache"


@dataclass(frozen=True)
class Move:
    """One migration of `migrate_many`: the arguments of `migrate` for one prefix."""

    source_url: str
    target_url: str
    input_ids: Sequence[int]
    extra_key: str | None = None
    # The source's `/get_request_extra_token_size` reply for these ids, if asked already.
    held: ExtraTokenSizeReply | dict[str, Any] | None = None


class Call(Protocol):
    """What this module reads of a protocol step's HTTP call (`calls.Call`)."""

    url: str
    path: str
    body: Any  # a `wire.bodies` model


class Sessions(Protocol):
    def get(self, url: str) -> SessionInfoReply | None: ...


Reply = tuple[int | None, Any]  # (HTTP status or None on a connection error, JSON/text)


def lockstep(
    jobs: Sequence[Generator[Call, Reply, Any]],
    sessions: Sessions,
    failure: type[Exception],
) -> Generator[list[Call], list[Reply], list[Any]]:
    """Advance every job by one call per round; the transfers bound for one source that
    takes batches go as one call. Returns each job's value, or the `failure` it raised."""
    outcomes: list[Any] = [None] * len(jobs)
    waiting: dict[int, Call] = {}

    def advance(i: int, reply: Reply | None) -> None:
        try:
            waiting[i] = jobs[i].send(reply)
        except StopIteration as done:
            outcomes[i] = done.value
        except failure as e:
            outcomes[i] = e

    for i in range(len(jobs)):
        advance(i, None)
    while waiting:
        calls, owners = _round(waiting, sessions)
        replies = yield calls
        waiting.clear()
        for owned, reply in zip(owners, replies, strict=True):
            parts = _split(reply, len(owned)) if len(owned) > 1 else [reply]
            for i, part in zip(owned, parts, strict=True):
                advance(i, part)
    return outcomes


def _round(waiting: dict[int, Call], sessions: Sessions) -> tuple[list[Call], list[list[int]]]:
    """This round's calls, and which jobs each one answers."""
    by_source: dict[str, list[int]] = {}
    singles: list[int] = []
    for i, call in waiting.items():
        if call.path == TRANSFER_ROUTE and _takes_batches(sessions.get(call.url)):
            by_source.setdefault(call.url, []).append(i)
        else:
            singles.append(i)
    calls: list[Call] = []
    owners: list[list[int]] = []
    for owned in by_source.values():
        if len(owned) == 1:
            singles.extend(owned)
            continue
        moves = [waiting[i].body for i in owned]
        batch = build(TransferBatchBody, moves=moves)
        calls.append(dataclasses.replace(waiting[owned[0]], body=batch))
        owners.append(owned)
    for i in sorted(singles):
        calls.append(waiting[i])
        owners.append([i])
    return calls, owners


def _takes_batches(info: SessionInfoReply | None) -> bool:
    return info is not None and TRANSFER_BATCH in info.features


def _split(reply: Reply, count: int) -> list[Reply]:
    """A batch reply as each transfer's own (status, JSON); a batch that failed as a
    whole (connection error, refused body) is that failure for every transfer."""
    status, payload = reply
    moves = payload.get("moves") if isinstance(payload, dict) else None
    if status != 200 or not isinstance(moves, list) or len(moves) != count:
        return [reply] * count
    parts: list[Reply] = []
    for move in moves:
        if not isinstance(move, dict):
            parts.append((502, f"malformed batch reply entry: {move!r}"))
            continue
        move = dict(move)
        parts.append((move.pop("status_code", 200), move))
    return parts
