"""`benchmark/bench_rl_scene.py`'s measured phase on CPU mini servers (the GPU run is the
lead's): with the `/generate` stand-in, two conversations whose first turns ran on A
queue behind low-priority decodes that hold A's two running slots; in `migrate` mode
the scene policy moves exactly the conversations' next turns to B with their KV, in
`none` nothing moves; the report functions digest both, and the result file keeps each
variant of the scene apart."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from generate_standin import StandinConfig, next_token, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_rl_scene as bench  # noqa: E402
import rl_scene_report as report  # noqa: E402

PAGE = 16
# B's /metrics: migration at 10 GB/s with 1 MB per token against 1 ms of prefill per
# token, so the cost model (mode "auto") migrates.
METRICS = """\
sglang:kv_migration_bytes_total{tp_rank="0",role="source"} 1e9
sglang:kv_migration_tokens_total{tp_rank="0",role="source"} 1000
sglang:kv_migration_phase_seconds_sum{tp_rank="0",phase="transfer"} 0.1
sglang:kv_migration_phase_seconds_count{tp_rank="0",phase="transfer"} 10
sglang:forward_execution_seconds_total{category="extend"} 5.0
sglang:realtime_tokens_total{mode="prefill_compute"} 5000
"""


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerHandle]]:
    def spec() -> ServerSpec:
        config = StandinConfig(
            max_running=2, step_s=0.01, capacity_tokens=100_000, metrics_text=METRICS
        )
        return ServerSpec(extension=standin_factory(config))

    handles = start_servers([spec(), spec()])
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def expected(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


SCENE = bench.Scene(
    conversations=2, context=2 * PAGE, observation=5, history_gen=4, high_gen=6,
    low_count=2, low_prompt=PAGE, low_gen=80, b_low=1, b_prompt=PAGE // 4, high=5, low=0,
    vocab=1000,
)  # fmt: skip


def test_scene_modes_on_mini_servers(servers: list[ServerHandle], tmp_path: Path) -> None:
    urls = [s.url for s in servers]
    args = bench.parse_args(["--page-size", str(PAGE), "--max-concurrent", "4"])
    work = bench.make_workload(SCENE)
    none = asyncio.run(bench.run_mode("none", SCENE, work, urls, bench.policy_for("none", args)))
    for server in servers:
        server.ask(0, "flush")
    policy = bench.policy_for("migrate", args)
    migrate = asyncio.run(bench.run_mode("migrate", SCENE, work, urls, policy))

    highs = [t for t in migrate.turns if t.kind == "high"]
    assert len(highs) == 2 and all(t.held_tokens == 2 * PAGE for t in highs)
    for turn in highs:
        (move,) = turn.moves
        assert move["outcome"] == "migrated" and move["path"] == "host"
        assert move["migrated_tokens"] == 2 * PAGE and "transfer" in move["phases_s"]
        assert move["landing_tier"] == "host"  # the host path lands in the host tier
        assert turn.servers == urls  # queued on A, finished on B
        assert set(turn.target_cached) == {"device", "host"}
    lows = [t for t in migrate.turns if t.kind == "low"]
    assert len(lows) == 3 and all(t.moves == [] for t in lows)
    assert all(t.moves == [] and len(set(t.servers)) == 1 for t in none.turns)
    for i, obs in enumerate(work.observations):  # same tokens as the uninterrupted run
        history = work.first_turns[i] + expected(work.first_turns[i], SCENE.history_gen)
        assert highs[i].output_ids == expected(history + obs, SCENE.high_gen)

    rows = [report.summarize(none, none), report.summarize(migrate, none)]
    assert rows[1]["moves"] == 2 and rows[1]["paths"] == ["host"]
    assert rows[1]["landing"] == {"host -> host": 2}
    assert rows[1]["moved_outputs_identical"] == rows[1]["moved"] == 2
    assert rows[0]["moves"] == 0
    runs = [report.Run("room", 0, none), report.Run("room", 0, migrate)]
    pooled = bench.rl_scene_stats.pooled_rows(report.turn_seconds(runs)["room"])
    assert [r["high_turns"] for r in pooled] == [SCENE.conversations] * 2
    assert set(bench.rl_scene_stats.ratios(pooled)) == {
        "high_p99_migrate_over_recompute",
        "high_p99_migrate_over_none",
        "low_p99_migrate_over_none",
    }
    assert "| migrate |" in report.markdown(rows)
    # The file: each variant on its own; `--merge` reads its turn seconds back.
    runs.append(report.Run("full", 0, migrate))
    content = report.result_file({"context": 32}, {}, runs, {})
    assert set(content["variants"]) == {"room", "full"}
    assert set(content["turns"]) == {"room:0:none", "room:0:migrate", "full:0:migrate"}
    path = tmp_path / "bench_rl_scene_32.json"
    report.write(path, content)
    merged = bench.rl_scene_stats.merge([path])
    assert set(merged["room"]) == {"none", "migrate"} and set(merged["full"]) == {"migrate"}
    assert (
        json.loads(path.read_text())["variants"]["room"]["repeat_ratios"][
            "high_p99_migrate_over_none"
        ]["n"]
        == 1
    )


def test_arguments_and_server_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # 120 GiB free (a lent GPU machine has ~125 GiB): room for A's whole 16K scene.
    monkeypatch.setattr(bench.gpu_servers, "mem_available_bytes", lambda: 120 << 30)
    args = bench.parse_args(["--context", "16384", "--target-gpu", "room", "full"])
    room, full = (bench.scene_from(args, 128_256, v) for v in args.target_gpu)
    flags_a, flags_b = bench.server_flags(args, [room, full], 128 << 10)
    for flag in ("--enable-priority-scheduling", "--priority-scheduling-preemption-threshold",
                 "--hicache-ratio", "--enable-metrics", "--page-size"):  # fmt: skip
        assert flag in flags_a and flag in flags_b
    assert "--mem-fraction-static" not in flags_a  # sized at each start (gpu_servers.py)
    # A's low decodes need ~90% of its KV pool, and the host tier holds all of the scene.
    low_kv = room.low_count * (room.low_prompt + room.low_gen)
    assert 0.85 * args.max_total_tokens <= low_kv <= args.max_total_tokens
    ratio = float(flags_a[flags_a.index("--hicache-ratio") + 1])
    per_conv = room.context + room.history_gen + room.observation + room.high_gen
    assert ratio * args.max_total_tokens >= room.conversations * per_conv + low_kv
    # Full: B's own decodes take ~90% of its pool, so a 16K history finds no room there.
    assert 0.85 * args.max_total_tokens <= full.b_low * (full.b_prompt + full.low_gen)
    assert args.max_total_tokens - full.b_low * (full.b_prompt + full.low_gen) < per_conv
    assert room.b_low * (room.b_prompt + room.low_gen) < args.max_total_tokens / 2
    context_len = int(flags_a[flags_a.index("--context-length") + 1])
    assert context_len >= full.b_prompt + full.low_gen
    assert args.high - args.low < args.preemption_threshold  # the turns wait, never preempt
    # CUDA graphs on, 24 turns, 3 repeats unless asked.
    assert (args.no_cuda_graph, args.conversations, args.repeats) == (False, 24, 3)
    # With little memory the host tiers shrink to the share they may pin.
    monkeypatch.setattr(bench.gpu_servers, "mem_available_bytes", lambda: 20 << 30)
    small_a, _ = bench.server_flags(args, [room, full], 128 << 10)
    assert float(small_a[small_a.index("--hicache-ratio") + 1]) < ratio
    with pytest.raises(SystemExit):
        bench.parse_args(["--bogus"])
