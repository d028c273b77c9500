"""A discrete-event model of a rollout over N SGLang servers, under verl's placement.

`Rollout` is `bench_verl_pattern.py`'s workload at any scale: sticky multi-turn sessions,
each turn the history plus `user_tokens` new tokens, `new_tokens` generated (greedy, no
EOS), the next turn at once. Skew is verl's: `pinned` sessions run their first turn while
only the first `hot_servers` are registered (replicas that register later), then the
rest join and every session runs `turns` turns (the pinned ones resume). With
`resume_all`, the other sessions too run their first turn before the measured step (once
every server has joined, placed by the policy), so that every skew measures the same work.
The makespan is from the step's start to the last turn's release; a turn's latency from
acquire to release.

A policy places each turn (`fleet_policies`): verl's balancer as it ships (sticky, never
re-pins), `KVMigrationLoadBalancer` re-pinning with re-prefill (its cost model forced to
recompute) or with KV migration (its own verdict), or the balanced-without-recompute
bound. Servers (`fleet_server`) run SGLang's scheduler loop with costs derived from the
GPU records (`fleet_costs`). Deterministic: the seed draws the workload's lengths and
seeds the balancers' tie-breaks (they use the `random` module: its state is restored
afterwards).

What the model leaves out:
- the contents of tokens: outputs are lengths only (no EOS, no sampling cost), and a
  session's KV is one prefix per server (no sharing between sessions, no radix splits);
- SGLang's optimistic admission and retraction: a request reserves its whole output at
  admission, so a full pool queues instead of retracting; no mixed prefill+decode batches,
  no overlap scheduler, no speculative decoding, no preemption by priority;
- HiCache's write-through traffic and the host pool's own limits on load-back bandwidth
  (a load-back costs only its per-token copy, added to the prefill it precedes);
- the network and the HTTP layer beyond a fixed request overhead; moves between hosts use
  the Mooncake TCP rows (RDMA would be faster); idle trips cost nothing beyond the fitted
  fixed costs, busy ones wait `busy_wait_iterations` loop iterations of each side;
- GPU sharing beyond time slicing by each server's GPU share (`fleet_server.Gpu`): no
  context-switch cost, no contention for PCIe or host memory bandwidth between moves;
- decode cost by batch only through the contexts it reads (`CostProfile.decode_work`):
  the per-request sampling and bookkeeping of large batches are in no record;
- the KV pools' true sizes: `kv_capacity_tokens` applies SGLang's sizing rule without
  what CUDA graphs and activations take; the `Rebalancer` scenes price moves with a
  fixed cost model instead of one refreshed from the servers' `/metrics`;
- failures, timeouts, weight updates, verl's Ray RPC latency.
The bound is a reference run, not a proof: another policy's timing can land a few percent
under it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet_costs import CROSS_HOST, GPU, HOST, CostProfile, kv_capacity_tokens
from fleet_policies import Move, make_placement
from fleet_server import Clock, Gpu, Request, Server, ServerConfig


@dataclass(frozen=True)
class FleetSpec:
    servers: int
    servers_per_gpu: int = 1
    gpus_per_host: int = 8
    mem_fraction_static: float = 0.85
    kv_tokens: int | None = None  # None: from mem_fraction_static (`kv_capacity_tokens`)
    hicache_ratio: float = 2.0
    host_tokens: tuple[int, ...] | None = None  # per server; None: hicache_ratio x GPU pool
    max_running: int = 256
    chunk_tokens: int = 8192
    page_size: int = 16
    priority: bool = False

    def server_config(self, index: int) -> ServerConfig:
        gpu, order = divmod(index, self.servers_per_gpu)
        kv = self.kv_tokens or kv_capacity_tokens(self.mem_fraction_static, order)
        return ServerConfig(
            kv_tokens=kv,
            host_tokens=self.host_tokens[index]
            if self.host_tokens
            else int(kv * self.hicache_ratio),
            max_running=self.max_running,
            chunk_tokens=self.chunk_tokens,
            page_size=self.page_size,
            priority=self.priority,
            host=f"host{gpu // self.gpus_per_host}",
        )


class Fleet:
    """The servers, their GPUs and the clock; prices and lands moves."""

    def __init__(self, spec: FleetSpec, costs: CostProfile):
        self.spec = spec
        self.costs = costs
        self.clock = Clock()
        self.servers: dict[str, Server] = {}
        gpus: dict[int, Gpu] = {}
        for i in range(spec.servers):
            config = spec.server_config(i)
            gpu = gpus.setdefault(i // spec.servers_per_gpu, Gpu(self.clock))
            name = f"{config.host}-s{i}:{30000 + i}"
            self.servers[name] = Server(name, config, costs, gpu, self.clock)

    @property
    def names(self) -> list[str]:
        return list(self.servers)

    def trip_wait_s(self, server: Server) -> float:
        """A control trip arriving at a scheduler mid-iteration waits half of it on average."""
        return server.current_iteration_s() / 2

    def move_s(self, move: Move) -> float:
        """A migration's time: its routes' fixed and per-token costs, plus the loop
        iterations it waits on each side that is busy."""
        src, dst = self.servers[move.source], self.servers[move.target]
        if move.path == "device":
            host_part = move.tokens - move.device_tokens
            routes = [(GPU, move.device_tokens), (HOST, host_part)]
        else:
            routes = [(CROSS_HOST, move.tokens)]
        used = [(r, n) for r, n in routes if n > 0]
        if not used:
            return 0.0
        copy = sum(self.costs.moves[r].per_token_s * n for r, n in used)
        fixed = max(self.costs.moves[r].fixed_s for r, _ in used)
        waits = src.current_iteration_s() + dst.current_iteration_s()
        return fixed + copy + self.costs.busy_wait_iterations * waits

    def land(self, move: Move) -> None:
        """The move's pages committed on its target: on its GPU (device path), else in its
        host pool. The source keeps its copy (a migration copies; LRU frees it later)."""
        dst = self.servers[move.target]
        have, _ = dst.held(move.session)
        dst.land(move.session, have + move.tokens, on_device=move.path == "device")


@dataclass(frozen=True)
class Rollout:
    sessions: int
    turns: int = 4
    context: int = 8192
    user_tokens: int = 256
    new_tokens: int = 32
    pinned: int = 0  # sessions whose first turn ran on the hot servers alone
    hot_servers: int = 1
    resume_all: bool = False  # every session's first turn runs before the measured step
    context_spread: float = 0.0  # first prompts vary uniformly by this fraction
    seed: int = 0


@dataclass
class Turn:
    session: str
    turn: int
    server: str
    started: float
    latency_s: float
    prompt: int
    cached: int
    moved: Move | None = None


@dataclass
class RolloutResult:
    policy: str
    balancer: str
    makespan_s: float
    turns: list[Turn]
    moves: dict[str, int]
    migrated_tokens: int
    prefill_tokens: int
    loaded_back_tokens: int
    events: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(t.latency_s for t in self.turns)
        return {
            "policy": self.policy,
            "balancer": self.balancer,
            "makespan_s": round(self.makespan_s, 4),
            "turn_p50_s": round(_percentile(lat, 50), 4),
            "turn_p99_s": round(_percentile(lat, 99), 4),
            "turns": len(self.turns),
            "moves": self.moves,
            "migrated_tokens": self.migrated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "loaded_back_tokens": self.loaded_back_tokens,
        }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class _Session:
    sid: str
    history: int
    turns_left: int
    turn: int = 0


@dataclass
class _Run:
    """One rollout in progress: the fleet, the placement, every turn so far."""

    fleet: Fleet
    rollout: Rollout
    placement: Any
    turns: list[Turn] = field(default_factory=list)
    measuring: bool = False

    def start_turn(self, s: _Session, on_done: Callable[[], None]) -> None:
        clock = self.fleet.clock
        prompt = s.history + self.rollout.user_tokens
        started = clock.now
        server_id, move, asked = self.placement.acquire(s.sid, prompt)
        server = self.fleet.servers[server_id]
        delay = 0.0
        if asked:  # the balancer's size queries on both servers
            src = move.source if move else server_id
            delay += sum(self.fleet.trip_wait_s(self.fleet.servers[n]) for n in {src, server_id})
        if move is not None and move.tokens > 0:
            delay += self.fleet.move_s(move)
            clock.at(clock.now + delay, lambda m=move: self.fleet.land(m))
        delay += self.fleet.costs.request_overhead_s

        def finished(r: Request) -> None:
            self.placement.release(server_id, s.sid)
            if self.measuring:
                self.turns.append(
                    Turn(
                        s.sid,
                        s.turn,
                        server_id,
                        started,
                        clock.now - started,
                        prompt,
                        r.matched,
                        move,
                    )
                )
            s.history = prompt + self.rollout.new_tokens
            s.turn += 1
            s.turns_left -= 1
            if s.turns_left > 0:
                self.start_turn(s, on_done)
            else:
                on_done()

        request = Request(
            f"{s.sid}/{s.turn}", s.sid, prompt, self.rollout.new_tokens, on_finish=finished
        )
        clock.at(clock.now + delay, lambda: server.submit(request))


def first_prompts(rollout: Rollout) -> list[int]:
    rng = random.Random(rollout.seed)
    spread = rollout.context_spread
    return [
        max(16, round(rollout.context * (1 + spread * (2 * rng.random() - 1))))
        for _ in range(rollout.sessions)
    ]


def run_rollout(
    spec: FleetSpec,
    rollout: Rollout,
    policy: str,
    costs: CostProfile,
    balancer_config: dict[str, Any] | None = None,
) -> RolloutResult:
    """Simulate one rollout step under `policy` (see the module docstring)."""
    state = random.getstate()
    random.seed(rollout.seed)  # the balancers' tie-breaks
    try:
        return _run(spec, rollout, policy, costs, balancer_config or {})
    finally:
        random.setstate(state)


def _run(
    spec: FleetSpec, rollout: Rollout, policy: str, costs: CostProfile, config: dict[str, Any]
) -> RolloutResult:
    fleet = Fleet(spec, costs)
    names = fleet.names
    hot = names[: max(1, rollout.hot_servers)] if rollout.pinned else names
    config = {"repin_margin": 2, "prefill_seconds_per_token": None, **config}
    placement = make_placement(policy, fleet.servers, hot, config, random.Random(rollout.seed))
    prompts = first_prompts(rollout)
    sessions = [_Session(f"s{i}", prompts[i], rollout.turns) for i in range(rollout.sessions)]
    run = _Run(fleet, rollout, placement)
    pinned = sessions[: rollout.pinned]
    events = 0
    for s in pinned:  # their first turn, before the other servers join
        s.turns_left = 1
        run.start_turn(s, lambda: None)
    events += fleet.clock.run()
    if hot != names:
        placement.add_servers([n for n in names if n not in hot])
    if rollout.resume_all:
        for s in sessions[rollout.pinned :]:
            s.turns_left = 1
            run.start_turn(s, lambda: None)
        events += fleet.clock.run()
    t0 = fleet.clock.now
    stats0 = {n: dict(srv.stats) for n, srv in fleet.servers.items()}
    outcomes0 = placement.outcomes()
    run.measuring = True
    done_at: list[float] = []
    for s in sessions:
        s.turns_left = rollout.turns
        run.start_turn(s, lambda: done_at.append(fleet.clock.now))
    events += fleet.clock.run()
    placement.close()
    if len(done_at) != len(sessions):
        raise RuntimeError(f"{len(sessions) - len(done_at)} sessions never finished")
    moves = _delta(placement.outcomes(), outcomes0)
    return RolloutResult(
        policy=policy,
        balancer=placement.kind,
        makespan_s=max(done_at) - t0,
        turns=run.turns,
        moves=moves,
        migrated_tokens=sum(t.moved.tokens for t in run.turns if t.moved),
        prefill_tokens=_stat(fleet, stats0, "prefill_tokens"),
        loaded_back_tokens=_stat(fleet, stats0, "loaded_back"),
        events=events,
    )


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


def _stat(fleet: Fleet, before: dict[str, dict[str, int]], key: str) -> int:
    return sum(s.stats[key] - before[n][key] for n, s in fleet.servers.items())
