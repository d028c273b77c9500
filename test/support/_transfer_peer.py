"""The peer process of test_transfer.py: a MooncakeTransport with one buffer to write into.

Runs in a spawned process (no sglang, no torch). Protocol over a multiprocessing Pipe:
the peer first sends ``("ready", session_id, addr, size)``; then it answers
``("read",)`` with the buffer's bytes (``send_bytes``), ``("streams",)`` with how many
inbound data streams its engine has open, ``("shut_streams",)`` by shutting all of them
as the target's late-stream fence does (`tcp_streams.py`) and answering how many it shut
and how many stayed open, and ``("quit",)`` by closing its transport and exiting. It
exits on its own if no command comes for `IDLE_EXIT_S`.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

IDLE_EXIT_S = 120.0
SHUT_WAIT_S = 10.0  # bound for the engine to close the streams it was told to


def initial_contents(size: int, seed: int):
    """The bytes the peer buffer starts with (random, so untouched bytes are checkable)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def peer_main(conn: Connection, size: int, registered: int, seed: int) -> None:
    """Serve one buffer of `size` bytes, of which only the first `registered` are registered."""
    from sglang_kv_migration.paths.host.mooncake import (
        MemoryRegion,
        MooncakeTransport,
        TransportConfig,
    )

    buffer = initial_contents(size, seed)  # kept alive for the whole process
    addr = buffer.ctypes.data
    with MooncakeTransport(TransportConfig()) as transport:
        transport.register([MemoryRegion(addr, registered)])
        conn.send(("ready", transport.session_id, addr, size))
        while conn.poll(IDLE_EXIT_S):
            command = conn.recv()
            if command[0] == "read":
                conn.send_bytes(buffer.tobytes())
            elif command[0] == "streams":
                conn.send(len(transport.inbound.open_now()))
            elif command[0] == "shut_streams":
                conn.send(_shut_inbound_streams(transport.inbound))
            elif command[0] == "quit":
                break
    conn.close()


def _shut_inbound_streams(inbound) -> tuple[int, int]:
    """Shut every inbound data stream open now and wait until the engine closed them, as
    `PendingMigrations` does when a quarantine ends without a settled receipt; returns
    (streams shut, streams still open after `SHUT_WAIT_S`)."""
    import time

    streams = inbound.open_now()
    left = streams
    deadline = time.monotonic() + SHUT_WAIT_S
    while left and time.monotonic() < deadline:
        left = inbound.close(left)
        if left:
            time.sleep(0.01)
    return len(streams), len(left)
