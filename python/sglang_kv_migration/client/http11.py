"""The synchronous client's HTTP: keep-alive HTTP/1.1 POSTs over the standard library.

A migration is three or four short POSTs whose bodies are already encoded JSON, so the client
needs no more of HTTP than `http.client` has; httpx costs about 0.5-1 ms more per call
on a busy 2-core box (`docs/benchmarks.md`, "The control plane on CPU"), which is a
sizeable part of a small migration. `MigrationClient` uses this unless it is handed an
`httpx.Client` (for proxies, custom transports, or anything else httpx offers): this
one connects directly, ignoring the `HTTP(S)_PROXY` variables.

One connection per (thread, origin), so threads sharing a client never share a socket;
a thread's connections are closed when the thread ends (a rollout manager that makes
new worker threads for every batch would otherwise keep every socket they opened).
A kept-alive connection the server has since closed (uvicorn closes idle ones after 5 s)
is detected before the request is written, as httpcore does, and replaced; a request
that was written is never sent again (an allocate must not run twice).
"""

from __future__ import annotations

import http.client
import select
import threading
import weakref
from urllib.parse import urlsplit

# What a failed call raises (the caller turns it into a failed phase).
ERRORS = (OSError, http.client.HTTPException)


class Http11:
    """POST bytes, get (status, body bytes); `timeout` bounds each socket operation."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        # Every open connection, for `close()`; a thread's own dict holds the only strong
        # references, so its connections go (closed) with the thread.
        self._all: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        parts = urlsplit(url)
        origin = (parts.scheme, parts.hostname or "", parts.port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        conn = self._connection(origin)
        try:
            conn.request("POST", target, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            self._drop(origin, conn)
            raise
        if response.will_close:
            self._drop(origin, conn)
        return response.status, data

    def close(self) -> None:
        with self._lock:
            conns, self._all = list(self._all), weakref.WeakSet()
        for conn in conns:
            conn.close()

    def _connection(self, origin: tuple[str, str, int | None]) -> http.client.HTTPConnection:
        conns: dict = self._local.__dict__.setdefault("conns", _ThreadConnections())
        conn = conns.get(origin)
        if conn is not None and _closed_by_peer(conn):
            self._drop(origin, conn)
            conn = None
        if conn is None:
            scheme, host, port = origin
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = cls(host, port, timeout=self.timeout)
            conns[origin] = conn
            with self._lock:
                self._all.add(conn)
        return conn

    def _drop(self, origin: tuple[str, str, int | None], conn: http.client.HTTPConnection) -> None:
        conn.close()
        conns: dict = self._local.__dict__.get("conns", {})
        if conns.get(origin) is conn:
            del conns[origin]
        with self._lock:
            self._all.discard(conn)


class _ThreadConnections(dict):
    """One thread's connections by origin; closed when the thread ends (CPython drops a
    `threading.local`'s per-thread dict with its thread)."""

    def __del__(self) -> None:
        for conn in list(self.values()):
            conn.close()


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """True when an idle kept-alive socket is readable: the server closed it (EOF) or
    sent something unasked; either way it cannot carry the next request."""
    sock = conn.sock
    if sock is None:
        return False  # not connected yet: `request` connects
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
