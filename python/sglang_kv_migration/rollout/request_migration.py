"""Move a live request — queued or running on one SGLang server — to another, with its KV.

    migrator = AsyncRequestMigrator()                     # RequestMigrator: same, blocking
    handle = await migrator.submit(src, GenerateRequest(prompt_ids, {"max_new_tokens": 512},
                                                        priority=5))
    ...                                                   # later, e.g. from a rebalancer:
    await migrator.move_request(handle, dst)              # abort, migrate, resume
    out = await handle.result()                           # the whole output, however moved
    out.output_ids, out.finish_reason, out.segments       # as if it had run in one piece
    await migrator.move_request(handle, dst, live=True)   # copy while it decodes

Why the migrator issues the `/generate` call. SGLang hands the tokens a request generated
so far to one place only: the caller's own `/generate` call, which returns with
``finish_reason.type == "abort"`` and the partial ``output_ids`` once `/abort_request`
stops the request (a queued request returns with no output; a running one after one more
decode step). So whoever moves a request must hold that call. `submit` sends it (with a
fresh `rid`) and keeps it in a `RequestHandle`; a rollout manager that sends its own calls
passes the in-flight response to `adopt` instead. Either way the caller then waits on
`handle.result()`, which returns the whole output however often the request moved.

`move_request(handle, target)`:
1. marks the handle as moving and sends `/abort_request {rid}` to the source, again every
   `abort_retry_s` (an abort that arrives before the tokenizer registered the rid is
   dropped by SGLang) until the source's call returns, at most `abort_timeout_s`;
2. if the request finished on its own meanwhile, that is the result (nothing moves);
3. else migrates ``(prompt + generated)[:-1]`` with `AsyncMigrationClient.migrate` (SGLang
   recomputes the last token anyway) and resumes on the target with the same sampling
   parameters, the remaining ``max_new_tokens`` (and ``min_new_tokens``) and the same
   priority. With ``mode="auto"`` (the default) the `CostModel` first prices the tokens
   the source holds beyond the target, and a `recompute` verdict skips the migration;
4. with a `recompute` verdict (or ``mode="recompute"``) the target re-prefills; if the
   migration fails at any phase, the request resumes by re-prefill on the target
   (``on_failure="target"``) or on the source, whose cache still holds its KV
   (``on_failure="source"``); if the source never answers the abort (or its call
   failed), the request restarts on the target from
   the last known tokens. The caller never loses the request.

`move_request(handle, target, live=True)` — a live move, for a request that is decoding:
the request keeps decoding on the source while its KV is copied, and stops only for the
delta. What SGLang 0.5.12 holds of a decoding request: once its prompt is prefilled,
`cache_unfinished_req` inserts the prompt's whole pages into the radix tree (``fill_ids``
page-aligned down; with chunked prefill each chunk as it is done; a request re-prefilled
after a retraction, prompt + output so far), and nothing more until it finishes or is
aborted (`cache_finished_req` then inserts prompt + output[:-1], page-aligned). So:
1. stage 1, while decoding: a size query for ``(prompt + generated so far)[:-1]`` (the
   streamed call says what was generated) finds the prompt's pages, and they migrate
   (with ``mode="auto"`` only if the cost model says migrate; else the move is an
   ordinary one). Further stages follow while the source holds at least
   ``live_stage_tokens`` more than the target has (a source that exposes generated
   pages mid-decode, or holds an identical earlier rollout), at most ``live_max_stages``;
2. the stop (step 1 above); a request that finished meanwhile is the result;
3. the delta: the target lacks only the pages generated since the last stage, and a
   migration of ``(prompt + generated)[:-1]`` tops it up (only the missing pages move).
   With ``mode="auto"`` the cost model prices the delta from what stage 1 moved, without
   asking the servers, and a `recompute` verdict (a few pages against a migration's
   fixed cost) resumes at once: the target recomputes those tokens over the prefix it
   holds. Then the request resumes on the target, as in step 3.
Any failure falls back as above: a stage that fails while decoding leaves the request
running on the source (``on_failure="source"``: it never stopped) or stops it and
re-prefills on the target; a failed delta resumes by re-prefill on the target (which
keeps what stage 1 moved) or on the source. `MoveReport.stages` says what each copy did
(tokens held and moved, seconds, while decoding or not), and every report's
``seconds["stall"]`` (`stall_s`) is the time the request produced nothing: from the last
token the source streamed to the first token of the resumed piece, set when that token
arrives. With ``mode="recompute"`` nothing is copied and `live` changes nothing.

Resumed pieces get new rids (SGLang aborts every rid that *starts with* the one given, so
rids are never prefixes of each other). The migrator streams its own calls (to learn when
a request leaves the queue: `RequestHandle.started`) and hands the caller the reply a
non-streaming call returns; an adopted call must be non-streaming.
With ``--skip-tokenizer-init`` (what RL rollouts use) requests are ``input_ids`` and
replies ``output_ids``; a server with a tokenizer works too as long as requests carry
``input_ids``. `RequestMigrator` is the blocking facade: it runs the same coroutines on a
private event loop thread, so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import httpx

from sglang_kv_migration.client.migration import (
    SIZE_QUERY,
    SIZE_QUERY_ROUTE,
    ApiKeys,
    AsyncMigrationClient,
    AuthFailed,
    MigrationClient,
    MigrationFailed,
    MigrationResult,
    auth_hint,
    predict_path,
    size_query,
)
from sglang_kv_migration.rollout import live_rounds
from sglang_kv_migration.rollout.cost_model import (
    CostEstimate,
    CostModel,
    bytes_per_token_from_session_info,
)
from sglang_kv_migration.rollout.dp_routing import routed_body
from sglang_kv_migration.rollout.generate_stream import (
    JSON_HEADERS,
    GenerateFailed,
    PieceProgress,
    encoded_body,
    read_generate_stream,
    wall_clock,
)
from sglang_kv_migration.wire.convert import from_dict
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply

logger = logging.getLogger(__name__)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens in SGLang 0.5.12
# meta_info fields with one entry per output token: joined across pieces in the result.
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
DEFAULT_GENERATE_TIMEOUT_S = 3600.0

SegmentKind = Literal["original", "migrated", "reprefill", "resumed_on_source", "restarted"]
MoveOutcome = Literal["migrated", "recomputed", "fell_back", "finished_before_move", "restarted"]
FailureTarget = Literal["target", "source"]
# "auto": the cost model decides; "migrate": always migrate; "recompute": never (abort and
# re-prefill on the target: the baseline every RL framework uses today).
MoveMode = Literal["auto", "migrate", "recompute"]
T = TypeVar("T")


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass
class GenerateRequest:
    """One non-streaming `/generate` call, in the fields a move needs to know.

    `priority` is SGLang's request priority: servers order their queue by it with
    ``--enable-priority-scheduling`` (larger first unless
    ``--schedule-low-priority-values-first``); a server without it ignores the field, or
    refuses the request with ``--abort-on-priority-when-disabled``.
    """

    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    extra_key: str | None = None  # radix-cache namespace, passed to /generate and migrate
    extra_body: dict[str, Any] = field(default_factory=dict)  # other /generate fields, as is
    rid: str = field(default_factory=new_rid)

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self.extra_body,
            "input_ids": self.input_ids,
            "sampling_params": self.sampling_params,
            "rid": self.rid,
        }
        if self.priority is not None:
            body["priority"] = self.priority
        if self.extra_key is not None:
            body["extra_key"] = self.extra_key
        return body

    def finished_by(self, generated: list[int], eos_token_ids: frozenset[int]) -> dict | None:
        """The finish reason `generated` already reached, if any. SGLang reports an abort
        even when the aborted step hit the budget or a stop token, so a move checks."""
        if len(generated) >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        stops = set(self.sampling_params.get("stop_token_ids") or [])
        if not self.sampling_params.get("ignore_eos"):
            stops |= eos_token_ids
        if generated and generated[-1] in stops:
            return {"type": "stop", "matched": generated[-1]}
        return None

    def continuation(self, generated: list[int]) -> GenerateRequest:
        """The rest of this request after `generated`: same parameters, smaller budget."""
        params = dict(self.sampling_params)
        params["max_new_tokens"] = max(0, self.max_new_tokens - len(generated))
        if "min_new_tokens" in params:
            params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(generated))
        return dataclasses.replace(
            self, input_ids=self.input_ids + list(generated), sampling_params=params, rid=new_rid()
        )


@dataclass(frozen=True)
class Segment:
    """One piece of a request: where it ran and what it produced there."""

    server_url: str
    rid: str
    kind: SegmentKind
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    cached_tokens: int | None  # the server's meta_info.cached_tokens, if it said
    meta_info: dict[str, Any] = field(default_factory=dict)  # that piece's, as returned


StageDecision = Literal["migrate", "recompute", "failed"]


@dataclass(frozen=True)
class Stage:
    """One copy of a live move (``move_request(live=True)``). Stages while decoding copy
    what the source already holds as the request keeps running there; the one after the
    stop copies the delta (or, `decision="recompute"`, leaves it to the target)."""

    index: int  # 1, 2, ... in the order they ran
    while_decoding: bool  # True: the request kept running on the source meanwhile
    generated: int  # tokens the request had generated on the source when it began
    held_tokens: int  # page-aligned prefix the source held (0: not asked)
    migrated_tokens: int  # what moved (the target kept what it held already)
    seconds: float
    decision: StageDecision = "migrate"
    failure: str = ""
    path: str = ""  # the data path that moved the pages ("" when none moved)


@dataclass(frozen=True)
class MoveReport:
    """What one `move_request` did. `seconds`: abort (source stop), migrate, total, and
    for a live move `live` (the stages while decoding); `last_token_to_stop` (from the
    source's last streamed token to its call's return: the part of the stall the abort
    causes) when the call is the migrator's; `stall` is added once the resumed piece's
    first token arrives (see `stall_s`). `moments`: when each step happened, by
    `time.time()` (SGLang's `meta_info` clock): ``stop_sent``, ``last_source_token``,
    ``stop_returned``, ``last_copy_done`` (a live move's last copy while decoding), and
    once the resumed piece's first token arrives ``resume_sent`` and ``first_token``."""

    rid: str  # the request's original rid
    source_url: str
    target_url: str
    outcome: MoveOutcome
    resumed_on: str  # "" when the request had already finished
    generated_before_move: int
    estimate: CostEstimate | None = None
    migration: MigrationResult | None = None
    failure: str = ""  # why a migration did not happen as planned
    seconds: dict[str, float] = field(default_factory=dict)
    live: bool = False  # asked for a live move (`stages` says what each copy did)
    stages: list[Stage] = field(default_factory=list)
    moments: dict[str, float] = field(default_factory=dict)

    @property
    def stall_s(self) -> float | None:
        """Seconds the request produced nothing: from the last token the source streamed
        (the move's start when that piece streamed none, or its call is adopted) to the
        first token of the resumed piece; 0.0 when the request never stopped; None until
        that first token arrives."""
        return self.seconds.get("stall")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["migration"] = self.migration.to_dict() if self.migration else None
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d


@dataclass(frozen=True)
class RequestOutput:
    """The output one uninterrupted request would have given, plus where it ran."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    meta_info: dict[str, Any]  # the last piece's meta_info
    segments: list[Segment]
    moves: list[MoveReport]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "finish_reason": self.finish_reason,
            "meta_info": self.meta_info,
            "segments": [dataclasses.asdict(s) for s in self.segments],
            "moves": [m.to_dict() for m in self.moves],
        }


class GatewayRouting(Protocol):
    """A gateway in front of the workers (`integrations.gateway.ModelGateway`): `stream`
    POSTs through it to the worker `worker_url` names and yields that worker's reply (its
    `status_code`, `aread()` and `aiter_lines()`, as a streamed httpx response has)."""

    def stream(
        self, http: Any, worker_url: str, body: Any, headers: Any
    ) -> AbstractAsyncContextManager[Any]: ...


class RequestHandle:
    """A request the migrator can move. `result()` waits for the whole output.

    Call contract: create only through `submit`/`adopt`; use from the migrator's event
    loop (the sync facade wraps it in `SyncRequestHandle`).
    """

    def __init__(
        self,
        server_url: str,
        request: GenerateRequest,
        response: Awaitable[Any],
        progress: PieceProgress | None = None,
    ):
        self.request = request  # as first sent; `rid` below is the piece now running
        self.server_url = server_url
        self.submitted_at = time.monotonic()
        self.segments: list[Segment] = []
        self.moves: list[MoveReport] = []
        self._piece = request
        self._piece_kind: SegmentKind = "original"
        self._progress = progress  # None: the call is not the migrator's (adopted)
        self._moving = False
        self._call_consumed = False  # a move recorded this piece's reply itself
        self._done: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._call = self._watch(response)

    @property
    def rid(self) -> str:
        return self._piece.rid

    @property
    def priority(self) -> int | None:
        return self.request.priority

    @property
    def moving(self) -> bool:
        return self._moving

    @property
    def piece(self) -> GenerateRequest:
        """The piece now running (the first request, or the latest resumed rest)."""
        return self._piece

    @property
    def call(self) -> asyncio.Task[Any]:
        """The running piece's `/generate` call (a move awaits its abort reply)."""
        return self._call

    @property
    def started(self) -> bool | None:
        """Whether the piece now running has produced a token (it left the queue and was
        prefilled); None when unknown (an adopted call the migrator does not read)."""
        if self._progress is None:
            return None
        return self._progress.first_token_at is not None

    @property
    def last_token_at(self) -> float | None:
        """`time.monotonic()` of the running piece's last streamed token (None: none yet,
        or an adopted call the migrator does not read)."""
        return self._progress.last_token_at if self._progress is not None else None

    def generated_so_far(self) -> list[int]:
        """What the running piece streamed so far ([] for an adopted call)."""
        return list(self._progress.output_ids) if self._progress is not None else []

    def done(self) -> bool:
        return self._done.done()

    async def result(self) -> RequestOutput:
        return await asyncio.shield(self._done)

    def output(self) -> RequestOutput:
        """The whole output once `done()`; raises like `asyncio.Future.result()`."""
        return self._done.result()

    # -- what a move does to the handle (called by the migrator only) --------------------

    def begin_move(self) -> None:
        """The running piece's reply now belongs to the move, not to `result()`."""
        self._moving = True

    def end_move(self) -> None:
        """The move gave up before resuming: a reply finishes the handle again (one
        that came while the move held it, at once)."""
        self._moving = False
        if self._call.done() and not self._call_consumed:
            self._on_piece_done(self._call)

    def stopped(self, reply: dict[str, Any]) -> list[int]:
        """Record the aborted piece's reply as a segment; returns what it generated."""
        self._call_consumed = True
        return self._add_segment(reply)

    def finish_during_move(self, reply: dict[str, Any]) -> None:
        """The piece finished on its own before the abort reached it: that is the result."""
        self._moving = False
        self._finish(reply)

    def complete_during_move(self, last_meta: dict[str, Any]) -> None:
        """The aborted step completed the request (`last_meta` names the real finish)."""
        self._moving = False
        self._complete(last_meta)

    def resume_on(
        self,
        url: str,
        piece: GenerateRequest,
        kind: SegmentKind,
        response: Awaitable[Any],
        progress: PieceProgress,
    ) -> None:
        """The move is over: `piece` runs on `url` as `response`, read into `progress`."""
        self.server_url = url
        self._piece = piece
        self._piece_kind = kind
        self._progress = progress
        self._moving = False
        self._call_consumed = False
        self._call = self._watch(response)

    # -- internals -------------------------------------------------------------------------

    def _watch(self, response: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run (or adopt) one piece's call; finish the handle unless a move consumes it."""
        task = asyncio.ensure_future(response)
        task.add_done_callback(self._on_piece_done)
        return task

    def _on_piece_done(self, task: asyncio.Task[Any]) -> None:
        if self._moving or self._done.done() or task is not self._call:
            return  # `move_request` reads this piece's reply itself, or it was replaced
        if task.cancelled():
            self._done.set_exception(GenerateFailed(f"request {self.rid} was cancelled"))
        elif task.exception() is not None:
            self._done.set_exception(task.exception())
        else:
            self._finish(task.result())

    def _add_segment(self, reply: dict[str, Any]) -> list[int]:
        meta = reply.get("meta_info", {})
        output_ids = list(reply.get("output_ids", []))
        self.segments.append(
            Segment(
                server_url=self.server_url,
                rid=self._piece.rid,
                kind=self._piece_kind,
                output_ids=output_ids,
                finish_reason=meta.get("finish_reason"),
                cached_tokens=meta.get("cached_tokens"),
                meta_info=meta,
            )
        )
        return output_ids

    def _finish(self, reply: dict[str, Any]) -> None:
        self._add_segment(reply)
        self._complete(reply.get("meta_info", {}))

    def _complete(self, last_meta: dict[str, Any]) -> None:
        output_ids = [t for s in self.segments for t in s.output_ids]
        # The last piece's meta_info, with the counts and finish reason of the whole request.
        meta = dict(last_meta)
        meta["prompt_tokens"] = len(self.request.input_ids)
        meta["completion_tokens"] = len(output_ids)
        for key in _PER_TOKEN_META:  # e.g. logprobs: one entry per output token, per piece
            if len(self.segments) > 1 and all(key in s.meta_info for s in self.segments):
                meta[key] = [x for s in self.segments for x in s.meta_info[key]]
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "length":
            finish = meta["finish_reason"] = {**finish, "length": self.request.max_new_tokens}
        self._done.set_result(
            RequestOutput(
                rid=self.request.rid,
                prompt_ids=list(self.request.input_ids),
                output_ids=output_ids,
                finish_reason=finish,
                meta_info=meta,
                segments=list(self.segments),
                moves=list(self.moves),
            )
        )


class AsyncRequestMigrator:
    """Submits, adopts and moves requests (asyncio). One per rollout manager.

    `migration_client` may be an `AsyncMigrationClient` or a `MigrationClient` (run in a
    worker thread). `eos_token_ids`: the model's end-of-sequence ids, so that a request
    whose last step before the abort emitted one is finished rather than resumed.
    `cost_model=None` uses the default priors; `refresh_cost_model` learns from the
    servers' `/metrics`. `api_key` goes with `/generate` and the load routes,
    `admin_api_key` with `/abort_request` and the migration routes (`client.ApiKeys`);
    one alone is sent everywhere, as today. A key a server refuses raises `AuthFailed`
    naming the route, before the request is touched. `live_max_stages` and
    `live_stage_tokens` bound a live move's copies while decoding (module docstring).
    `gateway`: every `/generate` (first piece and resumed ones) goes through the model
    gateway, pinned to the worker a handle names; aborts, loads and migrations still go
    to the workers themselves.
    """

    def __init__(
        self,
        migration_client: AsyncMigrationClient | MigrationClient | None = None,
        *,
        cost_model: CostModel | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        generate_timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
        abort_retry_s: float = 1.0,
        abort_timeout_s: float = 30.0,
        eos_token_ids: Iterable[int] = (),
        live_max_stages: int = 3,
        live_stage_tokens: int = 1024,
        gateway: GatewayRouting | None = None,
        live_max_rounds: int = 6,
    ):
        self.keys = ApiKeys(api_key, admin_api_key)
        self.gateway = gateway
        self._migration = migration_client or AsyncMigrationClient(
            api_key=api_key, admin_api_key=admin_api_key
        )
        self._owns_migration = migration_client is None
        self._http = http_client or httpx.AsyncClient(timeout=generate_timeout_s)
        self._owns_http = http_client is None
        self.cost_model = cost_model or CostModel()
        self.abort_retry_s = abort_retry_s
        self.abort_timeout_s = abort_timeout_s
        # The model's EOS ids (the rollout manager's tokenizer knows them): a request whose
        # aborted step emitted one is complete, not resumed.
        self.eos_token_ids = frozenset(eos_token_ids)
        # Live moves: at most this many copies while the request decodes; one after the
        # first only while the source holds this many tokens more than the target.
        if live_max_stages < 1:
            raise ValueError(f"live_max_stages must be at least 1, got {live_max_stages}")
        self.live_max_stages = live_max_stages
        self.live_stage_tokens = live_stage_tokens
        # Feature "running_slots": at most this many rounds from the request's own slots.
        self.live_max_rounds = max(1, live_max_rounds)
        self._live: list[RequestHandle] = []

    # -- requests ------------------------------------------------------------------------

    async def submit(self, server_url: str, request: GenerateRequest) -> RequestHandle:
        """Send `request` to `server_url` and return its handle at once."""
        progress = PieceProgress()
        call = self._generate(server_url, request, progress)
        return self._track(RequestHandle(server_url, request, call, progress))

    async def adopt(
        self, server_url: str, request: GenerateRequest, response: Awaitable[dict[str, Any]]
    ) -> RequestHandle:
        """Take over a `/generate` call the caller already sent (with ``request.rid``);
        `response` resolves to that call's JSON reply."""
        return self._track(RequestHandle(server_url, request, response))

    def live(self) -> list[RequestHandle]:
        """Handles whose request has not finished, oldest first."""
        self._live = [h for h in self._live if not h.done()]
        return list(self._live)

    async def move_request(
        self,
        handle: RequestHandle,
        target_url: str,
        *,
        on_failure: FailureTarget = "target",
        mode: MoveMode = "auto",
        path: str | None = None,
        live: bool = False,
    ) -> MoveReport:
        """Stop the request on its server and resume it on `target_url`; returns once the
        resumed piece is sent. With `live`, first copy what the source holds while the
        request keeps decoding there (see the module docstring). Raises `ValueError` if it
        is already moving or on the target."""
        if handle.moving:
            raise ValueError(f"request {handle.request.rid} is already being moved")
        if target_url.rstrip("/") == handle.server_url.rstrip("/"):
            raise ValueError(f"request {handle.request.rid} already runs on {target_url}")
        move = _Move(handle, handle.server_url, target_url, live=live)
        if handle.done():
            return move.report("finished_before_move", "", 0)
        handle.begin_move()
        try:
            if mode != "recompute":
                await self._check_admin_key(handle.server_url, target_url)
            if live and mode != "recompute":
                await self._copy_while_decoding(move, mode, path)
                if move.failure and on_failure == "source":
                    return self._keep_on_source(move)
            stopped = await self._stop_piece(move)
            if isinstance(stopped, MoveReport):
                return stopped
            if move.failure:  # a stage failed while decoding: fall back as below
                return self._fall_back(move, stopped, on_failure, move.failure)
            if move.stages:
                return await self._place_delta(move, stopped, on_failure, mode, path)
            return await self._place(move, stopped, on_failure, mode, path)
        except BaseException:
            handle.end_move()
            raise

    async def _stop_piece(self, move: _Move) -> list[int] | MoveReport:
        """Stop the running piece (steps 1 and 2): what it generated, or the report when
        nothing is left to place (it finished, or restarts on the target)."""
        handle, target_url = move.handle, move.target_url
        t0 = time.perf_counter()
        move.stop_started = time.monotonic()
        reply = await self._stop(handle)
        move.seconds["abort"] = time.perf_counter() - t0
        move.stop_returned = time.monotonic()
        move.last_source_token = handle.last_token_at
        if move.last_source_token is not None:  # the part of the stall before the stop
            move.seconds["last_token_to_stop"] = time.monotonic() - move.last_source_token
        if reply is None:
            # The source never answered: start over on the target from what we know.
            piece = dataclasses.replace(handle.piece, rid=new_rid())
            failure = "the source did not return the request"
            report = move.report("restarted", target_url, 0, failure=failure)
            return self._resume(move, piece, target_url, "restarted", report)
        finish = reply.get("meta_info", {}).get("finish_reason") or {}
        if finish.get("type") != "abort":
            report = move.report("finished_before_move", "", len(reply.get("output_ids", [])))
            handle.finish_during_move(reply)
            return report
        generated = handle.stopped(reply)
        done = handle.piece.finished_by(generated, self.eos_token_ids)
        if done is not None:  # the aborted step completed it: nothing left to resume
            report = move.report("finished_before_move", "", len(generated))
            handle.complete_during_move({**reply.get("meta_info", {}), "finish_reason": done})
            return report
        return generated

    # -- live moves ----------------------------------------------------------------------

    async def _copy_while_decoding(self, move: _Move, mode: MoveMode, path: str | None) -> None:
        """The stages before the stop: copy what the source holds of the request (its
        prompt, once prefilled) while it keeps decoding; another stage only while the
        source holds `live_stage_tokens` more than the target, at most `live_max_stages`.
        A failure is recorded in `move.failure` (the request is still running). Servers
        that both list "running_slots" copy from the request's own slots instead, in
        rounds (`live_rounds.py`), and fall back to this when it does not run there."""
        handle = move.handle
        if await live_rounds.both_list_running_slots(self, move):
            page = await self._page_size(move.target_url)
            if await live_rounds.copy_in_rounds(self, move, mode, path, page) or move.failure:
                return
        t0 = time.perf_counter()
        for index in range(1, self.live_max_stages + 1):
            stage_t0 = time.perf_counter()
            generated = handle.generated_so_far()
            ids = (handle.piece.input_ids + generated)[:-1]
            try:
                held = await self.held_kv(move.source_url, ids, handle.piece.extra_key)
                fresh = held.matched_token_size - move.target_has
                if fresh <= 0 or (index > 1 and fresh < self.live_stage_tokens):
                    break
                if (
                    index == 1
                    and mode == "auto"
                    and not await self._worth_it(move, ids, held, path)
                ):
                    break
                result = await self._migrate(
                    move.source_url, move.target_url, ids, handle.piece.extra_key, path, held
                )
            except AuthFailed:
                raise
            except (MigrationFailed, httpx.HTTPError) as failure:
                move.failed_while_decoding(f"stage {index}", generated, stage_t0, failure)
                break
            move.copied_while_decoding(generated, stage_t0, result)
        move.seconds["live"] = time.perf_counter() - t0

    async def _worth_it(
        self, move: _Move, ids: list[int], held: ExtraTokenSizeReply, path: str | None
    ) -> bool:
        """mode="auto": the cost model prices stage 1 like a whole move; a `recompute`
        verdict makes the move an ordinary one (priced again after the stop)."""
        move.estimate = await self._estimate(
            move.source_url, move.target_url, ids, held, move.handle.piece.extra_key, path
        )
        return move.estimate.decision == "migrate"

    async def _place_delta(
        self,
        move: _Move,
        generated: list[int],
        on_failure: FailureTarget,
        mode: MoveMode,
        path: str | None,
    ) -> MoveReport:
        """After the stop: move what the target lacks of ``(prompt + generated)[:-1]`` (the
        pages produced since the last stage; the migration tops the target up), or with
        ``mode="auto"`` let the target recompute it when the cost model says so (no
        round trips), then resume on the target."""
        handle, target_url = move.handle, move.target_url
        rest = handle.piece.continuation(generated)
        ids = rest.input_ids[:-1]
        t0 = time.perf_counter()
        index = len(move.stages) + 1
        delta = await self._delta_tokens(move, len(ids))
        if delta <= 0 or (mode == "auto" and self._delta_decision(move, delta) == "recompute"):
            move.add_stage(False, generated, t0, decision="recompute")
            move.seconds["migrate"] = time.perf_counter() - t0
            report = move.report("migrated", target_url, len(generated))
            return self._resume(move, rest, target_url, "migrated", report)
        try:
            held = await self.held_kv(move.source_url, ids, rest.extra_key)
            result = await self._migrate(
                move.source_url, target_url, ids, rest.extra_key, path, held
            )
        except (MigrationFailed, httpx.HTTPError) as failure:
            move.add_stage(False, generated, t0, decision="failed", failure=str(failure))
            move.seconds["migrate"] = time.perf_counter() - t0
            return self._fall_back(move, generated, on_failure, f"stage {index}: {failure}")
        move.seconds["migrate"] = time.perf_counter() - t0
        move.migration = result
        move.add_stage(False, generated, t0, result)
        report = move.report("migrated", target_url, len(generated))
        return self._resume(move, rest, target_url, "migrated", report)

    async def _delta_tokens(self, move: _Move, length: int) -> int:
        """Page-aligned tokens of a `length`-token prefix the target lacks after the
        stages (page size from the target's session info, which is cached)."""
        page = await self._page_size(move.target_url)
        return length // page * page - move.target_has

    async def _page_size(self, url: str) -> int:
        """The server's page size, from its (cached) session info; 1 when unknown."""
        try:
            info = await self._session_info(url)
            return max(1, info.ranks[0].page_size)
        except (MigrationFailed, httpx.HTTPError, IndexError, TypeError, ValueError):
            return 1

    def _delta_decision(self, move: _Move, delta: int) -> str:
        """The cost model's verdict on the delta, priced from what stage 1 moved (bytes
        per token, path) without asking the servers anything."""
        result = move.migration
        per_token = None
        if result is not None and result.migrated_token_size:
            per_token = result.migrated_bytes / result.migrated_token_size
        path = result.path if result is not None else None
        try:
            nbytes = round(delta * per_token) if per_token else None
            return self.cost_model.estimate(delta, nbytes, path=path or None).decision
        except ValueError:  # bytes unknown: migrate, as the caller asked for a live move
            return "migrate"

    def _keep_on_source(self, move: _Move) -> MoveReport:
        """A stage failed while decoding and ``on_failure="source"``: the request never
        stopped, so it simply keeps running there."""
        move.handle.end_move()
        generated = len(move.handle.generated_so_far())
        report = move.report("fell_back", move.source_url, generated, failure=move.failure)
        report.seconds["stall"] = 0.0
        return report

    def _fall_back(
        self, move: _Move, generated: list[int], on_failure: FailureTarget, failure: str
    ) -> MoveReport:
        """Resume by re-prefill on the target (which keeps what earlier stages moved) or
        on the source, whose cache still holds the request's KV."""
        handle = move.handle
        rest = handle.piece.continuation(generated)
        fallback = move.target_url if on_failure == "target" else move.source_url
        kind: SegmentKind = "reprefill" if on_failure == "target" else "resumed_on_source"
        logger.warning("moving %s: %s; resuming on %s", handle.request.rid, failure, fallback)
        move.seconds.setdefault("migrate", 0.0)
        report = move.report("fell_back", fallback, len(generated), failure=failure)
        return self._resume(move, rest, fallback, kind, report)

    async def refresh_cost_model(
        self, source_url: str, target_url: str, *, path: str | None = None
    ) -> CostModel:
        """Re-learn the cost model from both servers' `/metrics` (missing ones keep priors)."""
        source, target = await asyncio.gather(
            self._get_text(source_url, "/metrics"), self._get_text(target_url, "/metrics")
        )
        self.cost_model = CostModel.from_metrics(source, target, path=path, prior=self.cost_model)
        return self.cost_model

    async def get_json(self, url: str, path: str) -> Any:
        """GET a JSON endpoint (e.g. `/v1/loads`); raises `AuthFailed` when the server
        refuses the key, `httpx.HTTPError` on other failures."""
        r = await self._http.get(
            url.rstrip("/") + path, headers=self.keys.headers(path), timeout=10.0
        )
        self._raise_if_refused(url, path, r)
        r.raise_for_status()
        return r.json()

    async def held_kv(
        self,
        url: str,
        input_ids: list[int],
        extra_key: str | None = None,
        running_rid: str = "",
    ) -> ExtraTokenSizeReply:
        """What `url` holds of `input_ids` (its `/get_request_extra_token_size` reply:
        ``matched_token_size``, device and host tier, and ``device_token_size``; with
        `running_rid`, feature "running_slots", also ``running_token_size``)."""
        try:
            info = await self._session_info(url)  # cached: no trip after the first
        except MigrationFailed:  # the query below reports what is wrong with the server
            info = None
        body = size_query(info, input_ids, extra_key, running_rid=running_rid)
        return await self._size_query(url, body)

    async def host_headroom(self, url: str) -> int | None:
        """Host slots a host-path allocate on `url` could claim now (free plus evictable
        host-only pages), None when it does not say. One size query with ``headroom``:
        what it holds of the one-token prompt asked is irrelevant."""
        reply = await self._size_query(url, size_query(None, [0], headroom=True))
        value = reply.host_headroom_tokens
        return value if isinstance(value, int) and value >= 0 else None

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()
        if self._owns_migration:
            await _maybe_await(_close(self._migration))

    async def __aenter__(self) -> AsyncRequestMigrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the steps of a move -------------------------------------------------------------

    async def _check_admin_key(self, source_url: str, target_url: str) -> None:
        """Read both servers' session info (cached by the client: free after the first
        move) so that a refused admin key raises here, before the abort, instead of
        turning every move into a silent re-prefill. Other failures are left to the
        migration, whose fallbacks handle them."""
        for url in (source_url, target_url):
            try:
                await self._session_info(url)
            except AuthFailed:
                raise
            except (MigrationFailed, httpx.HTTPError) as e:
                logger.debug("session info of %s: %s", url, e)

    def _raise_if_refused(self, url: str, path: str, response: httpx.Response) -> None:
        """A 401/403 is a wrong or missing key: raise at once, naming route and key."""
        if response.status_code not in (401, 403):
            return
        route = path.split("?", 1)[0]
        raise AuthFailed(
            route.strip("/"),
            route,
            f"{url.rstrip('/')}{route} refused {self.keys.sent(path)} (HTTP "
            f"{response.status_code}: {response.text[:200]}); {auth_hint(path)}",
            response.status_code,
        )

    async def _stop(self, handle: RequestHandle) -> dict[str, Any] | None:
        """Abort the running piece and return its reply; None if the source never answers.
        A refused key raises `AuthFailed` at the first reply (the request keeps running
        on the source): retrying cannot help."""
        call = handle.call
        deadline = time.monotonic() + self.abort_timeout_s
        while not call.done() and time.monotonic() < deadline:
            try:
                r = await self._http.post(
                    handle.server_url.rstrip("/") + "/abort_request",
                    json={"rid": handle.rid},
                    headers=self.keys.headers("/abort_request"),
                    timeout=10.0,
                )
                self._raise_if_refused(handle.server_url, "/abort_request", r)
            except httpx.HTTPError as e:
                logger.warning("abort of %s on %s failed: %s", handle.rid, handle.server_url, e)
            wait = min(self.abort_retry_s, max(0.0, deadline - time.monotonic()))
            await asyncio.wait([call], timeout=wait)
        if not call.done():
            call.cancel()  # closes the connection; SGLang aborts a disconnected request
            return None
        if call.cancelled() or call.exception() is not None:
            return None
        return call.result()

    async def _place(
        self,
        move: _Move,
        generated: list[int],
        on_failure: FailureTarget,
        mode: MoveMode,
        path: str | None,
    ) -> MoveReport:
        """Price, migrate and resume the rest of the request (steps 3 and 4)."""
        handle, source_url, target_url = move.handle, move.source_url, move.target_url
        rest = handle.piece.continuation(generated)
        ids = rest.input_ids[:-1]  # SGLang computes the last token in any case
        t0 = time.perf_counter()
        if mode == "recompute":
            move.seconds["migrate"] = 0.0
            report = move.report("recomputed", target_url, len(generated))
            return self._resume(move, rest, target_url, "reprefill", report)
        try:
            # One size query per move: it prices the move and the migration reuses it.
            held = await self.held_kv(source_url, ids, rest.extra_key)
            estimate = await self._estimate(source_url, target_url, ids, held, rest.extra_key, path)
            if mode == "auto" and estimate.decision == "recompute":
                move.seconds["migrate"] = time.perf_counter() - t0
                report = move.report("recomputed", target_url, len(generated), estimate=estimate)
                return self._resume(move, rest, target_url, "reprefill", report)
            result = await self._migrate(source_url, target_url, ids, rest.extra_key, path, held)
        except (MigrationFailed, httpx.HTTPError) as failure:
            move.seconds["migrate"] = time.perf_counter() - t0
            return self._fall_back(move, generated, on_failure, str(failure))
        move.seconds["migrate"] = time.perf_counter() - t0
        report = move.report(
            "migrated", target_url, len(generated), estimate=estimate, migration=result
        )
        return self._resume(move, rest, target_url, "migrated", report)

    async def _estimate(
        self,
        source_url: str,
        target_url: str,
        ids: list[int],
        held: ExtraTokenSizeReply,
        extra_key: str | None,
        path: str | None = None,
    ) -> CostEstimate:
        """The cost model's verdict on the tokens the source holds beyond the target
        (`held`: the source's size query), priced on the path the migration will take
        (`client.predict_path`); session info comes from the client's cache."""
        source_held = held.matched_token_size
        target_held = 0
        if source_held:
            on_target = await self.held_kv(target_url, ids[:source_held], extra_key)
            target_held = on_target.matched_token_size
        tokens = max(0, source_held - target_held)
        if not tokens:
            return self.cost_model.estimate(0)
        source_info = await self._session_info(source_url)
        target_info = await self._session_info(target_url)
        chosen = predict_path(source_info, target_info, held, path) or None
        nbytes = None
        if self.cost_model.costs_for(chosen).bytes_per_token is None:
            nbytes = tokens * bytes_per_token_from_session_info(source_info)
        return self.cost_model.estimate(tokens, nbytes, path=chosen, held=held)

    def _resume(
        self,
        move: _Move,
        rest: GenerateRequest,
        url: str,
        kind: SegmentKind,
        report: MoveReport,
    ) -> MoveReport:
        """Send `rest` to `url` as the handle's next piece; its first token sets the
        report's stall (from the source's last streamed token, else the stop's start).
        A migrated piece goes to the target's DP rank that holds its KV (`dp_routing.py`)."""
        if kind == "migrated" or url != move.source_url:
            migration = move.migration if kind == "migrated" else None
            dp_rank = migration.target_dp_rank if migration is not None else None
            rest = dataclasses.replace(rest, extra_body=routed_body(rest.extra_body, dp_rank))
        since = move.last_source_token or move.stop_started or time.monotonic()

        def first_token(at: float) -> None:
            report.seconds["stall"] = max(0.0, at - since)
            report.moments["first_token"] = wall_clock(at)
            if progress.sent_at is not None:
                report.moments["resume_sent"] = wall_clock(progress.sent_at)

        progress = PieceProgress(on_first_token=first_token)
        move.handle.resume_on(url, rest, kind, self._generate(url, rest, progress), progress)
        return report

    async def _generate(
        self, url: str, request: GenerateRequest, progress: PieceProgress
    ) -> dict[str, Any]:
        """One piece's `/generate`, streamed so that `progress` learns when its first token
        arrives (SGLang publishes no per-request queue state); returns what the same call
        without streaming would have returned."""
        body = encoded_body({**request.body(), "stream": True})
        where = url.rstrip("/") + "/generate"
        try:
            headers = {**JSON_HEADERS, **self.keys.headers("/generate")}
            progress.sent_at = time.monotonic()
            if self.gateway is None:
                opened = self._http.stream("POST", where, content=body, headers=headers)
            else:  # through the gateway, pinned to `url` (resolved and checked there)
                opened = self.gateway.stream(self._http, url, body, headers)
                where += " via the gateway"
            async with opened as r:
                if r.status_code >= 300:
                    text = (await r.aread()).decode(errors="replace")
                    hint = ""
                    if r.status_code in (401, 403):
                        hint = f" (sent {self.keys.sent('/generate')}; {auth_hint('/generate')})"
                    raise GenerateFailed(f"{where}: HTTP {r.status_code}: {text[:500]}{hint}")
                return await read_generate_stream(r.aiter_lines(), progress, where)
        except httpx.HTTPError as e:
            raise GenerateFailed(f"{where}: {type(e).__name__}: {e}") from e

    async def _migrate(
        self,
        source: str,
        target: str,
        ids: list[int],
        extra_key: str | None,
        path: str | None,
        held: ExtraTokenSizeReply,
        running_rid: str = "",
    ) -> MigrationResult:
        # `path` only when asked for, so clients without the keyword keep working.
        kwargs: dict[str, Any] = {"path": path} if path is not None else {}
        kwargs["held"] = held
        if running_rid:  # feature "running_slots"
            kwargs["running_rid"] = running_rid
        client = self._migration
        if isinstance(client, AsyncMigrationClient):
            return await client.migrate(source, target, ids, extra_key, **kwargs)
        return await asyncio.to_thread(client.migrate, source, target, ids, extra_key, **kwargs)

    async def _session_info(self, url: str) -> SessionInfoReply:
        client = self._migration
        if isinstance(client, AsyncMigrationClient):
            return await client.session_info(url)
        return await asyncio.to_thread(client.session_info, url)

    async def _size_query(self, url: str, body: Any) -> ExtraTokenSizeReply:
        """`/get_request_extra_token_size` of `url` with `body` (`size_query`)."""
        client = self._migration
        route = SIZE_QUERY_ROUTE
        if isinstance(client, AsyncMigrationClient):
            reply = await client.call(url, route, body)
        else:
            reply = await asyncio.to_thread(client.call, url, route, body)
        try:
            return from_dict(ExtraTokenSizeReply, reply)
        except ValueError as e:
            raise MigrationFailed(SIZE_QUERY, f"{url}{route}: malformed reply: {e}") from None

    async def _get_text(self, url: str, path: str) -> str | None:
        try:
            headers = self.keys.headers(path)
            r = await self._http.get(url.rstrip("/") + path, headers=headers, timeout=10.0)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code < 300 else None

    def _track(self, handle: RequestHandle) -> RequestHandle:
        self.live()  # drop finished ones
        self._live.append(handle)
        return handle


@dataclass
class _Move:
    """One `move_request` in progress: where from, where to, and its clock."""

    handle: RequestHandle
    source_url: str
    target_url: str
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    live: bool = False
    # Live moves: the stages so far, what the target holds after them, the last result
    # and stage 1's estimate; `failure` names a stage that failed while decoding.
    stages: list[Stage] = field(default_factory=list)
    target_has: int = 0
    migration: MigrationResult | None = None
    estimate: CostEstimate | None = None
    failure: str = ""
    # time.monotonic() of the source's last streamed token, of the stop's start and
    # return, and of the end of the last copy while decoding.
    last_source_token: float | None = None
    stop_started: float | None = None
    stop_returned: float | None = None
    last_copy_done: float | None = None

    def add_stage(
        self,
        while_decoding: bool,
        generated: list[int],
        started: float,
        result: MigrationResult | None = None,
        decision: StageDecision = "migrate",
        failure: str = "",
    ) -> None:
        """Record the next stage (`started`: its `time.perf_counter()` start)."""
        self.stages.append(
            Stage(
                index=len(self.stages) + 1,
                while_decoding=while_decoding,
                generated=len(generated),
                held_tokens=result.source_held_token_size if result else 0,
                migrated_tokens=result.migrated_token_size if result else 0,
                seconds=time.perf_counter() - started,
                decision=decision,
                failure=failure,
                path=result.path if result else "",
            )
        )

    def copied_while_decoding(
        self, generated: list[int], started: float, result: MigrationResult
    ) -> None:
        """A stage or round before the stop moved `result`: the target holds its prefix."""
        self.target_has = result.matched_after_commit
        self.migration = result
        self.add_stage(True, generated, started, result)
        self.last_copy_done = time.monotonic()

    def failed_while_decoding(
        self, which: str, generated: list[int], started: float, failure: Exception
    ) -> None:
        """A stage or round before the stop failed (the request is still running)."""
        self.failure = f"{which} (while decoding): {failure}"
        self.add_stage(True, generated, started, decision="failed", failure=str(failure))

    def report(
        self, outcome: MoveOutcome, resumed_on: str, generated: int, **kw: Any
    ) -> MoveReport:
        self.seconds["total"] = time.perf_counter() - self.started
        if self.live:
            kw.setdefault("estimate", self.estimate)
            kw.setdefault("migration", self.migration)
            kw.update(live=True, stages=list(self.stages))
        report = MoveReport(
            rid=self.handle.request.rid,
            source_url=self.source_url,
            target_url=self.target_url,
            outcome=outcome,
            resumed_on=resumed_on,
            generated_before_move=generated,
            seconds=dict(self.seconds),
            moments=self.moments(),
            **kw,
        )
        self.handle.moves.append(report)
        return report

    def moments(self) -> dict[str, float]:
        """The move's moments so far, by `time.time()` (see `MoveReport`)."""
        stamps = {
            "stop_sent": self.stop_started,
            "last_source_token": self.last_source_token,
            "stop_returned": self.stop_returned,
            "last_copy_done": self.last_copy_done,
        }
        return {name: wall_clock(at) for name, at in stamps.items() if at is not None}


# --------------------------------------------------------------------------- sync facade


class SyncRequestHandle:
    """Blocking view of a `RequestHandle` owned by a `RequestMigrator`."""

    def __init__(self, migrator: RequestMigrator, handle: RequestHandle):
        self.migrator = migrator
        self.handle = handle

    @property
    def rid(self) -> str:
        return self.handle.rid

    @property
    def server_url(self) -> str:
        return self.handle.server_url

    def done(self) -> bool:
        return self.handle.done()

    def result(self, timeout: float | None = None) -> RequestOutput:
        return self.migrator.wait(self, timeout)


class RequestMigrator:
    """Blocking facade of `AsyncRequestMigrator`: same arguments, same behaviour; its
    coroutines run on a private event-loop thread. `close()` (or `with`) stops it."""

    def __init__(self, migration_client: MigrationClient | None = None, **options: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="request-migrator", daemon=True
        )
        self._thread.start()

        async def build() -> AsyncRequestMigrator:
            return AsyncRequestMigrator(migration_client, **options)

        self.inner = self._run(build())

    def submit(self, server_url: str, request: GenerateRequest) -> SyncRequestHandle:
        return SyncRequestHandle(self, self._run(self.inner.submit(server_url, request)))

    def adopt(
        self,
        server_url: str,
        request: GenerateRequest,
        response: concurrent.futures.Future[dict[str, Any]],
    ) -> SyncRequestHandle:
        async def adopt() -> RequestHandle:
            return await self.inner.adopt(server_url, request, asyncio.wrap_future(response))

        return SyncRequestHandle(self, self._run(adopt()))

    def move_request(
        self, handle: SyncRequestHandle, target_url: str, **options: Any
    ) -> MoveReport:
        return self._run(self.inner.move_request(handle.handle, target_url, **options))

    def wait(self, handle: SyncRequestHandle, timeout: float | None = None) -> RequestOutput:
        """`handle`'s whole output (blocking; `TimeoutError` after `timeout` seconds)."""
        return self._run(handle.handle.result(), timeout)

    def refresh_cost_model(self, source_url: str, target_url: str, **options: Any) -> CostModel:
        return self._run(self.inner.refresh_cost_model(source_url, target_url, **options))

    @property
    def cost_model(self) -> CostModel:
        return self.inner.cost_model

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.inner.aclose(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> RequestMigrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _close(client: AsyncMigrationClient | MigrationClient) -> Any:
    if isinstance(client, AsyncMigrationClient):
        return client.aclose()
    client.close()
    return None


async def _maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value):
        await value
