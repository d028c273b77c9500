"""One server of test_core_migration.py: a harness cache plus the real scheduler-side code.

Runs in a spawned process. The parent drives it over a multiprocessing Pipe with
``(command, *args)`` tuples; every command is answered with ``("ok", value)`` or
``("error", traceback_text)``. The only other link between the two servers is the
Mooncake transfer engine (TCP on 127.0.0.1) that `MigrationSchedulerSide` owns.

Commands:
    setup(cfg_fields, watchdog_timeout_s, side_kwargs)  build a fresh harness + scheduler side
    fragment_host(seed)                    shuffle the host pool's free pages (worst case)
    staging()                              the target's staging arena counters
    profile_calls(on)                      count Python/C calls per handler call and poll()
    call_profile()                         (max calls in one invocation, invocations, loop max s)
    insert(tokens, seed, write_back)       insert_random (then write back and drain)
    evict_device()                         back everything up, evict every device page
    call(name, request)                    run a handler; transfer waits (bounded) for its reply
    expire_by_polling(max_iterations)      poll() until nothing is pending (watchdog)
    end_quarantine()                       free quarantined slots as if their window closed
    advance_clock(seconds)                 the target's clock (windows, deadlines) that much later
    snapshot()                             HarnessSnapshot
    match(tokens)                          (device length, host hit length)
    kv_digest(tokens)                      load back, then per-layer sha256 of the KV bytes
    host_digest(slots)                     sha256 of every host buffer's bytes (untouched checks)
    pending()                              number of pending migrations
    quit()
"""

from __future__ import annotations

import hashlib
import time
from multiprocessing.connection import Connection
from typing import Any

from pipe_rpc import serve

IDLE_EXIT_S = 300.0
TRANSFER_WAIT_S = 60.0
SPIN_ITERATION_S = 50e-6  # an idle SGLang scheduler iteration, roughly


class _Server:
    def __init__(self) -> None:
        self.harness: Any = None
        self.side: Any = None
        self.outputs: list[Any] = []
        self.profile = False
        self.spin = False  # see `idle_iteration`
        self.yield_gil = True  # RankSettings.yield_gil of every side built
        self.call_counts: list[tuple[int, list]] = []

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
            self.side = None
        if self.harness is not None:
            self.harness.close()
            self.harness = None

    # -- commands -------------------------------------------------------------

    def setup(
        self, cfg_fields: dict, watchdog_timeout_s: float, side_kwargs: dict | None = None
    ) -> dict:
        import cpu_harness
        from sglang_kv_migration.paths.host.mooncake import TransportConfig
        from sglang_kv_migration.server.rank.settings import RankSettings
        from sglang_kv_migration.server.scheduler.compose import compose_rank
        from side_helpers import one_rank_context

        side_kwargs = dict(side_kwargs or {})
        transport = side_kwargs.pop("transport", {})
        self.close()
        self.outputs = []
        self.harness = cpu_harness.build_harness(cpu_harness.HarnessConfig(**cfg_fields))
        ctx = one_rank_context(
            self.harness.cache, "tiny-llama", lambda output, req: self.outputs.append(output)
        )
        self.side = compose_rank(
            ctx,
            RankSettings(
                watchdog_timeout_s=watchdog_timeout_s,
                transport_config=TransportConfig(hostname="127.0.0.1", **transport),
                yield_gil=self.yield_gil,
                **side_kwargs,
            ),
        )
        return {"host_size": int(self.harness.kv_host_pool.size)}

    def insert(self, tokens: list[int], seed: int, write_back: bool) -> int:
        held = self.harness.insert_random(tokens, seed=seed)
        if write_back:
            self.harness.write_back_all()
        else:
            self.harness.drain_writes()
        return len(held)

    def evict_device(self) -> int:
        return self.harness.evict_device_all()

    def call(self, name: str, request: Any) -> Any:
        # Through the dispatcher's wrapped handler, as the scheduler calls it (timed).
        handler = dict(self.side.handlers())[type(request)]
        self.outputs.clear()
        reply = self._on_loop_thread(handler, request)
        if reply is not None:
            self.side.poll()  # the rest of the scheduler iteration that ran the handler
            return reply
        # Deferred reply (transfer, staged commit): the loop calls poll() each iteration.
        deadline = time.monotonic() + TRANSFER_WAIT_S
        while not self.outputs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no reply within {TRANSFER_WAIT_S}s")
            self._on_loop_thread(lambda _: self.side.poll(), None)
            if not self.outputs:
                self.idle_iteration()
        assert len(self.outputs) == 1, self.outputs
        return self.outputs.pop()

    def idle_iteration(self) -> None:
        """The rest of one scheduler loop iteration. `spin` mode stands in for SGLang's
        loop, which never blocks while idle: ~50 us of Python holding the GIL, then the
        per-iteration poll. Otherwise a 0.5 ms sleep (the GIL is free meanwhile)."""
        if not self.spin:
            time.sleep(0.0005)
            return
        end = time.perf_counter() + SPIN_ITERATION_S
        while time.perf_counter() < end:
            pass
        if self.side is not None:
            self.side.poll()

    def set_spin(self, on: bool, yield_gil: bool = True) -> None:
        self.spin = on
        self.yield_gil = yield_gil
        if self.side is not None:
            self.side.loop.yield_gil = yield_gil

    def _on_loop_thread(self, run: Any, arg: Any) -> Any:
        """Run one piece of scheduler-thread work, counting its calls when profiling."""
        if not self.profile:
            return run(arg)
        import sys
        from collections import Counter

        calls: Counter[str] = Counter()

        def count(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                code = frame.f_code
                calls[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
            elif event == "c_call":
                calls[getattr(arg, "__qualname__", "?")] += 1

        sys.setprofile(count)
        try:
            return run(arg)
        finally:
            sys.setprofile(None)
            self.call_counts.append((sum(calls.values()), calls.most_common(8)))

    def profile_calls(self, on: bool) -> None:
        self.profile = on
        self.call_counts = []

    def call_profile(self) -> tuple[int, int, float, list]:
        """(most calls in one invocation, invocations, loop timer max s, its top callees)."""
        counts, self.call_counts = self.call_counts, []
        worst = max(counts, default=(0, []))
        return worst[0], len(counts), self.side.diagnostics.loop_timer.max_s, worst[1]

    def fragment_host(self, seed: int) -> int:
        """Shuffle the host pool's free list page by page: every later allocation is
        one run per page (the worst case). Returns the number of free pages."""
        import torch

        pool = self.harness.kv_host_pool
        ps = pool.page_size
        free = self.harness.host_free_list()
        pages = free.reshape(-1, ps)[:, 0] if ps > 1 else free
        order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(seed))
        pages = pages[order]
        if ps > 1:
            pool.free_slots = (pages[:, None] + torch.arange(ps)).reshape(-1)
        else:
            pool.free_slots = pages
        return len(pages)

    def staging(self) -> dict:
        staging = self.side.target.staging
        if staging is None:
            return {}
        arena = staging.arena
        return {
            "free": arena.free_bytes,
            "size": arena.region[1],
            "quarantined": len(arena._quarantined),  # test only: the arena's private list
            "granted": staging.granted,
            "refused_full": staging.refused_full,
            "early": staging.early_bytes,
        }

    def expire_by_polling(self, max_iterations: int) -> int:
        """Run the scheduler loop's poll() until the watchdog freed everything."""
        for i in range(max_iterations):
            if len(self.side.target.pending) == 0:
                return i
            self.side.poll()
            time.sleep(0.001)
        return -1

    def end_quarantine(self) -> list[str]:
        # Slots leave quarantine once the engine closed the inbound streams shut down
        # for them (`tcp_streams.py`): a moment later, so ask again for a bounded while.
        freed: list[str] = []
        deadline = time.monotonic() + 5.0
        while True:
            freed += self.side.target.pending.release_quarantine(now=float("inf"))
            if not self.side.target.pending.quarantine or time.monotonic() > deadline:
                return freed
            time.sleep(0.01)

    def advance_clock(self, seconds: float) -> None:
        """Move the side's registry clock (write windows, watchdog deadlines, the staging
        arena's reuse) `seconds` ahead: a test of a window waits for none."""
        pending = self.side.target.pending
        clock = pending.clock
        pending.clock = lambda: clock() + seconds

    def snapshot(self) -> Any:
        return self.harness.snapshot()

    def match(self, tokens: list[int]) -> tuple[int, int]:
        return self.harness.match_lengths(tokens)

    def kv_digest(self, tokens: list[int]) -> tuple[int, list[str]]:
        loaded = self.harness.load_back(tokens)
        layers = self.harness.read_device_kv(loaded)
        return len(loaded), [_digest(t) for t in layers]

    def scramble_indexer(self, tokens: list[int]) -> int:
        """NSA: flip every bit of the indexer's device pages of `tokens` (not the KV)."""
        loaded = self.harness.load_back(tokens)
        for rows in self.harness.indexer_rows():
            rows[loaded] = ~rows[loaded]
        return len(loaded)

    def host_digest(self) -> str:
        return _digest(self.harness.kv_host_pool.kv_buffer)

    def pending(self) -> int:
        return len(self.side.target.pending)


def _digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes()).hexdigest()


def _u8() -> Any:
    import torch

    return torch.uint8


def peer_main(conn: Connection) -> None:
    import cpu_harness

    cpu_harness.install_cpu_shims()
    import sglang_kv_migration.server.scheduler.compose  # noqa: F401  (the slow sglang import, up front)

    server = _Server()
    conn.send(("ready", None))
    serve(conn, server, IDLE_EXIT_S)
