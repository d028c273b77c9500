"""A gate in front of a rank's host-path writes (test env only): a write the rank starts
waits there until the test opens it, so a test holds a transfer "on the wire" for as
long as it needs, without a slowed link or a clock (`mini_server`'s commands
`hold_writes`, `held_writes`, `release_writes`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

# Longest a held write waits for the test (then it goes on, so no rank hangs forever).
HOLD_LIMIT_S = 300.0


class WriteGate:
    """Wraps `transport.write_pages`: each call returns at once with a pending handle (the
    source has started writing, as far as it can tell) and runs once the gate opens."""

    def __init__(self, transport: Any):
        self.transport = transport
        self.real = transport.write_pages
        self.opened = threading.Event()
        self.opened.set()  # open until the test holds it
        self._lock = threading.Lock()
        self.held = 0  # writes waiting at the gate now
        transport.write_pages = self.write_pages

    def close(self) -> None:
        """Let every held write go, and later ones through."""
        self.opened.set()

    def hold(self) -> None:
        self.opened.clear()

    def write_pages(self, *args: Any, **kwargs: Any) -> Any:
        from sglang_kv_migration.paths.host.transport import TransferHandle

        if self.opened.is_set():
            return self.real(*args, **kwargs)
        done: Future = Future()
        with self._lock:
            self.held += 1

        def later() -> None:
            self.opened.wait(HOLD_LIMIT_S)
            with self._lock:
                self.held -= 1
            try:
                done.set_result(self.real(*args, **kwargs).result())
            except BaseException as e:  # the write's own failure, as the source would see it
                done.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        return TransferHandle(done)


def gate_of(scheduler: Any) -> WriteGate:
    """The rank's gate, made on first use."""
    gate = getattr(scheduler, "test_write_gate", None)
    if gate is None:
        gate = WriteGate(scheduler.kv_migration.paths["host"].transport)
        scheduler.test_write_gate = gate
    return gate


def hold_writes(scheduler: Any) -> int:
    gate_of(scheduler).hold()
    return 0


def held_writes(scheduler: Any) -> int:
    return gate_of(scheduler).held


def release_writes(scheduler: Any) -> int:
    gate = gate_of(scheduler)
    held = gate.held
    gate.close()
    return held


COMMANDS = {
    "hold_writes": hold_writes,
    "held_writes": held_writes,
    "release_writes": release_writes,
}
