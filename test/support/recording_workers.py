"""TEST STAND-IN: trivial HTTP workers for the model gateway's routing tests, each
recording which requests it served (test env only).

A worker answers the discovery routes the gateway reads before it registers one (the
replies of `sglang_discovery.py`) and `/generate`: a JSON reply, or with ``"stream":
true`` SGLang's server-sent events (one chunk, then ``[DONE]``), whose one output token
is the worker's number. Every `/generate` it receives is recorded with the request's
``rid`` as it arrived, before the reply is written: a request the gateway sent to the
wrong worker is on that worker's record even when its caller cancelled it. Served by
the standard library's threading HTTP server, bound to a free port on 127.0.0.1 when
created (no port is chosen before it is bound).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "tiny-llama"
_DISCOVERY: dict[str, dict[str, Any]] = {
    "/health": {},
    "/v1/models": {
        "object": "list",
        "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "sglang", "root": MODEL}
        ],
    },
    "/model_info": {"model_path": MODEL, "is_generation": True, "weight_version": "default"},
    "/server_info": {
        "model_path": MODEL,
        "served_model_name": MODEL,
        "tp_size": 1,
        "dp_size": 1,
        "skip_tokenizer_init": True,
        "version": "0.5.12",
    },
}
_DISCOVERY["/get_model_info"] = _DISCOVERY["/model_info"]
_DISCOVERY["/get_server_info"] = _DISCOVERY["/server_info"]


@dataclass
class RecordingWorker:
    number: int
    server: ThreadingHTTPServer
    served: list[str] = field(default_factory=list)  # rids, in arrival order
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def record(self, rid: str) -> None:
        with self.lock:
            self.served.append(rid)

    def rids(self) -> list[str]:
        with self.lock:
            return list(self.served)


@contextmanager
def recording_workers(n: int) -> Iterator[list[RecordingWorker]]:
    """`n` workers serving on their own threads; shut down on exit."""
    workers: list[RecordingWorker] = []
    try:
        for number in range(n):
            worker = RecordingWorker(number, ThreadingHTTPServer(("127.0.0.1", 0), _Handler))
            worker.server.worker = worker  # type: ignore[attr-defined]
            worker.server.daemon_threads = True
            threading.Thread(target=worker.server.serve_forever, daemon=True).start()
            workers.append(worker)
        yield workers
    finally:
        for worker in workers:
            worker.server.shutdown()
            worker.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet: the tests read the records
        pass

    def do_GET(self) -> None:
        reply = _DISCOVERY.get(self.path.split("?", 1)[0])
        if reply is None:
            self._send(404, {"error": f"no route {self.path}"})
        else:
            self._send(200, reply)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/generate":
            self._send(404, {"error": f"no route {self.path}"})
            return
        worker: RecordingWorker = self.server.worker  # type: ignore[attr-defined]
        rid = str(body.get("rid", ""))
        worker.record(rid)
        reply = {
            "output_ids": [worker.number],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(body.get("input_ids") or []),
                "completion_tokens": 1,
                "cached_tokens": 0,
            },
        }
        if not body.get("stream"):
            self._send(200, reply)
            return
        events = f"data: {json.dumps(reply)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(events)))
        self.end_headers()
        self.wfile.write(events)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
