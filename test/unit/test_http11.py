"""The synchronous client's own HTTP (`client/http11.py`) against a stdlib HTTP server:
keep-alive reuse, a connection the server closed, one socket per thread, errors."""

from __future__ import annotations

import gc
import http.server
import threading
from collections.abc import Iterator

import pytest
from sglang_kv_migration.client import http11
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    seen: list[tuple[int, str, bytes]] = []  # (client port, path, body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Handler.seen.append((self.client_address[1], self.path, body))
        if self.path == "/close":
            self.close_connection = True  # answers, then closes the kept-alive socket
        reply = b'{"success": true, "path": "%s"}' % self.path.encode()
        status = 404 if self.path == "/missing" else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.seen = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_reuses_one_connection_and_replaces_a_closed_one(server: str) -> None:
    client = http11.Http11(timeout=5)
    assert client.post(server + "/a", b"1", {}) == (200, b'{"success": true, "path": "/a"}')
    client.post(server + "/b?x=1", b"2", {})
    client.post(server + "/close", b"3", {})  # the server closes after answering
    client.post(server + "/c", b"4", {})  # a fresh connection, the request sent once
    client.close()
    ports = [port for port, _path, _body in _Handler.seen]
    assert [path for _port, path, _body in _Handler.seen] == ["/a", "/b?x=1", "/close", "/c"]
    assert ports[0] == ports[1] == ports[2] != ports[3]


def test_threads_get_their_own_connections_closed_when_they_end(server: str) -> None:
    client = http11.Http11(timeout=5)
    client.post(server + "/main", b"", {})
    sockets = []

    def work() -> None:
        client.post(server + "/worker", b"", {})
        sockets.extend(conn.sock for conn in client._local.conns.values())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    gc.collect()
    # The ended thread's socket is closed, not kept until the client closes.
    assert len(sockets) == 1 and sockets[0].fileno() == -1
    assert len(client._all) == 1  # the main thread's, still open
    client.post(server + "/main-again", b"", {})
    client.close()
    (main_port, _, _), (worker_port, _, _), (again_port, _, _) = _Handler.seen
    assert main_port != worker_port and again_port == main_port


def test_migration_client_reports_status_and_unreachable_servers(server: str) -> None:
    with MigrationClient(timeout=5) as client:
        assert client.call(server, "/ok", {"a": 1}) == {"success": True, "path": "/ok"}
        assert _Handler.seen[-1][2] == b'{"a":1}'
        with pytest.raises(MigrationFailed) as failure:
            client.call(server, "/missing")
        assert failure.value.status_code == 404
    with MigrationClient(timeout=5) as client:
        # A refused connection is a failed phase (no status), not an exception escaping.
        status, message = client._post(
            type("Call", (), {"url": "http://127.0.0.1:9", "path": "/x", "body": {}})()
        )
        assert status is None and "Connection" in message


# ---------------------------------------------------------------- replies of every shape


class _RawServer:
    """A socket server on 127.0.0.1 whose `reply(n, conn)` answers the n-th request with
    whatever bytes a test writes (and returns whether to keep the connection)."""

    def __init__(self, reply):
        import socket

        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/commit"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn) -> None:
        reader = conn.makefile("rb")
        with conn:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.requests.append(head + reader.read(length))
                if not self.reply(len(self.requests), conn):
                    return

    def close(self) -> None:
        self._listener.close()


def _serving(reply) -> Iterator[_RawServer]:
    server = _RawServer(reply)
    try:
        yield server
    finally:
        server.close()


def test_chunked_split_and_until_close_replies() -> None:
    import time

    def reply(n: int, conn) -> bool:
        if n == 1:  # chunked, with an extension and a trailer, written in pieces
            for piece in (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chun", b"ked\r\n\r\n3\r\n{",
                          b'"a\r\n5;x=1\r\n": 1}\r\n0\r\nX-T: 1\r\n\r\n'):  # fmt: skip
                conn.sendall(piece)
                time.sleep(0.01)
            return True
        if n == 2:  # a status with no reason, no length: the body ends with the connection
            conn.sendall(b"HTTP/1.1 409\r\n\r\nuntil-close")
            return False
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        return True

    for server in _serving(reply):
        client = http11.Http11(timeout=5)
        assert client.post(server.url, b"{}", {"X-Key": "k"}) == (200, b'{"a": 1}')
        assert client.post(server.url, b"{}", {}) == (409, b"until-close")
        assert client.post(server.url, b"{}", {}) == (200, b"{}")  # a new connection
        assert client.post(server.url, b"{}", {}) == (200, b"{}")  # kept
        client.close()
        assert server.connections == 2 and len(server.requests) == 4
        first = server.requests[0]
        assert first.startswith(b"POST /commit HTTP/1.1\r\n") and first.endswith(b"\r\n\r\n{}")
        assert b"\r\nX-Key: k\r\n" in first and b"\r\nContent-Length: 2\r\n" in first


def test_a_request_is_never_sent_twice_and_bad_replies_raise_the_documented_errors() -> None:
    def reply(n: int, conn) -> bool:
        if n == 2:
            conn.sendall(b"not http\r\n\r\n")
        if n == 3:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        if n == 4:
            conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000)
        return False  # request 1: closed with no reply at all

    for server in _serving(reply):
        client = http11.Http11(timeout=5)
        with pytest.raises(http11.ERRORS):
            client.post(server.url, b"{}", {})
        assert len(server.requests) == 1  # not resent on a fresh connection
        with pytest.raises(http11.ProtocolError, match="not an HTTP/1.x reply"):
            client.post(server.url, b"{}", {})
        with pytest.raises(EOFError):  # the body cut short
            client.post(server.url, b"{}", {})
        with pytest.raises(http11.ProtocolError, match="reply headers too long"):
            client.post(server.url, b"{}", {})
        assert len(server.requests) == 4 and not client._all  # every failed one closed
        client.close()


def test_a_timed_out_call_drops_its_connection() -> None:
    def never(_n: int, _conn) -> bool:
        import time

        time.sleep(2)
        return False

    for server in _serving(never):
        client = http11.Http11(timeout=0.2)
        with pytest.raises(TimeoutError) as info:
            client.post(server.url, b"{}", {})
        assert isinstance(info.value, http11.ERRORS)
        assert not client._all  # never kept with a reply still unread
        client.close()
