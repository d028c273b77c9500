"""A load balancer for verl 0.9.1's rollout that re-pins sticky sessions with their KV.

verl routes every rollout request through one balancer actor shared by all agent-loop
workers (`verl/workers/rollout/router.py`, `GlobalRequestLoadBalancer`): a session
(`request_id`) sticks to the server it first went to, so every turn hits that server's
prefix cache, and a new session goes to the server with the fewest requests in flight.
A sticky session stays put however loaded its server gets; moving it would forfeit its KV.

`KVMigrationLoadBalancer` keeps that placement and moves a session only when moving it
pays. Load is counted in tokens: the prompt tokens of the requests in flight on each
server (verl hands each turn's `prompt_ids` to `acquire_server`, because
`require_acquire_fields` asks for them, and the request id to `release_server`). When a
session's server has more than `repin_margin` requests in flight beyond the least-loaded
one (a guard against moving on noise), the move is priced for that session: the source's
size query says how much of the turn's `prompt_ids` it holds and on which tier, and the
cost model (`rollout/cost_model.py`) prices migrating that KV against re-prefilling it.

- The gain of a move is the load it takes this turn away from: the tokens in flight on
  its server beyond the target's, priced at the prefill rate.
- Its cost is the migration, when the cost model says the KV moves; else the
  re-prefill of what the source holds, whose cache the session leaves behind.
- The session moves only when the gain beats the cost; otherwise it stays where its KV
  is (`get_status()["kept"]` counts those). So which sessions move is decided by their
  prefix length and tier and by the load in tokens, not by request counts: a session
  whose KV migrates cheaply moves once the imbalance is worth its migration, one that
  would be re-prefilled only past an imbalance larger than what it holds, and one whose
  move costs more than the imbalance is worth stays.

A move that fails (unreachable server, refused transfer, timeout) leaves the re-prefill to
the new server: the request never fails because of a move. A move awaits only its own
session's acquire: the balancer is an asyncio (Ray async) actor, so other sessions'
acquires and releases go on meanwhile; the turn counts on its server while the move is
priced and on the target from the moment it is decided.

verl loads it by configuration (`rollout.router_config_path`, a YAML with `router_class`;
verl constructs it with ``(servers, config)``; docs/rl-integration.md, "verl"; the keys
are `verl_router_config.py`'s), or as `load_balancer_cls` (constructed with
``servers=..., max_cache_size=...``). It satisfies
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
from sglang_kv_migration.integrations.verl_router_config import (
    BalancerConfig,
    RouterConfigError,
)
from sglang_kv_migration.rollout.cost_model import (
    CostEstimate,
    bytes_per_token_from_session_info,
)
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply

logger = logging.getLogger(__name__)

# verl's message: its fully-async client retries on exactly this text.
NO_SERVERS = "No available servers in load balancer"
# Where a session's turn went, or why it stayed (`MoveRecord.outcome`, `get_status`).
MIGRATED, RECOMPUTE, FAILED = "migrated", "recompute", "failed"


@dataclasses.dataclass(frozen=True)
class MoveRecord:
    """One re-pin: where the session went and what happened to its KV."""

    request_id: str
    source: str
    target: str
    # MIGRATED, RECOMPUTE (re-prefilled on the target: its gain beat that, or the source
    # held nothing to move) or FAILED (the migration failed; re-prefilled).
    outcome: str
    migrated_tokens: int = 0
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class MovePrice:
    """What moving one session's turn would gain and cost (seconds), and the cost
    model's verdict on its KV."""

    gain_s: float
    cost_s: float
    estimate: CostEstimate
    held: ExtraTokenSizeReply | None

    @property
    def pays(self) -> bool:
        return self.gain_s > self.cost_s

    def describe(self) -> str:
        e = self.estimate
        return (
            f"gain {self.gain_s:.4f}s vs cost {self.cost_s:.4f}s ({e.tokens} tokens: "
            f"migrate {e.migrate_s:.4f}s, re-prefill {e.recompute_s:.4f}s)"
        )


class KVMigrationLoadBalancer:
    """verl's sticky + least-loaded balancer that moves a session, with its KV, only when
    moving it pays (module docstring)."""

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
        (default: one built from the config's keys, on first use). A config that fails
        its check does not raise here (verl would see a dead actor): every call raises
        `RouterConfigError` naming the key."""
        raw = dict(config or {})
        if max_cache_size is not None:
            raw["max_cache_size"] = max_cache_size
        self.config_error: RouterConfigError | None = None
        try:
            self.config = BalancerConfig.from_mapping(raw)
        except RouterConfigError as e:
            logger.error("KVMigrationLoadBalancer: %s; every call will raise it", e)
            self.config_error, self.config = e, BalancerConfig()
        self.cost_model = self.config.cost_model()
        self._servers: dict[str, Any] = dict(servers)
        self._inflight: dict[str, int] = {sid: 0 for sid in servers}
        # Prompt tokens of the requests in flight, per server and request id.
        self._tokens: dict[str, dict[str, list[int]]] = {sid: {} for sid in servers}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # request_id -> server, LRU
        self._moving: dict[str, asyncio.Future[None]] = {}  # request_id -> its move
        self._client = client
        self.moves: list[MoveRecord] = []
        self._outcomes: Counter[str] = Counter()
        self.kept = 0  # sessions left where their KV is: moving them did not pay

    # ------------------------------------------------------------------ verl's protocol

    def require_acquire_fields(self) -> list[str]:
        """The turn's token ids: its load, and what a re-pinned session's move migrates."""
        self._check_config()
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        """The request id: which turn's tokens leave its server's load."""
        self._check_config()
        return ["request_id"]

    async def acquire_server(
        self, request_id: str, prompt_ids: list[int] | None = None, **extra: Any
    ) -> tuple[str, Any]:
        """`(server_id, handle)` for this turn: the session's server, or the least-loaded
        one when moving the session there pays (its KV migrated first when it moves)."""
        self._check_config()
        while (pending := self._moving.get(request_id)) is not None:
            await asyncio.shield(pending)  # the session's previous turn is moving it
        if not self._inflight:
            raise RuntimeError(NO_SERVERS)
        tokens = len(prompt_ids or ())
        sticky = self._sticky_server(request_id)
        if sticky is None:
            return self._take(request_id, self._least_loaded(), tokens)
        target = self._repin_candidate(sticky)
        self._take(request_id, sticky, tokens)  # counted where it is while it is priced
        if target is None or not prompt_ids:
            return sticky, self._servers[sticky]
        done = asyncio.get_running_loop().create_future()
        self._moving[request_id] = done
        try:
            moved = await self._move_if_it_pays(request_id, sticky, target, list(prompt_ids))
        finally:
            del self._moving[request_id]
            done.set_result(None)
        if moved is None:
            return sticky, self._servers[sticky]
        if moved not in self._servers:  # removed while the move ran
            self.release_server(moved, request_id)
            self._sticky.pop(request_id, None)
            return await self.acquire_server(request_id, prompt_ids)
        return moved, self._servers[moved]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1
        self._drop_tokens(server_id, request_id)

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        for sid, handle in servers.items():
            self._servers[sid] = handle
            self._inflight[sid] = 0
            self._tokens[sid] = {}

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:
            self._servers.pop(sid, None)
            self._inflight.pop(sid, None)
            self._tokens.pop(sid, None)

    def get_inflight_count(self, server_id: str) -> int:
        return self._inflight.get(server_id, 0)

    def get_inflight_tokens(self, server_id: str) -> int:
        """Prompt tokens of the requests in flight on `server_id` (its load in tokens)."""
        return sum(sum(turns) for turns in self._tokens.get(server_id, {}).values())

    def get_all_servers(self) -> list[str]:
        return list(self._inflight)

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    def clear_sticky_cache(self) -> dict:
        cleared = len(self._sticky)
        self._sticky.clear()
        return {"cleared_entries": cleared, "server_loads": dict(self._inflight)}

    def get_status(self) -> dict:
        self._check_config()
        return {
            "servers": dict(self._inflight),
            "tokens": {sid: self.get_inflight_tokens(sid) for sid in self._inflight},
            "total_inflight": self.get_total_inflight(),
            "active_servers": len(self._inflight),
            "registered_handles": list(self._servers),
            "moves": dict(self._outcomes),
            "kept": self.kept,
            "migrated_tokens": sum(m.migrated_tokens for m in self.moves),
        }

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ------------------------------------------------------------------ placement

    def _check_config(self) -> None:
        if self.config_error is not None:
            raise self.config_error

    def _sticky_server(self, request_id: str) -> str | None:
        sid = self._sticky.get(request_id)
        if sid is None:
            return None
        if sid not in self._inflight:  # its server left the pool
            del self._sticky[request_id]
            return None
        self._sticky.move_to_end(request_id)
        return sid

    def _least_loaded(self, exclude: str | None = None) -> str:
        """The server with the fewest tokens in flight, then the fewest requests."""
        loads = {
            sid: (self.get_inflight_tokens(sid), n)
            for sid, n in self._inflight.items()
            if sid != exclude
        }
        least = min(loads.values())
        return random.choice([sid for sid, load in loads.items() if load == least])

    def _repin_candidate(self, sticky: str) -> str | None:
        """The least-loaded other server, if `sticky` carries more than the margin of
        requests beyond it (a move is then priced; else the session stays)."""
        if len(self._inflight) < 2:
            return None
        target = self._least_loaded(exclude=sticky)
        if self._inflight[sticky] - self._inflight[target] > self.config.repin_margin:
            return target
        return None

    def _take(self, request_id: str, sid: str, tokens: int) -> tuple[str, Any]:
        self._sticky[request_id] = sid
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self.config.max_cache_size:
            self._sticky.popitem(last=False)
        self._inflight[sid] += 1
        self._tokens[sid].setdefault(request_id, []).append(tokens)
        return sid, self._servers[sid]

    def _drop_tokens(self, server_id: str, request_id: str | None) -> None:
        """One turn's tokens leave `server_id`: the request's, else (verl releasing
        without an id) the oldest turn's there."""
        turns = self._tokens.get(server_id)
        if not turns:
            return
        key = request_id if request_id in turns else next(iter(turns))
        turns[key].pop(0)
        if not turns[key]:
            del turns[key]

    def _shift(self, request_id: str, source: str, target: str) -> None:
        """The turn counted on `source` while it was priced goes to `target`."""
        tokens = self._tokens[source][request_id][-1]
        self.release_server(source, request_id)
        self._take(request_id, target, tokens)

    # ------------------------------------------------------------------ moves

    async def _move_if_it_pays(
        self, request_id: str, source: str, target: str, ids: list[int]
    ) -> str | None:
        """Price moving this turn from `source` to `target`; if it pays, re-pin the
        session there (migrating its KV when the cost model says so) and return the
        server it now counts on; else None (it stays). Never raises: a failed price or
        migration re-pins with a re-prefill, as a failed move always did."""
        try:
            async with asyncio.timeout(self.config.move_timeout_s):
                price = await self._price(source, target, ids)
                if not price.pays:
                    self.kept += 1
                    logger.debug("session %s stays on %s: %s", request_id, source, price.describe())
                    return None
                self._shift(request_id, source, target)  # counted there from now on
                self._record(await self._move(request_id, source, target, ids, price))
                return target
        except Exception as e:  # any failure: the request goes on, the target re-prefills
            logger.warning(
                "KV move of session %s from %s to %s failed, re-prefilling there: %s",
                request_id,
                source,
                target,
                e,
            )
            if self._sticky.get(request_id) == source:  # failed before it was re-pinned
                self._shift(request_id, source, target)
            detail = f"{type(e).__name__}: {e}"
            self._record(MoveRecord(request_id, source, target, FAILED, detail=detail))
            return target

    async def _move(
        self, request_id: str, source: str, target: str, ids: list[int], price: MovePrice
    ) -> MoveRecord:
        if price.estimate.decision != "migrate":
            return MoveRecord(request_id, source, target, RECOMPUTE, detail=price.describe())
        client = self._migration_client()
        result = await client.migrate(_url(source), _url(target), ids, held=price.held)
        return MoveRecord(
            request_id,
            source,
            target,
            MIGRATED,
            migrated_tokens=result.migrated_token_size,
            detail=f"{result.path} path, matched after commit {result.matched_after_commit}; "
            + price.describe(),
        )

    async def _price(self, source: str, target: str, ids: list[int]) -> MovePrice:
        """What moving this turn gains (the tokens in flight on `source` beyond `target`,
        at the prefill rate) and costs (its migration if the KV moves, else the re-prefill
        of what the source holds beyond the target)."""
        client = self._migration_client()
        src = _url(source)
        source_info = await client.session_info(src)
        held = from_dict(
            ExtraTokenSizeReply,
            await client.call(src, SIZE_QUERY_ROUTE, size_query(source_info, ids)),
        )
        estimate = await self._estimate(client, src, _url(target), ids, held)
        cost_s = estimate.migrate_s if estimate.decision == "migrate" else estimate.recompute_s
        # After the awaits: the loads as they are now.
        surplus = self.get_inflight_tokens(source) - self.get_inflight_tokens(target) - len(ids)
        gain_s = max(0, surplus) * self.cost_model.prefill.seconds_per_token
        return MovePrice(gain_s, cost_s, estimate, held)

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
