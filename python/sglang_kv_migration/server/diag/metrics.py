"""Prometheus metrics of migrations, exported with SGLang's own (`--enable-metrics`).

SGLang sets `PROMETHEUS_MULTIPROC_DIR` before its processes start and serves every
process's metrics on `/metrics`; metrics created here in a scheduler process land there
the same way SGLang's scheduler metrics do. Names follow SGLang's `sglang:` prefix:

- `sglang:kv_migration_total{role, outcome}` — migrations by the moment they reached
  (`wire.moments.Moment`, the names records, state machines and logs use). Target
  outcomes: `allocated`, `allocate_failed`, `committed`, `commit_failed`, `verify_failed`
  (a `verify` digest mismatch), `aborted`, `expired`, `weights_changed` (new weights
  dropped a migration waiting for its source's commit); source outcomes: `sent`,
  `send_failed`.
- `sglang:kv_migration_tokens_total{role}` / `sglang:kv_migration_bytes_total{role}` —
  tokens and bytes sent (source) or committed (target) by this rank.
- `sglang:kv_migration_phase_seconds{phase}` — `wire.moments.Phase`: `allocate` (target
  handler), `transfer` (source, submit to completion on every rank), `commit` (target
  handler) and `pending` (target, allocate to commit).
- `sglang:kv_migration_scheduler_seconds` — per scheduler loop iteration in which our code
  had work (a handler ran, or anything was in flight or pending): the time our handlers
  and our per-iteration poll spent on the scheduler thread (`LoopTimer`). The target
  "source loop never blocked more than 1 ms by a migration" reads off its buckets.
- `sglang:kv_migration_poll_seconds_total` / `sglang:kv_migration_poll_iterations_total`
  — the same time summed over every iteration in which anything of ours was in flight,
  pending or handled, and every iteration (idle ones, whose poll returns at once, are
  counted, not timed: `benchmark/bench_idle_poll.py` measures what they cost).

- `sglang:kv_migration_route_bytes_total{path, route}` /
  `sglang:kv_migration_route_seconds_total{path, route}` — source, per successful send:
  the bytes this rank moved on each route (`paths.base.ROUTE_NAMES`: `gpu_to_gpu`,
  `host_to_gpu`, `landing`, `host_to_host`) and the time moving them took (the device
  path's per-tier copy events, the host path's wire time): each route's rate. One-offs
  are no sample, their time counts as fixed: a device-path copy that is the first into
  a kept peer mapping, or the first of its tier in the process (its kernel compiles).
- `sglang:kv_migration_fixed_seconds{path}` — source, per successful send: the transfer
  phase minus the routes' time (opening the peer, pinning, planning, queueing, polling):
  the source's part of a migration's fixed cost on that path. The cost model
  (`rollout/cost_model.py`) learns each route's rate and fixed cost from these three.

Every series also carries `model_name`, `tp_rank` and `pp_rank`, like SGLang's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from sglang_kv_migration.wire.moments import Moment, Phase

LABELS = ("model_name", "tp_rank", "pp_rank")
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOOP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1)
ACCOUNT_FLUSH_S = 1.0  # how often `LoopTimer` adds its every-iteration account to /metrics
IDLE_FLUSH_ITERATIONS = 1 << 16  # idle iterations counted between two exports

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
        self._poll_seconds = families["poll_seconds"]
        self._poll_iterations = families["poll_iterations"]
        self._route_bytes = families["route_bytes"]
        self._route_seconds = families["route_seconds"]
        self._fixed = families["fixed"]

    def outcome(self, role: str, moment: Moment) -> None:
        self._total.labels(**self._labels, role=role, outcome=moment.value).inc()

    def moved(self, role: str, tokens: int, nbytes: int) -> None:
        self._tokens.labels(**self._labels, role=role).inc(tokens)
        self._bytes.labels(**self._labels, role=role).inc(nbytes)

    def phase(self, phase: Phase, seconds: float) -> None:
        self._phase.labels(**self._labels, phase=phase.value).observe(seconds)

    def routes(
        self, path: str, routes: Mapping[str, tuple[int, float]], fixed_seconds: float
    ) -> None:
        """One successful send on `path`: (bytes, seconds) per route, and the rest."""
        for route, (nbytes, seconds) in routes.items():
            self._route_bytes.labels(**self._labels, path=path, route=route).inc(nbytes)
            self._route_seconds.labels(**self._labels, path=path, route=route).inc(seconds)
        self._fixed.labels(**self._labels, path=path).observe(fixed_seconds)

    def scheduler_time(self, seconds: float) -> None:
        self._loop.labels(**self._labels).observe(seconds)

    def poll_account(self, seconds: float, iterations: int) -> None:
        self._poll_seconds.labels(**self._labels).inc(seconds)
        self._poll_iterations.labels(**self._labels).inc(iterations)


class LoopTimer:
    """Time our code spends on the scheduler thread, summed per loop iteration, by part.

    Handlers are wrapped with `timed` (they run when the iteration dispatches requests)
    and charge their time to the request type's name. The per-iteration poll, which runs
    after the dispatch, calls `begin_poll`, then `lap(name)` after each of its steps
    (charging the time since the previous stamp to that step), and `end_iteration` last,
    which charges the rest to `poll` and records the iteration's total: the sum of its
    parts. `max_s`, `worst_parts` (the parts of the iteration that set `max_s`) and
    `iterations` are kept in process for benchmarks and tests; only the total is
    exported (the histogram). Cost: two `perf_counter` calls per handler and per poll
    step, and a dict of a few entries per iteration.

    Benchmarks can ask for more (`diagnose`): per part, the thread's CPU time and its
    voluntary / involuntary context switches (wall minus CPU is time off the CPU: with
    involuntary switches the OS preempted the thread; with voluntary ones it slept,
    e.g. waiting for the GIL another thread held), and garbage collections inside our
    parts, charged to a `gc` part of their own.
    """

    POLL = "poll"  # the poll's time not charged to a named step
    GC = "gc"

    def __init__(self, metrics: MigrationMetrics):
        self._metrics = metrics
        self._parts: dict[str, float] = {}
        self.handled = False  # a handler ran in this iteration (the poll then times it)
        self._stamp = 0.0
        self.max_s = 0.0
        self.worst_parts: dict[str, float] = {}
        self.iterations = 0  # iterations recorded (ours had work)
        self._account_s, self._account_n, self._account_flushed = 0.0, 0, time.perf_counter()
        self._idle_n = 0
        # Diagnostics, off unless `diagnose` turned them on.
        self._probe: Callable[[], tuple[float, int, int]] | None = None
        self._probe_parts: dict[str, tuple[float, int, int]] = {}
        self._probe_stamp = (0.0, 0, 0)
        # Per part of the worst iteration: (CPU s, voluntary, involuntary switches).
        self.worst_probe_parts: dict[str, tuple[float, int, int]] = {}
        self._inside = False  # in one of our parts (a collection then is charged to `gc`)
        self._gc_started = 0.0
        self._gc_s = 0.0  # collected inside the part being timed, not yet charged

    def reset(self) -> None:
        """Forget the worst iteration (benchmarks measure one call at a time)."""
        self.max_s = 0.0
        self.worst_parts = {}
        self.worst_probe_parts = {}

    def diagnose(self, cpu: bool = True, collections: bool = True) -> None:
        """Benchmarks: also keep the thread's CPU time and context switches per part
        (a `getrusage` call per stamp), and charge garbage collections that run inside
        our parts to `gc` (a process-wide `gc` callback). `diagnose(False, False)`
        turns both off again."""
        import gc

        self._probe = _thread_probe if cpu else None
        registered = self._on_gc in gc.callbacks
        if collections and not registered:
            gc.callbacks.append(self._on_gc)
        elif not collections and registered:
            gc.callbacks.remove(self._on_gc)

    def timed(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(req: Any) -> Any:
            self._begin()
            try:
                return handler(req)
            finally:
                self._charge(type(req).__name__)
                self.handled = True
                self._inside = False

        return run

    def idle_iteration(self) -> None:
        """An iteration with nothing of ours to do: counted, not timed (the poll returns
        at once). The count is exported every `IDLE_FLUSH_ITERATIONS` idle iterations."""
        self._idle_n += 1
        if self._idle_n >= IDLE_FLUSH_ITERATIONS:
            self._metrics.poll_account(0.0, self._idle_n)
            self._idle_n = 0

    def begin_poll(self) -> None:
        self._begin()

    def lap(self, part: str) -> None:
        """Charge the time since the previous stamp (`begin_poll` or `lap`) to `part`."""
        self._charge(part)

    def end_iteration(self, active: bool) -> None:
        """Close the iteration: `active` when anything of ours was in flight or pending."""
        self._charge(self.POLL)
        self._inside = False
        parts, self._parts = self._parts, {}
        probe_parts, self._probe_parts = self._probe_parts, {}
        handled, self.handled = self.handled, False
        spent = sum(parts.values())
        # Every timed iteration (idle ones are only counted: `idle_iteration`). Exported
        # at most once a second (a counter update is a file write).
        self._account_s += spent
        self._account_n += 1
        if self._stamp - self._account_flushed >= ACCOUNT_FLUSH_S:
            self._metrics.poll_account(self._account_s, self._account_n)
            self._account_s, self._account_n, self._account_flushed = 0.0, 0, self._stamp
        if not (active or handled):  # idle: nothing of ours ran but the empty poll
            return
        self.iterations += 1
        if spent > self.max_s:
            self.max_s = spent
            self.worst_parts = parts
            self.worst_probe_parts = probe_parts
        self._metrics.scheduler_time(spent)

    # ------------------------------------------------------------------ helpers

    def _begin(self) -> None:
        self._inside = True
        self._stamp = time.perf_counter()
        if self._probe is not None:
            self._probe_stamp = self._probe()

    def _charge(self, part: str) -> None:
        """Charge the time since the last stamp to `part` (collections in it to `gc`)."""
        now = time.perf_counter()
        seconds, self._stamp = now - self._stamp, now
        parts = self._parts
        if self._gc_s:
            gc_s, self._gc_s = min(self._gc_s, seconds), 0.0
            seconds -= gc_s
            parts[self.GC] = parts.get(self.GC, 0.0) + gc_s
        parts[part] = parts.get(part, 0.0) + seconds
        if self._probe is not None:
            probe_now = self._probe()
            before = self._probe_parts.get(part, (0.0, 0, 0))
            self._probe_parts[part] = tuple(  # type: ignore[assignment]
                b + n - s for b, n, s in zip(before, probe_now, self._probe_stamp, strict=True)
            )
            self._probe_stamp = probe_now

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Outside our parts: SGLang's time. Inside, a collection another thread runs
        # holds the GIL, so it stalls the scheduler thread all the same.
        if not self._inside:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_started = 0.0


def _thread_probe() -> tuple[float, int, int]:
    """(this thread's CPU seconds, voluntary, involuntary context switches so far)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw


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
            "route_bytes": Counter(
                "sglang:kv_migration_route_bytes_total",
                "Bytes of KV cache this source rank sent, by path and route.",
                labelnames=(*LABELS, "path", "route"),
            ),
            "route_seconds": Counter(
                "sglang:kv_migration_route_seconds_total",
                "Time this source rank spent moving bytes, by path and route.",
                labelnames=(*LABELS, "path", "route"),
            ),
            "fixed": Histogram(
                "sglang:kv_migration_fixed_seconds",
                "Source transfer time not spent moving bytes, per successful send.",
                labelnames=(*LABELS, "path"),
                buckets=PHASE_BUCKETS,
            ),
            "loop": Histogram(
                "sglang:kv_migration_scheduler_seconds",
                "Time migration code spent on the scheduler thread per loop iteration "
                "(iterations where it had work).",
                labelnames=LABELS,
                buckets=LOOP_BUCKETS,
            ),
            "poll_seconds": Counter(
                "sglang:kv_migration_poll_seconds",
                "Time migration code spent on the scheduler thread, every loop iteration "
                "(idle ones too).",
                labelnames=LABELS,
            ),
            "poll_iterations": Counter(
                "sglang:kv_migration_poll_iterations",
                "Scheduler loop iterations that ran the migration poll.",
                labelnames=LABELS,
            ),
        }
    return _FAMILIES


class NullMetrics(MigrationMetrics):
    """Used when `--enable-metrics` is off: records nothing, registers nothing."""

    def __init__(self) -> None:
        pass

    def outcome(self, role: str, moment: Moment) -> None:
        pass

    def moved(self, role: str, tokens: int, nbytes: int) -> None:
        pass

    def phase(self, phase: Phase, seconds: float) -> None:
        pass

    def routes(
        self, path: str, routes: Mapping[str, tuple[int, float]], fixed_seconds: float
    ) -> None:
        pass

    def scheduler_time(self, seconds: float) -> None:
        pass

    def poll_account(self, seconds: float, iterations: int) -> None:
        pass
