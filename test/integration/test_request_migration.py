"""`move_request` against CPU mini servers with the `/generate` stand-in.

The servers are `mini_server`s (real HiRadixCache, real migration routes and Mooncake TCP
on 127.0.0.1) extended with `generate_standin`, a test stand-in for SGLang's
`/generate` and `/abort_request` whose tokens are a pure function of the sequence: a
request that is stopped, moved and resumed must give exactly the tokens of one
uninterrupted run (`expected_output`). Failures are injected on the client's side of the
migration calls (an httpx transport that answers 503 for one route), so each phase fails
against otherwise real servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from fail_on import FailOn
from generate_standin import StandinConfig, expected_output, held_at, hold, standin_factory
from mini_server import ServerHandle, ServerPair, ServerSpec, start_servers
from sglang_kv_migration import cli
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.rollout.cost_model import CostModel, MigrationCosts, PrefillCosts
from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateFailed,
    GenerateRequest,
    PieceProgress,
    RequestMigrator,
    read_generate_stream,
)
from timing import wait_until

# Two tests here also run on 0.5.23 (any_sglang): a running request moved with its KV
# and a queued one with its history, the request migrator over that line's server. The
# rest exercise the client's decisions (failures, cost model, rebalancer, CLI) against
# the same routes, which the marked tests and test_http_api.py cover on both lines.

PAGE = 16
STEP_S = 0.01
# Where the source holds a request a test moves (`generate_standin.hold`): it is still
# there when the move comes, however slow the machine.
HOLD_AT = 10


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# The source holds this conversation prefix from the start (a previous turn).
QUEUED_HISTORY = _seq(3000, 3 * PAGE)


# Earlier turns of the conversations the rebalancer test queues on the source.
REBALANCE_HISTORIES = [_seq(10_000 + 1000 * i, 2 * PAGE) for i in range(3)]
CLI_HISTORIES = [_seq(15_000, 2 * PAGE), _seq(16_000, 2 * PAGE)]
# Earlier turns of the scene test's conversations (two high-priority, one low).
SCENE_HISTORIES = [_seq(30_000 + 1000 * i, 2 * PAGE) for i in range(3)]
SOURCE_CAPACITY = 200  # tokens: a few queued prompts put the source under KV pressure


# What the servers' /metrics say: 10 GB/s, 1 MB per token and 2 ms of fixed cost per
# migration; 1 ms of prefill per token on the target (SGLang's device-timer series).
SOURCE_METRICS = """\
sglang:kv_migration_bytes_total{tp_rank="0",role="source"} 1e9
sglang:kv_migration_tokens_total{tp_rank="0",role="source"} 1000
sglang:kv_migration_phase_seconds_sum{tp_rank="0",phase="transfer"} 0.1
sglang:kv_migration_phase_seconds_count{tp_rank="0",phase="transfer"} 10
"""
TARGET_METRICS = """\
sglang:kv_migration_phase_seconds_sum{tp_rank="0",phase="allocate"} 0.01
sglang:kv_migration_phase_seconds_count{tp_rank="0",phase="allocate"} 10
sglang:kv_migration_phase_seconds_sum{tp_rank="0",phase="commit"} 0.01
sglang:kv_migration_phase_seconds_count{tp_rank="0",phase="commit"} 10
sglang:forward_execution_seconds_total{category="extend"} 5.0
sglang:realtime_tokens_total{mode="prefill_compute"} 5000
"""


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    source = standin_factory(
        StandinConfig(
            max_running=1,
            step_s=STEP_S,
            capacity_tokens=SOURCE_CAPACITY,
            metrics_text=SOURCE_METRICS,
        )
    )
    target = standin_factory(
        StandinConfig(
            max_running=1, step_s=STEP_S, capacity_tokens=100_000, metrics_text=TARGET_METRICS
        )
    )
    histories = [QUEUED_HISTORY, *REBALANCE_HISTORIES, *CLI_HISTORIES, *SCENE_HISTORIES]
    preload = [(h, 1 + i) for i, h in enumerate(histories)]
    handles = start_servers(
        [ServerSpec(extension=source, preload=preload), ServerSpec(extension=target)]
    )
    try:
        yield ServerPair(*handles)
    finally:
        for handle in handles:
            handle.stop()


# Migration always looks cheaper than recomputation, so the moves below really migrate.
ALWAYS_MIGRATE = CostModel(
    MigrationCosts(bandwidth_bytes_per_s=1e12, overhead_s=0.0), PrefillCosts(seconds_per_token=1.0)
)


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def _load(server: ServerHandle) -> dict:
    return httpx.get(server.url + "/v1/loads", timeout=10).json()["loads"][0]


def _decoding_on(server: ServerHandle, prompt: list[int]):
    """A check for `wait_until`: `prompt`'s request, the only one on `server`, runs and
    has generated a few tokens."""

    def decoding() -> bool:
        load = _load(server)
        return load["num_running_reqs"] == 1 and load["num_used_tokens"] >= len(prompt) + 3

    return decoding


def _start_running(migrator: RequestMigrator, server: ServerHandle, prompt: list[int], n: int):
    """Submit a request and return its handle once it has run a few steps (the caller
    holds `server` at `HOLD_AT` tokens, so it does not finish before its move)."""
    handle = migrator.submit(server.url, GenerateRequest(prompt, {"max_new_tokens": n}))
    assert wait_until(_decoding_on(server, prompt), 60.0, interval_s=0.01)
    return handle


# --------------------------------------------------------------------------- tests


def test_continuation_and_finished_by() -> None:
    params = {"max_new_tokens": 10, "min_new_tokens": 4, "stop_token_ids": [7]}
    req = GenerateRequest([1, 2, 3], params, priority=2, extra_key="k",
                          extra_body={"return_logprob": True})  # fmt: skip
    rest = req.continuation([5, 6])
    assert rest.input_ids == [1, 2, 3, 5, 6]
    assert rest.sampling_params == {"max_new_tokens": 8, "min_new_tokens": 2, "stop_token_ids": [7]}
    assert rest.rid != req.rid and (rest.priority, rest.extra_key) == (2, "k")
    body = rest.body()
    assert (body["return_logprob"], body["priority"], body["rid"]) == (True, 2, rest.rid)
    assert req.sampling_params["max_new_tokens"] == 10  # the original is untouched
    eos = frozenset({2})
    assert req.finished_by([5], eos) is None
    assert req.finished_by([5, 7], eos) == {"type": "stop", "matched": 7}
    assert req.finished_by([5, 2], eos) == {"type": "stop", "matched": 2}
    no_eos = GenerateRequest([1], {"max_new_tokens": 10, "ignore_eos": True})
    assert no_eos.finished_by([5, 2], eos) is None
    assert req.finished_by(list(range(20, 30)), eos) == {"type": "length", "length": 10}


@pytest.mark.any_sglang
def test_running_request_moves_with_its_kv(servers: ServerPair) -> None:
    prompt = _seq(1000, 2 * PAGE + 7)
    with RequestMigrator(cost_model=ALWAYS_MIGRATE) as migrator:
        with held_at(servers.source.url, HOLD_AT):
            handle = migrator.submit(
                servers.source.url,
                GenerateRequest(
                    prompt,
                    {"max_new_tokens": 60, "temperature": 0.0},
                    priority=3,
                    extra_body={"return_logprob": True},
                ),
            )
            # Some tokens on the source.
            assert wait_until(_decoding_on(servers.source, prompt), 60.0, interval_s=0.01)
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 60)
    assert out.finish_reason == {"type": "length", "length": 60}
    assert out.prompt_ids == prompt
    # Per-token extras of both pieces are joined like the tokens.
    assert [t for _, t, _ in out.meta_info["output_token_logprobs"]] == out.output_ids
    assert out.meta_info["completion_tokens"] == 60
    first, second = out.segments
    assert (first.server_url, first.kind) == (servers.source.url, "original")
    assert first.finish_reason["type"] == "abort"
    assert 0 < len(first.output_ids) < 60
    assert (second.server_url, second.kind) == (servers.target.url, "migrated")
    assert len(first.output_ids) + len(second.output_ids) == 60
    (move,) = out.moves
    assert move.outcome == "migrated" and move.generated_before_move == len(first.output_ids)
    assert move.estimate is not None and move.estimate.decision == "migrate"
    # The page-aligned part of prompt + generated[:-1] moved, and the target served it
    # from cache.
    moved_len = (len(prompt) + len(first.output_ids) - 1) // PAGE * PAGE
    assert move.migration.migrated_token_size == moved_len
    assert move.migration.migrated_bytes > 0
    assert second.cached_tokens == move.migration.matched_after_commit == moved_len


@pytest.mark.any_sglang
def test_queued_request_moves_its_history(servers: ServerPair) -> None:
    """A request queued behind another: nothing generated yet, but the conversation so far
    (cached from an earlier turn) moves."""
    blocker_prompt = _seq(4000, PAGE)
    prompt = QUEUED_HISTORY + _seq(3100, 9)

    async def scenario() -> tuple:
        async with AsyncRequestMigrator(cost_model=ALWAYS_MIGRATE) as migrator:
            blocker = await migrator.submit(
                servers.source.url, GenerateRequest(blocker_prompt, {"max_new_tokens": 40})
            )
            await _until(lambda: _load(servers.source)["num_running_reqs"] == 1)
            queued = await migrator.submit(
                servers.source.url, GenerateRequest(prompt, {"max_new_tokens": 12}, priority=9)
            )
            await _until(lambda: _load(servers.source)["num_waiting_reqs"] == 1)
            assert {h.request.rid for h in migrator.live()} == {
                blocker.request.rid,
                queued.request.rid,
            }
            await migrator.move_request(queued, servers.target.url)
            out = await queued.result()
            return out, await blocker.result()

    # The blocker waits at the gate until the queued request was moved (aborted).
    with held_at(servers.source.url, HOLD_AT, aborts=1):
        out, blocker_out = asyncio.run(scenario())
    assert out.output_ids == expected_output(prompt, 12)
    first, second = out.segments
    assert first.output_ids == [] and first.finish_reason["type"] == "abort"
    assert second.server_url == servers.target.url and second.kind == "migrated"
    (move,) = out.moves
    assert move.migration.migrated_token_size == len(QUEUED_HISTORY)
    assert second.cached_tokens == len(QUEUED_HISTORY)
    # The request ahead of it was not disturbed.
    assert blocker_out.output_ids == expected_output(blocker_prompt, 40)
    assert [s.kind for s in blocker_out.segments] == ["original"]


PHASE_ROUTES = {
    "session_info": "/get_transfer_session_info",
    "extra_token_size": "/get_request_extra_token_size",
    "allocate": "/allocate_token_for_transfer",
    "transfer": "/transfer_request_kvcache",
    "commit": "/commit",
}


@pytest.mark.parametrize("phase", list(PHASE_ROUTES))
def test_failure_at_each_phase_falls_back_to_reprefill(servers: ServerPair, phase: str) -> None:
    prompt = _seq(5000 + 100 * list(PHASE_ROUTES).index(phase), PAGE + 5)
    transport = FailOn(PHASE_ROUTES[phase])
    client = MigrationClient(http_client=httpx.Client(transport=transport, timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as migrator:
        with held_at(servers.source.url, HOLD_AT):
            handle = _start_running(migrator, servers.source, prompt, 30)
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()

    assert transport.hits >= 1
    assert out.output_ids == expected_output(prompt, 30)
    assert out.finish_reason["type"] == "length"
    (move,) = out.moves
    assert move.outcome == "fell_back" and move.resumed_on == servers.target.url
    assert "injected failure" in move.failure
    assert [s.kind for s in out.segments] == ["original", "reprefill"]
    # Nothing was committed on the target: it recomputed the whole prefix.
    assert out.segments[1].cached_tokens == 0


class CountCalls(httpx.BaseTransport):
    """Counts the calls per (port, route); every call goes to the real server."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int | None, str], int] = {}
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.url.port, request.url.path)
        self.calls[key] = self.calls.get(key, 0) + 1
        return self._real.handle_request(request)

    def close(self) -> None:
        self._real.close()


def test_one_size_query_per_move(servers: ServerPair) -> None:
    """In auto mode the source's size query prices the move and the migration reuses it;
    session info comes from the client's cache."""
    prompt = _seq(6500, 2 * PAGE + 1)
    transport = CountCalls()
    client = MigrationClient(http_client=httpx.Client(transport=transport, timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as migrator:
        with held_at(servers.source.url, HOLD_AT):
            handle = _start_running(migrator, servers.source, prompt, 30)
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 30)
    (move,) = out.moves
    assert move.outcome == "migrated" and move.migration.migrated_token_size > 0
    source_port = httpx.URL(servers.source.url).port
    target_port = httpx.URL(servers.target.url).port
    assert transport.calls[(source_port, "/get_request_extra_token_size")] == 1
    assert transport.calls[(source_port, "/get_transfer_session_info")] == 1
    assert transport.calls[(target_port, "/get_transfer_session_info")] == 1


def test_failure_can_resume_on_the_source(servers: ServerPair) -> None:
    prompt = _seq(6000, 2 * PAGE + 1)
    client = MigrationClient(http_client=httpx.Client(transport=FailOn("/commit"), timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as migrator:
        with held_at(servers.source.url, HOLD_AT):
            handle = _start_running(migrator, servers.source, prompt, 30)
            migrator.move_request(handle, servers.target.url, on_failure="source")
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 30)
    assert [(s.server_url, s.kind) for s in out.segments] == [
        (servers.source.url, "original"),
        (servers.source.url, "resumed_on_source"),
    ]
    # The source still held the request's KV: its resumed piece hit the cache.
    assert out.segments[1].cached_tokens > 0


def test_cost_model_says_recompute(servers: ServerPair) -> None:
    prompt = _seq(7000, PAGE + 3)
    slow_path = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1.0, overhead_s=10.0),
        PrefillCosts(seconds_per_token=1e-6),
    )
    with RequestMigrator(cost_model=slow_path) as migrator:
        with held_at(servers.source.url, HOLD_AT):
            handle = _start_running(migrator, servers.source, prompt, 30)
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()

    assert out.output_ids == expected_output(prompt, 30)
    (move,) = out.moves
    assert move.outcome == "recomputed" and move.migration is None
    assert move.estimate.decision == "recompute"
    assert move.estimate.migrate_s > move.estimate.recompute_s
    assert move.estimate.tokens > 0 and move.estimate.nbytes > 0  # priced from session info
    assert out.segments[1].kind == "reprefill"


def test_cost_model_learned_from_metrics_decides(servers: ServerPair) -> None:
    prompt = _seq(7500, 3 * PAGE + 2)
    with RequestMigrator() as migrator:
        model = migrator.refresh_cost_model(servers.source.url, servers.target.url)
        assert model.migration.bandwidth_bytes_per_s == pytest.approx(1e10)  # 1 GB / 0.1 s
        assert model.migration.bytes_per_token == pytest.approx(1e6)
        assert model.migration.overhead_s == pytest.approx(0.002 + 0.005)
        assert model.prefill.seconds_per_token == pytest.approx(1e-3)
        with held_at(servers.source.url, HOLD_AT):
            handle = _start_running(migrator, servers.source, prompt, 30)
            # mode="auto": the model decides
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()

    (move,) = out.moves
    tokens = move.estimate.tokens
    assert tokens > 0 and move.estimate.nbytes == tokens * 1_000_000
    assert move.estimate.recompute_s == pytest.approx(tokens * 1e-3)
    assert move.estimate.migrate_s == pytest.approx(0.007 + tokens * 1e-4)
    assert move.outcome == "migrated" and move.migration.migrated_token_size == tokens
    assert out.output_ids == expected_output(prompt, 30)


def test_finished_request_is_not_moved(servers: ServerPair) -> None:
    prompt = _seq(8000, 5)
    with RequestMigrator() as migrator:
        handle = migrator.submit(servers.source.url, GenerateRequest(prompt, {"max_new_tokens": 3}))
        done = handle.result(timeout=30)
        report = migrator.move_request(handle, servers.target.url)
    assert done.output_ids == expected_output(prompt, 3)
    assert report.outcome == "finished_before_move" and report.resumed_on == ""
    with pytest.raises(ValueError, match="already runs"):
        RequestMigrator().move_request(handle, servers.source.url)


def test_adopted_call_moves(servers: ServerPair) -> None:
    """The caller sent /generate itself (with its rid) and hands the in-flight call over."""
    prompt = _seq(8500, PAGE + 9)
    request = GenerateRequest(prompt, {"max_new_tokens": 40})
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        RequestMigrator(cost_model=ALWAYS_MIGRATE) as migrator,
    ):
        with held_at(servers.source.url, HOLD_AT):
            call = pool.submit(
                lambda: (
                    httpx.post(servers.source.url + "/generate", json=request.body(), timeout=60)
                    .raise_for_status()
                    .json()
                )
            )
            assert wait_until(_decoding_on(servers.source, prompt), 60.0, interval_s=0.01)
            handle = migrator.adopt(servers.source.url, request, call)
            handle.migrator.move_request(handle, servers.target.url)
        out = handle.result()
    assert out.rid == request.rid
    assert out.output_ids == expected_output(prompt, 40)
    assert [s.kind for s in out.segments] == ["original", "migrated"]
    assert out.segments[0].rid == request.rid != out.segments[1].rid


def test_source_that_never_answers_restarts_on_the_target(servers: ServerPair) -> None:
    prompt = _seq(8700, 7)

    async def scenario() -> tuple:
        async with AsyncRequestMigrator(abort_retry_s=0.05, abort_timeout_s=0.3) as migrator:
            never = asyncio.get_running_loop().create_future()  # a call that never returns
            request = GenerateRequest(prompt, {"max_new_tokens": 5})
            handle = await migrator.adopt(servers.source.url, request, never)
            report = await migrator.move_request(handle, servers.target.url)
            return report, await handle.result(), never

    report, out, never = asyncio.run(scenario())
    assert report.outcome == "restarted" and "did not return" in report.failure
    assert never.cancelled()
    assert out.output_ids == expected_output(prompt, 5)
    assert [(s.server_url, s.kind) for s in out.segments] == [(servers.target.url, "restarted")]


# --------------------------------------------------------------------------- rebalancer


def test_rebalancer_moves_queued_high_priority_requests(servers: ServerPair) -> None:
    """The source runs one long low-priority request and queues three others (each with a
    cached earlier turn); the rebalancer moves the queued ones, highest priority first,
    two at a time, and stops by itself once everything finished."""
    blocker_prompt = _seq(13_000, PAGE)
    prompts = [h + _seq(14_000 + 100 * i, 5) for i, h in enumerate(REBALANCE_HISTORIES)]
    priorities = [1, 9, 5]
    policy = RebalancePolicy(
        kv_pressure=0.3, target_max_ratio=0.5, max_concurrent=2, mode="migrate"
    )

    async def scenario() -> tuple:
        async with AsyncRequestMigrator() as migrator:
            blocker = await migrator.submit(
                servers.source.url,
                GenerateRequest(blocker_prompt, {"max_new_tokens": 80}, priority=0),
            )
            await _until(lambda: _load(servers.source)["num_running_reqs"] == 1)
            queued = [
                await migrator.submit(
                    servers.source.url, GenerateRequest(p, {"max_new_tokens": 10}, priority=prio)
                )
                for p, prio in zip(prompts, priorities, strict=True)
            ]
            await _until(lambda: _load(servers.source)["num_waiting_reqs"] == 3)
            rebalancer = Rebalancer(migrator, [servers.source.url, servers.target.url], policy)
            first_round = await rebalancer.step()
            summary = await rebalancer.run(max_rounds=300, interval_s=0.02)
            outs = [await h.result() for h in queued]
            return first_round, summary, outs, await blocker.result(), queued

    # The blocker waits at the gate until the three queued requests were moved.
    with held_at(servers.source.url, HOLD_AT, aborts=3):
        first_round, summary, outs, blocker_out, queued = asyncio.run(scenario())
    # Round one: the two most urgent, to the idle target; the third follows later.
    assert [m.handle for m in first_round] == [queued[1], queued[2]]
    assert {(m.source_url, m.target_url) for m in first_round} == {
        (servers.source.url, servers.target.url)
    }
    assert summary.moves_started == 3 and summary.errors == []
    assert summary.outcomes == {"migrated": 3}
    assert summary.rounds < 300  # stopped by itself once idle
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == expected_output(prompt, 10)
        assert [s.server_url for s in out.segments] == [servers.source.url, servers.target.url]
        assert out.segments[1].cached_tokens == 2 * PAGE  # the earlier turn moved
        assert out.moves[0].migration.migrated_token_size == 2 * PAGE
    # The running low-priority request stayed where it was.
    assert [s.kind for s in blocker_out.segments] == ["original"]
    assert blocker_out.output_ids == expected_output(blocker_prompt, 80)


def test_rebalancer_leaves_a_running_request_alone(servers: ServerPair) -> None:
    """A high-priority request already decoding on the pressured source is not moved (the
    migrator's streamed call saw its first token); the queued low-priority ones are."""
    running_prompt = _seq(15_000, PAGE)
    queued_prompts = [_seq(15_100 + 100 * i, 5) for i in range(2)]
    policy = RebalancePolicy(
        kv_pressure=0.1, target_max_ratio=0.9, max_concurrent=4, mode="recompute"
    )

    async def scenario() -> tuple:
        async with AsyncRequestMigrator() as migrator:
            running = await migrator.submit(
                servers.source.url,
                GenerateRequest(running_prompt, {"max_new_tokens": 60}, priority=9),
            )
            await _until(lambda: running.started)
            queued = [
                await migrator.submit(
                    servers.source.url, GenerateRequest(p, {"max_new_tokens": 4}, priority=0)
                )
                for p in queued_prompts
            ]
            await _until(lambda: _load(servers.source)["num_waiting_reqs"] == 2)
            states = [running.started, *(h.started for h in queued)]
            rebalancer = Rebalancer(migrator, [servers.source.url, servers.target.url], policy)
            first_round = await rebalancer.step()
            for move in first_round:  # resumed on the target while the source holds on
                await move.handle.result()
            await asyncio.to_thread(hold, servers.source.url, None)
            outs = [await h.result() for h in (running, *queued)]
            return states, first_round, outs, queued

    # The running request waits at the gate until the moved ones have finished.
    with held_at(servers.source.url, HOLD_AT):
        states, first_round, outs, queued = asyncio.run(scenario())
    assert states == [True, False, False]
    # Before, the running high-priority request came first and was moved.
    assert first_round and first_round[0].handle is queued[1]  # newest first within a priority
    assert all(m.handle in queued for m in first_round)
    running_out, *queued_outs = outs
    assert [s.kind for s in running_out.segments] == ["original"]
    assert running_out.output_ids == expected_output(running_prompt, 60)
    assert queued_outs[1].segments[-1].server_url == servers.target.url
    for prompt, out in zip(queued_prompts, queued_outs, strict=True):
        assert out.output_ids == expected_output(prompt, 4)


def test_rebalancer_sees_the_scene(servers: ServerPair) -> None:
    """The seed's scene on a mini server: its one running slot is taken by a decoding
    high-priority request (KV has room: the pressure is the full slot); queued behind it
    are two high-priority conversations whose earlier turns the source holds — in its
    host pool only, after evicting its GPU tier — a high-priority request it holds no
    KV for, and a low-priority conversation. The scene policy moves exactly the two
    conversations, in one round, priced and moved on the host path."""
    servers.source.ask(0, "evict_device")
    high_a, high_b, low_history = (
        h + _seq(36_000 + 100 * i, 5) for i, h in enumerate(SCENE_HISTORIES)
    )
    uncached = _seq(37_000, 5)
    decoding_prompt = _seq(38_000, PAGE)
    policy = RebalancePolicy(
        kv_pressure=0.99, min_priority=5, min_held_tokens=PAGE, max_concurrent=4, mode="auto"
    )

    async def scenario() -> tuple:
        async with AsyncRequestMigrator() as migrator:
            decoding = await migrator.submit(
                servers.source.url,
                GenerateRequest(decoding_prompt, {"max_new_tokens": 60}, priority=9),
            )
            await _until(lambda: decoding.started)
            queued = [
                await migrator.submit(
                    servers.source.url, GenerateRequest(p, {"max_new_tokens": 6}, priority=prio)
                )
                for p, prio in ((high_a, 9), (high_b, 9), (uncached, 9), (low_history, 0))
            ]
            await _until(lambda: _load(servers.source)["num_waiting_reqs"] == 4)
            load = _load(servers.source)
            rebalancer = Rebalancer(migrator, [servers.source.url, servers.target.url], policy)
            first_round = await rebalancer.step()
            headroom = rebalancer.summary.last_loads[servers.target.url].host_headroom_tokens
            for move in first_round:  # resumed on the target while the source holds on
                await move.handle.result()
            await asyncio.to_thread(hold, servers.source.url, None)
            summary = await rebalancer.run(max_rounds=300, interval_s=0.02)
            outs = [await h.result() for h in (decoding, *queued)]
            return load, first_round, headroom, summary, queued, outs

    # The decoding request waits at the gate until the two conversations were moved and
    # resumed: until then nothing the source admits or finishes can evict their
    # histories from its host pool before their moves price them.
    with held_at(servers.source.url, HOLD_AT):
        load, first_round, headroom, summary, queued, outs = asyncio.run(scenario())
    assert load["num_total_tokens"] < 0.99 * load["max_total_num_tokens"]  # KV has room
    # The target said what its host pool can take (its size query with "headroom"), and
    # each move was planned on a pool that holds it.
    assert isinstance(headroom, int) and headroom >= 2 * PAGE
    assert all(m.path in ("device", "host") for m in first_round)
    assert [m.handle for m in first_round] == [queued[1], queued[0]]  # newest first
    assert [(m.held.tokens, m.held.device_tokens) for m in first_round] == [(2 * PAGE, 0)] * 2
    assert summary.moves_started == 2 and summary.errors == []
    assert summary.outcomes == {"migrated": 2}
    for report in summary.reports:
        assert report.estimate.path == "host" and report.migration.path == "host"
        assert report.migration.migrated_token_size == 2 * PAGE
    decoding_out, a_out, b_out, uncached_out, low_out = outs
    for out in (a_out, b_out):
        assert [s.server_url for s in out.segments] == [servers.source.url, servers.target.url]
        assert out.segments[1].cached_tokens == 2 * PAGE
    for out in (decoding_out, uncached_out, low_out):
        assert [(s.server_url, s.kind) for s in out.segments] == [(servers.source.url, "original")]
    prompts = (decoding_prompt, high_a, high_b, uncached, low_history)
    for prompt, out, n in zip(prompts, outs, (60, 6, 6, 6, 6), strict=True):
        assert out.output_ids == expected_output(prompt, n)


def test_stream_reader_folds_cumulative_and_incremental_chunks() -> None:
    async def lines(chunks: list[str]):
        for chunk in chunks:
            yield chunk

    def event(ids: list[int], total: int, finish: dict | None = None) -> str:
        meta = {"completion_tokens": total, "finish_reason": finish, "cached_tokens": 3}
        return "data: " + json.dumps({"output_ids": ids, "meta_info": meta})

    done = {"type": "length", "length": 3}
    cumulative = [event([7], 1), "", event([7, 8], 2), event([7, 8, 9], 3, done), "data: [DONE]"]
    incremental = [event([7], 1), event([8], 2), event([9], 3, done), "data: [DONE]"]
    aborted = {"type": "abort", "message": "Aborted"}
    abort_repeats_last = [event([7], 1), event([7, 8], 2), event([7, 8, 9], 3), event([9], 3)]
    for chunks in (cumulative, incremental):
        progress = PieceProgress()
        reply = asyncio.run(read_generate_stream(lines(chunks), progress, "srv"))
        assert reply["output_ids"] == [7, 8, 9]
        assert reply["meta_info"]["finish_reason"] == done
        assert progress.tokens == 3 and progress.first_token_at is not None
    abort_repeats_last[-1] = event([9], 3, aborted)  # SGLang's abort chunk when streaming
    reply = asyncio.run(read_generate_stream(lines(abort_repeats_last), PieceProgress(), "srv"))
    assert reply["output_ids"] == [7, 8, 9] and reply["meta_info"]["finish_reason"] == aborted
    with pytest.raises(GenerateFailed, match="completion_tokens=5"):
        asyncio.run(read_generate_stream(lines([event([7], 5)]), PieceProgress(), "srv"))
    queued_abort = [event([], 0, {"type": "abort"}), "data: [DONE]"]
    progress = PieceProgress()
    reply = asyncio.run(read_generate_stream(lines(queued_abort), progress, "srv"))
    assert reply["output_ids"] == [] and progress.first_token_at is None
    with pytest.raises(GenerateFailed, match="srv: boom"):
        asyncio.run(read_generate_stream(lines(['data: {"error": "boom"}']), progress, "srv"))
    with pytest.raises(GenerateFailed, match="without a reply"):
        asyncio.run(read_generate_stream(lines(["data: [DONE]"]), progress, "srv"))


def test_rebalance_cli_runs_a_batch(servers: ServerPair, tmp_path, capsys) -> None:
    prompts = [CLI_HISTORIES[0] + _seq(15_500, 3), CLI_HISTORIES[1] + _seq(16_500, 4)]
    lines = [
        {"server": servers.source.url, "input_ids": prompts[0], "priority": 5,
         "sampling_params": {"max_new_tokens": 50}},
        {"server": servers.source.url, "input_ids": prompts[1], "priority": 1,
         "sampling_params": {"max_new_tokens": 8}},
    ]  # fmt: skip
    requests = tmp_path / "work.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    server_args = ["--server", servers.source.url, "--server", servers.target.url]
    # The running request waits at the gate until the queued one was moved.
    with held_at(servers.source.url, HOLD_AT, aborts=1):
        code = cli.main(
            ["rebalance", *server_args, "--requests", str(requests), "--output", str(output),
             "--mode", "migrate", "--kv-pressure", "0.1", "--interval", "0.02",
             "--max-rounds", "300"]
        )  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["requests"] == summary["finished"] == 2
    assert summary["moves_started"] == 1 and summary["outcomes"] == {"migrated": 1}
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["output_ids"] for r in results] == [
        expected_output(prompts[0], 50),
        expected_output(prompts[1], 8),
    ]
    moved = [r for r in results if r["moves"]]
    assert len(moved) == 1 and moved[0]["segments"][1]["cached_tokens"] == 2 * PAGE


def test_rebalance_cli_watch_and_bad_arguments(servers: ServerPair, capsys) -> None:
    server_args = ["--server", servers.source.url, "--server", servers.target.url]
    assert cli.main(["rebalance", *server_args, "--max-rounds", "2", "--interval", "0.01"]) == 0
    rounds = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["round"] for r in rounds] == [0, 1]
    assert set(rounds[0]["loads"]) == {servers.source.url, servers.target.url}
    assert all(load["ok"] for load in rounds[0]["loads"].values())
    # An unreachable server makes the watch fail; a missing --server is a usage error.
    down = ["--server", "http://127.0.0.1:9", "--max-rounds", "1"]
    assert cli.main(["rebalance", *server_args, *down]) == 1
    with pytest.raises(SystemExit) as usage:
        cli.main(["rebalance"])
    assert usage.value.code == 2
