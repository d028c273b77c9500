"""`benchmark/bench_flag_cost.py`'s rounds on CPU mini servers (the GPU run is the
lead's): with the `/generate` stand-in, one server without the plugin's flag and one with
it, every cell is measured on both in every round, interleaved, the cached TTFTs only
from samples whose prefix the server held whole, the decode cells from streams; the
result file is rewritten as the run goes and ends complete; the summary and its table
come out of it."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from generate_standin import StandinConfig, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_flag_cost as bench  # noqa: E402
import flag_cost_stats as stats  # noqa: E402
import gpu_servers  # noqa: E402


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerHandle]]:
    def spec(migration: bool) -> ServerSpec:
        config = StandinConfig(max_running=4, step_s=0.005, capacity_tokens=100_000)
        return ServerSpec(enable_kv_migration=migration, extension=standin_factory(config))

    handles = start_servers([spec(False), spec(True)])
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def test_rounds_measure_every_cell_on_every_server(
    servers: list[ServerHandle], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stand-in's cache holds 4,096 tokens: prompts of tens of tokens, not thousands.
    monkeypatch.setattr(bench, "RESULT", tmp_path / "bench_flag_cost.json")
    monkeypatch.setattr(bench, "FRESH", {"ttft_fresh_17": 17, "ttft_fresh_2k": 48})
    cached = {"ttft_cached_4k": 64, "ttft_cached_16k": 128, "ttft_cached_32k": 256}
    monkeypatch.setattr(bench, "CACHED", cached)
    monkeypatch.setattr(bench, "ITL_PROMPT", 32)
    monkeypatch.setattr(bench, "DECODE_PROMPT", 16)
    args = bench.parse_args(
        ["--rounds", "2", "--concurrency", "2", "4", "--decode-tokens", "8", "--itl-tokens",
         "8", "--fresh-samples", "2", "--samples", "2", "--deadline-s", "900"]
    )  # fmt: skip
    started = [
        gpu_servers.StartedServer(name, handle.url, 0.0, 0.0, 0)
        for name, handle in zip((stats.HICACHE, stats.FLAG), servers, strict=True)
    ]
    run = bench.Run(args, {"test": "mini servers"}, started)
    asyncio.run(run.rounds())

    record = json.loads(bench.RESULT.read_text())
    assert record["complete"] and record["errors"] == {} and record["warmup_s"] is not None
    rounds = record["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert [r["order"] for r in rounds] == [["hicache", "flag"], ["flag", "hicache"]]
    names = [*bench.FRESH, *cached, "itl_1", "decode_2", "itl_2", "decode_4", "itl_4"]
    for r in rounds:
        assert sorted(r["cells"]) == sorted(names)
        for name in names:
            for server in (stats.HICACHE, stats.FLAG):
                assert r["cells"][name][server]["value"] > 0, (name, server)
        for server in (stats.HICACHE, stats.FLAG):
            assert len(r["cells"]["ttft_fresh_17"][server]["samples_ms"]) == 2
            for name in cached:  # the prefix was made resident first: every sample hit
                entry = r["cells"][name][server]
                assert len(entry["samples_ms"]) == 2 and entry["misses"] == 0
            assert r["cells"]["decode_4"][server]["streams"] == 4
            assert r["cells"]["decode_4"][server]["window_s"] > 0
    summary = record["summary"]
    assert [row["cell"] for row in summary["rows"]] == names
    assert all(row["servers"][stats.FLAG]["n"] == 2 for row in summary["rows"])
    assert all(row["flag_cost_pct"] is not None and row["aa_kind"] == "rounds"
               for row in summary["rows"])  # fmt: skip
    assert summary == stats.summarize(rounds, [stats.HICACHE, stats.FLAG])
    assert "decode throughput, 4 concurrent (tok/s)" in stats.table(summary)
