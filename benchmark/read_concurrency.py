"""Where concurrent moves to one target wait for each other (issue 19, item 3), read from
the concurrency rounds a benchmark wrote (`bench_device_path.py --concurrency-rounds`,
`bench_any_tier.py --only-concurrency`): per round, one move against the same moves from
threads and in one call, and the parts that cannot overlap on one GPU and one source
scheduler thread.

    python3 benchmark/read_concurrency.py \
        docs/gpu-runs/2026-12-03/poll-waits-device-path-page16.json

Per round and way of sending (`threads`, `one call`):
- `wall` and `ratio`: all moves against one move alone (the issue's target: 1.5x);
- `copies`: the GPU time of every move's copy; copies into one GPU do not overlap (each
  is bound by its memory bandwidth), so `floor` = one move + the other moves' copies is
  the least the round can take if all else overlapped perfectly;
- `source`: the source scheduler thread's own work summed over the moves (the handler,
  the prepare while the target allocates, the checks, plan and launch after its answer,
  the receipts and reply): one Python thread, so it adds up;
- `target`: the target scheduler's allocate work summed (`target_scheduler`): its
  allocates are served one after another, and so are its answers;
- `bound`: one move plus what the other moves add on the busiest of the three
  resources that serve moves one at a time (the GPU's copies, the source's scheduler
  thread, the target's): the least the round can take even if the three overlapped
  perfectly;
- `budget`: what 1.5x leaves for everything but the copies, per extra move.

A file with `compare_env` runs (the same rounds on server pairs started with another
variable) lists each pair's rounds under its variable.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.5
# The transfer trip's steps (`server/source/transfers.py`) that run on the source's
# scheduler thread; `answer` and `copy_wait` are waits (and, for moves taken together,
# other moves' work), so they are left out.
SOURCE_STEPS = ("handler", "start", "finish")


def _steps(move: dict[str, Any]) -> dict[str, float]:
    steps = move.get("steps_ms") or {}
    return steps.get("transfer", steps) if isinstance(steps, dict) else {}


def source_work_ms(move: dict[str, Any]) -> float:
    """The source thread's own work for one move, ms (its prepare where the rank steps
    were recorded)."""
    steps = _steps(move)
    work = sum(float(steps.get(name, 0.0)) for name in SOURCE_STEPS)
    ranks = move.get("transfer_steps_ms") or []
    if ranks and isinstance(ranks[0], dict):
        work += float(ranks[0].get("prepare", 0.0))
    return work


def _target_work_ms(move: dict[str, Any]) -> float:
    return float(_steps(move).get("target_scheduler", 0.0))


def summarize(one: dict[str, Any], moves: list[dict[str, Any]], wall_ms: float) -> dict[str, float]:
    one_ms = float(one["wall_ms"])
    copies = [float(m.get("copy_ms") or 0.0) for m in moves]
    extra_moves = max(1, len(moves) - 1)
    source_ms = sum(source_work_ms(m) for m in moves)
    source_one_ms = source_work_ms(one)
    target_ms = sum(_target_work_ms(m) for m in moves)
    # What the moves add to one move's time on each resource that serves them one at a
    # time: the GPU's copies, the source's scheduler thread, the target's.
    added = {
        "copies": sum(copies) - (max(copies) if copies else 0.0),
        "source": max(0.0, source_ms - source_one_ms),
        "target": max(0.0, target_ms - _target_work_ms(one)),
    }
    bound_by = max(added, key=lambda name: added[name])
    floor_ms = one_ms + added["copies"]
    bound_ms = one_ms + added[bound_by]
    return {
        "moves": len(moves),
        "one_ms": one_ms,
        "wall_ms": wall_ms,
        "ratio": wall_ms / one_ms,
        "copies_ms": sum(copies),
        "floor_ms": floor_ms,
        "floor_ratio": floor_ms / one_ms,
        "source_ms": source_ms,
        "source_one_ms": source_one_ms,
        "target_ms": target_ms,
        "bound_ms": bound_ms,
        "bound_ratio": bound_ms / one_ms,
        "bound_by": bound_by,
        "budget_per_extra_move_ms": (TARGET_RATIO * one_ms - floor_ms) / extra_moves,
    }


def runs(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The file's server pairs: its own, and `bench_device_path.py --compare-env`'s
    (named by their variable)."""
    pairs = {"": data}
    pairs.update(data.get("compare_env") or {})
    return pairs


def rounds(data: dict[str, Any]) -> list[dict[str, dict[str, float]]]:
    found = []
    entries = data.get("concurrency") or []
    if isinstance(entries, dict):  # bench_any_tier.py writes one round, or a list
        entries = [entries]
    for entry in entries:
        one = entry["one"]
        ways = {}
        if entry.get("concurrent"):
            ways["threads"] = summarize(one, entry["concurrent"], entry["concurrent_wall_ms"])
        batch = entry.get("batch")
        if isinstance(batch, dict) and batch.get("moves"):
            ways["one call"] = summarize(one, batch["moves"], batch["wall_ms"])
        found.append(ways)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    header = (
        "| file | round | way | moves | one | wall | ratio | copies | floor (ratio) "
        "| source work (one) | target work | bound (ratio, by) | 1.5x leaves per extra move |"
    )
    print(header)
    print("|" + "---|" * 13)
    medians = []
    for path in args.files:
        for pair, data in runs(json.loads(path.read_text())).items():
            name, ratios = f"{path.name} {pair}".strip(), []
            for number, ways in enumerate(rounds(data), 1):
                for way, s in ways.items():
                    ratios.append(s["ratio"])
                    print(_line(name, number, way, s))
            if ratios:
                medians.append(f"{name}: median ratio {statistics.median(ratios):.2f}x over "
                               f"{len(ratios)} rounds")  # fmt: skip
    print("", *medians, sep="\n")


def _line(name: str, number: int, way: str, s: dict[str, float]) -> str:
    return (
        f"| {name} | {number} | {way} | {s['moves']} | {s['one_ms']:.1f} "
        f"| {s['wall_ms']:.1f} | {s['ratio']:.2f}x | {s['copies_ms']:.2f} "
        f"| {s['floor_ms']:.1f} ({s['floor_ratio']:.2f}x) "
        f"| {s['source_ms']:.1f} ({s['source_one_ms']:.1f}) | {s['target_ms']:.1f} "
        f"| {s['bound_ms']:.1f} ({s['bound_ratio']:.2f}x, {s['bound_by']}) "
        f"| {s['budget_per_extra_move_ms']:.2f} |"
    )


if __name__ == "__main__":
    main()
