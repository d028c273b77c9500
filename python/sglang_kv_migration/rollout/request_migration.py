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

Where each step lives: `AsyncRequestMigrator.move_request` runs the stages in order; the
copies while decoding and the delta in `live_stages.py` (from the request's own slots in
`live_rounds.py`), the stop in `stop.py`, the pricing, migration, fallbacks and resume in
`resume.py`; a move in progress is `move.MoveInProgress`; the handle is
`request_handle.py`, the requests and reports `request_types.py`; every call to the
servers goes through `server_calls.ServerCalls` (each piece's streamed `/generate` is
read by `generate_stream.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

import httpx

from sglang_kv_migration.client.auth import ApiKeys
from sglang_kv_migration.client.migration import AsyncMigrationClient, MigrationClient
from sglang_kv_migration.rollout.cost_model import CostModel
from sglang_kv_migration.rollout.generate_stream import (
    GenerateFailed,
    PieceProgress,
    read_generate_stream,
)
from sglang_kv_migration.rollout.live_stages import copy_while_decoding, place_delta
from sglang_kv_migration.rollout.move import MoveInProgress
from sglang_kv_migration.rollout.request_handle import RequestHandle
from sglang_kv_migration.rollout.request_types import (
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    FailureTarget,
    GenerateRequest,
    MoveMode,
    MoveOutcome,
    MoveReport,
    RequestOutput,
    Segment,
    SegmentKind,
    Stage,
    StageDecision,
    new_rid,
)
from sglang_kv_migration.rollout.resume import fall_back, keep_on_source, place
from sglang_kv_migration.rollout.server_calls import (
    DEFAULT_GENERATE_TIMEOUT_S,
    GatewayRouting,
    ServerCalls,
)
from sglang_kv_migration.rollout.stop import stop_piece
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply

# What a rollout manager imports from here: importable as from the modules that define them.
__all__ = [
    "DEFAULT_GENERATE_TIMEOUT_S",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "AsyncRequestMigrator",
    "FailureTarget",
    "GatewayRouting",
    "GenerateFailed",
    "GenerateRequest",
    "MoveMode",
    "MoveOutcome",
    "MoveReport",
    "PieceProgress",
    "RequestHandle",
    "RequestMigrator",
    "RequestOutput",
    "Segment",
    "SegmentKind",
    "Stage",
    "StageDecision",
    "SyncRequestHandle",
    "new_rid",
    "read_generate_stream",
]
T = TypeVar("T")


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
        self.servers = ServerCalls(
            migration_client,
            api_key=api_key,
            admin_api_key=admin_api_key,
            http_client=http_client,
            generate_timeout_s=generate_timeout_s,
            gateway=gateway,
        )
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

    @property
    def keys(self) -> ApiKeys:
        """The API and admin keys the migrator's calls carry."""
        return self.servers.keys

    @property
    def gateway(self) -> GatewayRouting | None:
        """The model gateway every `/generate` goes through (None: straight to workers)."""
        return self.servers.gateway

    # -- requests ------------------------------------------------------------------------

    async def submit(self, server_url: str, request: GenerateRequest) -> RequestHandle:
        """Send `request` to `server_url` and return its handle at once."""
        progress = PieceProgress()
        call = self.servers.generate(server_url, request, progress)
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
        move = MoveInProgress(handle, handle.server_url, target_url, live=live)
        if handle.done():
            return move.report("finished_before_move", "", 0)
        handle.begin_move()
        try:
            if mode != "recompute":
                await self.servers.check_admin_key(handle.server_url, target_url)
            if live and mode != "recompute":
                await copy_while_decoding(self, move, mode, path)
                if move.failure and on_failure == "source":
                    return keep_on_source(move)
            stopped = await stop_piece(self, move)
            if isinstance(stopped, MoveReport):
                return stopped
            if move.failure:  # a stage failed while decoding: fall back as below
                return fall_back(self, move, stopped, on_failure, move.failure)
            if move.stages:
                return await place_delta(self, move, stopped, on_failure, mode, path)
            return await place(self, move, stopped, on_failure, mode, path)
        except BaseException:
            handle.end_move()
            raise

    async def refresh_cost_model(
        self, source_url: str, target_url: str, *, path: str | None = None
    ) -> CostModel:
        """Re-learn the cost model from both servers' `/metrics` (missing ones keep priors)."""
        source, target = await asyncio.gather(
            self.servers.get_text(source_url, "/metrics"),
            self.servers.get_text(target_url, "/metrics"),
        )
        self.cost_model = CostModel.from_metrics(source, target, path=path, prior=self.cost_model)
        return self.cost_model

    async def get_json(self, url: str, path: str) -> Any:
        """See `ServerCalls.get_json`."""
        return await self.servers.get_json(url, path)

    async def held_kv(
        self,
        url: str,
        input_ids: list[int],
        extra_key: str | None = None,
        running_rid: str = "",
    ) -> ExtraTokenSizeReply:
        """See `ServerCalls.held_kv`."""
        return await self.servers.held_kv(url, input_ids, extra_key, running_rid)

    async def host_headroom(self, url: str) -> int | None:
        """See `ServerCalls.host_headroom`."""
        return await self.servers.host_headroom(url)

    async def aclose(self) -> None:
        await self.servers.aclose()

    async def __aenter__(self) -> AsyncRequestMigrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _track(self, handle: RequestHandle) -> RequestHandle:
        self.live()  # drop finished ones
        self._live.append(handle)
        return handle


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
