"""One rank's diagnostics: its metrics, the loop timer that charges scheduler time to
migrations, the optional profile (`SGLANG_KV_MIGRATION_PROFILE_DIR`, `profiling.py`) and
the log lines kept back until the rank is idle (`deferred_log.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_kv_migration.server.diag.deferred_log import DeferredLog
from sglang_kv_migration.server.diag.metrics import LoopTimer, MigrationMetrics, NullMetrics
from sglang_kv_migration.server.diag.profiling import RankProfile


@dataclass
class RankDiagnostics:
    metrics: MigrationMetrics  # `NullMetrics` without --enable-metrics
    loop_timer: LoopTimer
    profile: RankProfile | None = None
    # One list of kept-back log lines for the source and the target parts.
    log_later: DeferredLog = field(default_factory=DeferredLog)

    @classmethod
    def of(cls, metrics: MigrationMetrics | None, profile: RankProfile | None) -> RankDiagnostics:
        """None: no metrics (without --enable-metrics)."""
        metrics = metrics or NullMetrics()
        return cls(metrics, LoopTimer(metrics), profile)
