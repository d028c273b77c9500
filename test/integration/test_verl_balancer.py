"""`KVMigrationLoadBalancer` as verl 0.9.1 loads and calls it, against CPU mini servers.

verl's own code loads the class (`router._load_router_yaml` and `_resolve_router_class`
on the router YAML of docs/rl-integration.md) and asks it for a server
(`llm_server.LLMServerClient._acquire_server`, which forwards the fields the balancer
declares).
What is left out is Ray: verl wraps the class in `ray.remote` and calls its methods
through an actor; here they are called on the instance. The servers are `mini_server`s
with the `/generate` stand-in (real HiRadixCache, real migration routes, Mooncake TCP on
127.0.0.1), so "served from cache" is the server's own prefix match.

Whether a session moves is arithmetic on what the servers report: the tokens each server
holds of a prompt (their size queries), the tokens in flight (the balancer's own count)
and the cost model's priors. The harness's KV is 512 bytes a token, so a migration of up
to a few hundred tokens costs the host path's fixed 0.02 s and a few microseconds; with
`prefill_seconds_per_token` at 1 ms a re-prefill of 16 tokens costs 0.016 s and of 32
tokens 0.032 s. The tests set the load in flight so that each verdict has margin.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import verl_recipe
from generate_standin import StandinConfig, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang_kv_migration.client.migration import AsyncMigrationClient
from sglang_kv_migration.integrations import verl_router_config
from sglang_kv_migration.integrations.verl_balancer import KVMigrationLoadBalancer
from sglang_kv_migration.integrations.verl_router_config import RouterConfigError

router = pytest.importorskip("verl.workers.rollout.router")
llm_server = pytest.importorskip("verl.workers.rollout.llm_server")

PAGE = 16
# Migration beats re-prefill for these few-page prefixes only when prefill is priced high
# (the recipe's prior is a real model's, where a 3-page prefix is cheaper to recompute).
MIGRATE_CONFIG = {**verl_recipe.router_config(), "prefill_seconds_per_token": 1.0}
# Prefill at 1 ms a token: a re-prefill of one page (0.016 s) is cheaper than a
# migration (0.02 s), of two pages (0.032 s) dearer.
MS_PER_TOKEN = {**verl_recipe.router_config(), "prefill_seconds_per_token": 1e-3}


def _seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerHandle]]:
    config = StandinConfig(max_running=4, step_s=0.005)
    handles = start_servers(
        [ServerSpec(extension=standin_factory(config)) for _ in range(2)]
        + [ServerSpec(extension=standin_factory(config), broken_transport_rank=0)]
    )
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def _sid(server: ServerHandle) -> str:
    """verl's server id: the replica's HTTP address without a scheme."""
    return server.url.removeprefix("http://")


def _generate(server_id: str, prompt: list[int], n: int = 8) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n}}
    reply = httpx.post(f"http://{server_id}/generate", json=body, timeout=60)
    reply.raise_for_status()
    return reply.json()


def _loaded(lb: KVMigrationLoadBalancer, server_id: str, n: int, tag: str, tokens: int = 2) -> None:
    """`n` requests of other sessions in flight on `server_id` (the only server yet),
    `tokens` prompt tokens each."""
    for i in range(n):
        prompt = list(range(tokens))
        sid, _ = asyncio.run(lb.acquire_server(f"{tag}-other-{i}", prompt_ids=prompt))
        assert sid == server_id


def _load_more(lb: KVMigrationLoadBalancer, a: str, b: str, tag: str, tokens: int) -> None:
    """One more request in flight on `a` while `b` (idle) is in the pool: verl removes
    and adds replicas at run time, and a new session goes to the least-loaded one."""
    lb.remove_servers([b])
    _loaded(lb, a, 1, tag, tokens)
    lb.add_servers({b: "B"})


def _held_by(lb: KVMigrationLoadBalancer, a: str, session: str, turn1: list[int]) -> list[int]:
    """Turn 1 of `session` on `a` (the only server), generated and released: `a` then
    holds its pages. Returns turn 1's output."""
    assert asyncio.run(lb.acquire_server(session, prompt_ids=turn1))[0] == a
    out = _generate(a, turn1)["output_ids"]
    lb.release_server(a, session)
    return out


def _next_turn(lb: KVMigrationLoadBalancer, session: str, prompt: list[int]) -> str:
    """Acquire the session's next turn, then release it: where it went."""
    sid, _ = asyncio.run(lb.acquire_server(session, prompt_ids=prompt))
    lb.release_server(sid, session)
    return sid


class _Handle:
    """What verl's client calls on the balancer actor (`handle.method.remote(...)`),
    without Ray: each call runs the method on the instance."""

    def __init__(self, target: Any):
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                out = method(*args, **kwargs)
                if inspect.isawaitable(out):
                    return out
                future = asyncio.get_running_loop().create_future()
                future.set_result(out)
                return future

        return _Remote()


def test_verl_loads_the_class_from_the_recipes_router_yaml(tmp_path: Path) -> None:
    path = tmp_path / "kv_migration_router.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in verl_recipe.router_config().items()) + "\n")
    config = router._load_router_yaml(str(path))
    cls = router._resolve_router_class(config["router_class"])
    assert cls is KVMigrationLoadBalancer
    assert router.ray.remote(cls) is not None  # what verl wraps it in
    lb = cls({"a:1": "handle-a"}, config)  # verl's `(servers, yaml_config)`
    assert lb.config.repin_margin == config["repin_margin"]
    # And as verl builds a `load_balancer_cls`.
    assert cls(servers={"a:1": "h"}, max_cache_size=7).config.max_cache_size == 7
    # Every method of verl's protocol, with parameters verl can pass.
    protocol = router.RequestLoadBalancer
    names = [n for n in vars(protocol) if not n.startswith("_") and callable(getattr(protocol, n))]
    assert len(names) >= 10
    for name in names:
        ours = inspect.signature(getattr(cls, name)).parameters
        for param in inspect.signature(getattr(protocol, name)).parameters:
            assert param in ours or param == "extra", (name, param)


def test_a_router_yaml_typo_is_named_before_the_run_and_by_every_call(tmp_path: Path) -> None:
    """verl hands the YAML only to the balancer's constructor, in a Ray actor: a check
    before the run names the key, and the balancer itself does not die on it (verl would
    report a dead actor on the first rollout call) but answers every call with it."""
    good = tmp_path / "kv_migration_router.yaml"
    good.write_text("\n".join(f"{k}: {v}" for k, v in verl_recipe.router_config().items()))
    assert verl_router_config.main([str(good)]) == 0
    typo = tmp_path / "typo.yaml"
    typo.write_text(good.read_text() + "\nrepin_margn: 3\n")
    assert verl_router_config.main([str(typo)]) == 2
    wrong_type = tmp_path / "wrong_type.yaml"
    wrong_type.write_text(good.read_text().replace("repin_margin: 2", "repin_margin: two"))
    assert verl_router_config.main([str(wrong_type)]) == 2

    config = router._load_router_yaml(str(typo))  # what verl hands the constructor
    lb = router._resolve_router_class(config["router_class"])({"a:1": "A"}, config)
    client = llm_server.LLMServerClient(config=None, load_balancer_handle=_Handle(lb))
    with pytest.raises(RouterConfigError, match="'repin_margn' \\(did you mean 'repin_margin'"):
        asyncio.run(client._acquire_server("s", prompt_ids=[1, 2]))
    with pytest.raises(RouterConfigError, match="repin_margn"):
        lb.get_status()
    config = router._load_router_yaml(str(wrong_type))
    with pytest.raises(RouterConfigError, match="'repin_margin' must be an integer >= 0"):
        KVMigrationLoadBalancer({"a:1": "A"}, config).require_acquire_fields()


def test_sticky_sessions_and_least_loaded_placement(servers: list[ServerHandle]) -> None:
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A", b: "B"}, verl_recipe.router_config())
    client = llm_server.LLMServerClient(config=None, load_balancer_handle=_Handle(lb))

    async def run() -> None:
        first, handle = await client._acquire_server("s1", prompt_ids=[1, 2, 3])
        second, _ = await client._acquire_server("s2", prompt_ids=[4, 5])
        assert {first, second} == {a, b}  # the second goes to the idle server
        assert handle == {a: "A", b: "B"}[first]
        for _ in range(3):  # later turns stay, within the margin
            again, _ = await client._acquire_server("s1", prompt_ids=[1, 2, 3, 9])
            assert again == first
        assert lb.get_inflight_count(first) == 4 and lb.get_inflight_count(second) == 1
        for _ in range(4):
            lb.release_server(first)
        assert lb.get_total_inflight() == 1

    asyncio.run(run())
    assert client._lb_require_acquire_fields == ["prompt_ids"]
    assert lb.get_status()["moves"] == {}
    assert lb.clear_sticky_cache()["cleared_entries"] == 2


def test_a_short_prefix_stays_unless_the_load_gain_beats_its_reprefill(
    servers: list[ServerHandle],
) -> None:
    """With the recipe's prior a two-page prefix is re-prefilled rather than migrated:
    moving the session would cost its cache, so it stays where its KV is until the
    tokens in flight on its server beyond the other's are worth more than that."""
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A"}, verl_recipe.router_config())
    turn1 = _seq(7000, 2 * PAGE)
    out1 = _held_by(lb, a, "short", turn1)
    _loaded(lb, a, 3, "short", tokens=8)  # 24 tokens in flight: 2.4 ms of prefill
    lb.add_servers({b: "B"})
    turn2 = turn1 + out1 + [1, 2]
    assert _next_turn(lb, "short", turn2) == a  # re-prefilling 32 tokens costs 3.2 ms
    assert lb.moves == [] and lb.get_status()["kept"] == 1
    _load_more(lb, a, b, "short-more", tokens=100)  # now 124 tokens in flight
    assert _next_turn(lb, "short", turn2 + [3]) == b
    [move] = lb.moves
    assert move.outcome == "recompute" and move.migrated_tokens == 0, move
    assert "gain 0.0124" in move.detail and "re-prefill 0.0032" in move.detail, move


def test_a_long_prefix_migrates_once_the_load_gain_beats_its_migration(
    servers: list[ServerHandle],
) -> None:
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A"}, MS_PER_TOKEN)
    turn1 = _seq(5000, 10 * PAGE)
    out1 = _held_by(lb, a, "long", turn1)  # A now holds turn1 + out1[:-1]: 10 pages
    _loaded(lb, a, 3, "long", tokens=5)  # 15 ms of prefill in flight: less than 20 ms
    lb.add_servers({b: "B"})
    turn2 = turn1 + out1 + _seq(6000, PAGE)
    assert _next_turn(lb, "long", turn2) == a
    assert lb.moves == [] and lb.get_status()["kept"] == 1
    _load_more(lb, a, b, "long-more", tokens=30)  # 45 ms: the migration pays
    sid, handle = asyncio.run(lb.acquire_server("long", prompt_ids=turn2))
    assert (sid, handle) == (b, "B")
    [move] = lb.moves
    assert move.outcome == "migrated", move
    assert move.migrated_tokens == 10 * PAGE  # the whole pages A held
    served = _generate(b, turn2)
    assert served["meta_info"]["cached_tokens"] >= 10 * PAGE
    lb.release_server(b, "long")
    assert _next_turn(lb, "long", turn2) == b  # sticky to B
    assert lb.get_status()["migrated_tokens"] == 10 * PAGE


def test_mixed_sessions_each_move_by_their_own_price(servers: list[ServerHandle]) -> None:
    """Three sessions on one server, the same load in flight: each moves by what its own
    move costs (one page re-prefilled, two pages or ten migrated), not by its turn."""
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A"}, MS_PER_TOKEN)
    turns = {}
    for name, pages, start in (("one", 1, 11_000), ("two", 2, 12_000), ("ten", 10, 13_000)):
        turn1 = _seq(start, pages * PAGE)
        turns[name] = turn1 + _held_by(lb, a, name, turn1) + [9]
    _loaded(lb, a, 3, "mixed", tokens=6)  # 18 ms of prefill in flight
    lb.add_servers({b: "B"})
    placed = {name: _next_turn(lb, name, turns[name]) for name in ("ten", "one", "two")}
    # One page re-prefills in 16 ms < 18 ms; a migration costs 20 ms > 18 ms.
    assert placed == {"ten": a, "one": b, "two": a}
    assert [(m.request_id, m.outcome) for m in lb.moves] == [("one", "recompute")]
    assert lb.get_status()["kept"] == 2
    _load_more(lb, a, b, "mixed-more", tokens=22)  # 40 ms: both migrations pay
    placed = {name: _next_turn(lb, name, turns[name]) for name in ("two", "ten")}
    assert placed == {"two": b, "ten": b}
    moved = {m.request_id: (m.outcome, m.migrated_tokens) for m in lb.moves[1:]}
    assert moved == {"two": ("migrated", 2 * PAGE), "ten": ("migrated", 10 * PAGE)}
    served = _generate(b, turns["ten"])
    assert served["meta_info"]["cached_tokens"] >= 10 * PAGE
    # The load is counted in tokens, and every release took its turn's tokens off.
    assert lb.get_inflight_tokens(b) == 0
    assert lb.get_inflight_tokens(a) == 3 * 6 + 22


@pytest.mark.parametrize("failure", ["unreachable", "transport"])
def test_a_failed_move_falls_back_to_reprefill(servers: list[ServerHandle], failure: str) -> None:
    broken = _sid(servers[2])  # its transfer engine refuses every write
    b = _sid(servers[1])
    source = "127.0.0.1:9" if failure == "unreachable" else broken
    lb = KVMigrationLoadBalancer({source: "S"}, MIGRATE_CONFIG)
    turn1 = _seq(8000 + (1000 if failure == "transport" else 0), 3 * PAGE)
    asyncio.run(lb.acquire_server("f", prompt_ids=turn1))
    if failure == "transport":
        _generate(broken, turn1)
    lb.release_server(source)
    _loaded(lb, source, 3, failure)
    lb.add_servers({b: "B"})
    sid, _ = asyncio.run(lb.acquire_server("f", prompt_ids=turn1 + [1, 2, 3]))
    assert sid == b  # the request goes on, to the new server
    [move] = lb.moves
    assert move.outcome == "failed" and move.migrated_tokens == 0, move
    assert lb.get_status()["moves"] == {"failed": 1}
    assert lb.get_inflight_count(b) == 1


class _GatedClient:
    """The real client, whose migrations wait for `gate` (to hold a move in flight while
    the test acquires for other sessions)."""

    def __init__(self) -> None:
        self.real = AsyncMigrationClient()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def migrate(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting.set()
        await self.gate.wait()
        return await self.real.migrate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_move_never_blocks_other_sessions_acquires(servers: list[ServerHandle]) -> None:
    a, b = _sid(servers[0]), _sid(servers[1])
    turn1 = _seq(9000, 3 * PAGE)
    _generate(a, turn1)

    async def run() -> None:
        client = _GatedClient()
        lb = KVMigrationLoadBalancer({a: "A"}, MIGRATE_CONFIG, client=client)
        await lb.acquire_server("slow", prompt_ids=turn1)
        lb.release_server(a)
        for i in range(3):
            await lb.acquire_server(f"busy-{i}", prompt_ids=[1])
        lb.add_servers({b: "B"})
        moving = asyncio.create_task(lb.acquire_server("slow", prompt_ids=turn1 + [7]))
        await asyncio.wait_for(client.waiting.wait(), 10)
        # While the move waits: new sessions are placed, others released, and the moving
        # session's next turn waits for its move.
        # Decided, the moving request counts on B already.
        assert lb.get_inflight_count(b) == 1 and lb.get_inflight_count(a) == 3
        placed = [await lb.acquire_server(f"new-{i}", prompt_ids=[2]) for i in range(3)]
        # The moving turn's 49 tokens are B's load: A's 3 one-token requests are less.
        assert [sid for sid, _ in placed] == [a, a, a]
        lb.release_server(a)
        next_turn = asyncio.create_task(lb.acquire_server("slow", prompt_ids=turn1 + [7, 8]))
        await asyncio.sleep(0.05)
        assert not moving.done() and not next_turn.done()
        client.gate.set()
        assert (await asyncio.wait_for(moving, 60))[0] == b
        assert (await asyncio.wait_for(next_turn, 60))[0] == b
        assert [m.outcome for m in lb.moves] == ["migrated"]
        await lb.aclose()

    asyncio.run(run())
