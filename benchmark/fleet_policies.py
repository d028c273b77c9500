"""Where each turn goes: the real balancers, driven inside the simulation.

`BalancerPlacement` runs a real verl `RequestLoadBalancer` — verl's
`GlobalRequestLoadBalancer` or this package's `KVMigrationLoadBalancer`, built by
`bench_verl_pattern.make_balancer` exactly as the GPU benchmark builds its arms — through
its own `acquire_server` / `release_server` / `add_servers`. `KVMigrationLoadBalancer`
asks the servers what they hold and migrates through a client: `SimMigrationClient` answers
for the simulated servers (session info with each server's host, size queries from their
caches, a migration recorded as a `Move` the simulation then times and lands). Its
decisions — when to re-pin, where, whether moving beats re-prefilling (its `CostModel`),
and the path (`predict_path`) — are the package's own code.

`BoundPlacement` is the balanced-without-recompute bound: every turn goes to the server
with the fewest requests in flight, and its session's KV is there already, at no cost
(moved there, not copied); among equally loaded servers it keeps the one that holds it.
It is a reference, not a proof: a policy's different timing can come out a few percent
under it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import bench_verl_pattern
import verl_pattern_stats as arms
from fleet_server import Server
from sglang_kv_migration.client.migration import MigrationResult, predict_path
from sglang_kv_migration.integrations.verl_balancer import KVMigrationLoadBalancer
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import (
    ExtraTokenSizeReply,
    RankSessionInfo,
    SessionInfoReply,
)

BOUND = "bound"
POLICIES = (*arms.ARMS, BOUND)


@dataclass
class Move:
    """A migration the balancer made: `tokens` of `session`'s sequence from `source` to
    `target`, `device_tokens` of them on the source's GPU, over `path`."""

    session: str
    source: str
    target: str
    tokens: int
    device_tokens: int
    path: str


def device_beyond(device_tokens: int, target_has: int) -> int:
    """Of a prefix whose first `device_tokens` the source holds on its GPU, the part a move
    sends beyond the target's first `target_has` that comes from the GPU."""
    return max(0, device_tokens - target_has)


class SimMigrationClient:
    """The `AsyncMigrationClient` calls `KVMigrationLoadBalancer` makes, answered by the
    simulated servers. `session` is the session whose turn is being acquired (the caller
    sets it before each acquire: acquires never interleave here)."""

    def __init__(self, servers: dict[str, Server]):
        self.servers = servers
        self.session = ""
        self.moves: list[Move] = []

    def _server(self, url: str) -> Server:
        return self.servers[url.removeprefix("http://").rstrip("/")]

    async def session_info(self, url: str) -> SessionInfoReply:
        server = self._server(url)
        rank = RankSessionInfo(
            tp_rank=0,
            pp_rank=0,
            page_size=server.config.page_size,
            fingerprint={},
            paths={
                "device": {"host_identity": server.config.host, "tiers": ["device", "host"]},
                "host": {},
            },
            host_kv_item_lens=[server.costs.bytes_per_token],
        )
        return SessionInfoReply(success=True, ranks=[rank], features=[])

    async def call(self, url: str, path: str, body: Any = None) -> dict[str, Any]:
        """Only the size query is asked: what the server holds of the session's ids."""
        server = self._server(url)
        page = server.config.page_size
        asked = len(body.input_ids) // page * page
        tokens, device = server.held(self.session)
        matched = min(tokens, asked)
        return {
            "success": True,
            "matched_token_size": matched,
            "device_token_size": min(device, matched),
            "extra_token_size": asked - matched,
            "total_token_size": asked,
        }

    async def migrate(
        self, source_url: str, target_url: str, input_ids: list[int], **kw: Any
    ) -> MigrationResult:
        src, dst = self._server(source_url), self._server(target_url)
        held = from_dict(ExtraTokenSizeReply, kw["held"])  # the balancer always passes it
        have, _ = dst.held(self.session)
        tokens = max(0, held.matched_token_size - have)
        infos = [await self.session_info(u) for u in (source_url, target_url)]
        path = predict_path(infos[0], infos[1], held) or "host"
        move = Move(
            self.session,
            src.name,
            dst.name,
            tokens,
            device_beyond(held.device_token_size, have),
            path,
        )
        self.moves.append(move)
        return MigrationResult(
            source_url=source_url,
            target_url=target_url,
            migration_id=f"sim-{len(self.moves)}",
            source_held_token_size=held.matched_token_size,
            target_matched_token_size=have,
            migrated_token_size=tokens,
            migrated_bytes=tokens * src.costs.bytes_per_token,
            matched_after_commit=held.matched_token_size,
            path=path,
        )

    async def aclose(self) -> None:
        return None


class BalancerPlacement:
    """A real verl balancer placing the simulated turns (see the module docstring)."""

    def __init__(self, policy: str, servers: dict[str, Server], first: list[str], config: dict):
        self.policy = policy
        self.client = SimMigrationClient(servers)
        self.servers = servers
        args = argparse.Namespace(**config)
        handles = {sid: f"handle-{sid}" for sid in first}
        if policy == arms.DEFAULT and not config.get("verl", True):
            # The benchmark's own stand-in when verl does not import (it places the same).
            self.balancer = KVMigrationLoadBalancer(handles, {"repin_margin": 10**9})
        else:
            self.balancer = bench_verl_pattern.make_balancer(policy, handles, args)
        router = dict(config.get("router") or {})
        if policy == arms.REPREFILL:
            router.pop("cost_margin", None)  # what makes the arm re-prefill stays
        if router and isinstance(self.balancer, KVMigrationLoadBalancer):
            # Router YAML keys beyond the benchmark's arms (e.g. cost_margin): the same
            # balancer, its config with them.
            merged = {**dataclasses.asdict(self.balancer.config), **router}
            self.balancer = KVMigrationLoadBalancer(handles, merged)
        self.kind = type(self.balancer).__name__
        if hasattr(self.balancer, "_client"):  # KVMigrationLoadBalancer: our servers answer
            self.balancer._client = self.client
        self._loop = asyncio.new_event_loop()

    def add_servers(self, ids: list[str]) -> None:
        self.balancer.add_servers({sid: f"handle-{sid}" for sid in ids})

    def acquire(self, session: str, prompt_tokens: int) -> tuple[str, Move | None, bool]:
        """(server, the move made, whether the balancer asked the servers first)."""
        self.client.session = session
        before = len(self.client.moves)
        asked = self._repins()
        kwargs = {}
        if "prompt_ids" in self.balancer.require_acquire_fields():
            kwargs["prompt_ids"] = range(prompt_tokens)
        out = self.balancer.acquire_server(session, **kwargs)
        if asyncio.iscoroutine(out):
            out = self._loop.run_until_complete(out)
        server_id, _ = out
        move = self.client.moves[-1] if len(self.client.moves) > before else None
        return server_id, move, self._repins() > asked

    def release(self, server_id: str, session: str) -> None:
        self.balancer.release_server(server_id, session)

    def outcomes(self) -> dict[str, int]:
        status = self.balancer.get_status() if hasattr(self.balancer, "get_status") else {}
        return dict(status.get("moves", {}))

    def close(self) -> None:
        if hasattr(self.balancer, "aclose"):
            self._loop.run_until_complete(self.balancer.aclose())
        self._loop.close()

    def _repins(self) -> int:
        """Re-pins so far, whatever became of their KV (verl's balancer makes none)."""
        return sum(self.outcomes().values())


class BoundPlacement:
    """Fewest in flight, the session's KV already there (the bound)."""

    kind = "bound"

    def __init__(self, servers: dict[str, Server], first: list[str], rng: random.Random):
        self.servers = servers
        self.active = list(first)
        self.inflight = {sid: 0 for sid in first}
        self.rng = rng
        self.teleported = 0

    def add_servers(self, ids: list[str]) -> None:
        for sid in ids:
            self.active.append(sid)
            self.inflight[sid] = 0

    def acquire(self, session: str, prompt_tokens: int) -> tuple[str, Move | None, bool]:
        least = min(self.inflight.values())
        candidates = [s for s in self.active if self.inflight[s] == least]
        best = max(self.servers.values(), key=lambda s: s.held(session)[0])
        tokens, _ = best.held(session)
        # Among the least loaded, the one holding the session's KV (nothing to move).
        sid = best.name if best.name in candidates and tokens else self.rng.choice(candidates)
        self.inflight[sid] += 1
        if best.name != sid and tokens > self.servers[sid].held(session)[0]:
            if self.servers[sid].land(session, tokens, on_device=True):
                best.forget(session)  # moved, not copied: no capacity lost to it
            self.teleported += 1
        return sid, None, False

    def release(self, server_id: str, session: str) -> None:
        self.inflight[server_id] -= 1

    def outcomes(self) -> dict[str, int]:
        return {"free": self.teleported} if self.teleported else {}

    def close(self) -> None:
        return None


def make_placement(
    policy: str, servers: dict[str, Server], first: list[str], config: dict, rng: random.Random
) -> BalancerPlacement | BoundPlacement:
    if policy == BOUND:
        return BoundPlacement(servers, first, rng)
    if policy not in arms.ARMS:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    return BalancerPlacement(policy, servers, first, config)
