"""What `--enable-kv-migration` costs a scheduler loop iteration when nothing migrates (CPU).

SGLang calls our two per-iteration hooks (`scheduler_hooks.before_process_input_requests`
and `after_process_input_requests`) once per scheduler loop iteration on every server
that has this package installed: with the flag off they find no migration side and
return; with the flag on and nothing in flight the side's `before_requests()` reads
whether a source asked its allocate channel for slots (one zmq socket option, on
single-rank servers) and its `poll()` returns at once (`scheduler/loop.py`). This times
both on a real `MigrationSchedulerSide` (CPU harness: SGLang's own HiRadixCache and host
pool, a real Mooncake engine, a real allocate channel), side by side in one run, medians
over repeats, and prints the difference per iteration. Multiplied by a server's loop
rate (the GPU benchmark reads it from `sglang:kv_migration_poll_iterations_total`) it
gives the share of the scheduler thread the flag takes while idle.

    .venv/bin/python benchmark/bench_idle_poll.py [--iterations 200000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))


def _build_side():
    import cpu_harness

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu_harness.install_cpu_shims()
    from sglang_kv_migration.paths.host.mooncake import TransportConfig
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics
    from sglang_kv_migration.server.rank.settings import RankSettings
    from sglang_kv_migration.server.scheduler.compose import compose_rank
    from side_helpers import one_rank_context

    harness = cpu_harness.build_harness(cpu_harness.HarnessConfig(page_size=16))
    side = compose_rank(
        one_rank_context(harness.cache, model="idle"),
        RankSettings(
            watchdog_timeout_s=60.0,
            transport_config=TransportConfig(hostname="127.0.0.1"),
            metrics=MigrationMetrics("idle", 0, 0),  # as with --enable-metrics
        ),
    )
    return harness, side


def _time_hook(hook, scheduler, iterations: int) -> float:
    """Seconds per call of the hook, as SGLang's AFTER wrapper calls it."""
    recv: list = []
    started = time.perf_counter()
    for _ in range(iterations):
        hook(None, scheduler, recv)
    return (time.perf_counter() - started) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from sglang_kv_migration.server.scheduler.hooks import (
        after_process_input_requests,
        before_process_input_requests,
    )

    def hook(result: None, scheduler: object, recv: list) -> None:
        # One loop iteration's calls, as SGLang's BEFORE and AFTER wrappers make them.
        before_process_input_requests(scheduler, recv)
        after_process_input_requests(result, scheduler, recv)

    harness, side = _build_side()
    off = SimpleNamespace(kv_migration=None)  # flag off: the hook finds no side
    on = SimpleNamespace(kv_migration=side)  # flag on, nothing in flight or pending
    results: dict[str, list[float]] = {"off": [], "on": [], "empty loop": []}
    try:
        for _ in range(args.repeats):
            results["empty loop"].append(_time_hook(lambda *a: None, off, args.iterations))
            results["off"].append(_time_hook(hook, off, args.iterations))
            results["on"].append(_time_hook(hook, on, args.iterations))
        assert side.diagnostics.loop_timer.iterations == 0, "an idle poll was timed as busy"
    finally:
        side.close()
        harness.close()
    med = {k: statistics.median(v) * 1e9 for k, v in results.items()}
    print(f"{args.repeats} repeats x {args.iterations} calls, median ns per call:")
    for name, ns in med.items():
        spread = [round(x * 1e9) for x in results[name]]
        print(f"  {name:10s} {ns:7.0f}   (all: {spread})")
    print(f"flag on - off: {med['on'] - med['off']:.0f} ns per scheduler loop iteration")


if __name__ == "__main__":
    main()
