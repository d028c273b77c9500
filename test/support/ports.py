"""Ports for listeners the tests start on 127.0.0.1 where the port must be named before
the listener binds it (a gateway's command line, a gloo group's address).

A port the kernel hands out for port 0 lies in its ephemeral range, the range every
outgoing connection of every process on the machine takes its local port from: between
the test's choice and the listener's bind (seconds, for a process that starts first) a
busy machine may hand it to a connection, and the bind fails. A port below that range
is never handed out so; only another listener naming it could take it.
"""

from __future__ import annotations

import random
import socket

# How far below the ephemeral range the ports are chosen.
_SPAN = 12_000


def listen_port() -> int:
    """A port below the kernel's ephemeral range that nothing is bound to now. Bounded
    search; raises if none is free."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - _SPAN), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} after 200 tries")
