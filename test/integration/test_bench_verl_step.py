"""`benchmark/bench_verl_pattern.py`'s rollout step on CPU mini servers (the GPU run is
the lead's): with the `/generate` stand-in, every arm pins the skewed sessions as it
should (all on A, or for the bound spread over both), the re-pinning arms re-pin with
re-prefill or with the KV moved, every turn is measured, and every arm's greedy outputs
are the same tokens."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from generate_standin import StandinConfig, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_verl_pattern as bench  # noqa: E402
import verl_pattern_stats as stats  # noqa: E402


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerHandle]]:
    config = StandinConfig(max_running=8, step_s=0.005)
    handles = start_servers([ServerSpec(extension=standin_factory(config)) for _ in range(2)])
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def test_every_arm_of_one_step(servers: list[ServerHandle]) -> None:
    # Prefill priced high: these few-page histories migrate (a real model's prior would
    # recompute them).
    args = bench.parse_args(
        ["--sessions", "6", "--skewed", "5", "--turns", "2", "--context", "32",
         "--context-max", "96", "--user-tokens", "8", "--new-tokens", "4",
         "--repin-margin", "1", "--prefill-seconds-per-token", "1.0"]
    )  # fmt: skip
    urls = [s.url for s in servers]
    steps = {}
    for arm in stats.ARMS:
        for server in servers:
            server.ask(0, "flush")
        steps[arm] = asyncio.run(bench.run_step(arm, urls, args, "0/0"))
    for arm, step in steps.items():
        assert len(step["turns"]) == args.sessions * args.turns, arm
        assert step["makespan_s"] > 0
    assert steps[stats.DEFAULT]["pinned_to_a"] == args.skewed
    assert 0 < steps[stats.BOUND]["pinned_to_a"] < args.skewed  # spread from the start
    a = urls[0].removeprefix("http://")
    skewed = {f"s{i}" for i in range(args.skewed)}
    assert all(t["server"] == a for t in steps[stats.DEFAULT]["turns"]
               if t["key"].split("/")[0] in skewed)  # fmt: skip
    assert steps[stats.DEFAULT]["moves"] in ({}, {"recompute": 0})
    assert steps[stats.REPREFILL]["moves"].get("recompute", 0) >= 1
    assert steps[stats.MIGRATE]["moves"].get("migrated", 0) >= 1
    assert steps[stats.MIGRATE]["migrated_tokens"] > 0
    outputs = {arm: {t["key"]: t["output_ids"] for t in s["turns"]} for arm, s in steps.items()}
    assert stats.output_mismatches(outputs) == []
    for step in steps.values():
        step["repeat"] = 0
    summary = stats.summarize({arm: [s] for arm, s in steps.items()}, {0: []})
    assert summary["repeat_ratios"]["makespan_migrate_over_bound"]["n"] == 1
    assert summary["targets"]["identical_greedy_outputs"] is True


def test_scale_defaults_and_history_growth() -> None:
    args = bench.parse_args([])
    assert (args.sessions, args.skewed, args.turns) == (64, 48, 4)
    longest, total = bench.history_tokens(args)
    lengths = stats.context_lengths(args.seed, args.sessions, args.context, args.context_max)
    growth = (args.turns + 1) * (args.user_tokens + args.new_tokens)
    assert longest == max(lengths) + growth and total == sum(lengths) + 64 * growth
    assert 8192 <= longest <= 16384  # the histories grow to 8-16K
    with pytest.raises(SystemExit):
        bench.parse_args(["--skewed", "65"])
