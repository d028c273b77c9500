"""What a migration returns (`MigrationResult`, with `to_dict()`) or raises
(`MigrationFailed`; `AuthFailed` when a server refused the key a call carried)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did. Sizes are tokens; timings are seconds per phase."""

    source_url: str
    target_url: str
    migration_id: str  # "" when nothing had to move
    # Page-aligned prefix the source held. Without a size query (feature
    # "partial_transfer") what the migration learnt: the target's prefix plus what moved
    # when the source held less than the request, else the whole request.
    source_held_token_size: int
    target_matched_token_size: int  # what the target already held (kept, not moved)
    migrated_token_size: int
    migrated_bytes: int
    matched_after_commit: int  # prefix the target can now serve from cache
    timings: dict[str, float] = field(default_factory=dict)
    path: str = ""  # the data path that moved the pages ("" when nothing moved)
    # Why the paths auto prefers were not (or not successfully) used.
    fallback_reason: str = ""
    copy_seconds: float = 0.0  # time the data path spent moving bytes, on the source
    # Host path, per rank: how each write was shaped ("direct", "gather", "staged") and
    # how many transfer-engine entries all ranks' writes needed together.
    plans: list[str] = field(default_factory=list)
    entries: int = 0
    # Per source rank: where its part of the transfer spent its time, ms (host path).
    transfer_steps_ms: list[dict[str, float]] = field(default_factory=list)
    # Migrations it took: more than one into a target whose device-path writes land in a
    # landing arena smaller than the prefix (--enable-memory-saver).
    rounds: int = 1
    # Per phase ("extra_token_size", "allocate", "transfer", "commit"): where its round
    # trip spent its time, ms: the server's `steps_ms` (`server/diag/trace.py`; empty from
    # servers without it) and `outside`, this client's trip less the server's route.
    steps_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # The source handed its receipts to the target's mailbox and the target committed by
    # itself (feature "source_commit"): no commit trip. The target commits before it
    # handles any request sent after this result.
    source_committed: bool = False
    # Feature "dp_ranks": the target's data-parallel rank that holds the migrated KV
    # (None: a server with one). Send the continuation there: `routed_dp_rank`.
    target_dp_rank: int | None = None
    # Where the pages landed on the target: "gpu" (device path) or "host" (its host
    # tier: the shared_host and host paths), "" when nothing moved.
    landing_tier: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class MigrationFailed(Exception):
    """A phase failed. `rolled_back` says whether the target allocation was released;
    `migration_id` is set once the target had allocated (for logs and manual clean-up)."""

    def __init__(
        self,
        phase: str,
        message: str,
        status_code: int | None = None,
        rolled_back: bool = False,
    ):
        status = f" (HTTP {status_code})" if status_code is not None else ""
        super().__init__(f"{phase} failed{status}: {message}")
        self.phase = phase
        self.message = message
        self.status_code = status_code
        self.rolled_back = rolled_back
        self.migration_id = ""
        self.reply: dict[str, Any] | None = None  # the failed call's JSON reply, if any


class AuthFailed(MigrationFailed):
    """A server refused the key a call carried (HTTP 401 or 403). Never retried: a wrong
    key does not become right by waiting. `route` is the refused route."""

    def __init__(self, phase: str, route: str, message: str, status_code: int):
        super().__init__(phase, message, status_code)
        self.route = route
