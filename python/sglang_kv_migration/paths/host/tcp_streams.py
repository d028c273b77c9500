"""The transfer engine's inbound TCP data streams in this process: listed and closed.

Mooncake (0.3.13) over TCP reports a batch past its timeout as failed but does not close
the stream that carries it: when a cut link comes back, TCP delivers the rest into this
target's memory, after the write window closed (docs/reliability.md, late writes). The
target owns the receiving end. Before it reuses slots whose window closed without the
source's settled receipt, it shuts down every inbound data stream open at that moment
and waits until the engine has closed them (`PendingMigrations`): Linux answers data
that reaches a socket shut for reading after its FIN with a reset (RFC 1122), and once
no descriptor of this process refers to a stream nothing can read it into memory.

A healthy write on a stream closed this way fails. Mooncake keeps every lane's stream
until a write on it fails, so a source's next writes to this target meet the shut
streams one by one: it retries a failed entry once per lane and then reaches a new
stream (`mooncake_batches._Singles`). Only sockets of this process on the engine's own data
listener are touched. Linux only (`/proc`); elsewhere nothing is listed and the window
alone applies.
"""

from __future__ import annotations

import contextlib
import os
import socket

_LISTEN = "0A"  # /proc/net/tcp state of a listening socket


def own_sockets() -> dict[int, int]:
    """Socket inode -> a descriptor of this process that refers to it."""
    sockets: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                sockets[int(link[8:-1])] = int(name)
    return sockets


def _tcp_sockets() -> list[tuple[int, str, int]]:
    """(local port, state, inode) of every TCP socket of this network namespace."""
    entries = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                port = int(fields[1].rsplit(":", 1)[1], 16)
                entries.append((port, fields[3], int(fields[9])))
    return entries


def listening_ports() -> frozenset[int]:
    """The TCP ports this process listens on."""
    mine = own_sockets()
    return frozenset(
        port for port, state, inode in _tcp_sockets() if state == _LISTEN and inode in mine
    )


class InboundStreams:
    """Connections this process accepted on the engine's data listener `ports`."""

    def __init__(self, ports: frozenset[int]):
        self.ports = ports

    def open_now(self) -> frozenset[int]:
        """The inodes of the inbound data streams open now."""
        if not self.ports:
            return frozenset()
        mine = own_sockets()
        return frozenset(
            inode
            for port, state, inode in _tcp_sockets()
            if port in self.ports and state != _LISTEN and inode in mine
        )

    def close(self, streams: frozenset[int]) -> frozenset[int]:
        """Shut down those of `streams` still open (the engine then closes them); returns
        them: empty once none is left."""
        mine = own_sockets()
        still = frozenset(inode for inode in streams if inode in mine)
        for inode in still:
            _shut_down(mine[inode], inode)
        return still


def _shut_down(fd: int, inode: int) -> None:
    """Shut a socket down for reading and writing through a duplicate of `fd`, only if
    the duplicate is still that socket (the descriptor may have been reused)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        if os.fstat(dup).st_ino != inode:
            return
        sock = socket.socket(fileno=dup)
        dup = -1  # the socket object owns it now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down or reset
        finally:
            sock.close()  # the engine's own descriptor keeps the socket until it closes
    finally:
        if dup >= 0:
            os.close(dup)
