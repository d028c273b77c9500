"""The peer process of test_transfer.py: a MooncakeTransport with one buffer to write into.

Runs in a spawned process (no sglang, no torch). Protocol over a multiprocessing Pipe:
the peer first sends ``("ready", session_id, addr, size)``; then it answers
``("read",)`` with the buffer's bytes (``send_bytes``) and ``("quit",)`` by closing its
transport and exiting. It exits on its own if no command comes for `IDLE_EXIT_S`.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

IDLE_EXIT_S = 120.0


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
            elif command[0] == "quit":
                break
    conn.close()
