"""Rebalance live requests across SGLang servers: who is pressured, what moves, where to.

    async with AsyncRequestMigrator() as migrator:
        handles = [await migrator.submit(url, req) for url, req in work]
        rebalancer = Rebalancer(migrator, [url_a, url_b], RebalancePolicy(max_concurrent=2))
        summary = await rebalancer.run(max_rounds=600, interval_s=0.5)   # stops when idle

Each round polls every server's `/v1/loads?include=core` (SGLang 0.5.12; `/get_load` as a
fallback) and plans moves with `plan_moves`, a pure function:

- a server is *pressured* when it has at least `min_waiting` queued requests and either
  its KV demand — tokens in use plus the prompts waiting (`num_total_tokens`) — is at
  least `kv_pressure` of its capacity (`max_total_num_tokens`), or its running slots are
  full (`num_running_reqs` ≥ `max_running_requests`);
- a server can *take* a request while its demand, plus that request's worst case
  (prompt + `max_new_tokens`), stays under `target_max_ratio` of its capacity, and (with
  `kv_headroom`, the default) while one of its pools can hold the request's KV at once
  (the tokens the source holds; the whole prompt when not asked). Device pool first:
  its free slots (`max_total_num_tokens` − `num_used_tokens`, which counts neither free
  nor evictable slots: what a device-path allocate can claim), less what the moves
  already planned to it this round and those still in flight claim. Then its host
  pool: the host slots a host-path allocate can claim (free plus evictable host-only
  pages, `host_headroom_tokens` of its `/get_request_extra_token_size` reply with
  ``headroom``, asked of every unpressured server in a round with a pressured one), less
  the host claims likewise. Each move says the path it takes (`PlannedMove.path`):
  "device" (the migration prefers the device path, falls back to the next path only if
  that fails), "shared_host" (servers on one host: into the target's host pool through
  memory both map, at memory speed; pinned: it never asks the full GPU pool first),
  "host" (servers on two hosts, or `shared_host` off: through the host path, pinned
  too), or, where neither pool holds it and `no_room="recompute"`, "recompute"
  (re-prefill on the target; with the default `no_room="wait"` it is not planned).
  Several moves to one target thus do not together claim more than its pools had free
  when they were planned (the target's own work may still take slots meanwhile). A pool
  whose size is unknown (`/get_load`; a server that does not report its host headroom)
  is not checked;
- from each pressured server (most pressured first) it moves the highest-priority live
  requests the migrator tracks there that have not produced a token yet (still queued, or
  being prefilled; `move_running` lifts this) — most recently submitted first within a
  priority — at most as many as the server has queued, each to the taker with the
  shortest queue and lowest demand, updating both loads as it goes; with `min_priority`
  only requests at least that urgent, and with `min_held_tokens` only those whose KV the
  source holds at least that many tokens of, on its GPU or in its host pool (asked with
  `/get_request_extra_token_size` each round, for the candidates only);
- at most `max_concurrent` moves are in flight and `max_moves_per_round` start per round,
  and a request moves at most `max_moves_per_request` times (default once).

The scene the project exists for — high-priority conversations queued behind long
low-priority decodes on a worker whose slots or KV are full, their earlier turns' KV in
that worker's cache — is ``RebalancePolicy(min_priority=HIGH, min_held_tokens=page_size)``:
exactly those move, several at once, each priced on the path it will take.

SGLang does not publish which rids are queued, so the rebalancer only moves requests the
rollout manager submitted through the migrator (`AsyncRequestMigrator.live()`), whose
streamed calls tell when each produced its first token (`RequestHandle.started`; an
adopted call's state is unknown and counts as not started). Each move
is `move_request(mode=policy.mode, live=policy.live)`: by default the cost model,
refreshed from the two servers' `/metrics` at most every `cost_refresh_s`, decides between
migrating the KV and re-prefilling on the target; with `live` (and `move_running`) a
decoding request keeps decoding while its KV is copied. Every loop here is bounded by
rounds or deadlines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sglang_kv_migration.client.migration import AuthFailed
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    MoveMode,
    MoveReport,
    RequestHandle,
)
from sglang_kv_migration.rollout.server_loads import ServerLoad, from_get_load, from_v1_loads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalancePolicy:
    kv_pressure: float = 0.9
    min_waiting: int = 1
    target_max_ratio: float = 0.7
    max_concurrent: int = 2
    max_moves_per_round: int = 4
    # SGLang's --schedule-low-priority-values-first (default: larger value = more urgent).
    low_priority_values_first: bool = False
    mode: MoveMode = "auto"
    cost_refresh_s: float = 60.0
    # Requests already decoding keep running where they are: moving one only pays the move
    # (they do not add to the queue that makes the server pressured).
    move_running: bool = False
    # Only requests at least this urgent move (None: any). Larger is more urgent unless
    # `low_priority_values_first`.
    min_priority: int | None = None
    # Only requests whose KV the source holds at least this many tokens of (device or
    # host tier) move; 0: any request, whether its KV is cached or not.
    min_held_tokens: int = 0
    # A request moves at most this often: once moved, the target's own queue is where it
    # waits (without it, slot pressure on a small target would bounce requests back).
    max_moves_per_request: int = 1
    # A target takes a move only while its free GPU KV slots (`ServerLoad.free_tokens`)
    # or, failing that, its host headroom (`ServerLoad.host_headroom_tokens`), less what
    # the moves planned to it this round and still in flight will claim there, hold the
    # move's KV (`PlannedMove.kv_tokens`): several moves to one target must not together
    # overflow a pool. False: no pool is checked and every move takes path "auto".
    kv_headroom: bool = True
    # The servers share a host and both offer the device path (a move that fits the
    # target's GPU pool takes it). False: every migration lands in the host pool, through
    # the host path.
    device_path: bool = True
    # With `device_path`: both also offer the shared-host path, so a move that fits only
    # the target's host pool lands there through shared memory; False: through the host
    # path (Mooncake), as across hosts.
    shared_host: bool = True
    # A move neither pool holds: "wait" (not planned; the request waits for room) or
    # "recompute" (re-prefilled on the target, whose own scheduler admits it).
    no_room: Literal["wait", "recompute"] = "wait"
    # Move decoding requests live (`move_request(live=True)`: their KV is copied while
    # they keep decoding, then only the delta after the stop); with `move_running`.
    live: bool = False

    def is_pressured(self, load: ServerLoad) -> bool:
        if not load.ok or load.num_waiting < self.min_waiting:
            return False
        slots_full = 0 < load.max_running <= load.num_running
        return slots_full or load.capacity_tokens <= 0 or load.demand_ratio >= self.kv_pressure

    def urgent_enough(self, priority: int | None) -> bool:
        if self.min_priority is None:
            return True
        value = priority or 0
        if self.low_priority_values_first:
            return value <= self.min_priority
        return value >= self.min_priority

    def can_take(self, load: ServerLoad, tokens: int) -> bool:
        if not load.ok or self.is_pressured(load):
            return False
        if load.capacity_tokens <= 0:
            return load.num_waiting == 0
        return (load.demand_tokens + tokens) / load.capacity_tokens <= self.target_max_ratio

    def has_headroom(self, load: ServerLoad, claimed: int, kv_tokens: int) -> bool:
        """Whether `load`'s GPU pool holds `kv_tokens` more after `claimed` (see
        `kv_headroom`); unknown capacity (`/get_load`) is not checked."""
        free = load.free_tokens
        if not self.kv_headroom or free is None:
            return True
        return free - claimed >= kv_tokens

    def has_host_headroom(self, load: ServerLoad, claimed: int, kv_tokens: int) -> bool:
        """Whether `load`'s host pool holds `kv_tokens` more after `claimed`; unknown
        headroom (a server that does not report it) is not checked."""
        room = load.host_headroom_tokens
        if not self.kv_headroom or room is None:
            return True
        return room - claimed >= kv_tokens

    def landing_path(
        self, load: ServerLoad, device_claimed: int, host_claimed: int, kv_tokens: int
    ) -> str | None:
        """The path a move of `kv_tokens` to `load` is planned on: "device",
        "shared_host", "host", "recompute", "" (`kv_headroom` off: the client chooses),
        or None (no room)."""
        if self.mode == "recompute":
            return RECOMPUTE  # nothing is allocated by the move itself
        if not self.kv_headroom:
            return ""
        if self.device_path and self.has_headroom(load, device_claimed, kv_tokens):
            return DEVICE
        if self.has_host_headroom(load, host_claimed, kv_tokens):
            return SHARED_HOST if self.device_path and self.shared_host else HOST
        return RECOMPUTE if self.no_room == "recompute" else None


DEVICE, SHARED_HOST, HOST, RECOMPUTE = "device", "shared_host", "host", "recompute"
# Targets are ranked by the path a move would take there first: device before the host
# pool before re-prefill ("" — unchecked — ranks with device).
_PATH_RANK = {"": 0, DEVICE: 0, SHARED_HOST: 1, HOST: 1, RECOMPUTE: 2}
# The target pool each path's move claims (`plan_moves`' claims).
_POOL_OF = {DEVICE: DEVICE, SHARED_HOST: HOST, HOST: HOST}


class Movable(Protocol):
    """What planning reads of a request (a `RequestHandle` has all of it)."""

    server_url: str
    submitted_at: float

    @property
    def priority(self) -> int | None: ...

    @property
    def moving(self) -> bool: ...

    @property
    def request(self) -> Any: ...  # .input_ids, .max_new_tokens

    @property
    def started(self) -> bool | None: ...  # produced a token already; None: unknown

    @property
    def moves(self) -> list[Any]: ...  # the moves it made so far

    def done(self) -> bool: ...


@dataclass(frozen=True)
class HeldKV:
    """What a source holds of a request's prompt (its `/get_request_extra_token_size`)."""

    tokens: int  # page-aligned prefix held, device and host tier together
    device_tokens: int = 0  # the part of it on the source's GPU


@dataclass(frozen=True)
class PlannedMove:
    handle: Any  # Movable
    source_url: str
    target_url: str
    tokens: int  # worst-case KV demand the request brings to the target
    held: HeldKV | None = None  # what the source held when planned (None: not asked)
    # KV slots the move claims on the target at once: what the source holds (the
    # migration allocates it), or the whole prompt when not asked; in the target's GPU
    # pool on path "device", its host pool on "shared_host" and "host", none on
    # "recompute".
    kv_tokens: int = 0
    path: str = ""  # DEVICE, SHARED_HOST, HOST, RECOMPUTE; "": not checked (client chooses)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rid": self.handle.request.rid,
            "priority": self.handle.priority,
            "source_url": self.source_url,
            "target_url": self.target_url,
            "tokens": self.tokens,
            "held_tokens": self.held.tokens if self.held else None,
            "device_tokens": self.held.device_tokens if self.held else None,
            "kv_tokens": self.kv_tokens,
            "path": self.path,
        }


def plan_moves(
    loads: dict[str, ServerLoad],
    requests: Sequence[Movable],
    policy: RebalancePolicy,
    in_flight: int = 0,
    held: Mapping[int, HeldKV] | None = None,
    claimed: Mapping[str, int] | None = None,
    claimed_host: Mapping[str, int] | None = None,
) -> list[PlannedMove]:
    """The moves of one round (see the module docstring). Pure: reads, never mutates.
    `held`: what each source holds, by ``id(handle)``; needed when
    `policy.min_held_tokens` is set (a request missing from it does not move).
    `claimed` / `claimed_host`: GPU / host KV slots the moves still in flight will claim,
    by target url (the round adds its own moves' `kv_tokens` as it plans them)."""
    budget = min(policy.max_moves_per_round, policy.max_concurrent - in_flight)
    if budget <= 0:
        return []
    state = dict(loads)
    claims = {DEVICE: Counter(claimed or {}), HOST: Counter(claimed_host or {})}
    sources = sorted(
        (url for url, load in state.items() if policy.is_pressured(load)),
        key=lambda url: -state[url].demand_ratio,
    )
    moves: list[PlannedMove] = []
    for source in sources:
        for handle in _candidates(requests, source, policy)[: state[source].num_waiting]:
            if len(moves) >= budget or not policy.is_pressured(state[source]):
                break
            kv = (held or {}).get(id(handle))
            if policy.min_held_tokens > 0 and (kv is None or kv.tokens < policy.min_held_tokens):
                continue
            tokens = len(handle.request.input_ids) + handle.request.max_new_tokens
            kv_tokens = kv.tokens if kv is not None else len(handle.request.input_ids)
            paths = {
                u: policy.landing_path(load, claims[DEVICE][u], claims[HOST][u], kv_tokens)
                for u, load in state.items()
                if u != source and policy.can_take(load, tokens)
            }
            takers = [u for u, path in paths.items() if path is not None]
            if not takers:
                break  # the more urgent request waits for room; none jumps it
            target = min(
                takers,
                key=lambda u: (
                    _PATH_RANK[paths[u] or ""],
                    state[u].num_waiting,
                    state[u].demand_ratio,
                    u,
                ),
            )
            path = paths[target] or ""
            moves.append(PlannedMove(handle, source, target, tokens, kv, kv_tokens, path))
            if path in _POOL_OF:
                claims[_POOL_OF[path]][target] += kv_tokens
            state[source] = _shift(state[source], -1, -tokens)
            state[target] = _shift(state[target], +1, +tokens)
    return moves


@dataclass
class RebalanceSummary:
    rounds: int = 0
    moves_started: int = 0
    reports: list[MoveReport] = field(default_factory=list)
    planned: list[PlannedMove] = field(default_factory=list)  # every move started
    errors: list[str] = field(default_factory=list)
    last_loads: dict[str, ServerLoad] = field(default_factory=dict)

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(Counter(r.outcome for r in self.reports))

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "moves_started": self.moves_started,
            "outcomes": self.outcomes,
            "errors": self.errors,
            "reports": [r.to_dict() for r in self.reports],
            "planned": [m.to_dict() for m in self.planned],
            "last_loads": {u: dataclasses.asdict(load) for u, load in self.last_loads.items()},
        }


class Rebalancer:
    """Watches `servers` and moves the migrator's live requests off pressured ones.

    Call contract: use from the migrator's event loop; `step()` and `run()` are not
    re-entrant (one rebalancer per migrator). The keys are the migrator's
    (`AsyncRequestMigrator(api_key=..., admin_api_key=...)`); a key a server refuses
    raises `AuthFailed` from `step()`/`run()` (a move that met one: at the next round),
    since every later round would be refused too.
    """

    def __init__(
        self,
        migrator: AsyncRequestMigrator,
        servers: Sequence[str],
        policy: RebalancePolicy | None = None,
    ):
        self.migrator = migrator
        self.servers = [s.rstrip("/") for s in servers]
        self.policy = policy or RebalancePolicy()
        self.summary = RebalanceSummary()
        self._tasks: set[asyncio.Task[None]] = set()
        self._costs_learned: dict[tuple[str, str], float] = {}
        # The refresh of a pair's cost model in flight: every move that starts meanwhile
        # waits for it rather than pricing with the model it replaces.
        self._refreshing: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._refused: AuthFailed | None = None  # a move's refused key, raised by step()
        # GPU KV slots the moves in flight claim on their targets (`plan_moves`' claimed):
        # a later round's load may not show them yet. Once a move's allocate shows in
        # the target's load they count twice until it ends: a move may wait a round.
        self._claimed: Counter[str] = Counter()
        self._claimed_host: Counter[str] = Counter()  # the same for host-path moves
        # Requests this rebalancer started moving, until their move ends: a move marks
        # its handle `moving` only once it reaches the migrator (after learning costs), so
        # the next round must not plan the same request again in between.
        self._started: set[str] = set()

    async def poll(self) -> dict[str, ServerLoad]:
        loads = await asyncio.gather(*(self._load(url) for url in self.servers))
        return dict(zip(self.servers, loads, strict=True))

    async def step(self) -> list[PlannedMove]:
        """One round: poll, plan, start the planned moves (they run in the background)."""
        if self._refused is not None:
            raise self._refused
        loads = await self.poll()
        if self.policy.kv_headroom and any(map(self.policy.is_pressured, loads.values())):
            loads = await self._with_host_headroom(loads)
        self.summary.last_loads = loads
        self.summary.rounds += 1
        live = self._movable(self.migrator.live())
        held = await self._held(loads, live) if self.policy.min_held_tokens > 0 else None
        live = self._movable(live)  # a move may have begun while the sizes were asked
        moves = plan_moves(
            loads,
            live,
            self.policy,
            in_flight=len(self._tasks),
            held=held,
            claimed=self._claimed,
            claimed_host=self._claimed_host,
        )
        self.summary.planned.extend(moves)
        for move in moves:
            self._started.add(move.handle.request.rid)
            claims = self._claims_of(move)
            if claims is not None:
                claims[move.target_url] += move.kv_tokens
            task = asyncio.ensure_future(self._move(move))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.summary.moves_started += len(moves)
        return moves

    async def run(
        self,
        *,
        max_rounds: int,
        interval_s: float = 0.5,
        stop_when_idle: bool = True,
        drain_timeout_s: float = 300.0,
    ) -> RebalanceSummary:
        """Up to `max_rounds` rounds, `interval_s` apart; with `stop_when_idle`, ends
        early once no tracked request is live and no move is in flight. Waits at most
        `drain_timeout_s` for moves still running at the end."""
        for _ in range(max_rounds):
            await self.step()
            if stop_when_idle and not self.migrator.live() and not self._tasks:
                break
            await asyncio.sleep(interval_s)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
        return self.summary

    # -- internals ------------------------------------------------------------------------

    async def _move(self, move: PlannedMove) -> None:
        handle: RequestHandle = move.handle
        try:
            if self.policy.mode == "auto":
                await self._learn_costs(move.source_url, move.target_url)
            mode: MoveMode = "recompute" if move.path == RECOMPUTE else self.policy.mode
            # A move planned into the host pool goes there directly: asking the full GPU
            # pool first would only be refused.
            path = move.path if move.path in (SHARED_HOST, HOST) else None
            report = await self.migrator.move_request(
                handle, move.target_url, mode=mode, path=path, live=self.policy.live
            )
            self.summary.reports.append(report)
        except AuthFailed as e:  # every later move would be refused as well: stop
            self.summary.errors.append(f"{handle.request.rid}: {e}")
            self._refused = e
        except Exception as e:  # one failed move must not stop the loop
            logger.exception("moving %s to %s failed", handle.request.rid, move.target_url)
            self.summary.errors.append(f"{handle.request.rid}: {type(e).__name__}: {e}")
        finally:
            self._started.discard(handle.request.rid)
            claims = self._claims_of(move)
            if claims is not None:
                claims[move.target_url] -= move.kv_tokens
                if claims[move.target_url] <= 0:
                    del claims[move.target_url]

    def _claims_of(self, move: PlannedMove) -> Counter[str] | None:
        """The claims a move counts in: device ("" too: unchecked moves usually land
        there), host (shared_host and host), or none (re-prefill)."""
        if _POOL_OF.get(move.path) == HOST:
            return self._claimed_host
        return None if move.path == RECOMPUTE else self._claimed

    async def _with_host_headroom(self, loads: dict[str, ServerLoad]) -> dict[str, ServerLoad]:
        """`loads` with the host headroom of every server that may take a move."""
        asks = [u for u, load in loads.items() if load.ok and not self.policy.is_pressured(load)]
        replies = await asyncio.gather(
            *(self.migrator.host_headroom(url) for url in asks), return_exceptions=True
        )
        out = dict(loads)
        for url, reply in zip(asks, replies, strict=True):
            if isinstance(reply, AuthFailed):
                raise reply
            if isinstance(reply, BaseException):  # unknown: the host pool is not checked
                logger.debug("%s: host headroom: %s", url, reply)
                continue
            out[url] = dataclasses.replace(loads[url], host_headroom_tokens=reply)
        return out

    def _movable(self, handles: Sequence[RequestHandle]) -> list[RequestHandle]:
        return [h for h in handles if not h.moving and h.request.rid not in self._started]

    async def _held(
        self, loads: dict[str, ServerLoad], live: list[RequestHandle]
    ) -> dict[int, HeldKV]:
        """What each pressured source holds of its candidates' prompts (at most as many
        candidates as it has queued, and `_MAX_HELD_QUERIES` in all)."""
        asks: list[tuple[RequestHandle, str]] = []
        for url, load in loads.items():
            if self.policy.is_pressured(load):
                asks += [(h, url) for h in _candidates(live, url, self.policy)[: load.num_waiting]]
        asks = asks[:_MAX_HELD_QUERIES]
        replies = await asyncio.gather(
            *(
                self.migrator.held_kv(url, h.request.input_ids, h.request.extra_key)
                for h, url in asks
            ),
            return_exceptions=True,
        )
        held: dict[int, HeldKV] = {}
        for (handle, url), reply in zip(asks, replies, strict=True):
            if isinstance(reply, AuthFailed):
                raise reply
            if isinstance(reply, BaseException):  # not held, as far as we can tell
                logger.debug("%s: held size of %s: %s", url, handle.request.rid, reply)
                continue
            held[id(handle)] = HeldKV(reply.matched_token_size, reply.device_token_size)
        return held

    async def _learn_costs(self, source: str, target: str) -> None:
        pair = (source, target)
        now = time.monotonic()
        last = self._costs_learned.get(pair)
        if last is None or now - last >= self.policy.cost_refresh_s:
            self._costs_learned[pair] = now
            refresh = self.migrator.refresh_cost_model(source, target)
            self._refreshing[pair] = asyncio.ensure_future(refresh)
        refreshing = self._refreshing.get(pair)
        if refreshing is None:
            return
        try:
            await asyncio.shield(refreshing)
        finally:
            if refreshing.done() and self._refreshing.get(pair) is refreshing:
                del self._refreshing[pair]

    async def _load(self, url: str) -> ServerLoad:
        try:
            reply = await self.migrator.get_json(url, "/v1/loads?include=core")
            return from_v1_loads(url, reply["loads"])
        except AuthFailed:
            raise
        except Exception as e:  # older server or a hiccup: try the legacy route
            logger.debug("%s/v1/loads: %s", url, e)
        try:
            return from_get_load(url, await self.migrator.get_json(url, "/get_load"))
        except AuthFailed:
            raise
        except Exception as e:  # an unreachable server is reported, not raised
            logger.warning("%s: load unavailable: %s", url, e)
            return ServerLoad(url, ok=False)


_MAX_HELD_QUERIES = 64  # size queries per round: each is one cheap scheduler round trip


def _candidates(requests: Sequence[Movable], source: str, policy: RebalancePolicy) -> list[Any]:
    sign = 1 if policy.low_priority_values_first else -1
    mine = [
        h
        for h in requests
        if h.server_url.rstrip("/") == source
        and not h.moving
        and not h.done()
        and (policy.move_running or not h.started)
        and policy.urgent_enough(h.priority)
        and len(h.moves) < policy.max_moves_per_request
    ]
    return sorted(mine, key=lambda h: (sign * (h.priority or 0), -h.submitted_at))


def _shift(load: ServerLoad, waiting: int, tokens: int) -> ServerLoad:
    return dataclasses.replace(
        load,
        num_waiting=max(0, load.num_waiting + waiting),
        demand_tokens=max(0, load.demand_tokens + tokens),
    )
