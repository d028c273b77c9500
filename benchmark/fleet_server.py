"""One simulated SGLang server: its scheduler loop, KV pools and prefix cache.

The loop follows SGLang 0.5.12's default scheduler: each iteration first tries to form a
prefill batch from the waiting queue (priority first with `priority`, then arrival),
admitting requests while running slots and KV slots allow and up to `chunk_tokens` new
tokens (a longer prompt is chunked over iterations, and goes on first in the next one);
only when no prefill is formed does the running batch decode one token. A prefill
produces each finished prompt's first token.

Memory: a running request reserves its prompt plus `max_new` tokens of the GPU pool at
admission (no retraction); a finished request's sequence stays cached, per session, on
the GPU until KV slots are needed, then moves to the host pool (HiCache), whose least
recently used tails are dropped when it is full. A prompt reuses what its session holds
on this server: the GPU part free, the host part loaded back (priced per token), the rest
prefilled; at least its last token is always prefilled.

Time: an iteration's GPU work comes from `CostProfile`; servers that share one GPU share
its time (`Gpu`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet_costs import CostProfile


@dataclass(frozen=True)
class ServerConfig:
    kv_tokens: int  # GPU KV pool (tokens)
    host_tokens: int  # HiCache host pool (tokens)
    max_running: int = 256
    chunk_tokens: int = 8192  # SGLang's chunked prefill size on an H100 / H200
    page_size: int = 16
    priority: bool = False  # --enable-priority-scheduling (larger value first)
    host: str = "host0"  # machine: the device path needs one for both servers


@dataclass
class Request:
    rid: str
    session: str
    prompt: int
    max_new: int
    priority: int = 0
    on_finish: Callable[[Request], None] | None = None
    # What happened to it.
    server: str = ""
    submitted: float = 0.0  # reached the scheduler
    matched: int = 0  # prefix served from cache at admission
    loaded_back: int = 0  # ... of which loaded back from the host pool
    prefilled: int = 0  # prompt tokens done (matched or computed)
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    # Decode bookkeeping: the server's decode-step count when it joined the batch.
    joined_step: int = 0

    @property
    def computed(self) -> int:
        """Prefill tokens this request computed."""
        return self.prompt - self.matched if self.prefilled >= self.prompt else 0


@dataclass
class Entry:
    """What a session's sequence left cached on one server: `tokens` from its start, the
    first `device` of them on the GPU, the rest in the host pool."""

    tokens: int
    device: int
    used: float


class Gpu:
    """Servers sharing one GPU share its time equally while more than one has an iteration
    on it (processor sharing: kernels of two processes time-slice, they do not overlap).
    What an iteration holds the GPU for is its occupancy: its GPU work, or for an eager
    forward its whole launch-bound time (`Server._start_iteration`): a stream of small
    kernels launched back to back keeps its context on the GPU, and while another
    context holds its time slice none of them runs. (Chosen so after the RL scene's
    records showed B's two eager decodes at 20-45 ms a step beside A's batch, against
    15.6 ms alone.)"""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.servers: list[Server] = []
        self._jobs: dict[str, _Job] = {}  # by server name
        self._last = 0.0
        self._version = 0

    def run(self, server: Server, occupancy: float, done: Callable[[], None]) -> float:
        """Start an iteration that holds the GPU for `occupancy` seconds alone; `done` runs
        when it ends. Returns its expected duration at the current share."""
        self._advance()
        self._jobs[server.name] = _Job(occupancy, done)
        self._reschedule()
        return occupancy * self._sharing()

    def _sharing(self) -> int:
        return max(1, len(self._jobs))

    def _advance(self) -> None:
        now = self.clock.now
        dt, self._last = now - self._last, now
        for job in self._jobs.values():
            job.remaining = max(0.0, job.remaining - dt / len(self._jobs))

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            first = min(j.remaining for j in self._jobs.values())
            version = self._version
            self.clock.at(self.clock.now + first * len(self._jobs), lambda: self._tick(version))

    def _tick(self, version: int) -> None:
        if version != self._version:
            return  # a start or an end since changed the shares
        self._advance()
        ended = [n for n, j in self._jobs.items() if j.remaining <= 1e-12]
        for name in ended:
            self._jobs.pop(name).done()
        self._reschedule()


@dataclass
class _Job:
    remaining: float  # seconds of GPU occupancy left (alone on the GPU)
    done: Callable[[], None]


class Server:
    def __init__(
        self, name: str, config: ServerConfig, costs: CostProfile, gpu: Gpu, sim: Any
    ) -> None:
        self.name = name
        self.config = config
        self.costs = costs
        self.gpu = gpu
        gpu.servers.append(self)
        self.sim = sim  # at(t, fn) and now
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.chunked: Request | None = None
        self.cache: dict[str, Entry] = {}
        self.reserved = 0  # GPU slots held by running and chunked requests
        self.device_cached = 0
        self.host_cached = 0
        self.busy = False
        self.work = 0.0  # the current iteration's GPU work and duration
        self.iteration_s = 0.0
        self.decode_steps = 0
        self._finishing: list[tuple[int, int, Request]] = []  # (step, seq, request)
        self._seq = itertools.count()
        self._sum_context = 0
        self._longest: int | None = None  # max(prompt - joined_step) of the batch
        self.stats = {"prefill_tokens": 0, "loaded_back": 0, "iterations": 0, "decode_steps": 0}

    # ------------------------------------------------------------------ what others ask

    def current_iteration_s(self) -> float:
        """How long a trip waits for this scheduler's loop iteration now (0 when idle)."""
        return self.iteration_s if self.busy else 0.0

    def held(self, session: str) -> tuple[int, int]:
        """(tokens, on GPU) this server holds of `session`'s sequence, page-aligned."""
        entry = self.cache.get(session)
        if entry is None:
            return 0, 0
        page = self.config.page_size
        return entry.tokens // page * page, entry.device // page * page

    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def in_flight(self) -> int:
        return self.num_running() + len(self.waiting)

    def demand_tokens(self) -> int:
        """KV in use plus the prompts waiting (SGLang's `num_total_tokens`)."""
        return self.reserved + sum(r.prompt for r in self.waiting)

    def host_headroom(self) -> int:
        """Host slots a host-path allocate could claim: free plus evictable host-only
        pages, which here is every host slot (nothing pins the host pool)."""
        return self.config.host_tokens

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        request.server = self.name
        request.submitted = self.sim.now
        self.waiting.append(request)
        self.kick()

    def abort(self, request: Request) -> bool:
        """Take a waiting request out of the queue (a running one is not stopped)."""
        if request in self.waiting:
            self.waiting.remove(request)
            request.aborted = True
            return True
        return False

    def land(self, session: str, tokens: int, on_device: bool) -> bool:
        """A migration's pages committed: `tokens` of `session` now cached here, on the GPU
        when `on_device` and its pool has room, else in the host pool. False: no room."""
        entry = self.cache.get(session)
        if entry is not None and entry.tokens >= tokens:
            return True
        have = entry.tokens if entry is not None else 0
        extra = tokens - have
        if on_device and self._make_room(extra, keep=session):
            self._set_entry(session, tokens, (entry.device if entry else 0) + extra)
            return True
        if self._make_host_room(extra, keep=session):
            self._set_entry(session, tokens, entry.device if entry else 0)
            return True
        return False

    def forget(self, session: str) -> None:
        """Drop what this server holds of `session` (it moved elsewhere for free)."""
        self._drop_entry(session)

    def kick(self) -> None:
        if not self.busy and (self.waiting or self.running or self.chunked):
            self._start_iteration()

    # ------------------------------------------------------------------ the loop

    def _start_iteration(self) -> None:
        batch = self._prefill_batch()
        if batch:
            work = sum(self.costs.prefill_work(n, cached) for _, n, cached in batch)
            # A prompt's host-tier prefix loads back before its first chunk.
            first = sum(r.loaded_back for r, _, before in batch if before == r.matched)
            work += self.costs.load_back_s_per_token * first
            floor = self.costs.eager_floor_s
            done: Callable[[], None] = lambda: self._end_prefill(batch)  # noqa: E731
        elif self.running:
            work = self.costs.decode_work(self._sum_context, self._max_context())
            floor = self.costs.decode_floor()
            done = self._end_decode
        else:
            return
        self.busy = True
        self.work = work
        self.stats["iterations"] += 1
        occupancy = max(floor, work)
        self.iteration_s = self.gpu.run(self, occupancy, lambda: self._finish_iteration(done))

    def _finish_iteration(self, done: Callable[[], None]) -> None:
        self.busy = False
        self.work = 0.0
        done()
        self.kick()

    def _prefill_batch(self) -> list[tuple[Request, int, int]]:
        """(request, new tokens this iteration, tokens before them) for one prefill."""
        budget = self.config.chunk_tokens
        batch: list[tuple[Request, int, int]] = []
        if self.chunked is not None:
            r = self.chunked
            n = min(r.prompt - r.prefilled, budget)
            batch.append((r, n, r.prefilled))
            budget -= n
            if r.prefilled + n < r.prompt:
                return batch
            self.chunked = None
        if self.config.priority:
            self.waiting.sort(key=lambda r: (-r.priority, r.submitted))
        while self.waiting and budget > 0:
            if len(self.running) + len(batch) >= self.config.max_running:
                break
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.pop(0)
            n = min(r.prompt - r.prefilled, budget)
            batch.append((r, n, r.prefilled))
            budget -= n
            if r.prefilled + n < r.prompt:
                self.chunked = r
                break
        return batch

    def _admit(self, r: Request) -> bool:
        """Reserve `r`'s KV, reusing what its session holds here; False: no room now."""
        entry = self.cache.get(r.session)
        page = self.config.page_size
        matched = 0 if entry is None else min(entry.tokens, r.prompt - 1) // page * page
        on_device = 0 if entry is None else min(matched, entry.device // page * page)
        need = r.prompt + r.max_new
        if self.reserved + need > self.config.kv_tokens:  # every cached page can go
            return False
        if entry is not None:
            self._drop_entry(r.session)
        if not self._make_room(need, keep=None):
            raise AssertionError("room was checked")  # pragma: no cover
        self.reserved += need
        r.matched = matched
        r.loaded_back = matched - on_device
        r.prefilled = matched
        self.stats["loaded_back"] += r.loaded_back
        return True

    def _end_prefill(self, batch: list[tuple[Request, int, int]]) -> None:
        now = self.sim.now
        for r, n, _ in batch:
            r.prefilled += n
            self.stats["prefill_tokens"] += n
            if r.prefilled < r.prompt:
                continue
            r.first_token_at = now
            if r.max_new <= 1:
                self._finish(r)
                continue
            r.joined_step = self.decode_steps
            self.running[r.rid] = r
            self._longest = None
            self._sum_context += r.prompt + 1
            heapq.heappush(self._finishing, (self.decode_steps + r.max_new - 1, next(self._seq), r))

    def _end_decode(self) -> None:
        self.decode_steps += 1
        self.stats["decode_steps"] += 1
        self._sum_context += len(self.running)
        while self._finishing and self._finishing[0][0] <= self.decode_steps:
            _, _, r = heapq.heappop(self._finishing)
            del self.running[r.rid]
            self._longest = None
            self._sum_context -= self._context(r)
            self._finish(r)

    def _finish(self, r: Request) -> None:
        r.finished_at = self.sim.now
        self.reserved -= r.prompt + r.max_new
        page = self.config.page_size
        tokens = (r.prompt + r.max_new) // page * page
        entry = self.cache.get(r.session)
        if entry is None or entry.tokens <= tokens:
            if entry is not None:
                self._drop_entry(r.session)
            self._set_entry(r.session, tokens, tokens)
        if r.on_finish is not None:
            r.on_finish(r)

    # ------------------------------------------------------------------ memory

    def _context(self, r: Request) -> int:
        return r.prompt + 1 + self.decode_steps - r.joined_step

    def _max_context(self) -> int:
        """The longest running context: prompt + 1 + steps since it joined, whose largest
        `prompt - joined_step` changes only when the batch does."""
        if not self.running:
            return 0
        if self._longest is None:
            self._longest = max(r.prompt - r.joined_step for r in self.running.values())
        return self._longest + 1 + self.decode_steps

    def _set_entry(self, session: str, tokens: int, device: int) -> None:
        self._drop_entry(session)
        device = min(device, tokens)
        self.cache[session] = Entry(tokens, device, self.sim.now)
        self.device_cached += device
        self.host_cached += tokens - device

    def _drop_entry(self, session: str) -> None:
        entry = self.cache.pop(session, None)
        if entry is not None:
            self.device_cached -= entry.device
            self.host_cached -= entry.tokens - entry.device

    def _make_room(self, tokens: int, keep: str | None) -> bool:
        """Free `tokens` GPU slots by moving the least recently used cached sequences'
        tails to the host pool; False (nothing moved) when they would not be enough."""
        free = self.config.kv_tokens - self.reserved - self.device_cached
        if free >= tokens:
            return True
        keep_dev = self.cache[keep].device if keep in self.cache else 0
        if free + self.device_cached - keep_dev < tokens:
            return False
        for session, entry in sorted(self.cache.items(), key=lambda kv: kv[1].used):
            if free >= tokens:
                break
            if session == keep or entry.device == 0:
                continue
            moved = min(entry.device, tokens - free)
            entry.device -= moved
            self.device_cached -= moved
            self.host_cached += moved
            free += moved
        self._trim_host(keep)
        return True

    def _make_host_room(self, tokens: int, keep: str) -> bool:
        if self.config.host_tokens - self.host_cached < tokens:
            self._trim_host(keep, reserve=tokens)
        return self.config.host_tokens - self.host_cached >= tokens

    def _trim_host(self, keep: str | None, reserve: int = 0) -> None:
        """Drop host-pool tails, least recently used first, until the pool fits."""
        excess = self.host_cached + reserve - self.config.host_tokens
        if excess <= 0:
            return
        for session, entry in sorted(self.cache.items(), key=lambda kv: kv[1].used):
            if excess <= 0:
                break
            if session == keep:
                continue
            dropped = min(entry.tokens - entry.device, excess)
            entry.tokens -= dropped
            self.host_cached -= dropped
            excess -= dropped
            if entry.tokens == 0:
                del self.cache[session]


@dataclass
class Clock:
    """The event queue the servers and the policies share."""

    now: float = 0.0
    _heap: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def run(self, until: float = float("inf"), max_events: int = 50_000_000) -> int:
        """Run events in time order (ties: in the order they were scheduled)."""
        n = 0
        while self._heap and n < max_events:
            t, _, fn = self._heap[0]
            if t > until:
                break
            heapq.heappop(self._heap)
            self.now = t
            fn()
            n += 1
        return n
