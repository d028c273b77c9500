"""One `move_request` in progress (`MoveInProgress`): where from and where to, its clock
and moments, the stages it ran and what the target holds after them; it builds the
move's `MoveReport`. `Migrator` is what a move's stages read of the
`AsyncRequestMigrator` that runs them: its servers and its settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglang_kv_migration.client.results import MigrationResult
from sglang_kv_migration.rollout.cost_model import CostEstimate, CostModel
from sglang_kv_migration.rollout.generate_stream import wall_clock
from sglang_kv_migration.rollout.request_handle import RequestHandle
from sglang_kv_migration.rollout.request_types import (
    MoveOutcome,
    MoveReport,
    Stage,
    StageDecision,
)
from sglang_kv_migration.rollout.server_calls import ServerCalls


class Migrator(Protocol):
    """What a move's stages read of the `AsyncRequestMigrator` (its arguments say what
    each setting means)."""

    servers: ServerCalls
    cost_model: CostModel
    eos_token_ids: frozenset[int]
    abort_retry_s: float
    abort_timeout_s: float
    live_max_stages: int
    live_stage_tokens: int
    live_max_rounds: int


@dataclass
class MoveInProgress:
    """One `move_request` in progress: where from, where to, and its clock."""

    handle: RequestHandle
    source_url: str
    target_url: str
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    live: bool = False
    # Live moves: the stages so far, what the target holds after them, the last result
    # and stage 1's estimate; `failure` names a stage that failed while decoding.
    stages: list[Stage] = field(default_factory=list)
    target_has: int = 0
    migration: MigrationResult | None = None
    estimate: CostEstimate | None = None
    failure: str = ""
    # time.monotonic() of the source's last streamed token, of the stop's start and
    # return, and of the end of the last copy while decoding.
    last_source_token: float | None = None
    stop_started: float | None = None
    stop_returned: float | None = None
    last_copy_done: float | None = None

    def add_stage(
        self,
        while_decoding: bool,
        generated: list[int],
        started: float,
        result: MigrationResult | None = None,
        decision: StageDecision = "migrate",
        failure: str = "",
    ) -> None:
        """Record the next stage (`started`: its `time.perf_counter()` start)."""
        self.stages.append(
            Stage(
                index=len(self.stages) + 1,
                while_decoding=while_decoding,
                generated=len(generated),
                held_tokens=result.source_held_token_size if result else 0,
                migrated_tokens=result.migrated_token_size if result else 0,
                seconds=time.perf_counter() - started,
                decision=decision,
                failure=failure,
                path=result.path if result else "",
            )
        )

    def copied_while_decoding(
        self, generated: list[int], started: float, result: MigrationResult
    ) -> None:
        """A stage or round before the stop moved `result`: the target holds its prefix."""
        self.target_has = result.matched_after_commit
        self.migration = result
        self.add_stage(True, generated, started, result)
        self.last_copy_done = time.monotonic()

    def failed_while_decoding(
        self, which: str, generated: list[int], started: float, failure: Exception
    ) -> None:
        """A stage or round before the stop failed (the request is still running)."""
        self.failure = f"{which} (while decoding): {failure}"
        self.add_stage(True, generated, started, decision="failed", failure=str(failure))

    def report(
        self, outcome: MoveOutcome, resumed_on: str, generated: int, **kw: Any
    ) -> MoveReport:
        self.seconds["total"] = time.perf_counter() - self.started
        if self.live:
            kw.setdefault("estimate", self.estimate)
            kw.setdefault("migration", self.migration)
            kw.update(live=True, stages=list(self.stages))
        report = MoveReport(
            rid=self.handle.request.rid,
            source_url=self.source_url,
            target_url=self.target_url,
            outcome=outcome,
            resumed_on=resumed_on,
            generated_before_move=generated,
            seconds=dict(self.seconds),
            moments=self.moments(),
            **kw,
        )
        self.handle.moves.append(report)
        return report

    def moments(self) -> dict[str, float]:
        """The move's moments so far, by `time.time()` (see `MoveReport`)."""
        stamps = {
            "stop_sent": self.stop_started,
            "last_source_token": self.last_source_token,
            "stop_returned": self.stop_returned,
            "last_copy_done": self.last_copy_done,
        }
        return {name: wall_clock(at) for name, at in stamps.items() if at is not None}
