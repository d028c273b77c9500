"""A live move's rounds from the running request's own slots (feature "running_slots").

CPU mini servers whose `/generate` stand-in (`slot_standin.py`) decodes into real token
slots of real SGLang `Req`s in the scheduler's running batch: nothing generated reaches
the radix tree until the request stops, as in SGLang 0.5.12. The stand-in's tokens are
a pure function of the sequence, so a moved request must give exactly the tokens of an
uninterrupted run; its KV is seeded random bytes, and a finished request inserts its own
slots into the tree, so the target's pages can be compared byte for byte.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from generate_standin import StandinConfig, expected_output, held_at
from mini_server import LONG_GRANT_S, ServerHandle, ServerPair, ServerSpec, start_servers
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed
from sglang_kv_migration.rollout.cost_model import CostModel, MigrationCosts, PrefillCosts
from sglang_kv_migration.rollout.request_migration import GenerateRequest, RequestMigrator
from sglang_kv_migration.wire.features import RUNNING_SLOTS
from slot_standin import slot_standin_factory
from timing import wait_until

PAGE = 16
ALWAYS_MIGRATE = CostModel(
    MigrationCosts(bandwidth_bytes_per_s=1e12, overhead_s=0.0), PrefillCosts(seconds_per_token=1.0)
)


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    config = StandinConfig(max_running=2, step_s=0.01, capacity_tokens=100_000)
    spec = ServerSpec(extension=slot_standin_factory(config), grant_ttl_s=LONG_GRANT_S)
    handles = start_servers([spec, spec])
    try:
        yield ServerPair(*handles)
    finally:
        for handle in handles:
            handle.stop()


class Slowed(httpx.BaseTransport):
    """Real calls; every call to `slow` waits `delay` first (so rounds span decode steps),
    then until `gate()` holds (bounded)."""

    def __init__(
        self,
        slow: str = "/transfer_request_kvcache",
        delay: float = 0.15,
        gate: Callable[[], bool] | None = None,
    ):
        self.slow, self.delay, self.gate = slow, delay, gate
        self.calls: dict[str, int] = {}
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls[request.url.path] = self.calls.get(request.url.path, 0) + 1
        if request.url.path == self.slow:
            time.sleep(self.delay)
            if self.gate is not None:
                assert wait_until(self.gate, 60.0, interval_s=0.005), "the gate stayed shut"
        return self._real.handle_request(request)


class WithoutFeature(MigrationClient):
    """A client that sees servers without "running_slots" (older servers)."""

    def session_info(self, url: str, *args, **kwargs):
        info = super().session_info(url, *args, **kwargs)
        return dataclasses.replace(info, features=[f for f in info.features if f != RUNNING_SLOTS])


def _load(server: ServerHandle) -> dict:
    return httpx.get(server.url + "/v1/loads", timeout=10).json()["loads"][0]


def _decoding(m: RequestMigrator, server: ServerHandle, prompt: list[int], n: int, tokens: int):
    """Submit a request; its handle once the migrator has seen it generate `tokens`
    tokens (the caller holds `server` at more, unless the request is to finish)."""
    handle = m.submit(server.url, GenerateRequest(prompt, {"max_new_tokens": n}))
    streamed = lambda: len(handle.handle.generated_so_far()) >= tokens  # noqa: E731
    assert wait_until(streamed, 60.0, interval_s=0.01)
    return handle


def _post(server: ServerHandle, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=30)


# --------------------------------------------------------------------------- tests


def test_rounds_copy_generated_pages_while_decoding(servers: ServerPair) -> None:
    prompt = list(range(1000, 1000 + 2 * PAGE + 7))
    transport = Slowed()
    client = MigrationClient(http_client=httpx.Client(transport=transport, timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        # A page generated before the first round; held at 60 tokens, so the tail after
        # the last round is at most 3 pages however the rounds and the decode interleave.
        with held_at(servers.source.url, 60):
            handle = _decoding(m, servers.source, prompt, 200, tokens=10)
            m.move_request(handle, servers.target.url, live=True)
        out = handle.result()
    assert out.output_ids == expected_output(prompt, 200)
    (move,) = out.moves
    assert move.outcome == "migrated"
    rounds = [s for s in move.stages if s.while_decoding]
    assert rounds and all(s.decision == "migrate" for s in rounds)
    # The first round already moved generated pages, not only the prompt's.
    aligned_prompt = len(prompt) // PAGE * PAGE
    assert rounds[0].migrated_tokens > aligned_prompt
    assert rounds[0].held_tokens > rounds[0].generated // 2
    # Each later round moved only what the request generated meanwhile.
    for before, after in zip(rounds, rounds[1:], strict=False):
        assert after.migrated_tokens == after.held_tokens - before.held_tokens
    # What the tail had to move (or recompute) after the stop is small: at most what the
    # last round left plus the tokens generated during the stop.
    tail = move.stages[-1]
    assert not tail.while_decoding
    first, resumed = out.segments
    total = len(prompt) + len(first.output_ids) - 1
    assert total // PAGE * PAGE - rounds[-1].held_tokens <= 3 * PAGE
    assert resumed.cached_tokens == total // PAGE * PAGE
    # The move's moments, by the wall clock, in the order they happen.
    at = move.moments
    assert at["last_copy_done"] <= at["stop_sent"] <= at["stop_returned"]
    assert at["last_source_token"] <= at["stop_returned"] <= at["resume_sent"]
    assert at["resume_sent"] < at["first_token"]
    assert at["first_token"] - at["last_source_token"] == pytest.approx(move.stall_s, abs=1e-3)


def test_pages_copied_from_running_slots_are_byte_exact(servers: ServerPair) -> None:
    """The target's pages are the bytes the rounds read from the running request's own
    slots. After the stop the source's tree holds those very slots (a finished request
    inserts its row, as SGLang's `cache_finished_req`), and each server writes KV of its
    own (`slot_standin.py`), so equal bytes were migrated, not recomputed."""
    prompt = list(range(2000, 2000 + 3 * PAGE + 1))
    client = MigrationClient(http_client=httpx.Client(transport=Slowed(), timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 60):  # a page generated, and no finish, by then
            handle = _decoding(m, servers.source, prompt, 100, tokens=16)
            report = m.move_request(handle, servers.target.url, live=True)
        out = handle.result(timeout=60)
    rounds = [s for s in report.stages if s.while_decoding]
    moved = rounds[-1].held_tokens
    assert moved > len(prompt) // PAGE * PAGE  # generated pages moved while decoding
    ids = (prompt + out.output_ids)[:moved]
    source_kv = servers.source.ask(0, "kv", ids)
    assert _differing_positions(source_kv, servers.target.ask(0, "kv", ids), moved) == []
    # Negative control: one corrupted slot on the target is found, and only that one.
    position = moved - PAGE // 2
    servers.target.ask(0, "corrupt_kv", ids, position)
    assert _differing_positions(source_kv, servers.target.ask(0, "kv", ids), moved) == [position]


def _differing_positions(source_kv: list, target_kv: list, n: int) -> list[int]:
    """The token positions whose KV bytes differ in any layer (K and V, or the latent)."""
    assert len(source_kv) == len(target_kv) > 0
    differ: set[int] = set()
    for s, t in zip(source_kv, target_kv, strict=True):
        tokens = 1 if s.dim() == 4 else 0  # MHA: (K and V, tokens, heads, head_dim)
        assert s.shape == t.shape and s.shape[tokens] == n
        a = s.contiguous().view(torch.uint8).movedim(tokens, 0).reshape(n, -1)
        b = t.contiguous().view(torch.uint8).movedim(tokens, 0).reshape(n, -1)
        differ.update((a != b).any(dim=1).nonzero().flatten().tolist())
    return sorted(differ)


def test_size_query_reports_running_slots_and_refuses_other_ids(servers: ServerPair) -> None:
    prompt = list(range(3000, 3000 + 2 * PAGE + 3))
    with RequestMigrator(cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 40):  # it runs while it is asked about
            handle = _decoding(m, servers.source, prompt, 300, tokens=20)
            ids = (prompt + handle.handle.generated_so_far())[:-1]
            rid = handle.rid
            held = _post(servers.source, "/get_request_extra_token_size",
                         {"input_ids": ids, "running_rid": rid}).json()  # fmt: skip
            assert held["running_token_size"] >= len(ids) // PAGE * PAGE - PAGE
            assert held["running_token_size"] > held["matched_token_size"]
            wrong = [*ids[:PAGE], ids[PAGE] + 1, *ids[PAGE + 1 :]]
            other = _post(servers.source, "/get_request_extra_token_size",
                          {"input_ids": wrong, "running_rid": rid}).json()  # fmt: skip
            assert other["running_token_size"] == -1
        out = m.wait(handle, timeout=60)
    assert out.output_ids == expected_output(prompt, 300)


def _allocated_for(servers: ServerPair, ids: list[int]) -> dict:
    """The target's allocate reply for `ids`, granted to the source."""
    info = _post(servers.source, "/get_transfer_session_info", {}).json()
    alloc = _post(servers.target, "/allocate_token_for_transfer", {
        "input_ids": ids, "source_fingerprints": [r["fingerprint"] for r in info["ranks"]],
        "source_instance": info["instance_id"]})  # fmt: skip
    assert alloc.status_code == 200, alloc.text
    return alloc.json()


def test_running_rid_tells_a_caller_without_a_grant_nothing(servers: ServerPair) -> None:
    """A caller probing a running request's tokens with `running_rid`: without a grant
    that verifies, every probe is the same refusal of the grant (a differing position,
    the right tokens, an unknown rid alike); with one, a refusal names the field, never
    where the tokens differ."""
    from multi_rank import host_transfer_body

    prompt = list(range(3500, 3500 + 2 * PAGE + 3))
    with RequestMigrator(cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 40):  # it runs while it is probed
            handle = _decoding(m, servers.source, prompt, 300, tokens=21)
            ids = (prompt + handle.handle.generated_so_far())[:-1]
            rid = handle.rid
            probes = {
                "right": (ids, rid),
                "differs at 1": ([ids[0], ids[1] + 1, *ids[2:]], rid),
                "differs at 20": ([*ids[:20], ids[20] + 1, *ids[21:]], rid),
                "unknown rid": (ids, "nope"),
            }
            # Slots the target allocated, a grant that does not verify: a token of another
            # key, and the grant of another prefix.
            alloc = _allocated_for(servers, list(range(9000, 9000 + 2 * PAGE)))
            target_info = _post(servers.target, "/get_transfer_session_info", {}).json()
            for grant in ("e30.", alloc["ranks"][0]["grant"]):
                answers = {}
                for what, (probe, probe_rid) in probes.items():
                    body = host_transfer_body(probe[: 2 * PAGE], alloc, target_info)
                    body["target_per_rank"][0]["grant"] = grant
                    r = _post(servers.source, "/transfer_request_kvcache",
                              {**body, "running_rid": probe_rid})  # fmt: skip
                    answers[what] = (r.status_code, r.json()["message"])
                assert set(answers.values()) == {answers["right"]}, answers
                status, message = answers["right"]
                assert status == 403 and "grant" in message, message
                assert "running_rid" not in message and "position" not in message, message
            _post(servers.target, "/abort_transfer", {"migration_id": alloc["migration_id"]})
            # Under a grant (the target allocated for those very ids): refused naming the
            # field, the same refusal wherever the ids differ.
            refusals = set()
            for what in ("differs at 1", "differs at 20"):
                wrong = probes[what][0][: 2 * PAGE]
                alloc = _allocated_for(servers, wrong)
                body = {**host_transfer_body(wrong, alloc, target_info), "running_rid": rid}
                r = _post(servers.source, "/transfer_request_kvcache", body)
                assert r.status_code == 400, r.text
                refusals.add(r.json()["message"])
                _post(servers.target, "/abort_transfer", {"migration_id": alloc["migration_id"]})
            (refusal,) = refusals
            assert "input_ids" in refusal and "position" not in refusal, refusal
        out = m.wait(handle, timeout=60)
    assert out.output_ids == expected_output(prompt, 300)


def test_without_the_feature_the_live_move_copies_from_the_tree(servers: ServerPair) -> None:
    prompt = list(range(4000, 4000 + 2 * PAGE + 7))
    transport = Slowed()
    client = WithoutFeature(http_client=httpx.Client(transport=transport, timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 60):
            handle = _decoding(m, servers.source, prompt, 120, tokens=3)
            m.move_request(handle, servers.target.url, live=True)
        out = handle.result()
    assert out.output_ids == expected_output(prompt, 120)
    stage1 = out.moves[0].stages[0]
    # Today's behaviour: only the prompt's pages, which the tree holds, move while decoding.
    assert stage1.while_decoding and stage1.migrated_tokens == len(prompt) // PAGE * PAGE


def test_a_request_that_finished_before_the_round_falls_back(servers: ServerPair) -> None:
    """The round's size query arrives after the request finished (it waits until the
    source runs no request): no running slots to read; the move falls back (today's
    stages, then the stop finds it finished)."""
    prompt = list(range(5000, 5000 + 2 * PAGE + 3))
    finished = lambda: _load(servers.source)["num_running_reqs"] == 0  # noqa: E731
    transport = Slowed(slow="/get_request_extra_token_size", delay=0.0, gate=finished)
    client = MigrationClient(http_client=httpx.Client(transport=transport, timeout=30))
    with client, RequestMigrator(client, cost_model=ALWAYS_MIGRATE) as m:
        handle = _decoding(m, servers.source, prompt, 20, tokens=1)
        report = m.move_request(handle, servers.target.url, live=True)
        out = handle.result(timeout=30)
    assert report.outcome == "finished_before_move"
    assert out.output_ids == expected_output(prompt, 20)
    assert all(s.decision != "failed" for s in report.stages)


def test_a_request_that_finishes_during_the_copy_fails_the_transfer(servers: ServerPair) -> None:
    """The request finishes after its slots were checked and read, before the copy is
    seen done (on a GPU its freed slots could be another request's by then): the
    transfer fails naming `running_rid`, and the target commits nothing."""
    prompt = list(range(6000, 6000 + 2 * PAGE + 3))
    with RequestMigrator(cost_model=ALWAYS_MIGRATE) as m:
        with held_at(servers.source.url, 60):  # it runs until the copy finishes it
            handle = _decoding(m, servers.source, prompt, 400, tokens=20)
            ids = (prompt + handle.handle.generated_so_far())[:-1]
            body = {"input_ids": ids, "running_rid": handle.rid}
            held = _post(servers.source, "/get_request_extra_token_size", body).json()
            running = held["running_token_size"]
            assert running > len(prompt) // PAGE * PAGE
            armed = _post(servers.source, "/standin/finish_during_copy", {"rid": handle.rid})
            assert armed.status_code == 200, armed.text
            as_held = {**held, "matched_token_size": running, "device_token_size": running}
            with MigrationClient() as client, pytest.raises(MigrationFailed) as failed:
                client.migrate(
                    servers.source.url,
                    servers.target.url,
                    ids[:running],
                    held=as_held,
                    running_rid=handle.rid,
                )
            assert f"running_rid {handle.rid!r} does not run" in str(failed.value)
        out = m.wait(handle, timeout=60)
    # Aborted right after the copy began: fewer tokens, the same ones.
    assert 0 < len(out.output_ids) < 400
    assert out.output_ids == expected_output(prompt, len(out.output_ids))
    assert servers.target.ask(0, "held", ids[:running]) == (0, 0)
    assert wait_until(lambda: servers.target.ask(0, "pending") == 0, 60.0, interval_s=0.05)


def test_bench_live_move_repeats_on_cpu(servers: ServerPair, tmp_path) -> None:
    """`benchmark/bench_live_move.py`'s row on the mini servers (the GPU run is the
    lead's): staggered requests, each moved live from its own slots, each complete with
    the uninterrupted run's tokens, a stall and an abort latency recorded. The source
    holds each request at the length the row moves it at (a gate, not the clock: on a
    loaded machine a request would otherwise finish before its move began)."""
    import argparse
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    import bench_live_move as bench

    # Mode "migrate": the default cost model would price these few pages for recompute.
    args = argparse.Namespace(tail=8, stagger=4, row_timeout=60.0, max_rounds=6, mode="migrate")
    prompts = [list(range(7000 + 100 * i, 7000 + 100 * i + 2 * PAGE + 5)) for i in range(2)]
    assert _post(servers.source, "/standin/hold", {"at": 40}).status_code == 200
    try:
        repeats = asyncio.run(
            bench.run_repeats(servers.source.url, servers.target.url, prompts, 40, args)
        )
    finally:
        assert _post(servers.source, "/standin/hold", {"at": None}).status_code == 200
    for prompt, row in zip(prompts, repeats, strict=True):
        assert row["outcome"] == "migrated" and row["complete"], row
        assert row["output_ids"] == expected_output(prompt, 48)
        assert row["rounds"] and row["rounds"][0]["held"] > len(prompt) // PAGE * PAGE
        assert row["stall_s"] > 0 and row["abort_s"] > 0
        # SGLang's own resume of the same request on the target, beside the move: the
        # target holds its whole pages, and it was sent and read as the resume was.
        base = row["baseline"]
        assert row["baseline_s"] == base["ttft_s"] > 0
        resumed_len = len(prompt) + row["generated_before_move"]
        assert base["cached_tokens"] >= (resumed_len - 1) // PAGE * PAGE > len(prompt)
        assert base["rid"] not in (row["source_rid"], row["resumed_rid"])
        assert row["source_rid"] != row["resumed_rid"]
        assert row["moments"]["resume_sent"] < row["moments"]["first_token"]
    # The breakdown's join: the migrator's clock says the stall's first phases; these
    # mini servers run no SGLang scheduler, so the servers' phases are not said.
    bench._add_breakdowns(repeats, tmp_path)
    for row in repeats:
        phases = row["phases"]
        assert phases["tail_to_stop"] >= 0 and phases["to_resume"] >= 0
        assert phases["resume.prefill"] is None and phases["stop.release"] is None
        assert phases["baseline"]["resume.http_in"] is None


def test_bench_ttft_split_times_calls_on_cpu(servers: ServerPair) -> None:
    """`benchmark/bench_ttft_split.py`'s calls on a mini server (the GPU run is the
    lead's): a call through a client made for it, one through a kept client and a
    streamed cached resume, each with its time to first token, then the summary."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    import bench_ttft_split as bench

    url = servers.target.url
    prompt = list(range(8000, 8000 + 2 * PAGE + 1))
    with httpx.Client(timeout=30) as kept:
        per_call = bench.timed_call(url, prompt, None)
        kept_call = bench.timed_call(url, prompt, kept)
    resumed = asyncio.run(bench.cached_resume(url, prompt + [5]))
    streamed = asyncio.run(bench.cached_resume(url, prompt + [6], 5))
    times = streamed["token_times"]  # one per token, in order: the decode steps' gaps
    assert len(times) == 5 and times == sorted(times)
    assert bench.report.decode_step_s(times) is not None
    for call in (per_call, kept_call, resumed):
        assert call["ttft_s"] > 0 and call["sent"] < call["first_token"]
    assert per_call["client_build_ms"] > 0  # the SSL context of a client made per call
    # The prompt was served once: the kept client's call and the resume hit its pages.
    assert kept_call["cached_tokens"] == resumed["cached_tokens"] == 2 * PAGE
    rows = bench.summarize({"fresh17_call_client": [per_call], "cached_33": [resumed]}, None)
    assert rows["fresh17_call_client"]["ttft"]["n"] == 1
    assert rows["cached_33"]["phases"]["resume.prefill"]["n"] == 0  # no SGLang stamps here
    table = bench.markdown("kvmig", rows)
    assert "| fresh17_call_client |" in table and "| cached_33 |" in table
