"""The asyncio client's HTTP: keep-alive HTTP/1.1 POSTs over asyncio streams.

The asyncio twin of `http11.py`: a migration's calls are short POSTs of encoded JSON to
the six routes, and `httpx.AsyncClient` costs about 1.6 ms more per call than this on a
2-core box (no-work trips, `docs/benchmarks.md`), which `migrate_request` and the
rebalancer pay on every trip. `AsyncMigrationClient` uses this unless it is handed an
`httpx.AsyncClient` (proxies, custom transports); it connects directly, ignoring the
`HTTP(S)_PROXY` variables.

Idle connections are kept per (event loop, origin); concurrent calls each take their
own. One the server has closed since (uvicorn closes idle ones after 5 s) is dropped
before a request is written; a request that was written is never sent again (an
allocate must not run twice). A call that fails or is cancelled half-way closes its
connection: it never goes back to the pool with a reply still unread.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

MAX_BODY_BYTES = 256 << 20  # far above any reply of the six routes


class ProtocolError(ValueError):
    """The server's reply is not HTTP/1.1 this client can read."""


# What a failed call raises (the caller turns it into a failed phase). TimeoutError is
# an OSError; IncompleteReadError an EOFError.
ERRORS = (OSError, EOFError, ProtocolError)

_Origin = tuple[str, str, int]


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        # Streams belong to the loop that opened them (a client may outlive one
        # `asyncio.run`); held, so another loop cannot take this one's identity.
        self.loop = asyncio.get_running_loop()

    @property
    def usable(self) -> bool:
        """False once the server closed it (the loop saw EOF) or it is being closed."""
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:  # its loop is closed: so is the socket's last user
            pass


class AsyncHttp11:
    """POST bytes, get (status, body bytes); `timeout` bounds each whole call."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._idle: dict[_Origin, list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout):
                conn = await self._connection(origin)
                conn.writer.write(request)
                await conn.writer.drain()
                status, data, keep = await _read_response(conn.reader)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if keep:
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        return status, data

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    async def _connection(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin, [])
        loop = asyncio.get_running_loop()
        for conn in list(idle):
            if conn.loop is not loop:
                continue  # another loop's (it drops them when it runs one again)
            idle.remove(conn)
            if conn.usable:
                return conn
            conn.close()
        self._idle[origin] = [c for c in idle if not c.loop.is_closed()]
        scheme, host, port = origin
        context = ssl.create_default_context() if scheme == "https" else None
        reader, writer = await asyncio.open_connection(host, port, ssl=context)
        return _Connection(reader, writer)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection may carry another request)."""
    try:  # bounded by the stream's limit (asyncio's default: 64 KiB)
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise ProtocolError("reply headers too long") from None
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x reply: {status_line[:80]!r}")
    fields: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"bad reply header {line[:80]!r}")
        fields[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return int(code), await _read_chunked(reader), keep
    if "content-length" in fields:
        length = fields["content-length"]
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            raise ProtocolError(f"bad Content-Length {length[:20]!r}")
        return int(code), await reader.readexactly(int(length)), keep
    return int(code), await reader.read(MAX_BODY_BYTES), False  # until the server closes


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        size_line = (await reader.readline()).split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {size_line[:20]!r}") from None
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        total += size
        if total > MAX_BODY_BYTES:
            raise ProtocolError("reply body too long")
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)  # CRLF after the chunk
