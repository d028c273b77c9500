"""The fleet simulation (`benchmark/fleet_*.py`) on small inputs: its costs come from the
records, its servers keep time and memory as stated, and the policies behave as they must
(the bound under every policy, nothing moves without skew, migration that never pays is
re-prefill, every turn's work done once)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import fleet_costs  # noqa: E402
import fleet_scenes  # noqa: E402
import fleet_validate  # noqa: E402
import results  # noqa: E402
import verl_pattern_stats as stats  # noqa: E402
from fleet_policies import BOUND, POLICIES  # noqa: E402
from fleet_server import Clock, Gpu, Request, Server, ServerConfig  # noqa: E402
from fleet_sim import FleetSpec, Rollout, run_rollout  # noqa: E402

COSTS = fleet_costs.derive(cuda_graphs=True)
NO_VERL = {"verl": False}  # verl's arm by the benchmark's stand-in: no 5 s import of verl
# Four servers on one host (moves take the device path), skewed 3:1 onto the first.
SMALL = FleetSpec(servers=4, gpus_per_host=4, kv_tokens=200_000, max_running=64)
SKEWED = Rollout(
    sessions=24,
    turns=3,
    context=8192,
    user_tokens=128,
    new_tokens=8,
    pinned=18,
    hot_servers=1,
    resume_all=True,
)


@pytest.fixture(scope="module")
def skewed_runs() -> dict:
    return {p: run_rollout(SMALL, SKEWED, p, COSTS, NO_VERL) for p in POLICIES}


# ---------------------------------------------------------------------------- costs


def test_every_constant_is_positive_and_names_the_record_it_came_from() -> None:
    for graphs in (True, False):
        costs = fleet_costs.derive(cuda_graphs=graphs)
        numbers = {k: v for k, v in costs.to_dict().items() if isinstance(v, float)}
        assert numbers and all(v > 0 for v in numbers.values()), numbers
        for name in [*numbers, *(f"moves.{r}" for r in fleet_costs.ROUTES)]:
            assert name in costs.sources, name
        cited = " ".join(costs.sources.values())
        for rel in ("busy", "live_h200", "host_stall", "host_table_p1", "device_p16"):
            assert results.RUNS[rel] in cited and (results.RUNS_DIR / results.RUNS[rel]).is_file()


def test_a_new_record_changes_the_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    real = results.load

    def faster_decode(name: str) -> dict:
        record = copy.deepcopy(real(name))
        if name == "busy":
            record["decode"]["without_tok_s"]["median"] *= 2
        if name == "live_h200":  # the model's constants are all from H200 records
            for row in record["rows"]:
                row["decode_step_s"] /= 2
        return record

    monkeypatch.setattr(results, "load", faster_decode)
    faster = fleet_costs.derive(cuda_graphs=True)
    assert faster.decode_base_s == pytest.approx(COSTS.decode_base_s / 2)
    assert faster.decode_kv_s_per_token < COSTS.decode_kv_s_per_token
    assert faster.busy_wait_iterations > COSTS.busy_wait_iterations  # same waits, shorter steps


def test_fitted_prefill_lands_near_the_measured_re_prefills() -> None:
    busy = results.load("busy")
    for row in busy["rows"]:
        model = COSTS.request_overhead_s + max(
            COSTS.eager_floor_s, COSTS.prefill_work(row["tokens"], 0)
        )
        assert model == pytest.approx(row["reprefill_ms"] / 1e3, rel=0.25), row["tokens"]


# ---------------------------------------------------------------------------- one server


def _server(kv: int = 100_000, host: int = 200_000, share: Gpu | None = None) -> Server:
    clock = share.clock if share else Clock()
    gpu = share or Gpu(clock)
    config = ServerConfig(kv_tokens=kv, host_tokens=host, max_running=8)
    return Server(f"s{len(gpu.servers)}", config, COSTS, gpu, clock)


def test_a_lone_request_takes_its_prefill_then_one_decode_step_per_token() -> None:
    server = _server()
    done: list[Request] = []
    req = Request("r", "a", prompt=4096, max_new=5, on_finish=done.append)
    server.submit(req)
    server.sim.run()
    prefill = max(COSTS.eager_floor_s, COSTS.prefill_work(4096, 0))
    steps = sum(COSTS.decode_work(4096 + k, 4096 + k) for k in range(1, 5))
    assert done == [req] and req.first_token_at == pytest.approx(prefill)
    assert req.finished_at == pytest.approx(prefill + steps)
    assert server.held("a") == (4096, 4096)  # prompt + 5 generated, page-aligned


def test_two_servers_on_one_gpu_share_it() -> None:
    alone = _server()
    alone.submit(Request("r", "a", 8192, 1))
    alone.sim.run()
    gpu = Gpu(Clock())
    pair = [_server(share=gpu), _server(share=gpu)]
    for i, s in enumerate(pair):
        s.submit(Request(f"r{i}", "a", 8192, 1))
    gpu.clock.run()
    assert gpu.clock.now == pytest.approx(2 * alone.sim.now)


def test_a_full_pool_moves_cached_tails_to_host_and_a_turn_loads_them_back() -> None:
    server = _server(kv=12_000, host=24_000)
    for session in ("a", "b"):  # b's 8,002 slots take 4,002 of a's cached 8,000
        server.submit(Request(session, session, 8000, 2))
        server.sim.run()
    assert server.held("a") == (8000, 3984)  # its first 3,998 stay on the GPU
    again = Request("a2", "a", 8200, 2)
    server.submit(again)
    server.sim.run()
    assert (again.matched, again.loaded_back, again.computed) == (8000, 4016, 200)
    assert server.held("b") == (8000, 3792)  # a's turn took 4,202 of b's slots
    assert server.stats["loaded_back"] == 4016


# ---------------------------------------------------------------------------- policies


def test_the_bound_is_at_most_every_policy(skewed_runs: dict) -> None:
    bound = skewed_runs[BOUND].makespan_s
    for policy, run in skewed_runs.items():
        assert bound <= run.makespan_s * 1.02, (policy, run.makespan_s, bound)
    # The skew costs verl's sticky placement, and moving KV beats re-prefilling it.
    assert skewed_runs[stats.DEFAULT].makespan_s > 1.3 * bound
    assert skewed_runs[stats.MIGRATE].makespan_s < skewed_runs[stats.REPREFILL].makespan_s
    assert skewed_runs[stats.MIGRATE].moves.get("migrated", 0) > 0
    assert skewed_runs[stats.MIGRATE].migrated_tokens > 0


def test_without_skew_no_policy_moves_anything() -> None:
    balanced = dataclasses.replace(SKEWED, pinned=0)
    for policy in POLICIES:
        run = run_rollout(SMALL, balanced, policy, COSTS, NO_VERL)
        assert run.moves == {} and run.migrated_tokens == 0, (policy, run.moves)


def test_migration_that_never_pays_is_re_prefill(skewed_runs: dict) -> None:
    infinite = {**NO_VERL, "router": {"cost_margin": math.inf}}  # no move is ever worth it
    never = run_rollout(SMALL, SKEWED, stats.MIGRATE, COSTS, infinite)
    reprefill = skewed_runs[stats.REPREFILL]
    assert never.migrated_tokens == 0 and never.moves == reprefill.moves
    assert never.summary()["makespan_s"] == reprefill.summary()["makespan_s"]
    assert [t.server for t in never.turns] == [t.server for t in reprefill.turns]


def test_every_turn_runs_once_and_its_prompt_is_served_or_computed(skewed_runs: dict) -> None:
    for policy, run in skewed_runs.items():
        assert len(run.turns) == SKEWED.sessions * SKEWED.turns, policy
        by_session: dict[str, list] = {}
        for t in run.turns:
            by_session.setdefault(t.session, []).append(t)
        for turns in by_session.values():
            assert [t.turn for t in turns] == list(range(1, SKEWED.turns + 1))
            for prev, nxt in zip(turns, turns[1:], strict=False):  # one turn at a time
                assert nxt.started >= prev.started + prev.latency_s - 1e-9
                assert nxt.prompt == prev.prompt + SKEWED.new_tokens + SKEWED.user_tokens
        computed = sum(t.prompt - t.cached for t in run.turns)
        assert run.prefill_tokens == computed, policy


def test_same_seed_same_result_and_the_seed_draws_the_lengths() -> None:
    spread = dataclasses.replace(SKEWED, context_spread=0.5)
    a = run_rollout(SMALL, spread, stats.MIGRATE, COSTS, NO_VERL).summary()
    b = run_rollout(SMALL, spread, stats.MIGRATE, COSTS, NO_VERL).summary()
    c = run_rollout(SMALL, dataclasses.replace(spread, seed=1), stats.MIGRATE, COSTS, NO_VERL)
    assert a == b and c.summary()["prefill_tokens"] != a["prefill_tokens"]


# ---------------------------------------------------------------------------- validation


def _verl_record(scale: float) -> dict:
    """A `bench_verl_pattern.py` result whose arms took `scale` x the simulated makespan."""
    config = {
        "sessions": 12,
        "skewed": 9,
        "turns": 2,
        "context": 2048,
        "user_tokens": 64,
        "new_tokens": 8,
        "repin_margin": 2,
        "prefill_seconds_per_token": None,
        "mem_fraction_static": 0.35,
        "seed": 0,
        "model": "llama3-8b",
        "default_balancer": "stand-in",
    }
    predicted = fleet_validate.predict_verl(config, COSTS)
    steps = {
        arm: [{"makespan_s": predicted[arm]["makespan_s"] * scale, "turns": [{"latency_s": 1.0}]}]
        for arm in stats.ARMS
    }
    return {"config": config, "summary": stats.summarize(steps, {0: []})}


def test_a_verl_pattern_record_is_compared_arm_by_arm() -> None:
    close = fleet_validate.compare_verl_record(_verl_record(1.1), COSTS)
    assert [r["arm"] for r in close["rows"]] == list(stats.ARMS)
    assert all(r["error"] == pytest.approx(1 / 1.1 - 1, abs=1e-3) for r in close["rows"])
    assert close["all_within"] and close["bound_s"] > 0
    far = fleet_validate.compare_verl_record(_verl_record(1.3), COSTS)
    assert not far["all_within"] and not any(r["within"] for r in far["rows"])


def test_the_rl_scene_replays_in_the_order_the_gpu_measured() -> None:
    record = json.loads((fleet_validate.RUNS_DIR / fleet_validate.SCENE_RECORDS[1]).read_text())
    eager = fleet_costs.derive(cuda_graphs=False)
    rows = {
        m: fleet_scenes.simulate_rl_scene(record, m, eager)
        for m in ("none", "recompute", "migrate")
    }
    assert (
        rows["migrate"]["high_p99_s"] < rows["recompute"]["high_p99_s"] < rows["none"]["high_p99_s"]
    )
    assert rows["migrate"]["moves"] == {"migrated": record["scene"]["conversations"]}
    assert rows["none"]["moves"] == {}


def test_moves_take_the_path_the_client_predicts_by_host() -> None:
    two_hosts = dataclasses.replace(SMALL, gpus_per_host=2)
    run = run_rollout(two_hosts, SKEWED, stats.MIGRATE, COSTS, NO_VERL)
    moved = [t.moved for t in run.turns if t.moved]
    assert moved
    paths = set()
    for move in moved:
        same_host = move.source.split("-")[0] == move.target.split("-")[0]
        assert move.path == ("device" if same_host else "host"), move
        paths.add(move.path)
    assert paths == {"device", "host"}
