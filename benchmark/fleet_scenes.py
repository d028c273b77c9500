"""The two end-to-end GPU scenes already measured, replayed in the simulation.

- The RL scene (`bench_rl_scene.py`): high-priority conversations queued on A behind
  low-priority decodes that fill its slots; modes none / recompute / migrate.
- Rollout rebalancing (`bench_rollout_rebalance.py`): multi-turn conversations all
  starting on A, each turn where the previous one finished; the same three modes.

Both move queued requests with the package's `Rebalancer` policy: each round here builds
the servers' `ServerLoad`s and calls the real `plan_moves` with the benchmark's own
`RebalancePolicy` (built by the benchmark's code from the record's config); a planned
move stops the request on its source, then re-prefills it on the target or migrates its
KV first, as `move_request` does (mode "auto": the package's `CostModel` decides on the
path `predict_path` gives). Only the orchestration around those calls is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet_costs import CostProfile
from fleet_policies import Move, device_beyond
from fleet_server import Request, Server
from fleet_sim import Fleet, FleetSpec
from sglang_kv_migration.rollout.cost_model import CostModel, PrefillCosts
from sglang_kv_migration.rollout.rebalancer import (
    RECOMPUTE,
    HeldKV,
    RebalancePolicy,
    ServerLoad,
    plan_moves,
)
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply


@dataclass
class _RequestView:
    """What planning reads of a request: its ids (only their number), its budget."""

    rid: str
    input_ids: range
    max_new_tokens: int


@dataclass
class SimHandle:
    """A tracked request, as `plan_moves` reads a `RequestHandle` (`Movable`)."""

    current: Request
    server_url: str
    submitted_at: float
    on_done: Callable[[SimHandle], None]
    moving: bool = False
    moves: list[str] = field(default_factory=list)
    finished_at: float | None = None

    @property
    def priority(self) -> int:
        return self.current.priority

    @property
    def request(self) -> _RequestView:
        r = self.current
        return _RequestView(r.rid, range(r.prompt), r.max_new)

    @property
    def started(self) -> bool:
        return self.current.first_token_at is not None

    def done(self) -> bool:
        return self.finished_at is not None


class RebalancerDriver:
    """A `Rebalancer`'s rounds over the simulated servers (see the module docstring)."""

    def __init__(self, fleet: Fleet, policy: RebalancePolicy, interval_s: float = 0.1):
        self.fleet = fleet
        self.policy = policy
        self.interval_s = interval_s
        self.handles: list[SimHandle] = []
        self.in_flight = 0
        self.claims: dict[str, Counter[str]] = {"device": Counter(), "host": Counter()}
        self.outcomes: Counter[str] = Counter()
        self.running = False
        costs = fleet.costs
        self.cost_model = CostModel(
            prefill=PrefillCosts(seconds_per_token=costs.prefill_work(8192, 0) / 8192)
        )

    # ------------------------------------------------------------------ tracking

    def submit(
        self, server: str, request: Request, on_done: Callable[[SimHandle], None]
    ) -> SimHandle:
        """Send `request` to `server` as the migrator does (HTTP first), tracked."""
        clock = self.fleet.clock
        handle = SimHandle(request, server, clock.now, on_done)
        self.handles.append(handle)
        self._send(handle, request, server)
        return handle

    def _send(self, handle: SimHandle, request: Request, server: str) -> None:
        clock = self.fleet.clock

        def finished(r: Request) -> None:
            handle.finished_at = clock.now
            handle.on_done(handle)

        request.on_finish = finished
        handle.current, handle.server_url = request, server
        at = clock.now + self.fleet.costs.request_overhead_s
        clock.at(at, lambda: self.fleet.servers[server].submit(request))

    # ------------------------------------------------------------------ rounds

    def start(self) -> None:
        self.running = True
        self.fleet.clock.at(self.fleet.clock.now, self._round)

    def stop(self) -> None:
        self.running = False

    def _round(self) -> None:
        if not self.running:
            return
        live = [h for h in self.handles if not h.done() and not h.moving]
        loads = self._loads()
        held = self._held(live) if self.policy.min_held_tokens > 0 else None
        moves = plan_moves(
            loads,
            live,
            self.policy,
            self.in_flight,
            held,
            self.claims["device"],
            self.claims["host"],
        )
        for move in moves:
            self._start_move(move)
        self.fleet.clock.at(self.fleet.clock.now + self.interval_s, self._round)

    def _loads(self) -> dict[str, ServerLoad]:
        loads = {}
        for name, s in self.fleet.servers.items():
            loads[name] = ServerLoad(
                name,
                num_running=s.num_running(),
                num_waiting=len(s.waiting),
                used_tokens=s.reserved,
                demand_tokens=s.demand_tokens(),
                capacity_tokens=s.config.kv_tokens,
                max_running=s.config.max_running,
            )
        if self.policy.kv_headroom and any(map(self.policy.is_pressured, loads.values())):
            for name, load in loads.items():
                if not self.policy.is_pressured(load):
                    headroom = self.fleet.servers[name].host_headroom()
                    loads[name] = dataclasses.replace(load, host_headroom_tokens=headroom)
        return loads

    def _held(self, live: list[SimHandle]) -> dict[int, HeldKV]:
        out = {}
        for h in live:
            tokens, device = self.fleet.servers[h.server_url].held(h.current.session)
            page = self.fleet.servers[h.server_url].config.page_size
            tokens = min(tokens, h.current.prompt // page * page)
            out[id(h)] = HeldKV(tokens, min(device, tokens))
        return out

    # ------------------------------------------------------------------ one move

    def _start_move(self, planned: Any) -> None:
        handle: SimHandle = planned.handle
        source = self.fleet.servers[planned.source_url]
        handle.moving = True
        self.in_flight += 1
        claims = self.claims.get(planned.path or "device") if planned.path != RECOMPUTE else None
        if claims is not None:
            claims[planned.target_url] += planned.kv_tokens
        abort_s = self.fleet.costs.busy_wait_iterations * source.current_iteration_s()

        def stopped() -> None:
            if not source.abort(handle.current):  # admitted meanwhile: it stays
                self._end_move(handle, planned, claims, "finished_before_move")
                return
            self._place(handle, planned, claims)

        self.fleet.clock.at(self.fleet.clock.now + abort_s, stopped)

    def _place(self, handle: SimHandle, planned: Any, claims: Counter[str] | None) -> None:
        clock = self.fleet.clock
        source = self.fleet.servers[planned.source_url]
        target = self.fleet.servers[planned.target_url]
        move = self._migration(handle.current.session, source, target, handle.current.prompt)
        mode = RECOMPUTE if planned.path == RECOMPUTE else self.policy.mode
        if mode == "auto" and move is not None:
            held = ExtraTokenSizeReply(
                success=True, matched_token_size=move.tokens, device_token_size=move.device_tokens
            )
            nbytes = move.tokens * self.fleet.costs.bytes_per_token
            estimate = self.cost_model.estimate(move.tokens, nbytes, path=move.path, held=held)
            mode = "migrate" if estimate.decision == "migrate" else RECOMPUTE
        r = handle.current
        fresh = Request(r.rid + "+", r.session, r.prompt, r.max_new, r.priority)
        if mode != RECOMPUTE and move is not None and move.tokens > 0:
            wait = self.fleet.trip_wait_s(source) + self.fleet.move_s(move)
            outcome = "migrated"

            def landed() -> None:
                self.fleet.land(move)
                self._send(handle, fresh, target.name)
                self._end_move(handle, planned, claims, outcome)

            clock.at(clock.now + wait, landed)
            return
        self._send(handle, fresh, target.name)
        self._end_move(handle, planned, claims, "recomputed")

    def _migration(self, session: str, source: Server, target: Server, prompt: int) -> Move | None:
        tokens, device = source.held(session)
        page = source.config.page_size
        tokens = min(tokens, (prompt - 1) // page * page)
        have, _ = target.held(session)
        if tokens <= have:
            return None
        path = "device" if source.config.host == target.config.host else "host"
        return Move(
            session,
            source.name,
            target.name,
            tokens - have,
            device_beyond(min(device, tokens), have),
            path,
        )

    def _end_move(
        self, handle: SimHandle, planned: Any, claims: Counter[str] | None, outcome: str
    ) -> None:
        handle.moving = False
        handle.moves.append(outcome)
        self.in_flight -= 1
        self.outcomes[outcome] += 1
        if claims is not None:
            claims[planned.target_url] -= planned.kv_tokens


# ---------------------------------------------------------------------------- scenes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def _row(mode: str, makespan: float, high: list[float], low: list[float], **extra: Any) -> dict:
    row: dict[str, Any] = {"mode": mode, "makespan_s": round(makespan, 3)}
    for kind, values in (("high", high), ("low", low)):
        row[f"{kind}_p50_s"] = round(percentile(values, 50), 3) if values else None
        row[f"{kind}_p99_s"] = round(percentile(values, 99), 3) if values else None
    return {**row, **extra}


def rl_scene_args(config: dict[str, Any]) -> argparse.Namespace:
    """The benchmark's arguments as it parsed them for the record (its defaults for
    options the record predates)."""
    import bench_rl_scene

    args = bench_rl_scene.parse_args([])
    known = {k: v for k, v in config.items() if hasattr(args, k)}
    return argparse.Namespace(**{**vars(args), **known})


def _flag(flags: list[str], name: str) -> float:
    return float(flags[flags.index(name) + 1])


def recorded_host_ratios(
    config: dict[str, Any], args: argparse.Namespace, scene: Any
) -> list[float]:
    """A's and B's `--hicache-ratio` as the run started them: from the flags a record
    keeps, else by the rule the benchmark used before it kept them (A's tier holds every
    conversation and the low decodes; B's half of it, or `--b-hicache-ratio`)."""
    flags = config.get("server_flags")
    if flags:
        return [_flag(flags[name], "--hicache-ratio") for name in ("A", "B")]
    per_conv = scene.context + scene.history_gen + scene.observation + scene.high_gen
    needed = scene.conversations * per_conv + scene.low_count * (scene.low_prompt + scene.low_gen)
    ratio_a = max(2.0, math.ceil(needed / args.max_total_tokens) + 0.5)
    ratio_b = config.get("b_hicache_ratio") or max(2.0, ratio_a / 2)
    return [ratio_a, ratio_b]


def simulate_rl_scene(record: dict[str, Any], mode: str, costs: CostProfile) -> dict[str, Any]:
    """One mode of `bench_rl_scene.py`'s scene as the record ran it (see its docstring)."""
    import bench_rl_scene

    args = rl_scene_args(record["config"])
    # Records from before the full-target variant have no `b_prompt`: B's low requests
    # then had a quarter of A's low prompt, as the benchmark still sizes the room variant.
    fields = {"b_prompt": record["scene"]["low_prompt"] // 4, **record["scene"]}
    scene = bench_rl_scene.Scene(**fields)
    ratios = recorded_host_ratios(record["config"], args, scene)
    hosts = tuple(int(r * args.max_total_tokens) for r in ratios)
    spec = FleetSpec(
        servers=2,
        servers_per_gpu=2,
        kv_tokens=args.max_total_tokens,
        max_running=args.max_running_requests,
        page_size=args.page_size,
        priority=True,
        host_tokens=hosts,
    )
    fleet = Fleet(spec, costs)
    a, b = fleet.names
    policy = bench_rl_scene.policy_for(mode, args)
    driver = RebalancerDriver(fleet, policy or RebalancePolicy(), interval_s=0.1)
    history = scene.context + scene.history_gen
    for i in range(scene.conversations):  # their first turns: A caches the histories
        driver.submit(
            a,
            Request(f"c{i}/0", f"c{i}", scene.context, scene.history_gen, scene.high),
            lambda h: None,
        )
    fleet.clock.run()
    driver.handles.clear()
    t0 = fleet.clock.now
    done: dict[str, list[float]] = {"high": [], "low": []}
    arrival = [0.0]

    def finished(kind: str) -> Callable[[SimHandle], None]:
        start = arrival if kind == "high" else [0.0]
        return lambda h: done[kind].append(fleet.clock.now - t0 - start[0])

    lows = [(a, scene.low_prompt)] * scene.low_count + [(b, scene.low_prompt // 4)] * scene.b_low
    for i, (server, prompt) in enumerate(lows):
        driver.submit(
            server, Request(f"low{i}", f"low{i}", prompt, scene.low_gen, scene.low), finished("low")
        )

    def arrive() -> None:
        if fleet.servers[a].num_running() < scene.low_count:
            fleet.clock.at(fleet.clock.now + 0.1, arrive)  # the benchmark polls /v1/loads
            return
        arrival[0] = fleet.clock.now - t0 + fleet.trip_wait_s(fleet.servers[a])
        for i in range(scene.conversations):
            prompt = history + scene.observation
            driver.submit(
                a, Request(f"c{i}/1", f"c{i}", prompt, scene.high_gen, scene.high), finished("high")
            )
        if policy is not None:
            driver.start()

    fleet.clock.at(t0, arrive)
    _run_until(
        fleet,
        lambda: (
            len(done["high"]) + len(done["low"]) == len(driver.handles)
            and len(done["high"]) == scene.conversations
        ),
        driver,
    )
    makespan = max(done["low"] + [arrival[0] + x for x in done["high"]])
    return _row(
        mode,
        makespan,
        done["high"],
        done["low"],
        arrival_s=round(arrival[0], 3),
        moves=dict(driver.outcomes),
    )


def simulate_rollout(record: dict[str, Any], mode: str, costs: CostProfile) -> dict[str, Any]:
    """One mode of `bench_rollout_rebalance.py`'s workload as the record ran it."""
    import bench_rollout_rebalance as bench

    c = record["config"]
    w = bench.Workload(
        c["conversations"], c["turns"], c["context"], c["observation"], c["gen"], c["high_fraction"]
    )
    convs = bench.make_workload(w, vocab=1000)
    spec = FleetSpec(
        servers=2,
        servers_per_gpu=2,
        kv_tokens=c["max_total_tokens"],
        max_running=c["max_running_requests"],
        page_size=c["page_size"],
        priority=True,
    )
    fleet = Fleet(spec, costs)
    source = fleet.names[0]
    policy = RebalancePolicy(
        kv_pressure=c["kv_pressure"],
        target_max_ratio=c["target_max_ratio"],
        max_concurrent=c["max_concurrent"],
    )
    move_mode = "recompute" if mode == "recompute" else c.get("migrate_mode", "migrate")
    driver = RebalancerDriver(fleet, dataclasses.replace(policy, mode=move_mode), 0.1)
    seconds: dict[int, list[float]] = {bench.HIGH: [], bench.LOW: []}
    ends: list[float] = []

    def turn(conv: Any, k: int, server: str, history: int) -> None:
        prompt = history + (c["context"] if k == 0 else c["observation"])
        start = fleet.clock.now

        def done(h: SimHandle) -> None:
            seconds[conv.priority].append(fleet.clock.now - start)
            if k + 1 < c["turns"]:
                turn(conv, k + 1, h.server_url, prompt + c["gen"])
            else:
                ends.append(fleet.clock.now)

        request = Request(f"c{conv.cid}/{k}", f"c{conv.cid}", prompt, c["gen"], conv.priority)
        driver.submit(server, request, done)

    for conv in convs:
        delay = 0.0 if conv.priority == bench.HIGH else c["low_delay"]
        fleet.clock.at(delay, lambda conv=conv: turn(conv, 0, source, 0))
    if mode != "none":
        driver.start()
    _run_until(fleet, lambda: len(ends) == len(convs), driver)
    return _row(
        mode, max(ends), seconds[bench.HIGH], seconds[bench.LOW], moves=dict(driver.outcomes)
    )


def _run_until(fleet: Fleet, finished: Callable[[], bool], driver: RebalancerDriver) -> None:
    """Run the clock in slices until `finished()`; then stop the rebalancer's rounds."""
    for _ in range(100_000):
        fleet.clock.run(until=fleet.clock.now + 1.0)
        if finished():
            break
    driver.stop()
    fleet.clock.run()
    if not finished():
        raise RuntimeError("the scene did not finish")
