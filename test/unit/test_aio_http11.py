"""The asyncio client's HTTP/1.1 (`client/aio_http11.py`) against a real asyncio server on
127.0.0.1 that answers each request the way a test tells it to."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from sglang_kv_migration.client import aio_http11
from sglang_kv_migration.client.aio_http11 import AsyncHttp11

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
Reply = Callable[[int, asyncio.StreamWriter], Awaitable[bool]]  # -> keep the connection


class Server:
    """Counts connections and requests; `reply(n, writer)` answers the n-th request."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.requests.append(head + await reader.readexactly(length))
                if not await self.reply(len(self.requests), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def _with_server(reply: Reply, body: Callable[[str, Server], Awaitable[None]]) -> None:
    server = Server(reply)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        await body(f"http://127.0.0.1:{port}/commit", server)
    finally:
        listener.close()
        await listener.wait_closed()


def _run(reply: Reply, body: Callable[[str, Server], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(_with_server(reply, body), 30))


async def _ok(_n: int, writer: asyncio.StreamWriter) -> bool:
    writer.write(OK)
    await writer.drain()
    return True


def test_calls_reuse_one_kept_alive_connection():
    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(5.0)
        for _ in range(3):
            assert await http.post(url, b'{"a": 1}', {"X-Key": "k"}) == (200, b"{}")
        await http.aclose()
        assert server.connections == 1 and len(server.requests) == 3
        first = server.requests[0]
        assert first.startswith(b"POST /commit HTTP/1.1\r\n")
        assert b"\r\nX-Key: k\r\n" in first and b"Content-Length: 8\r\n" in first
        assert first.endswith(b'\r\n\r\n{"a": 1}')

    _run(_ok, body)


def test_concurrent_calls_each_take_their_own_connection():
    async def slow_ok(_n: int, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        return await _ok(_n, writer)

    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(5.0)
        replies = await asyncio.gather(*(http.post(url, b"{}", {}) for _ in range(4)))
        assert replies == [(200, b"{}")] * 4 and server.connections == 4
        await http.aclose()

    _run(slow_ok, body)


def test_a_connection_the_server_closed_is_replaced_before_writing():
    async def ok_then_close(_n: int, writer: asyncio.StreamWriter) -> bool:
        await _ok(_n, writer)
        return False  # close without saying so, as uvicorn does with an idle one

    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(5.0)
        assert (await http.post(url, b"{}", {}))[0] == 200
        await asyncio.sleep(0.05)  # the loop sees the EOF
        assert (await http.post(url, b"{}", {}))[0] == 200
        assert server.connections == 2 and len(server.requests) == 2
        await http.aclose()

    _run(ok_then_close, body)


def test_chunked_and_connection_close_replies():
    async def chunked(n: int, writer: asyncio.StreamWriter) -> bool:
        if n != 2:
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'3\r\n{"a\r\n5;x=1\r\n": 1}\r\n0\r\n\r\n'
            )
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 409 Conflict\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx")
        await writer.drain()
        return False

    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(5.0)
        assert await http.post(url, b"{}", {}) == (200, b'{"a": 1}')
        assert await http.post(url, b"{}", {}) == (409, b"x")
        assert (await http.post(url, b"{}", {}))[1] == b'{"a": 1}'  # on a new connection
        assert server.connections == 2
        await http.aclose()

    _run(chunked, body)


def test_a_request_is_never_sent_twice_and_errors_are_the_documented_ones():
    async def close_at_once(n: int, writer: asyncio.StreamWriter) -> bool:
        if n == 2:
            writer.write(b"not http\r\n\r\n")
            await writer.drain()
        return False  # request 1: closed with no reply at all

    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(5.0)
        with pytest.raises(aio_http11.ERRORS):
            await http.post(url, b"{}", {})
        assert len(server.requests) == 1  # not resent on the closed connection
        with pytest.raises(aio_http11.ProtocolError, match="not an HTTP/1.x reply"):
            await http.post(url, b"{}", {})
        await http.aclose()

    _run(close_at_once, body)


def test_a_timed_out_call_closes_its_connection():
    async def never(_n: int, _writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(10)
        return False

    async def body(url: str, server: Server) -> None:
        http = AsyncHttp11(0.2)
        with pytest.raises(TimeoutError) as info:
            await http.post(url, b"{}", {})
        assert isinstance(info.value, aio_http11.ERRORS)
        assert not any(http._idle.values())  # never pooled with a reply still unread
        await http.aclose()

    _run(never, body)


def test_one_client_serves_one_event_loop_after_another():
    """A connection kept by a loop that has ended is never used by the next one."""
    import threading

    ready, stop = threading.Event(), threading.Event()
    box: dict = {}

    def serve() -> None:
        async def main() -> None:
            server = Server(_ok)
            listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
            box["url"] = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/commit"
            box["server"] = server
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)
            listener.close()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    http = AsyncHttp11(5.0)
    try:
        for _ in range(2):
            assert asyncio.run(http.post(box["url"], b"{}", {})) == (200, b"{}")
        assert box["server"].connections == 2  # one per loop
        assert asyncio.run(http.post(box["url"], b"{}", {}))[0] == 200
    finally:
        stop.set()
        thread.join(10)
