"""Driving an object in a child process over a `multiprocessing` pipe.

The child answers each ``(command, *args)`` with ``("ok", value)`` or ``("error",
traceback_text)``; ``("quit",)`` or `idle_s` without a command ends it. Used by the
two-process tests and the CPU benchmarks that run real SGLang cache objects.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


def serve(
    conn: Connection, target: Any, idle_s: float, between: Callable[[], None] | None = None
) -> None:
    """The child's loop: call `target`'s methods by name; close both when done.

    With `between`, the loop never blocks: it calls `between()` while no command is
    waiting (a scheduler loop that spins while idle, as SGLang's does).
    """
    try:
        while _wait(conn, idle_s, between):
            command, *args = conn.recv()
            if command == "quit":
                break
            try:
                conn.send(("ok", getattr(target, command)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        target.close()
        conn.close()


def _wait(conn: Connection, idle_s: float, between: Callable[[], None] | None) -> bool:
    if between is None:
        return conn.poll(idle_s)
    deadline = time.monotonic() + idle_s
    while not conn.poll(0):
        if time.monotonic() > deadline:
            return False
        between()
    return True


@dataclass
class Remote:
    """The parent's side: one child process and its pipe."""

    name: str
    conn: Connection
    process: Any
    reply_s: float = 600.0

    @classmethod
    def spawn(cls, name: str, main: Callable[[Connection], None]) -> Remote:
        """Start `main(conn)` in a fresh (spawned) daemon process; it ends with `serve`."""
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(target=main, args=(child,), daemon=True, name=name)
        process.start()
        child.close()
        return cls(name, conn, process)

    def do(self, command: str, *args: Any) -> Any:
        self.conn.send((command, *args))
        if not self.conn.poll(self.reply_s):
            raise TimeoutError(f"{self.name}: no reply to {command} in {self.reply_s} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed on {command}:\n{value}")
        return value

    def stop(self) -> None:
        try:
            self.conn.send(("quit",))
        except OSError:
            pass  # already gone
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
