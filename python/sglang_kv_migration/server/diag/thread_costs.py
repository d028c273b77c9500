"""What small operations cost on the calling thread: a diagnosis aid for the scheduler.

On the H200 the torch, CUDA and Python calls of a migration handler cost 5-15x more on a
server's scheduler thread than in a probe's hot loop. `measure()` times a fixed set of
operations on the thread that calls it, each in a hot loop and each once after other
work evicted the caches ("cold"), and reads what else could explain a difference:
whether the thread kept its CPU (CPU time against wall time, involuntary context
switches), its CPU affinity, torch's thread count and grad mode, and any Python trace
or profile function. `bench_device_path.py --calibrate` runs it in the benchmark's own
process and, through the opt-in profile (`profiling.py`,
`SGLANG_KV_MIGRATION_CALIBRATE=1`), on both servers' scheduler threads.

What it shows on an H200 (`docs/benchmarks-history.md`, "Why the scheduler's calls are
slow"): the scheduler threads are not slower than a plain process, hot or cold; a
handler's calls are slow because they run cold (a small torch op 2-3 us hot, 25-30 us
cold; a tiny CUDA launch 7-11 us hot, 40-60 us cold).

Opt-in only; each `measure()` takes ~0.1-0.3 s of the calling thread.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "SGLANG_KV_MIGRATION_CALIBRATE"
REPEATS = 200
WARM_UP = 20
COLD_REPEATS = 30


def measure(repeats: int | None = None) -> dict[str, Any]:
    """Median and p90 µs per call of each operation, and the thread's state."""
    repeats = repeats or REPEATS
    ops = _operations()
    wall0 = time.perf_counter()
    costs = {name: _time(fn, repeats) for name, fn in ops.items()}
    # Each call once after other work evicted the caches: how a handler meets them.
    thrash = bytearray(16 << 20)
    cold = {
        name: _time(fn, COLD_REPEATS, before=lambda: _evict(thrash))
        for name, fn in ops.items()
        if not name.startswith(("sleep", "python_loop"))
    }
    wall = time.perf_counter() - wall0
    return {
        "costs_us": costs,
        "cold_costs_us": cold,
        "wall_s": round(wall, 4),
        **_cpu_share(),
        "state": _state(),
    }


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


# --------------------------------------------------------------------------- helpers


def _evict(buffer: bytearray) -> None:
    """Touch every 64th byte of `buffer` (larger than the caches of one core)."""
    buffer[::64] = bytes(len(buffer) // 64)


def _time(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> dict[str, float]:
    for _ in range(WARM_UP):
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return {
        "p50": round(statistics.median(samples), 2),
        "p90": round(samples[int(len(samples) * 0.9) - 1], 2),
    }


def _operations() -> dict[str, Callable[[], Any]]:
    import numpy as np
    import torch

    def python_loop() -> int:
        total = 0
        for i in range(1000):
            total += i
        return total

    def small(x: int) -> int:
        return x + 1

    def python_calls() -> None:
        for i in range(100):
            small(i)

    arr = np.arange(64, dtype=np.int64)
    cpu = torch.arange(64, dtype=torch.int64)
    blob = os.urandom(4096)
    ops: dict[str, Callable[[], Any]] = {
        "python_loop_1000": python_loop,
        "python_calls_100": python_calls,
        "monotonic": time.monotonic,
        "blake2b_4k": lambda: hashlib.blake2b(blob).digest(),
        "numpy_cumsum_64": lambda: arr.cumsum(),
        "torch_cpu_cumsum_64": lambda: torch.cumsum(cpu, 0),
        "torch_cpu_empty_64": lambda: torch.empty(64, dtype=torch.int64),
        "torch_from_numpy": lambda: torch.from_numpy(arr),
        "torch_tensor_list_4": lambda: torch.tensor([1, 2, 3, 4]),
        "sched_yield": os.sched_yield,
        "sleep_0": lambda: time.sleep(0),
    }
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        on_gpu = torch.zeros(64, dtype=torch.int64, device=device)
        pinned = torch.arange(64, dtype=torch.int64).pin_memory()
        event = torch.cuda.Event()
        torch.cuda.synchronize(device)

        def record_query() -> bool:
            event.record()
            return event.query()

        ops.update(
            {
                "cuda_add_64": lambda: on_gpu.add_(1),
                "cuda_event_record_query": record_query,
                "cuda_h2d_pinned_64": lambda: pinned.to(device, non_blocking=True),
                "cuda_d2h_sync_64": lambda: on_gpu.cpu(),
                "cuda_current_stream": lambda: torch.cuda.current_stream(device),
            }
        )
    return ops


def _cpu_share(seconds: float = 0.05) -> dict[str, Any]:
    """Spin in Python for `seconds`: the share of that wall time this thread was on a
    CPU (below 1: other threads or processes took its CPU), and how often it was
    switched out."""
    before = _context_switches()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < seconds:
        pass
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    after = _context_switches()
    return {
        "cpu_share": round(cpu / wall, 3),
        "context_switches": {k: after[k] - before[k] for k in before if k in after},
    }


def _context_switches() -> dict[str, int]:
    """This thread's voluntary and involuntary context switches so far (Linux)."""
    path = Path(f"/proc/self/task/{threading.get_native_id()}/status")
    found: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.endswith("ctxt_switches"):
                found[key.strip()] = int(value)
    except OSError:
        pass
    return found


def _state() -> dict[str, Any]:
    """What could make this thread's calls slower than a plain process's."""
    import torch

    state: dict[str, Any] = {
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "python_threads": threading.active_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "trace_function": repr(sys.gettrace()),
        "profile_function": repr(sys.getprofile()),
        "switch_interval_s": sys.getswitchinterval(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "nice": os.nice(0),
    }
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.current_device()
        state["cuda_stream"] = str(torch.cuda.current_stream())
    return state
