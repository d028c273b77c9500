"""The asyncio client's HTTP: keep-alive HTTP/1.1 POSTs over asyncio streams.

The asyncio twin of `http11.py`: a migration's calls are short POSTs of encoded JSON to
the six routes, and `httpx.AsyncClient` costs about 1.6 ms more per call than this on a
2-core box (no-work trips, `docs/benchmarks.md`), which `move_request` and the
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

from sglang_kv_migration.client.http_reply import (
    ERRORS,
    MAX_BODY_BYTES,
    Origin,
    ProtocolError,
    chunk_size,
    parse_head,
    prepare_post,
)

# ERRORS: what a failed call raises (the caller turns it into a failed phase).
__all__ = ["ERRORS", "AsyncHttp11", "ProtocolError"]


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
        self._idle: dict[Origin, list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        origin, request = prepare_post(url, body, headers)
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

    async def _connection(self, origin: Origin) -> _Connection:
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
        head = parse_head((await reader.readuntil(b"\r\n\r\n"))[:-4])
    except asyncio.LimitOverrunError:
        raise ProtocolError("reply headers too long") from None
    if head.chunked:
        return head.status, await _read_chunked(reader), head.keep_alive
    if head.length is not None:
        return head.status, await reader.readexactly(head.length), head.keep_alive
    return head.status, await reader.read(MAX_BODY_BYTES), False  # until the server closes


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        size = chunk_size(await reader.readline())
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        total += size
        if total > MAX_BODY_BYTES:
            raise ProtocolError("reply body too long")
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)  # CRLF after the chunk
