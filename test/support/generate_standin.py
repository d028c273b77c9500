"""TEST STAND-IN for SGLang's `/generate`, `/abort_request`, `/v1/loads`, `/get_load` and
`/metrics`, served by a CPU mini server (`ServerSpec(extension=standin_factory(...))`).

It is not SGLang. It imitates exactly the behaviour `request_migration` and `rebalancer`
rely on, nothing more:

- `/generate` (non-streaming, ``input_ids`` in, ``output_ids`` out): requests wait in a
  queue, highest ``priority`` first (SGLang's default order), FIFO within a priority;
  at most ``max_running`` run. Admission is the "prefill": ``meta_info.cached_tokens`` is
  the prefix the server's real HiRadixCache holds (device + host; how much of each in
  ``cached_tokens_details``, as SGLang says), and the prompt's
  page-aligned part is inserted into that cache. Each later step emits one token per
  running request. A request finishes with ``{"type": "length"}`` after
  ``max_new_tokens`` tokens or ``{"type": "stop"}`` on a ``stop_token_ids`` token; then
  prompt + output[:-1] goes into the cache (as SGLang's ``cache_finished_req``), backed
  up to the host pool so the migration source can send it. ``return_logprob`` adds
  ``meta_info.output_token_logprobs`` (a dummy logprob per output token).
- Tokens are a pure function of the sequence so far (`next_token`), so a request that is
  stopped, moved and resumed yields the same tokens as one uninterrupted run — what
  greedy decoding gives on a real server.
- ``stream: true``: server-sent events as SGLang sends them without
  ``--incremental-streaming-output``: one chunk per token with every output id so far and
  ``finish_reason: null``, then the final chunk (the non-streaming reply), then
  ``data: [DONE]``.
- `/abort_request {rid}` (an admin route, as in SGLang): like SGLang, every rid that
  *starts with* the given one; a queued request returns at once with no output ("Abort
  in waiting queue"), a running one after one more step, with its tokens so far; both
  with ``finish_reason.type == "abort"``.
- `/standin/hold {"at": n}` (a test's gate, not SGLang's): from now on a running request
  that has generated `n` tokens waits there, emitting nothing, until it is aborted (its
  abort step then runs as usual) or `{"at": null}` releases every request; so a test can
  move a request at the length it needs however slow the machine is. With
  `"aborts": k` the gate opens by itself once `k` requests were aborted (moved away):
  a request stays ahead of the ones a rebalancer moves until it has moved them. With
  `"open_after_s": t` it opens by itself after `t` seconds at the latest (a bound: a
  test whose awaited abort never comes fails instead of hanging).
- `/v1/loads` and `/get_load`: SGLang's field names; ``num_total_tokens`` counts the
  tokens of running requests plus the prompts waiting, against ``capacity_tokens``.
- `/metrics`: ``metrics_text`` as configured (for cost-model tests).

The engine state lives in rank 0's scheduler process: HTTP handlers (uvicorn thread) put
work into a queue, and `tick()`, called by the mini server's loop between iterations,
does all cache work on the scheduler thread, as SGLang would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from sglang.srt.utils.auth import AuthLevel, auth_level


@dataclasses.dataclass
class StandinConfig:
    max_running: int = 1
    step_s: float = 0.01  # one token per running request per step
    capacity_tokens: int = 4096
    metrics_text: str = ""
    seed: int = 7  # random KV of inserted tokens


def next_token(seq: list[int]) -> int:
    """The stand-in's 'greedy' model: a pure function of the last tokens and the length."""
    a, b = seq[-1], seq[-2] if len(seq) > 1 else 0
    return 20_000 + (a * 7919 + b * 104_729 + len(seq) * 31) % 10_000


def expected_output(prompt: list[int], n: int) -> list[int]:
    """The `n` tokens the stand-in generates greedily after `prompt`, one at a time."""
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


def hold(
    server_url: str,
    tokens: int | None,
    aborts: int | None = None,
    open_after_s: float = 300.0,
    headers: dict[str, str] | None = None,
) -> None:
    """Set the `/standin/hold` gate of the stand-in at `server_url`: from now on a running
    request that has generated `tokens` tokens waits there (until it is aborted, as a move
    does) instead of finishing, however slow the machine; None releases every request,
    and so do `aborts` aborts when given, and `open_after_s` seconds in any case. The
    engine reads the gate and the requests from one queue, in order, so every request
    sent after this call meets it. `headers`: the key of a server that asks for one."""
    import httpx

    body = {"at": tokens, "aborts": aborts, "open_after_s": open_after_s}
    reply = httpx.post(f"{server_url}/standin/hold", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text


@contextlib.contextmanager
def held_at(
    server_url: str,
    tokens: int,
    aborts: int | None = None,
    headers: dict[str, str] | None = None,
) -> Iterator[None]:
    """`hold(server_url, tokens, aborts)` for the block, released on exit."""
    hold(server_url, tokens, aborts, headers=headers)
    try:
        yield
    finally:
        hold(server_url, None, headers=headers)


def standin_factory(config: StandinConfig, engine: type | None = None) -> Any:
    """A picklable `ServerSpec.extension`: builds the engine (`GenerateStandin`, or the
    subclass `engine`) in the server process."""
    return _Factory(config, engine)


@dataclasses.dataclass
class _Factory:
    config: StandinConfig
    engine: type | None = None

    def __call__(self, harness: Any) -> GenerateStandin:
        return (self.engine or GenerateStandin)(self.config, harness)


@dataclasses.dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_ids: set[int]
    priority: int
    order: int
    reply: Any  # (loop, future)
    return_logprob: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    # SGLang's `meta_info.cached_tokens_details`: of `cached_tokens`, how many were on
    # the GPU and how many only in the host tier (loaded back) at admission.
    cached_details: dict[str, int] = dataclasses.field(default_factory=dict)
    abort: bool = False


class GenerateStandin:
    def __init__(self, config: StandinConfig, harness: Any):
        self.config = config
        self.harness = harness
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._order = 0
        self._last_step = 0.0
        self._lock = threading.Lock()
        self._load: dict[str, int] = {"running": 0, "waiting": 0, "used": 0, "total": 0}
        self.hold_at: int | None = None  # `/standin/hold`: running requests wait at this
        self.hold_aborts: int | None = None  # aborts left before the gate opens by itself
        self.hold_until = 0.0  # when it opens by itself at the latest (time.monotonic)

    # -- HTTP side (uvicorn thread) -------------------------------------------------------

    def add_routes(self, app: Any) -> None:
        @app.post("/generate", response_model=None)
        async def generate(request: Request) -> Any:
            body = await request.json()
            loop = asyncio.get_running_loop()
            if body.get("stream"):
                chunks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
                self.inbox.put(("generate", (body, (loop, chunks))))
                return StreamingResponse(_events(chunks), media_type="text/event-stream")
            future = loop.create_future()
            self.inbox.put(("generate", (body, (loop, future))))
            return await future

        # SGLang marks /abort_request ADMIN_OPTIONAL: with --admin-api-key set, only the
        # admin key opens it (the mini server serves SGLang's own API-key middleware).
        @app.post("/abort_request", response_model=None)
        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def abort_request(request: Request) -> Any:
            self.inbox.put(("abort", (await request.json()).get("rid", "")))
            return PlainTextResponse("")

        @app.post("/standin/hold", response_model=None)
        async def hold(request: Request) -> Any:
            body = await request.json()
            at, aborts = body.get("at"), body.get("aborts")
            until = time.monotonic() + float(body.get("open_after_s") or 300.0)
            gate = (None if at is None else int(at), None if aborts is None else int(aborts))
            self.inbox.put(("hold", (*gate, until)))
            return {"hold_at": at, "aborts": aborts}

        @app.get("/v1/loads", response_model=None)
        async def loads() -> Any:
            load = self._load_dict()
            return {"dp_rank_count": 1, "loads": [load]}

        @app.get("/get_load", response_model=None)
        async def get_load() -> Any:
            load = self._load_dict()
            return [
                {
                    "dp_rank": 0,
                    "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "num_tokens": load["num_total_tokens"],
                    "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                    "ts_tic": time.perf_counter(),
                }
            ]

        @app.get("/metrics", response_model=None)
        async def metrics() -> Any:
            return PlainTextResponse(self.config.metrics_text)

    def busy(self) -> bool:
        """What the HTTP layer reads as SGLang's generate requests in flight (the
        tokenizer manager's `rid_to_state`): requests running or waiting here."""
        with self._lock:
            return bool(self._load["running"] or self._load["waiting"])

    def _load_dict(self) -> dict[str, Any]:
        with self._lock:
            load = dict(self._load)
        capacity = self.config.capacity_tokens
        return {
            "dp_rank": 0,
            "num_running_reqs": load["running"],
            "num_waiting_reqs": load["waiting"],
            "num_used_tokens": load["used"],
            "num_total_tokens": load["total"],
            "max_total_num_tokens": capacity,
            "token_usage": round(load["used"] / capacity, 4),
            "max_running_requests": self.config.max_running,
        }

    # -- scheduler side (rank 0's loop) ---------------------------------------------------

    def tick(self) -> None:
        while True:
            try:
                kind, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "generate":
                self._enqueue(*payload)
            elif kind == "hold":
                self.hold_at, self.hold_aborts, self.hold_until = payload
            else:
                self._abort(payload)
        now = time.monotonic()
        if now - self._last_step >= self.config.step_s and (self.running or self.waiting):
            self._last_step = now
            self._step()
        self._publish_load()

    def _enqueue(self, body: dict[str, Any], reply: Any) -> None:
        params = body.get("sampling_params") or {}
        self._order += 1
        self.waiting.append(
            _Req(
                rid=body.get("rid") or f"standin-{self._order}",
                input_ids=list(body["input_ids"]),
                max_new_tokens=int(params.get("max_new_tokens", 128)),
                stop_ids=set(params.get("stop_token_ids") or []),
                priority=int(body.get("priority") or 0),
                order=self._order,
                reply=reply,
                return_logprob=bool(body.get("return_logprob")),
            )
        )

    def _abort(self, rid: str) -> None:
        aborted = 0
        for req in [r for r in self.waiting if r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._answer(req, {"type": "abort", "message": "Abort in waiting queue"})
            aborted += 1
        for req in self.running:
            if req.rid.startswith(rid) and not req.abort:  # (a repeated abort counts once)
                req.abort = True
                aborted += 1
        if self.hold_aborts is not None and aborted:
            self.hold_aborts -= aborted
            if self.hold_aborts <= 0:  # the gate opens by itself
                self.hold_at = self.hold_aborts = None

    def _step(self) -> None:
        # Running requests first (one token each), then admissions (prefill + first token).
        for req in list(self.running):
            if not self.held(req):
                self._emit(req)
        self.waiting.sort(key=lambda r: (-r.priority, r.order))
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting.pop(0)
            device, host = self.harness.match_lengths(req.input_ids)
            req.cached_tokens = device + host
            req.cached_details = {"device": device, "host": host}
            self._insert(req.input_ids)
            self.running.append(req)
            self._emit(req)

    def held(self, req: _Req) -> bool:
        """Whether `req` waits at the `/standin/hold` gate (an aborted one never does)."""
        if self.hold_at is not None and time.monotonic() > self.hold_until:
            self.hold_at = self.hold_aborts = None  # the bound: the gate opens by itself
        return self.hold_at is not None and len(req.output_ids) >= self.hold_at and not req.abort

    def _emit(self, req: _Req) -> None:
        token = next_token(req.input_ids + req.output_ids)
        req.output_ids.append(token)
        if req.abort:
            reason: dict[str, Any] | None = {"type": "abort", "message": "Aborted"}
        elif token in req.stop_ids:
            reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= req.max_new_tokens:
            reason = {"type": "length", "length": req.max_new_tokens}
        else:
            if isinstance(req.reply[1], asyncio.Queue):  # streamed: one chunk per token
                self._send(req, self._reply(req, None), final=False)
            return
        self.running.remove(req)
        self._insert(req.input_ids + req.output_ids[:-1])
        self._answer(req, reason)

    def _insert(self, token_ids: list[int]) -> None:
        if len(token_ids) < self.harness.cfg.page_size:
            return
        self.harness.insert_random(token_ids, seed=self.config.seed)
        self.harness.write_back_all()

    def _answer(self, req: _Req, finish_reason: dict[str, Any]) -> None:
        self._send(req, self._reply(req, finish_reason), final=True)

    def _reply(self, req: _Req, finish_reason: dict[str, Any] | None) -> dict[str, Any]:
        out = {
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "finish_reason": finish_reason,
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "cached_tokens_details": req.cached_details or None,
            },
        }
        if req.return_logprob:  # SGLang's shape: (logprob, token id, text) per token
            out["meta_info"]["output_token_logprobs"] = [[-1.0, t, None] for t in req.output_ids]
        return out

    def _send(self, req: _Req, out: dict[str, Any], final: bool) -> None:
        """Non-streaming: the reply. Streaming: a chunk with every output id so far (as
        SGLang without --incremental-streaming-output), then the end of the stream."""
        loop, sink = req.reply
        if isinstance(sink, asyncio.Queue):
            loop.call_soon_threadsafe(sink.put_nowait, out)
            if final:
                loop.call_soon_threadsafe(sink.put_nowait, None)
        else:
            loop.call_soon_threadsafe(_set_result, sink, out)

    def _publish_load(self) -> None:
        used = sum(len(r.input_ids) + len(r.output_ids) for r in self.running)
        pending = sum(len(r.input_ids) for r in self.waiting)
        with self._lock:
            self._load = {
                "running": len(self.running),
                "waiting": len(self.waiting),
                "used": used,
                "total": used + pending,
            }


async def _events(chunks: asyncio.Queue[dict[str, Any] | None]) -> Any:
    while (chunk := await chunks.get()) is not None:
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)
