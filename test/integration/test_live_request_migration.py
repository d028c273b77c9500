"""`move_request(live=True)` against CPU mini servers with the `/generate` stand-in.

A live move copies what the source holds of a decoding request (its prompt, inserted into
the radix tree once prefilled, as SGLang 0.5.12 does) while the request keeps decoding,
then stops it and moves only the pages produced since. Same servers and stand-in as
`test_request_migration.py`: the stand-in's tokens are a pure function of the sequence,
so the moved request must give exactly the tokens of one uninterrupted run. Migration
calls are slowed or failed on the client's side (an httpx transport), so that stage 1
spans several decode steps and each stage can fail against otherwise real servers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from generate_standin import StandinConfig, expected_output, held_at, standin_factory
from mini_server import ServerHandle, ServerPair, ServerSpec, start_servers
from sglang_kv_migration import cli
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.rollout.cost_model import CostModel, MigrationCosts, PrefillCosts
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    RequestMigrator,
)
from timing import wait_until

PAGE = 16
STEP_S = 0.01
SLOW_STAGE_S = 0.2  # ~20 decode steps: stage 1 spans more than a page of new tokens


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# The multi-stage test's request: the source already holds its prompt and the first 100
# tokens it will generate (an earlier identical rollout), so what it holds of the request
# grows as the request decodes, which SGLang 0.5.12 itself never exposes mid-decode.
STAGED_PROMPT = _seq(50_000, 2 * PAGE + 7)
STAGED_HISTORY = STAGED_PROMPT + expected_output(STAGED_PROMPT, 100)


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    config = StandinConfig(max_running=2, step_s=STEP_S, capacity_tokens=100_000)
    handles = start_servers(
        [
            ServerSpec(extension=standin_factory(config), preload=[(STAGED_HISTORY, 1)]),
            ServerSpec(extension=standin_factory(config)),
        ]
    )
    try:
        yield ServerPair(*handles)
    finally:
        for handle in handles:
            handle.stop()


ALWAYS_MIGRATE = CostModel(
    MigrationCosts(bandwidth_bytes_per_s=1e12, overhead_s=0.0), PrefillCosts(seconds_per_token=1.0)
)
# Migrating costs 3 s flat, recomputing 50 ms a token: a prompt of 6 pages (4.8 s)
# migrates, a delta of up to 3 pages (2.4 s) is left to the target.
DELTA_RECOMPUTES = CostModel(
    MigrationCosts(bandwidth_bytes_per_s=1e12, overhead_s=3.0),
    PrefillCosts(seconds_per_token=0.05),
)


class Shaped(httpx.BaseTransport):
    """Calls go to the real servers; the `fail`-th call to `path` answers 503 (0: none),
    and every call to `slow` waits `delay` first, then until the check `gate()` makes for
    it holds (bounded)."""

    def __init__(
        self,
        path: str = "",
        fail: int = 0,
        slow: str = "/transfer_request_kvcache",
        delay: float = SLOW_STAGE_S,
        gate: Callable[[], Callable[[], bool]] | None = None,
    ):
        self.path, self.fail, self.slow, self.delay, self.gate = path, fail, slow, delay, gate
        self.calls: dict[str, int] = {}
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path
        self.calls[route] = self.calls.get(route, 0) + 1
        if route == self.path and self.calls[route] == self.fail:
            return httpx.Response(503, json={"success": False, "message": "injected failure"})
        if route == self.slow:
            time.sleep(self.delay)
            if self.gate is not None:
                opened = self.gate()
                assert wait_until(opened, 60.0, interval_s=0.005), "the gate stayed shut"
        return self._real.handle_request(request)

    def close(self) -> None:
        self._real.close()


def _client(transport: httpx.BaseTransport) -> MigrationClient:
    return MigrationClient(http_client=httpx.Client(transport=transport, timeout=30))


def _load(server: ServerHandle) -> dict:
    return httpx.get(server.url + "/v1/loads", timeout=10).json()["loads"][0]


def _generated(server: ServerHandle, prompt: list[int]) -> int | None:
    """How many tokens `prompt`'s request, the only one on `server`, has generated; None
    while it does not run."""
    load = _load(server)
    return load["num_used_tokens"] - len(prompt) if load["num_running_reqs"] == 1 else None


def _start_decoding(
    migrator: RequestMigrator, server: ServerHandle, prompt: list[int], n: int, tokens: int = 3
):
    """Submit a request; its handle once it has generated `tokens` tokens (the caller
    holds `server` at some count, so it does not finish before its move)."""
    handle = migrator.submit(server.url, GenerateRequest(prompt, {"max_new_tokens": n}))
    assert wait_until(lambda: (_generated(server, prompt) or 0) >= tokens, 60.0, interval_s=0.01)
    return handle


def _a_page_more(server: ServerHandle, prompt: list[int]) -> Callable[[], bool]:
    """A `Shaped` gate: the request generated a page more than when the call came (so the
    next stage holds a page more), or it stopped running."""
    start = _generated(server, prompt)

    def decoded() -> bool:
        now = _generated(server, prompt)
        return start is None or now is None or now > start + PAGE

    return decoded


def _aligned(n: int) -> int:
    return n // PAGE * PAGE


# --------------------------------------------------------------------------- tests


def test_live_move_copies_the_prompt_while_decoding(servers: ServerPair) -> None:
    prompt = _seq(1000, 2 * PAGE + 7)
    transport = Shaped()
    with _client(transport) as client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        # It decodes on through the (slowed) stage 1, up to the gate at 100 tokens; moved
        # after 26, the stop leaves pages beyond the prompt's to the delta.
        with held_at(servers.source.url, 100):
            handle = _start_decoding(m, servers.source, prompt, 120, tokens=26)
            handle.migrator.move_request(handle, servers.target.url, live=True)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 120)
    assert out.finish_reason == {"type": "length", "length": 120}
    first, second = out.segments
    assert (first.kind, second.kind) == ("original", "migrated")
    (move,) = out.moves
    assert move.live and move.outcome == "migrated"
    stage1, delta = move.stages
    # Stage 1 moved the prompt's whole pages while the request kept decoding: it produced
    # tokens during the (slowed) stage.
    assert stage1.while_decoding and stage1.decision == "migrate"
    assert stage1.migrated_tokens == stage1.held_tokens == _aligned(len(prompt))
    assert 0 < stage1.generated < len(first.output_ids)
    # After the stop only the pages produced since moved (the target kept the prompt).
    moved_len = _aligned(len(prompt) + len(first.output_ids) - 1)
    assert not delta.while_decoding and delta.decision == "migrate"
    assert delta.held_tokens == moved_len
    assert delta.migrated_tokens == moved_len - _aligned(len(prompt)) > 0
    assert move.migration.migrated_token_size == delta.migrated_tokens
    assert second.cached_tokens == moved_len
    # The stall (last source token -> first target token) holds the delta's migration,
    # not stage 1's.
    assert move.stall_s is not None
    assert move.seconds["migrate"] <= move.stall_s < move.seconds["total"]
    assert 0 <= move.seconds["last_token_to_stop"] <= move.stall_s - move.seconds["migrate"]
    assert move.seconds["live"] >= SLOW_STAGE_S
    assert move.to_dict()["stages"][0]["migrated_tokens"] == stage1.migrated_tokens
    # Two migrations (stage 1, delta), each one transfer call that allocates on the
    # target itself (feature "source_allocate": no allocate trip of the client's).
    assert transport.calls["/transfer_request_kvcache"] == 2  # stage 1 and the delta
    assert "/allocate_token_for_transfer" not in transport.calls


def test_live_move_leaves_a_small_delta_to_the_target(servers: ServerPair) -> None:
    """mode="auto": the cost model prices the delta from what stage 1 moved, and a
    `recompute` verdict resumes at once (no migration round trips after the stop)."""
    prompt = _seq(2000, 6 * PAGE + 7)
    transport = Shaped(slow="")
    with _client(transport) as client, RequestMigrator(client, cost_model=DELTA_RECOMPUTES) as m:
        # One page of output before the move, held there (the gate).
        with held_at(servers.source.url, PAGE):
            handle = _start_decoding(m, servers.source, prompt, 60, tokens=PAGE)
            handle.migrator.move_request(handle, servers.target.url, live=True)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 60)
    (move,) = out.moves
    stage1, delta = move.stages
    assert stage1.migrated_tokens == _aligned(len(prompt))
    assert move.estimate.decision == "migrate"
    assert (delta.decision, delta.migrated_tokens) == ("recompute", 0)
    assert transport.calls["/transfer_request_kvcache"] == 1  # stage 1 only
    assert out.segments[1].cached_tokens == _aligned(len(prompt))


def test_live_move_takes_more_stages_while_the_source_holds_more(servers: ServerPair) -> None:
    """The source holds more of the request the longer it decodes (`STAGED_HISTORY`):
    stages repeat while it holds a page more than the target, at most `live_max_stages`
    (asyncio API)."""
    # Each stage's transfer waits until the request decoded another page, so the next
    # stage finds a page more on the source (a gate, not the clock).
    transport = Shaped(delay=0.0, gate=lambda: _a_page_more(servers.source, STAGED_PROMPT))

    async def scenario():
        client = _client(transport)
        async with AsyncRequestMigrator(
            client, cost_model=ALWAYS_MIGRATE, live_stage_tokens=PAGE, live_max_stages=3
        ) as migrator:
            handle = await migrator.submit(
                servers.source.url, GenerateRequest(STAGED_PROMPT, {"max_new_tokens": 300})
            )
            deadline = time.monotonic() + 60.0
            while not handle.started and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            report = await migrator.move_request(handle, servers.target.url, live=True)
            out = await handle.result()
        client.close()
        return report, out

    report, out = asyncio.run(scenario())
    assert out.output_ids == expected_output(STAGED_PROMPT, 300)
    decoding = [s for s in report.stages if s.while_decoding]
    assert 2 <= len(decoding) <= 3
    held = [s.held_tokens for s in decoding]
    assert held == sorted(held) and len(set(held)) == len(held)
    # Each stage moved only what the previous ones had not.
    assert decoding[0].migrated_tokens == held[0]
    for before, stage in zip(decoding, decoding[1:], strict=False):
        assert stage.migrated_tokens == stage.held_tokens - before.held_tokens
        assert stage.generated > before.generated
    assert not report.stages[-1].while_decoding
    assert out.segments[1].cached_tokens == report.migration.matched_after_commit


@pytest.mark.parametrize(
    "stage,on_failure",
    [("decoding", "target"), ("decoding", "source"), ("delta", "target"), ("delta", "source")],
)
def test_live_move_falls_back_at_each_stage(
    servers: ServerPair, stage: str, on_failure: str
) -> None:
    base = {"decoding": 3000, "delta": 4000}[stage] + (0 if on_failure == "target" else 500)
    prompt = _seq(base, 2 * PAGE + 7)
    # Stage 1's transfer is the first, the delta's the second.
    transport = Shaped("/transfer_request_kvcache", fail=1 if stage == "decoding" else 2)
    with _client(transport) as client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        # Held at 24 tokens, so the stop leaves a page beyond the prompt's to the delta.
        with held_at(servers.source.url, 24):
            handle = _start_decoding(m, servers.source, prompt, 80, tokens=24)
            m.move_request(handle, servers.target.url, live=True, on_failure=on_failure)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 80)
    (move,) = out.moves
    assert move.outcome == "fell_back" and move.resumed_on == (
        servers.target.url if on_failure == "target" else servers.source.url
    )
    assert "injected failure" in move.failure
    failed = move.stages[-1]
    assert failed.decision == "failed" and failed.while_decoding == (stage == "decoding")
    kinds = [s.kind for s in out.segments]
    if stage == "decoding" and on_failure == "source":
        # The request never stopped: one piece, no stall.
        assert kinds == ["original"] and move.stall_s == 0.0
        return
    assert kinds == ["original", "reprefill" if on_failure == "target" else "resumed_on_source"]
    assert move.stall_s is not None and move.stall_s > 0
    resumed = out.segments[1]
    if on_failure == "source":
        assert resumed.cached_tokens > 0  # the source still held the request's KV
    elif stage == "delta":
        # Stage 1 had moved the prompt: the target re-prefilled only the delta.
        assert resumed.cached_tokens == _aligned(len(prompt))
    else:
        assert resumed.cached_tokens == 0


def test_live_move_of_a_request_that_finishes_meanwhile(servers: ServerPair) -> None:
    """The request finishes on the source during stage 1 (its transfer waits until the
    source runs no request): that is the result."""
    prompt = _seq(6000, 2 * PAGE + 3)

    def source_idle() -> Callable[[], bool]:
        return lambda: _load(servers.source)["num_running_reqs"] == 0

    # The transfer, which allocates on the target: held before the grant's clock starts.
    slow = Shaped(slow="/transfer_request_kvcache", delay=0.0, gate=source_idle)
    with _client(slow) as client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        handle = m.submit(servers.source.url, GenerateRequest(prompt, {"max_new_tokens": 40}))
        assert wait_until(lambda: handle.handle.started, 60.0, interval_s=0.005)
        report = m.move_request(handle, servers.target.url, live=True)
        out = handle.result(timeout=30)
    assert report.outcome == "finished_before_move" and report.live
    assert report.stages and report.stages[0].while_decoding
    assert out.output_ids == expected_output(prompt, 40)
    assert [s.kind for s in out.segments] == ["original"]


def test_recompute_mode_ignores_live(servers: ServerPair) -> None:
    prompt = _seq(6500, PAGE + 3)
    with RequestMigrator(cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 10):
            handle = _start_decoding(m, servers.source, prompt, 40)
            handle.migrator.move_request(handle, servers.target.url, live=True, mode="recompute")
        out = handle.result()
    (move,) = out.moves
    assert move.outcome == "recomputed" and move.stages == []
    assert out.output_ids == expected_output(prompt, 40)
    assert move.stall_s is not None


def test_rebalance_cli_moves_a_decoding_request_live(servers: ServerPair, tmp_path, capsys) -> None:
    """`--live --move-running`: the running request on the pressured source moves live.
    `--min-held-tokens`: only once the source holds its prompt's KV (a request moved
    before its prefill was cached has nothing to copy while it decodes: no live stage)."""
    prompts = [_seq(7000, 2 * PAGE + 5), _seq(7100, 2 * PAGE + 5), _seq(7200, PAGE)]
    lines = [
        {"server": servers.source.url, "input_ids": p, "priority": 5 - i,
         "sampling_params": {"max_new_tokens": n}}
        for i, (p, n) in enumerate(zip(prompts, (200, 200, 20), strict=True))
    ]  # fmt: skip
    requests = tmp_path / "work.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    code = cli.main(
        ["rebalance", "--server", servers.source.url, "--server", servers.target.url,
         "--requests", str(requests), "--output", str(output), "--mode", "migrate",
         "--move-running", "--live", "--kv-pressure", "0.0", "--interval", "0.05",
         "--min-held-tokens", str(PAGE),
         "--max-rounds", "400", "--max-concurrent", "1", "--max-moves-per-round", "1"]
    )  # fmt: skip
    assert code == 0
    results = [json.loads(line) for line in output.read_text().splitlines()]
    for prompt, line, result in zip(prompts, lines, results, strict=True):
        n = line["sampling_params"]["max_new_tokens"]
        assert result["output_ids"] == expected_output(prompt, n)
    moves = [m for r in results for m in r["moves"]]
    assert moves and all(m["live"] for m in moves)
    assert any(m["stages"] and m["stages"][0]["while_decoding"] for m in moves)
    assert all("stall" in m["seconds"] for m in moves if m["outcome"] == "migrated")


# --------------------------------------------------------------------------- benchmark


def test_bench_live_arms_on_cpu(servers: ServerPair) -> None:
    """`benchmark/bench_live_arms.py`'s arms and report on the mini servers (the GPU run
    is the lead's): every arm moves the decoding request and gives the reference output;
    the live arms report their stages and a stall."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    import bench_live_arms as bench

    assert bench.parse_args([]).contexts == [4096, 16384, 32768]
    args = argparse.Namespace(gen=60, move_after=8, arm_timeout=120.0)
    arms = {}
    for i, arm in enumerate(bench.ARMS):  # a prompt each: the target is not flushed here
        prompt = _seq(9000 + 100 * i, 2 * PAGE + 5)
        # Moved after 8 tokens, held at 30 until then: it cannot finish first.
        with held_at(servers.source.url, 30):
            arm_run = bench.run_arm(arm, servers.source.url, servers.target.url, prompt, args)
            row = asyncio.run(arm_run)
        row["equals_reference"] = row["output_ids"] == expected_output(prompt, 60)
        arms[arm] = row
    assert all(row["equals_reference"] for row in arms.values())
    assert all(row["stall_s"] is not None and row["stall_s"] > 0 for row in arms.values())
    assert arms["live_migrate"]["stages"][0]["while_decoding"]
    assert arms["live_migrate"]["stages"][0]["migrated_tokens"] == 2 * PAGE
    assert arms["recompute"]["outcome"] == "recomputed"
    checks = bench.checks(arms, ttft=0.01)
    assert checks["all_equal_reference"] and set(checks) >= {"live", "live_migrate"}
    table = bench.markdown([{"context": 37, "cached_ttft_s": 0.01, "arms": arms,
                             "checks": checks}], list(bench.ARMS))  # fmt: skip
    assert table.count("\n") == 2 and "| 37 |" in table
