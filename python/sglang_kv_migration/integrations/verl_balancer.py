"""A load balancer for verl 0.9.1's rollout that re-pins sticky sessions with their KV.

verl routes every rollout request through one balancer actor shared by all agent-loop
workers (`verl/workers/rollout/router.py`, `GlobalRequestLoadBalancer`): a session
(`request_id`) sticks to the server it first went to, so every turn hits that server's
prefix cache, and a new session goes to the server with the fewest requests in flight.
A sticky session stays put however loaded its server gets; moving it would forfeit its KV.

`KVMigrationLoadBalancer` keeps that placement, and when a session's server has more than
`repin_margin` requests in flight beyond the least-loaded one, it re-pins the session to
that server and first migrates the session's KV there (the turn's `prompt_ids`, which
verl hands to `acquire_server` because `require_acquire_fields` asks for them), so the
turn is served from cache. The cost model (`rollout/cost_model.py`) decides whether moving
beats re-prefilling; a move that is not worth it, or that fails (unreachable server,
refused transfer, timeout), leaves the re-prefill to the new server: the request never
fails because of a move. A move awaits only its own session's acquire: the balancer is an
asyncio (Ray async) actor, so other sessions' acquires and releases go on meanwhile, and
the new server's count includes the moving request from the start.

verl loads it by configuration (`rollout.router_config_path`, a YAML with `router_class`;
verl constructs it with ``(servers, config)``; docs/rl-integration.md, "verl"), or as
`load_balancer_cls` (constructed with ``servers=..., max_cache_size=...``). It satisfies
verl's `RequestLoadBalancer` protocol without importing verl or SGLang: server ids are
verl's ``"host:port"`` HTTP addresses of the replicas, handles are passed through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from sglang_kv_migration.client.migration import (
    SIZE_QUERY_ROUTE,
    AsyncMigrationClient,
    predict_path,
    size_query,
)
from sglang_kv_migration.rollout.cost_model import (
    CostEstimate,
    CostModel,
    PrefillCosts,
    bytes_per_token_from_session_info,
)
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply

logger = logging.getLogger(__name__)

# verl's message: its fully-async client retries on exactly this text.
NO_SERVERS = "No available servers in load balancer"
DEFAULT_ROUTING_CACHE_SIZE = 10_000  # verl's default sticky-map size


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """The router YAML's keys (besides `router_class`)."""

    # Re-pin a session when its server has more than this many requests in flight beyond
    # the least-loaded server's.
    repin_margin: int = 2
    max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE
    # Longest a move may take before the request goes to the new server without it.
    move_timeout_s: float = 30.0
    # The servers' --api-key / --admin-api-key, if set (the migration routes are admin
    # routes).
    api_key: str | None = None
    admin_api_key: str | None = None
    # Migrate only when it is this much cheaper than re-prefill (`CostModel.margin`).
    cost_margin: float = 1.0
    # Re-prefill seconds per token on the rollout servers (None: the cost model's prior).
    prefill_seconds_per_token: float | None = None

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> BalancerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known - {"router_class"})
        if unknown:
            raise ValueError(f"unknown router config keys: {', '.join(unknown)}")
        values = {k: v for k, v in config.items() if k in known}
        out = cls(**values)
        if out.repin_margin < 0 or out.max_cache_size < 1 or out.move_timeout_s <= 0:
            raise ValueError(
                "router config: repin_margin must be >= 0, max_cache_size >= 1 and "
                "move_timeout_s > 0"
            )
        return out

    def cost_model(self) -> CostModel:
        prefill = PrefillCosts()
        if self.prefill_seconds_per_token is not None:
            prefill = PrefillCosts(seconds_per_token=self.prefill_seconds_per_token)
        return CostModel(prefill=prefill, margin=self.cost_margin)


@dataclasses.dataclass(frozen=True)
class MoveRecord:
    """One re-pin: where the session went and what happened to its KV."""

    request_id: str
    source: str
    target: str
    # "migrated", "recompute" (the cost model's call, or nothing held to move) or "failed".
    outcome: str
    migrated_tokens: int = 0
    detail: str = ""


class KVMigrationLoadBalancer:
    """verl's sticky + least-in-flight balancer that migrates a re-pinned session's KV."""

    def __init__(
        self,
        servers: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
        *,
        max_cache_size: int | None = None,
        client: Any = None,
    ):
        """`servers`: verl's ``{"host:port": actor handle}``. `config`: the router YAML as
        a dict (verl passes it whole). `max_cache_size`: as verl passes it to a
        `load_balancer_cls` (overrides the config's). `client`: an `AsyncMigrationClient`
        (default: one built from the config's keys, on first use)."""
        raw = dict(config or {})
        if max_cache_size is not None:
            raw["max_cache_size"] = max_cache_size
        self.config = BalancerConfig.from_mapping(raw)
        self.cost_model = self.config.cost_model()
        self._servers: dict[str, Any] = dict(servers)
        self._inflight: dict[str, int] = {sid: 0 for sid in servers}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # request_id -> server, LRU
        self._moving: dict[str, asyncio.Future[None]] = {}  # request_id -> its move
        self._client = client
        self.moves: list[MoveRecord] = []
        self._outcomes: Counter[str] = Counter()

    # ------------------------------------------------------------------ verl's protocol

    def require_acquire_fields(self) -> list[str]:
        """The turn's token ids: what a re-pinned session's move migrates."""
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return []

    async def acquire_server(
        self, request_id: str, prompt_ids: list[int] | None = None, **extra: Any
    ) -> tuple[str, Any]:
        """`(server_id, handle)` for this turn: the session's server, or, when that one
        is loaded beyond the margin, the least-loaded one after its KV moved there."""
        while (pending := self._moving.get(request_id)) is not None:
            await asyncio.shield(pending)  # the session's previous turn is moving it
        if not self._inflight:
            raise RuntimeError(NO_SERVERS)
        sticky = self._sticky_server(request_id)
        if sticky is None:
            return self._take(request_id, self._least_loaded())
        target = self._repin_target(sticky)
        if target is None or not prompt_ids:
            return self._take(request_id, sticky)
        self._take(request_id, target)  # counted now: concurrent acquires see it
        done = asyncio.get_running_loop().create_future()
        self._moving[request_id] = done
        try:
            self._record(await self._move(request_id, sticky, target, list(prompt_ids)))
        finally:
            del self._moving[request_id]
            done.set_result(None)
        if target not in self._servers:  # removed while the move ran
            self.release_server(target)
            self._sticky.pop(request_id, None)
            return await self.acquire_server(request_id, prompt_ids)
        return target, self._servers[target]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        for sid, handle in servers.items():
            self._servers[sid] = handle
            self._inflight[sid] = 0

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:
            self._servers.pop(sid, None)
            self._inflight.pop(sid, None)

    def get_inflight_count(self, server_id: str) -> int:
        return self._inflight.get(server_id, 0)

    def get_all_servers(self) -> list[str]:
        return list(self._inflight)

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    def clear_sticky_cache(self) -> dict:
        cleared = len(self._sticky)
        self._sticky.clear()
        return {"cleared_entries": cleared, "server_loads": dict(self._inflight)}

    def get_status(self) -> dict:
        return {
            "servers": dict(self._inflight),
            "total_inflight": self.get_total_inflight(),
            "active_servers": len(self._inflight),
            "registered_handles": list(self._servers),
            "moves": dict(self._outcomes),
            "migrated_tokens": sum(m.migrated_tokens for m in self.moves),
        }

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ------------------------------------------------------------------ placement

    def _sticky_server(self, request_id: str) -> str | None:
        sid = self._sticky.get(request_id)
        if sid is None:
            return None
        if sid not in self._inflight:  # its server left the pool
            del self._sticky[request_id]
            return None
        self._sticky.move_to_end(request_id)
        return sid

    def _least_loaded(self) -> str:
        least = min(self._inflight.values())
        return random.choice([sid for sid, n in self._inflight.items() if n == least])

    def _repin_target(self, sticky: str) -> str | None:
        """The least-loaded server, if `sticky` carries more than the margin beyond it."""
        target = self._least_loaded()
        if self._inflight[sticky] - self._inflight[target] > self.config.repin_margin:
            return target
        return None

    def _take(self, request_id: str, sid: str) -> tuple[str, Any]:
        self._sticky[request_id] = sid
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self.config.max_cache_size:
            self._sticky.popitem(last=False)
        self._inflight[sid] += 1
        return sid, self._servers[sid]

    # ------------------------------------------------------------------ moves

    async def _move(self, request_id: str, source: str, target: str, ids: list[int]) -> MoveRecord:
        """Migrate what `source` holds of `ids` to `target` if the cost model says so.
        Never raises: a failure is recorded, and the target re-prefills."""
        try:
            async with asyncio.timeout(self.config.move_timeout_s):
                return await self._migrate_if_worth_it(request_id, source, target, ids)
        except Exception as e:  # any failure: the request goes on, the target re-prefills
            logger.warning(
                "KV move of session %s from %s to %s failed, re-prefilling there: %s",
                request_id,
                source,
                target,
                e,
            )
            detail = f"{type(e).__name__}: {e}"
            return MoveRecord(request_id, source, target, "failed", detail=detail)

    async def _migrate_if_worth_it(
        self, request_id: str, source: str, target: str, ids: list[int]
    ) -> MoveRecord:
        client = self._migration_client()
        src, dst = _url(source), _url(target)
        source_info = await client.session_info(src)
        held = from_dict(
            ExtraTokenSizeReply,
            await client.call(src, SIZE_QUERY_ROUTE, size_query(source_info, ids)),
        )
        estimate = await self._estimate(client, src, dst, ids, held)
        if estimate.decision != "migrate":
            detail = f"migrate {estimate.migrate_s:.4f}s vs re-prefill {estimate.recompute_s:.4f}s"
            return MoveRecord(request_id, source, target, "recompute", detail=detail)
        result = await client.migrate(src, dst, ids, held=held)
        return MoveRecord(
            request_id,
            source,
            target,
            "migrated",
            migrated_tokens=result.migrated_token_size,
            detail=f"{result.path} path, matched after commit {result.matched_after_commit}",
        )

    async def _estimate(
        self, client: Any, src: str, dst: str, ids: list[int], held: ExtraTokenSizeReply
    ) -> CostEstimate:
        """The cost model's verdict on what the source holds beyond the target, priced on
        the path the migration would take."""
        source_held = held.matched_token_size
        if not source_held:
            return self.cost_model.estimate(0)
        target_info = await client.session_info(dst)
        target_reply = from_dict(
            ExtraTokenSizeReply,
            await client.call(dst, SIZE_QUERY_ROUTE, size_query(target_info, ids[:source_held])),
        )
        tokens = max(0, source_held - target_reply.matched_token_size)
        source_info = await client.session_info(src)
        path = predict_path(source_info, target_info, held) or None
        nbytes = None
        if self.cost_model.costs_for(path).bytes_per_token is None:
            nbytes = tokens * bytes_per_token_from_session_info(source_info)
        return self.cost_model.estimate(tokens, nbytes, path=path, held=held)

    def _migration_client(self) -> Any:
        if self._client is None:
            self._client = AsyncMigrationClient(
                timeout=self.config.move_timeout_s,
                api_key=self.config.api_key,
                admin_api_key=self.config.admin_api_key,
            )
        return self._client

    def _record(self, move: MoveRecord) -> None:
        self.moves.append(move)
        del self.moves[:-1000]  # bounded: the latest moves, for get_status and logs
        self._outcomes[move.outcome] += 1


def _url(server_id: str) -> str:
    """verl's server ids are HTTP addresses without a scheme ("10.0.0.1:30000")."""
    return server_id if "://" in server_id else f"http://{server_id}"
