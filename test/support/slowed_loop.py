"""TEST STAND-IN for a busy SGLang scheduler: a mini server (`mini_server.py`) whose loop
takes a fixed step every iteration, as a busy batch's decode does, and an observer that
counts the loop iterations each migration spends on this rank.

    ServerSpec(extension=SlowedLoop(step_s=0.02))

What it changes: every iteration of rank 0's loop ends with `time.sleep(step_s)` after
our poll (where SGLang's loop would run the batch), and the scheduler reports itself
busy (`is_fully_idle` False: SGLang with a running batch), so nothing of ours waits for
an idle loop; the HTTP layer sees generate requests in flight (`busy`), unless
`POST /_test/busy {"busy": false}` said otherwise. Nothing else: the hooks, handlers,
channel, mailbox and Mooncake are real.

With ``copies_within_step`` the step also lasts until every host-path write this rank
started has finished (bounded), so a copy of a few pages ends within one step however
loaded the machine: the iterations a move takes are then counted, never raced.

What it counts (read-only, from `tick()`, which the loop calls after the iteration's
poll): per migration id this rank is the target of, the loop iteration that allocated
it (`pending.by_id` gains it) and the one that committed it (loses it). `GET
/_test/iterations` returns them; `POST /_test/iterations/reset` forgets them. A source's
iterations are in each transfer reply (`steps_ms`: `polls`, `first_poll`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The longest a step waits for the writes it started (`copies_within_step`).
COPY_WAIT_S = 60.0


@dataclass
class SlowedLoop:
    """A picklable `ServerSpec.extension` (built in rank 0's process by `__call__`)."""

    step_s: float = 0.02
    copies_within_step: bool = False

    def __call__(self, harness: Any) -> IterationCounter:
        return IterationCounter(self.step_s, copies_within_step=self.copies_within_step)


def iterations(url: str) -> dict[str, Any]:
    """What the server's counter saw (see the module docstring)."""
    import httpx

    return httpx.get(url + "/_test/iterations", timeout=30).json()


def reset(url: str, busy: bool = True) -> None:
    """Forget what was counted; the HTTP layer sees the scheduler `busy` (or not)."""
    import httpx

    for path, body in (("/_test/iterations/reset", {}), ("/_test/busy", {"busy": busy})):
        httpx.post(url + path, json=body, timeout=30).raise_for_status()


@dataclass
class IterationCounter:
    step_s: float
    iteration: int = 0
    allocated: dict[str, int] = field(default_factory=dict)  # migration id -> iteration
    committed: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    scheduler: Any = None
    generate_in_flight: bool = True  # what `busy` tells the HTTP layer
    copies_within_step: bool = False
    writes: list[Any] = field(default_factory=list)  # the host path's handles in flight
    _watching: bool = False

    def attach(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.is_fully_idle = lambda: False  # a batch runs every iteration

    def busy(self) -> bool:
        """What the HTTP layer reads (SGLang: generate requests in flight)."""
        return self.generate_in_flight

    def add_routes(self, app: Any) -> None:
        @app.get("/_test/iterations")
        async def iterations() -> dict[str, Any]:
            with self.lock:
                return {
                    "iteration": self.iteration,
                    "step_s": self.step_s,
                    "allocated": dict(self.allocated),
                    "committed": dict(self.committed),
                }

        @app.post("/_test/busy")
        async def busy(body: dict[str, bool]) -> dict[str, bool]:
            self.generate_in_flight = bool(body["busy"])
            return {"success": True}

        @app.post("/_test/iterations/reset")
        async def reset() -> dict[str, bool]:
            with self.lock:
                self.allocated.clear()
                self.committed.clear()
            return {"success": True}

    def tick(self) -> None:
        """After the iteration's poll: look at what is in flight, then take the step."""
        side = getattr(self.scheduler, "kv_migration", None)
        with self.lock:
            self.iteration += 1
            if side is not None:
                self._observe(side)
        if self.copies_within_step and side is not None and not self._watching:
            self._watch_writes(side.paths["host"].transport)
        time.sleep(self.step_s)
        deadline = time.monotonic() + COPY_WAIT_S
        while self.writes and time.monotonic() < deadline:
            self.writes = [handle for handle in self.writes if not handle.done()]
            time.sleep(0.001)

    def _watch_writes(self, transport: Any) -> None:
        """Keep the handle of every write the host path starts (`write_pages`)."""
        write_pages = transport.write_pages

        def recorded(*args: Any, **kwargs: Any) -> Any:
            handle = write_pages(*args, **kwargs)
            self.writes.append(handle)
            return handle

        transport.write_pages = recorded
        self._watching = True

    def _observe(self, side: Any) -> None:
        now = self.iteration
        pending = side.target.pending.by_id
        for mid in pending:
            self.allocated.setdefault(mid, now)
        for mid in list(self.allocated):
            if mid not in pending and mid not in self.committed:
                self.committed[mid] = now
