"""Opt-in profile of this package's work on a scheduler rank: a diagnosis aid, off by
default and free when off.

With `SGLANG_KV_MIGRATION_PROFILE_DIR` set in a server's environment, each scheduler
rank runs every migration handler and every non-idle `poll()` under one
`cProfile.Profile`, and times every garbage collection of its process (a pause of the
collector stalls the whole scheduler loop, whatever it was doing). Once the rank has
been idle for a second after such calls (never in the middle of a migration: writing
takes milliseconds) and at `close()`, it writes

- `scheduler-<port>-tp<r>-pp<s>.prof` (pstats; `python -m pstats FILE`),
- `scheduler-<port>-tp<r>-pp<s>-gc.json`: per generation the number of collections and
  their total ms, and every collection of 1 ms or more (`inside`: during our code).

cProfile slows Python-heavy code by up to ~2x: read the split, not the absolute times.
`SGLANG_KV_MIGRATION_PROFILE_GC_ONLY=1` times the collections alone, at no such cost.
`SGLANG_KV_MIGRATION_CALIBRATE=1` also times a fixed set of small operations on the
scheduler thread (`thread_costs.py`), once for each new label a benchmark writes into
`<dir>/calibrate` (read once a second while idle), into
`scheduler-<port>-tp<r>-pp<s>-calibration.json`.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_kv_migration.server.diag import thread_costs

ENV = "SGLANG_KV_MIGRATION_PROFILE_DIR"
GC_ONLY_ENV = "SGLANG_KV_MIGRATION_PROFILE_GC_ONLY"
IDLE_BEFORE_DUMP_S = 1.0
CALIBRATE_CHECK_S = 1.0  # how often an idle rank looks for a new calibration label
LONG_GC_MS = 1.0
MAX_LONG_GCS = 2000


class RankProfile:
    """One rank's profiler: `with profile:` around our calls (nestable), `wrap(f)`."""

    def __init__(self, directory: Path, name: str, calls: bool = True):
        directory.mkdir(parents=True, exist_ok=True)
        self._prof_path = directory / f"{name}.prof"
        self._gc_path = directory / f"{name}-gc.json"
        self._calibration_path = directory / f"{name}-calibration.json"
        self._calibrations: list[dict[str, Any]] | None = [] if thread_costs.enabled() else None
        self._trigger_path = directory / "calibrate"
        self._labels_done: set[str] = set()
        self._trigger_checked = 0.0
        self._profile = cProfile.Profile() if calls else None
        self._depth = 0
        self._busy_until = 0.0
        self._unwritten = False
        self._gc_started = 0.0
        self._gc_totals: dict[int, list[float]] = {}  # generation -> [count, ms]
        self._long_gcs: list[dict[str, Any]] = []
        gc.callbacks.append(self._on_gc)

    def __enter__(self) -> RankProfile:
        if self._depth == 0 and self._profile is not None:
            self._profile.enable()
        self._depth += 1
        return self

    def __exit__(self, *_exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._profile is not None:
            self._profile.disable()
        self._busy_until = time.monotonic()
        self._unwritten = True

    def idle(self) -> None:
        """An idle loop iteration: write the files once idle for `IDLE_BEFORE_DUMP_S`."""
        now = time.monotonic()
        if self._unwritten and now - self._busy_until >= IDLE_BEFORE_DUMP_S:
            self.dump()
        elif self._calibrations is not None and now - self._trigger_checked >= CALIBRATE_CHECK_S:
            self._trigger_checked = now
            try:
                label = self._trigger_path.read_text().strip()
            except OSError:
                return
            if label and label not in self._labels_done:
                self._labels_done.add(label)
                self._calibrate(label)

    def wrap(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def profiled(req: Any) -> Any:
            with self:
                return handler(req)

        return profiled

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_started) * 1e3
        generation = int(info.get("generation", -1))
        totals = self._gc_totals.setdefault(generation, [0, 0.0])
        totals[0] += 1
        totals[1] += ms
        if ms >= LONG_GC_MS and len(self._long_gcs) < MAX_LONG_GCS:
            self._long_gcs.append(
                {
                    "at": time.monotonic(),
                    "generation": generation,
                    "ms": round(ms, 3),
                    "collected": info.get("collected"),
                    "inside": self._depth > 0,
                }
            )

    def dump(self) -> None:
        """Write both files (the profiler must not be running: `create_stats` stops it)."""
        if self._depth:
            return
        self._unwritten = False
        if self._profile is not None:
            self._profile.dump_stats(self._prof_path)
        totals = {
            str(g): {"count": c, "ms": round(ms, 3)} for g, (c, ms) in self._gc_totals.items()
        }
        gc_report = {
            "by_generation": totals,
            "long": self._long_gcs,
            # Which threads of the process ran how much (a thread that keeps taking the
            # GIL slows every call of the scheduler's that releases it).
            "threads": _thread_cpu_seconds(),
            "python_threads": sorted(t.name for t in threading.enumerate()),
        }
        self._gc_path.write_text(json.dumps(gc_report, indent=1))

    def _calibrate(self, when: str) -> None:
        assert self._calibrations is not None
        self._calibrations.append({"when": when, "at": time.monotonic(), **thread_costs.measure()})
        self._calibration_path.write_text(json.dumps(self._calibrations, indent=1))

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.dump()


def _thread_cpu_seconds() -> list[dict[str, Any]]:
    """Per thread of this process (Linux): its name and CPU seconds so far."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    threads = []
    for task in sorted(Path("/proc/self/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        threads.append({"tid": int(task.name), "name": name, "cpu_s": round(cpu, 2)})
    return sorted(threads, key=lambda t: -t["cpu_s"])


def rank_profile(port: int, tp_rank: int, pp_rank: int) -> RankProfile | None:
    """This rank's profiler when the environment asks for one, else None."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    name = f"scheduler-{port}-tp{tp_rank}-pp{pp_rank}"
    return RankProfile(Path(directory), name, calls=os.environ.get(GC_ONLY_ENV, "") != "1")
