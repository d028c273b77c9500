"""Prometheus metrics of migrations, exported with SGLang's own (`--enable-metrics`).

SGLang sets `PROMETHEUS_MULTIPROC_DIR` before its processes start and serves every
process's metrics on `/metrics`; metrics created here in a scheduler process land there
the same way SGLang's scheduler metrics do. Names follow SGLang's `sglang:` prefix:

- `sglang:kv_migration_total{role, outcome}` — migrations by outcome. Target outcomes:
  `allocated`, `allocate_failed`, `committed`, `commit_failed`, `verify_failed` (a
  `verify` digest mismatch), `aborted`, `expired`;
  source outcomes: `sent`, `send_failed`.
- `sglang:kv_migration_tokens_total{role}` / `sglang:kv_migration_bytes_total{role}` —
  tokens and bytes sent (source) or committed (target) by this rank.
- `sglang:kv_migration_phase_seconds{phase}` — `allocate` (target handler), `transfer`
  (source, submit to completion on every rank), `commit` (target handler) and `pending`
  (target, allocate to commit).
- `sglang:kv_migration_scheduler_seconds` — per scheduler loop iteration in which our code
  had work (a handler ran, or anything was in flight or pending): the time our handlers
  and our per-iteration poll spent on the scheduler thread (`LoopTimer`). The issue's
  "source loop never blocked more than 1 ms by a migration" reads off its buckets.

Every series also carries `model_name`, `tp_rank` and `pp_rank`, like SGLang's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

LABELS = ("model_name", "tp_rank", "pp_rank")
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOOP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1)

# Prometheus refuses to register one name twice in a process: create them once.
_FAMILIES: dict[str, Any] | None = None


class MigrationMetrics:
    """Records one rank's migration events; `None`-safe wrapper lives in the caller."""

    def __init__(self, model_name: str, tp_rank: int, pp_rank: int):
        families = _families()
        self._labels = {"model_name": model_name, "tp_rank": str(tp_rank), "pp_rank": str(pp_rank)}
        self._total = families["total"]
        self._tokens = families["tokens"]
        self._bytes = families["bytes"]
        self._phase = families["phase"]
        self._loop = families["loop"]

    def outcome(self, role: str, outcome: str) -> None:
        self._total.labels(**self._labels, role=role, outcome=outcome).inc()

    def moved(self, role: str, tokens: int, nbytes: int) -> None:
        self._tokens.labels(**self._labels, role=role).inc(tokens)
        self._bytes.labels(**self._labels, role=role).inc(nbytes)

    def phase(self, phase: str, seconds: float) -> None:
        self._phase.labels(**self._labels, phase=phase).observe(seconds)

    def scheduler_time(self, seconds: float) -> None:
        self._loop.labels(**self._labels).observe(seconds)


class LoopTimer:
    """Time our code spends on the scheduler thread, summed per loop iteration.

    Handlers are wrapped with `timed` (they run when the iteration dispatches requests);
    `end_iteration` is called at the end of the per-iteration poll, which runs after the
    dispatch, and records the iteration's total. `max_s` and `iterations` are kept in
    process for benchmarks and tests; the histogram is exported.
    """

    def __init__(self, metrics: MigrationMetrics):
        self._metrics = metrics
        self._spent = 0.0
        self.max_s = 0.0
        self.iterations = 0  # iterations recorded (ours had work)

    def timed(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(req: Any) -> Any:
            started = time.perf_counter()
            try:
                return handler(req)
            finally:
                self._spent += time.perf_counter() - started

        return run

    def end_iteration(self, poll_s: float, active: bool) -> None:
        spent, self._spent = self._spent + poll_s, 0.0
        if not active and spent == poll_s:  # idle: nothing of ours ran but the empty poll
            return
        self.iterations += 1
        self.max_s = max(self.max_s, spent)
        self._metrics.scheduler_time(spent)


def _families() -> dict[str, Any]:
    global _FAMILIES
    if _FAMILIES is None:
        # Imported late, after SGLang has set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Histogram

        _FAMILIES = {
            "total": Counter(
                "sglang:kv_migration_total",
                "KV-cache migrations by role and outcome.",
                labelnames=(*LABELS, "role", "outcome"),
            ),
            "tokens": Counter(
                "sglang:kv_migration_tokens_total",
                "Tokens of KV cache sent (source) or committed (target).",
                labelnames=(*LABELS, "role"),
            ),
            "bytes": Counter(
                "sglang:kv_migration_bytes_total",
                "Bytes of KV cache sent (source) or committed (target) by this rank.",
                labelnames=(*LABELS, "role"),
            ),
            "phase": Histogram(
                "sglang:kv_migration_phase_seconds",
                "Latency of migration phases on this rank.",
                labelnames=(*LABELS, "phase"),
                buckets=PHASE_BUCKETS,
            ),
            "loop": Histogram(
                "sglang:kv_migration_scheduler_seconds",
                "Time migration code spent on the scheduler thread per loop iteration "
                "(iterations where it had work).",
                labelnames=LABELS,
                buckets=LOOP_BUCKETS,
            ),
        }
    return _FAMILIES


class NullMetrics(MigrationMetrics):
    """Used when `--enable-metrics` is off: records nothing, registers nothing."""

    def __init__(self) -> None:
        pass

    def outcome(self, role: str, outcome: str) -> None:
        pass

    def moved(self, role: str, tokens: int, nbytes: int) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        pass

    def scheduler_time(self, seconds: float) -> None:
        pass
