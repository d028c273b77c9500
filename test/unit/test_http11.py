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
