"""The GPU benchmarks' card and memory arithmetic (`benchmark/gpu_servers.py`) on CPU, and
the flag-cost benchmark's plan of servers for an H100 and an H200."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "gpu"))
import bench_flag_cost  # noqa: E402
import gpu_servers as gs  # noqa: E402
from real_servers import LLAMA3_8B  # noqa: E402

GIB = 1 << 30


def _smi(tmp_path: Path, output: str) -> str:
    """A stand-in nvidia-smi that prints `output` and records its arguments."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nprintf "%s\\n" "{output}"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_llama3_8b_kv_and_weights() -> None:
    assert gs.kv_bytes_per_token(LLAMA3_8B) == 128 * 1024  # 32 layers x 8 heads x 128 x K,V
    assert 16.0e9 < gs.weight_bytes(LLAMA3_8B) < 16.1e9  # 8.03B parameters in bf16


def test_pool_plan_and_fractions_for_three_servers_on_an_h100() -> None:
    weights, per_token = gs.weight_bytes(LLAMA3_8B), gs.kv_bytes_per_token(LLAMA3_8B)
    free = 81_000 * gs.MIB
    tokens = gs.plan_kv_tokens(free, 3, weights, per_token, cap=98_304)
    assert tokens % 4096 == 0 and 40_960 <= tokens <= 65_536
    # Each server, started in turn on what the earlier ones left, gets the same pool
    # (its profiled pool is free * f - weights, at least the plan) and leaves the
    # overhead for itself and the memory the later servers need.
    left = free
    for _ in range(3):
        f = gs.mem_fraction(left, weights, tokens, per_token)
        profiled = left * f - weights
        assert tokens * per_token <= profiled <= tokens * per_token + 2 * GIB
        left -= weights + tokens * per_token + gs.SERVER_OVERHEAD_BYTES
    assert left >= 0
    assert gs.plan_kv_tokens(free, 4, weights, per_token, cap=98_304) < 40_960
    assert gs.plan_kv_tokens(20 * GIB, 2, weights, per_token, cap=98_304) == 0
    with pytest.raises(ValueError, match="GiB are free"):
        gs.mem_fraction(10 * GIB, weights, tokens, per_token)


def test_host_ratio_covers_the_need_within_the_budget() -> None:
    per_token = 128 * 1024
    assert gs.host_ratio(300_000, 100_000, 200 * GIB, per_token) == 3.25
    # 20 GiB for two pinned pools of a 100K-token pool's size: at most 0.82 each, so the
    # floor.
    assert gs.host_ratio(300_000, 100_000, 20 * GIB, per_token, servers=2) == 1.5
    assert gs.host_ratio(10, 100_000, 200 * GIB, per_token, floor=2.0) == 2.0


def test_card_is_read_from_nvidia_smi_on_the_visible_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = _smi(tmp_path, "NVIDIA H100 80GB HBM3, 81559, 80988, 570.133.20")
    monkeypatch.setenv(gs.SMI_ENV, smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    card = gs.query_card()
    assert card == gs.Card("NVIDIA H100 80GB HBM3", 81559, 80988, "570.133.20", "3")
    assert (tmp_path / "args").read_text().startswith("-i 3 ")
    monkeypatch.setenv("KVMIG_COMMIT", "abc1234")
    info = gs.run_info(card)
    assert info["card"]["name"] == "NVIDIA H100 80GB HBM3" and info["commit"] == "abc1234"
    assert set(info["versions"]) == {"sglang", "torch", "sglang-kv-migration"}


def test_no_gpu_exits_with_status_2_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(gs.SMI_ENV, str(tmp_path / "absent"))
    with pytest.raises(SystemExit) as exc:
        gs.require_gpu("bench_x")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_x: needs a GPU machine") and err.count("\n") == 1
    monkeypatch.setenv(gs.SMI_ENV, _smi(tmp_path, "No devices were found"))
    with pytest.raises(gs.NoGPU):
        gs.query_card()


def test_flag_cost_plans_three_servers_on_an_h100_and_a_twin_on_an_h200() -> None:
    h100 = gs.Card("NVIDIA H100 80GB HBM3", 81559, 81000, "", "0")
    h200 = gs.Card("NVIDIA H200", 143771, 143000, "", "0")
    auto = bench_flag_cost.parse_args(["--twin", "auto"])
    names, tokens = bench_flag_cost.plan(auto, h100, LLAMA3_8B)
    assert names == ["stock", "hicache", "flag"] and 40_960 <= tokens <= 65_536
    names, tokens = bench_flag_cost.plan(auto, h200, LLAMA3_8B)
    assert names == ["stock", "hicache", "flag", "hicache_twin"] and tokens >= 65_536
    off = bench_flag_cost.parse_args([])
    assert bench_flag_cost.plan(off, h200, LLAMA3_8B)[0] == ["stock", "hicache", "flag"]
    with pytest.raises(SystemExit, match="KV tokens each"):
        bench_flag_cost.plan(bench_flag_cost.parse_args(["--twin", "on"]), h100, LLAMA3_8B)
