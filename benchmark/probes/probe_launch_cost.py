"""Host-side cost of the pieces of a device-path send (GPU machine only; seconds, no
server): where the source scheduler's ~1 ms "launch" and ~0.8 ms "match" steps of a
one-page transfer go (`docs/benchmarks-history.md`, "Two trips on the H200").

One process on GPU 0, 64 Llama-3-8B-shaped layer buffers (rows of 2 KiB) as source and
as destination. Each piece is timed on the host (what the scheduler thread pays), the
GPU idle before each call (synchronized, not timed): the two index copies to the
device from pageable and from pinned memory, a timed CUDA event pair, a stream wait,
the fused Triton page copy's launch, the copy plan of `tiers.plan_tiers` over device
slots, the host identity and GPU lookup of the target check, and the whole sequence as
`TierCopier.launch` runs it. Medians (and p90) of `--repeats` calls, microseconds.

    python3 benchmark/probes/probe_launch_cost.py [--pages 1 1024] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

LAYERS, ROW_BYTES, ROWS = 32, 8 * 128 * 2, 8192


def _time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    samples = []
    for _ in range(repeats + 10):
        sync()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples = sorted(samples[10:])  # the first calls warm caches and the JIT
    p90 = samples[-max(1, len(samples) // 10)]
    return {"p50_us": round(statistics.median(samples), 1), "p90_us": round(p90, 1)}


class _Buffers:
    """64 source and 64 destination layer buffers on one GPU, their pointer tables."""

    def __init__(self, dev: Any):
        import torch

        def make() -> list[Any]:
            return [
                torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8, device=dev)
                for _ in range(2 * LAYERS)
            ]

        self.dev = dev
        self.src, self.dst = make(), make()
        self.src_ptrs = torch.tensor([b.data_ptr() for b in self.src], device=dev)
        self.dst_ptrs = torch.tensor([b.data_ptr() for b in self.dst], device=dev)
        self.stream = torch.cuda.Stream(device=dev)


def _pieces(b: _Buffers, n: int) -> dict[str, Callable[[], Any]]:
    """Each piece of a send of `n` pages (page size 1), as a call."""
    import numpy as np
    import torch
    from sglang_kv_migration.paths.device import cuda_ipc, page_copy, tiers
    from sglang_kv_migration.sglang_adapter import DEVICE_TIER, Segment

    dev, stream = b.dev, b.stream
    pageable = torch.from_numpy(np.arange(n, dtype=np.int64))  # what the plan builds
    pinned = pageable.pin_memory()
    on_device = pageable.to(dev)
    slots = torch.arange(n, dtype=torch.int64, device=dev)  # a device node's slots
    uuid = cuda_ipc.gpu_uuid(dev.index)

    def timed_events() -> tuple[Any, Any]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def events() -> None:
        for event in timed_events():
            event.record(stream)

    def launch_like() -> None:
        # `TierCopier.launch` for one device tier: waits, index copies, events, copy.
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            src_idx = pageable.to(dev, non_blocking=True)
            dst_idx = pageable.to(dev, non_blocking=True)
            start, end = timed_events()
            start.record(stream)
            page_copy.copy_pages(b.src_ptrs, b.dst_ptrs, src_idx, dst_idx, ROW_BYTES)
            end.record(stream)

    return {
        "index to device, pageable": lambda: pageable.to(dev, non_blocking=True),
        "index to device, pinned": lambda: pinned.to(dev, non_blocking=True),
        "timed event pair, recorded": events,
        "stream wait": lambda: stream.wait_stream(torch.cuda.current_stream(dev)),
        "fused copy launch": lambda: page_copy.copy_pages(
            b.src_ptrs, b.dst_ptrs, on_device, on_device, ROW_BYTES
        ),
        "plan_tiers over device slots": lambda: tiers.plan_tiers(
            [Segment(DEVICE_TIER, slots)], 0, n, pageable, 1
        ),
        "host identity": cuda_ipc.host_identity,
        "GPU lookup by uuid": lambda: cuda_ipc.local_device_of(uuid),
        "whole launch sequence": launch_like,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 1024])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    buffers = _Buffers(dev)
    rows: list[dict[str, Any]] = []
    for n in args.pages:
        for name, fn in _pieces(buffers, n).items():
            rows.append(
                {"pages": n, "piece": name, **_time(fn, args.repeats, torch.cuda.synchronize)}
            )
    print("| pages | piece | p50 us | p90 us |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['pages']} | {r['piece']} | {r['p50_us']} | {r['p90_us']} |")
    print(json.dumps({"probe_launch_cost": rows}))


if __name__ == "__main__":
    main()
