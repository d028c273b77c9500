"""`KVMigrationLoadBalancer` as verl 0.9.1 loads and calls it, against CPU mini servers.

verl's own code loads the class (`router._load_router_yaml` and `_resolve_router_class`
on the router YAML of docs/rl-integration.md) and asks it for a server
(`llm_server.LLMServerClient._acquire_server`, which forwards the fields the balancer
declares).
What is left out is Ray: verl wraps the class in `ray.remote` and calls its methods
through an actor; here they are called on the instance. The servers are `mini_server`s
with the `/generate` stand-in (real HiRadixCache, real migration routes, Mooncake TCP on
127.0.0.1), so "served from cache" is the server's own prefix match.
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import verl_recipe
from generate_standin import StandinConfig, standin_factory
from mini_server import ServerHandle, ServerSpec, start_servers
from sglang_kv_migration.client.migration import AsyncMigrationClient
from sglang_kv_migration.integrations.verl_balancer import KVMigrationLoadBalancer

router = pytest.importorskip("verl.workers.rollout.router")
llm_server = pytest.importorskip("verl.workers.rollout.llm_server")

PAGE = 16
# Migration beats re-prefill for these few-page prefixes only when prefill is priced high
# (the recipe's prior is a real model's, where a 3-page prefix is cheaper to recompute).
MIGRATE_CONFIG = {**verl_recipe.router_config(), "prefill_seconds_per_token": 1.0}


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


def _loaded(lb: KVMigrationLoadBalancer, server_id: str, n: int, tag: str) -> None:
    """`n` requests of other sessions in flight on `server_id` (the only server yet)."""
    for i in range(n):
        sid, _ = asyncio.run(lb.acquire_server(f"{tag}-other-{i}", prompt_ids=[1, 2]))
        assert sid == server_id


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


def test_verl_loads_the_class_from_the_recipes_router_yaml() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kv_migration_router.yaml"
        path.write_text(
            "\n".join(f"{k}: {v}" for k, v in verl_recipe.router_config().items()) + "\n"
        )
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
    with pytest.raises(ValueError, match="unknown router config keys: repin_margn"):
        cls({}, {"repin_margn": 3})


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


def test_a_repinned_session_migrates_and_its_next_turn_is_served_from_cache(
    servers: list[ServerHandle],
) -> None:
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A"}, MIGRATE_CONFIG)
    turn1 = _seq(5000, 3 * PAGE)
    assert asyncio.run(lb.acquire_server("conv", prompt_ids=turn1))[0] == a
    out1 = _generate(a, turn1)["output_ids"]  # A now holds turn1 + out1[:-1]
    lb.release_server(a)
    _loaded(lb, a, 3, "repin")
    lb.add_servers({b: "B"})  # verl adds replicas at run time; B is idle
    turn2 = turn1 + out1 + _seq(6000, PAGE)
    sid, handle = asyncio.run(lb.acquire_server("conv", prompt_ids=turn2))
    assert (sid, handle) == (b, "B")
    [move] = lb.moves
    assert move.outcome == "migrated", move
    assert move.migrated_tokens == 3 * PAGE  # the whole pages A held
    served = _generate(b, turn2)
    assert served["meta_info"]["cached_tokens"] >= 3 * PAGE
    assert asyncio.run(lb.acquire_server("conv", prompt_ids=turn2))[0] == b  # sticky to B
    assert lb.get_status()["migrated_tokens"] == 3 * PAGE


def test_a_move_not_worth_it_repins_without_migrating(servers: list[ServerHandle]) -> None:
    a, b = _sid(servers[0]), _sid(servers[1])
    lb = KVMigrationLoadBalancer({a: "A"}, verl_recipe.router_config())
    turn1 = _seq(7000, 2 * PAGE)
    asyncio.run(lb.acquire_server("cheap", prompt_ids=turn1))
    out1 = _generate(a, turn1)["output_ids"]
    lb.release_server(a)
    _loaded(lb, a, 3, "cheap")
    lb.add_servers({b: "B"})
    sid, _ = asyncio.run(lb.acquire_server("cheap", prompt_ids=turn1 + out1))
    assert sid == b
    [move] = lb.moves
    # Two pages of this model re-prefill in far less time than a migration's fixed cost.
    assert move.outcome == "recompute" and move.migrated_tokens == 0, move
    assert "re-prefill" in move.detail


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
    """The real client, whose first call of each move waits for `gate` (to hold a move
    in flight while the test acquires for other sessions)."""

    def __init__(self) -> None:
        self.real = AsyncMigrationClient()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def session_info(self, url: str) -> dict[str, Any]:
        self.waiting.set()
        await self.gate.wait()
        return await self.real.session_info(url)

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
        assert lb.get_inflight_count(b) == 1  # the moving request counts on B already
        placed = [await lb.acquire_server(f"new-{i}", prompt_ids=[2]) for i in range(3)]
        assert [sid for sid, _ in placed][:2] == [b, b]  # B (1 in flight) is least loaded
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
