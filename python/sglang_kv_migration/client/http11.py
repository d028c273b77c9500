"""The synchronous client's HTTP: keep-alive HTTP/1.1 POSTs on plain sockets.

A migration is one to four short POSTs whose bodies are already encoded JSON, so the
client needs no more of HTTP than a request written in one buffer and a reply read by
its Content-Length (`http_reply.py`, shared with the asyncio client). `http.client`
(header objects, a reply-header parse through the `email` package) costs ~0.25 ms more
per call when a call runs cold between other work (`benchmark/probes/probe_http_trip.py`);
httpx more still (`docs/benchmarks-history.md`, "The control plane on CPU").
`MigrationClient` uses this unless it is handed an `httpx.Client` (for proxies, custom
transports, or anything else httpx offers): this one connects directly, ignoring the
`HTTP(S)_PROXY` variables.

One connection per (thread, origin), so threads sharing a client never share a socket;
a thread's connections are closed when the thread ends (a rollout manager that makes
new worker threads for every batch would otherwise keep every socket they opened).
A kept-alive connection the server has since closed (uvicorn closes idle ones after 5 s)
is detected before the request is written, as httpcore does, and replaced; a request
that was written is never sent again (an allocate must not run twice).
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import weakref

from sglang_kv_migration.client.http_reply import (
    ERRORS,
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    Origin,
    ProtocolError,
    chunk_size,
    parse_head,
    prepare_post,
)

# ERRORS: what a failed call raises (the caller turns it into a failed phase).
__all__ = ["ERRORS", "Http11", "ProtocolError"]


class _Connection:
    """A socket and what was read from it past the last reply."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray()

    @property
    def usable(self) -> bool:
        """Idle, and neither closed by the server nor holding bytes nobody asked for."""
        return not self._buffer and not _closed_by_peer(self.sock)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_reply(self) -> tuple[int, bytes, bool]:
        """(status, body, whether the connection may carry another request)."""
        head = parse_head(self._until(b"\r\n\r\n", MAX_HEAD_BYTES, "reply headers"))
        if head.chunked:
            return head.status, self._chunked(), head.keep_alive
        if head.length is not None:
            return head.status, self._exactly(head.length), head.keep_alive
        while len(self._buffer) <= MAX_BODY_BYTES and self._fill(eof_ok=True):
            pass  # until the server closes
        if len(self._buffer) > MAX_BODY_BYTES:
            raise ProtocolError("reply body too long")
        return head.status, self._take(len(self._buffer)), False

    def close(self) -> None:
        self.sock.close()

    def _fill(self, eof_ok: bool = False) -> bool:
        data = self.sock.recv(1 << 16)
        if not data:
            if eof_ok:
                return False
            raise EOFError("the server closed the connection before its reply ended")
        self._buffer += data
        return True

    def _take(self, n: int) -> bytes:
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _until(self, separator: bytes, limit: int, what: str) -> bytes:
        """The bytes up to `separator` (consumed, not returned)."""
        start = 0
        while (end := self._buffer.find(separator, start)) < 0:
            if len(self._buffer) > limit:
                raise ProtocolError(f"{what} too long")
            start = max(len(self._buffer) - len(separator) + 1, 0)
            self._fill()
        data = self._take(end)
        del self._buffer[: len(separator)]
        return data

    def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._fill()
        return self._take(n)

    def _chunked(self) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            size = chunk_size(self._until(b"\r\n", MAX_HEAD_BYTES, "a chunk size line"))
            if size == 0:
                while self._until(b"\r\n", MAX_HEAD_BYTES, "a trailer"):
                    pass  # trailers, up to the empty line
                return b"".join(chunks)
            total += size
            if total > MAX_BODY_BYTES:
                raise ProtocolError("reply body too long")
            chunks.append(self._exactly(size))
            self._exactly(2)  # CRLF after the chunk


class Http11:
    """POST bytes, get (status, body bytes); `timeout` bounds each socket operation."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        # Every open connection, for `close()`; a thread's own dict holds the only strong
        # references, so its connections go (closed) with the thread.
        self._all: weakref.WeakSet[_Connection] = weakref.WeakSet()

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        origin, request = prepare_post(url, body, headers)
        conn = self._connection(origin)
        try:
            conn.send(request)
            status, data, keep = conn.read_reply()
        except BaseException:
            self._drop(origin, conn)
            raise
        if not keep:
            self._drop(origin, conn)
        return status, data

    def close(self) -> None:
        with self._lock:
            conns, self._all = list(self._all), weakref.WeakSet()
        for conn in conns:
            conn.close()

    def _connection(self, origin: Origin) -> _Connection:
        conns: dict = self._local.__dict__.setdefault("conns", _ThreadConnections())
        conn = conns.get(origin)
        if conn is not None and not conn.usable:
            self._drop(origin, conn)
            conn = None
        if conn is None:
            conn = _Connection(_connect(origin, self.timeout))
            conns[origin] = conn
            with self._lock:
                self._all.add(conn)
        return conn

    def _drop(self, origin: Origin, conn: _Connection) -> None:
        conn.close()
        conns: dict = self._local.__dict__.get("conns", {})
        if conns.get(origin) is conn:
            del conns[origin]
        with self._lock:
            self._all.discard(conn)


def _connect(origin: Origin, timeout: float) -> socket.socket:
    scheme, host, port = origin
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        # The request goes in one write; no delayed send of its tail.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock


class _ThreadConnections(dict):
    """One thread's connections by origin; closed when the thread ends (CPython drops a
    `threading.local`'s per-thread dict with its thread)."""

    def __del__(self) -> None:
        for conn in list(self.values()):
            conn.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when an idle kept-alive socket is readable: the server closed it (EOF) or
    sent something unasked; either way it cannot carry the next request."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
