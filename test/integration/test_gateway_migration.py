"""Moving requests behind the real SGLang model gateway (`smg launch`, smg==1.13.0).

Two CPU mini servers (real HiRadixCache, migration routes, Mooncake TCP on 127.0.0.1)
serve the `/generate` stand-in (`generate_standin`) plus the discovery routes the gateway
reads before it registers a worker (`sglang_discovery`). The gateway is the binary from
the `smg` package in this environment, on free ports, killed at the end of each test.
What is checked: after a move the continuation reaches the target *through the gateway*
(the gateway's `x-smg-routed-worker-id`, the target's `cached_tokens`, the gateway's own
policy counters), the output is that of one uninterrupted run, and what each policy
cannot do (the header ignored, the session's key still mapped to the source).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from generate_standin import StandinConfig, expected_output, held_at, standin_factory
from mini_server import ServerPair, ServerSpec, start_servers
from sglang_discovery import discovery_factory
from sglang_kv_migration import cli
from sglang_kv_migration.integrations.gateway import (
    ROUTED_WORKER_HEADER,
    GatewayError,
    ModelGateway,
    SessionPins,
)
from sglang_kv_migration.rollout.request_migration import AsyncRequestMigrator, GenerateRequest
from smg_gateway import running_gateway

PAGE = 16
# Earlier turns the source holds from the start (the rebalance test's conversations).
HISTORIES = [list(range(40_000 + 1000 * i, 40_000 + 1000 * i + 2 * PAGE)) for i in range(2)]
SOURCE_CAPACITY = 200


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPair]:
    def spec(capacity: int, preload: list) -> ServerSpec:
        config = StandinConfig(max_running=1, step_s=0.01, capacity_tokens=capacity)
        return ServerSpec(extension=discovery_factory(standin_factory(config)), preload=preload)

    handles = start_servers(
        [spec(SOURCE_CAPACITY, [(h, 3 + i) for i, h in enumerate(HISTORIES)]), spec(100_000, [])]
    )
    try:
        yield ServerPair(*handles)
    finally:
        for handle in handles:
            handle.stop()


def _prompt(start: int, pages: int = 3) -> list[int]:
    return list(range(start, start + pages * PAGE + 5))


def _post(url: str, ids: list[int], n: int, headers: dict[str, str]) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n}}
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


async def _move_running(
    migrator: AsyncRequestMigrator, source: str, target: str, prompt: list[int], live: bool
):
    """Submit `prompt` on `source` (through the migrator's gateway), move it to `target`
    once it decodes, and return its whole output. The source holds it at 10 tokens, so
    it cannot finish before the move however slow the machine."""
    with held_at(source, 10):
        handle = await migrator.submit(source, GenerateRequest(prompt, {"max_new_tokens": 60}))
        deadline = time.monotonic() + 60.0
        while len(handle.generated_so_far()) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert handle.started, "the request did not start on the source"
        await migrator.move_request(handle, target, mode="migrate", live=live)
    return await handle.result()


async def _arrived(url: str, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until the stand-in at `url` has a request queued or running."""
    async with httpx.AsyncClient(timeout=30) as http:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = (await http.get(url + "/v1/loads")).json()["loads"][0]
            if load["num_running_reqs"] + load["num_waiting_reqs"]:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no request reached {url} in {timeout_s} s")


def gateway_url_of(workers, url: str) -> str:
    """The gateway's spelling of worker `url` (what `SessionPins` hands out)."""
    return next(w.url for w in workers if w.url.rstrip("/") == url)


def _routed(response: httpx.Response) -> str:
    return response.headers[ROUTED_WORKER_HEADER].rstrip("/")


def _key_on(gateway_url: str, worker: str) -> str:
    """A session key the gateway's consistent hashing maps to `worker` (bounded search)."""
    for i in range(40):
        key = f"session-{i}"
        r = _post(gateway_url + "/generate", [7, 8], 1, {"X-SMG-Routing-Key": key})
        if r.headers[ROUTED_WORKER_HEADER].rstrip("/") == worker:
            return key
    raise AssertionError(f"no key of 40 hashed to {worker}")


@pytest.mark.parametrize("live", [False, True], ids=["stopped", "live"])
def test_a_moved_request_and_its_next_turn_reach_the_target_through_the_gateway(
    servers: ServerPair, live: bool
) -> None:
    source, target = servers.source.url, servers.target.url
    with running_gateway([source, target], "consistent_hashing") as gw:
        session = _key_on(gw.url, source)
        prompt = _prompt(50_000 + 1000 * live)
        hits_before = gw.branch_count("consistent_hashing", "target_worker_hit")

        async def run():
            async with ModelGateway(gw.url) as gateway:
                async with AsyncRequestMigrator(gateway=gateway) as migrator:
                    out = await _move_running(migrator, source, target, prompt, live)
                pins = SessionPins(gateway)
                pins.pin(session, target)  # handle.server_url after the move
                return out, await pins.route(session)

        out, next_route = asyncio.run(run())
        assert out.output_ids == expected_output(prompt, 60)
        assert [s.server_url for s in out.segments] == [source, target]
        resumed = out.segments[-1]
        assert resumed.kind == "migrated" and out.moves[0].outcome == "migrated"
        # The resumed piece found the moved prompt + output on the target.
        assert resumed.cached_tokens >= 3 * PAGE
        # Both pieces went through the gateway, pinned by its own worker index.
        assert gw.branch_count("consistent_hashing", "target_worker_hit") == hits_before + 2

        # The next turn: by the session's key alone the gateway still picks the source ...
        turn = prompt + out.output_ids + [11, 12, 13]
        by_key = _post(gw.url + "/generate", turn, 2, {"X-SMG-Routing-Key": session})
        assert by_key.headers[ROUTED_WORKER_HEADER].rstrip("/") == source
        # ... pinned, it reaches the target, which holds the conversation's KV.
        pinned = _post(next_route.url, turn, 2, next_route.headers)
        assert pinned.headers[ROUTED_WORKER_HEADER].rstrip("/") == target
        held = (len(prompt) + len(out.output_ids) - 1) // PAGE * PAGE
        assert pinned.json()["meta_info"]["cached_tokens"] >= held


def test_the_target_index_is_the_gateways_own_worker_order(servers: ServerPair) -> None:
    source, target = servers.source.url, servers.target.url
    with running_gateway([source, target], "consistent_hashing") as gw:
        listed = [w["url"].rstrip("/") for w in gw.workers()]

        async def routes():
            async with ModelGateway(gw.url) as gateway:
                found = [await gateway.route(url) for url in (source, target)]
                with pytest.raises(GatewayError, match="not a worker"):
                    await gateway.route("http://127.0.0.1:9")
                assert [u.rstrip("/") for u in await gateway.worker_urls()] == listed
                # A new session takes the least-pinned worker; the map keeps at most 2.
                pins = SessionPins(gateway, max_sessions=2)
                pins.pin("a", source)
                assert await pins.choose("b") == gateway_url_of(await gateway.workers(), target)
                assert await pins.choose("a") == source and len(pins) == 2
                await pins.choose("c")
                assert pins.worker("b") is None and len(pins) == 2
                return found

        for url, route in zip((source, target), asyncio.run(routes()), strict=True):
            assert route.headers == {"X-SMG-Target-Worker": str(listed.index(url))}
            r = _post(route.url, [1, 2, 3], 1, route.headers)
            assert r.headers[ROUTED_WORKER_HEADER].rstrip("/") == url
        # An index the gateway does not have is refused, never re-routed.
        bad = httpx.post(
            gw.url + "/generate", json={"input_ids": [1]}, headers={"X-SMG-Target-Worker": "2"}
        )
        assert bad.status_code == 503


@pytest.mark.parametrize("policy", ["manual", "cache_aware"])
def test_policies_without_a_pin_header_use_the_rl_passthrough(
    servers: ServerPair, policy: str
) -> None:
    source, target = servers.source.url, servers.target.url
    with pytest.raises(ValueError, match="--enable-rl"):
        ModelGateway("http://127.0.0.1:9", policy=policy)
    with running_gateway([source, target], policy, "--enable-rl") as gw:
        # Turn 1 through the policy: the session lands where the policy puts it.
        session = f"{policy}-session"
        first = _prompt(60_000 + 1000 * (policy == "manual"))
        key = {"X-SMG-Routing-Key": session}
        r = _post(gw.url + "/generate", first, 4, key)
        home = _routed(r)
        away = target if home == source else source
        # The target header does not move it.
        other = {**key, "X-SMG-Target-Worker": str([source, target].index(away))}
        assert {_routed(_post(gw.url + "/generate", first, 1, other)) for _ in range(4)} == {home}

        turn = first + r.json()["output_ids"] + [21, 22]

        async def run():
            async with ModelGateway(gw.url, policy=policy, pin="rl_passthrough") as gateway:
                async with AsyncRequestMigrator(gateway=gateway) as migrator:
                    handle = await migrator.submit(
                        home, GenerateRequest(turn, {"max_new_tokens": 30})
                    )
                    # Queued or decoding (the passthrough buffers): `home` holds it at
                    # 10 tokens, so it is still there when the move comes.
                    await _arrived(home)
                    await migrator.move_request(handle, away, mode="migrate")
                    out = await handle.result()
                pins = SessionPins(gateway)
                pins.pin(session, out.segments[-1].server_url)
                return out, await pins.route(session)

        with held_at(home, 10):
            out, next_route = asyncio.run(run())
        assert out.output_ids == expected_output(turn, 30)
        assert out.segments[-1].server_url == away
        # The policy never saw the move: by the session alone it still picks `home` ...
        again = turn + out.output_ids + [31]
        assert _routed(_post(gw.url + "/generate", again, 1, key)) == home
        # ... and the pinned passthrough reaches `away`, which holds the KV.
        envelope = _post(next_route.url, again, 1, next_route.headers).json()
        assert envelope["url"].rstrip("/") == away
        assert envelope["body"]["meta_info"]["cached_tokens"] >= len(turn) // PAGE * PAGE


def test_rebalance_cli_resumes_through_the_gateway(servers: ServerPair, tmp_path, capsys) -> None:
    source, target = servers.source.url, servers.target.url
    prompts = [HISTORIES[0] + [40_501, 40_502, 40_503], HISTORIES[1] + [41_501, 41_502]]
    lines = [
        {"server": source, "input_ids": prompts[0], "priority": 5,
         "sampling_params": {"max_new_tokens": 50}},
        {"server": source, "input_ids": prompts[1], "priority": 1,
         "sampling_params": {"max_new_tokens": 8}},
    ]  # fmt: skip
    requests = tmp_path / "work.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    # The running request waits at the source's gate until the queued one was moved.
    with running_gateway([source, target], "consistent_hashing") as gw, held_at(source, 10, 1):
        code = cli.main(
            ["rebalance", "--server", source, "--server", target, "--gateway", gw.url,
             "--requests", str(requests), "--output", str(output), "--mode", "migrate",
             "--kv-pressure", "0.1", "--interval", "0.02", "--max-rounds", "300"]
        )  # fmt: skip
        hits = gw.branch_count("consistent_hashing", "target_worker_hit")
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["finished"] == 2 and summary["outcomes"] == {"migrated": 1}
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["output_ids"] for r in results] == [
        expected_output(prompts[0], 50),
        expected_output(prompts[1], 8),
    ]
    moved = [r for r in results if r["moves"]][0]
    assert [s["server_url"] for s in moved["segments"]] == [source, target]
    assert moved["segments"][1]["cached_tokens"] == 2 * PAGE
    assert hits == 3  # two submissions and the resumed piece, each pinned
    # A policy without a pin header is a usage error unless a pin is named.
    with pytest.raises(SystemExit) as usage:
        cli.main(["rebalance", "--server", source, "--gateway", gw.url,
                  "--gateway-policy", "manual", "--requests", str(requests)])  # fmt: skip
    assert usage.value.code == 2
