"""Requests to one worker *through* the SGLang model gateway (`smg`, formerly
`sglang-router`), so that a moved request's continuation reaches the server that now holds
its KV instead of the one the gateway's policy would pick.

    gateway = ModelGateway("http://gateway:30000")          # --policy consistent_hashing
    migrator = AsyncRequestMigrator(api_key=K, admin_api_key=A, gateway=gateway)
    handle = await migrator.submit(worker_url, request)     # sent through the gateway
    await migrator.move_request(handle, other_worker)       # resumed through it, pinned
    pins = SessionPins(gateway); pins.pin(session_id, handle.server_url)   # next turns

What smg 1.13.0 honours (checked against its binary, two and three workers):
- ``consistent_hashing``: ``X-SMG-Target-Worker: i`` sends the request to the i-th worker
  of the gateway's *own* list — the order of ``GET /workers``, which is the order the
  workers registered in, not the order of ``--worker-urls``, and differs between starts —
  so the index is read from ``/workers``, never assumed. An index out of range or of an
  unhealthy worker answers 503 (never re-routed). ``X-SMG-Routing-Key`` hashes the key
  onto the workers; the target header wins over it.
- ``manual``, ``cache_aware`` and the other policies ignore ``X-SMG-Target-Worker``.
  ``manual`` keeps key → worker until that worker fails or the key idles past
  ``--max-idle-secs``; ``cache_aware`` routes by its own prefix tree, which still points
  at the source after a move. What reaches one chosen worker under any policy is the RL
  control plane's passthrough (gateway started with ``--enable-rl``):
  ``POST /v1/rl/workers/{id}/engine/generate``. Its reply comes back whole, inside an
  envelope ``{worker_id, url, status, latency_ms, body}``, once the request finishes (a
  streamed call's events arrive together at the end), within ``--rl-control-timeout-secs``,
  and the policy never sees it: the manual key map and the cache-aware tree keep pointing
  at the source, so every later turn of that session must be pinned as well.
- every proxied reply names its worker in ``x-smg-routed-worker-id`` (the URL); a pinned
  send is checked against it (and the passthrough envelope's ``url``).
- nothing on the data path names a worker by URL or id: the target header takes only an
  index (a URL or an id there answers 503), custom request headers are not forwarded, and
  the worker ids of ``/workers`` are new on every start (a stale one answers 404 on the
  passthrough). Restarted, the gateway lists its workers in a new order, so an index is
  only good against the list it was read from.

So a pin is a worker URL, resolved to the gateway's index (or id) against its list read
right before each request (`ModelGateway.stream`), never a cached one. What can still go
wrong is a list change in the one local round trip between that read and the request:
the reply's first header names the worker that took it, so such a request is cancelled
there (its stream closed before its first token), counted in `ModelGateway.misroutes`,
and sent again against the list read anew. A gateway that is down or restarting, a
worker not (yet) listed, an index the gateway no longer has and a stale passthrough id
are retried the same way, within `retry_s`; none of them ever reaches another worker.

Nothing here imports SGLang, `server/` or `paths/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson

from sglang_kv_migration.rollout.request_migration import GenerateFailed

logger = logging.getLogger(__name__)

TARGET_WORKER_HEADER = "X-SMG-Target-Worker"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"

# target_worker: X-SMG-Target-Worker on the gateway's /generate (consistent_hashing);
# rl_passthrough: the RL control plane's per-worker passthrough (any policy, --enable-rl).
PinMode = Literal["target_worker", "rl_passthrough"]
POLICIES_WITH_TARGET_HEADER = frozenset({"consistent_hashing"})
# smg's answers to a target index it does not have (or whose worker is unhealthy: 503
# with this code in `x-smg-error-code`) and to a passthrough id it does not know (404
# with this error in the body): the list changed since it was read.
ERROR_CODE_HEADER = "x-smg-error-code"
NO_WORKER_CODE = "no_available_workers"
UNKNOWN_WORKER_CODE = "worker_not_found"
# Waits between the tries of one pinned request (seconds), doubling up to the last.
RETRY_WAITS_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class GatewayError(GenerateFailed):
    """The gateway could not pin a request: an unknown worker, a refused passthrough, or
    a reply from another worker than the one asked for."""


class WorkerNotListed(GatewayError):
    """The worker is not in the gateway's list (not registered yet, or removed)."""


def default_pin(policy: str) -> PinMode:
    """The pin a gateway running `policy` honours on its data path; raises `ValueError`
    (saying what does work) for a policy that honours none."""
    if policy in POLICIES_WITH_TARGET_HEADER:
        return "target_worker"
    raise ValueError(
        f"the gateway's {policy!r} policy ignores {TARGET_WORKER_HEADER}: start it with "
        "--policy consistent_hashing, or with --enable-rl and pass pin='rl_passthrough' "
        "(replies come back whole when the request finishes, and the policy does not learn "
        "where the session went)"
    )


@dataclass(frozen=True)
class GatewayWorker:
    id: str
    url: str


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass(frozen=True)
class GatewayRoute:
    """Where to POST to reach `worker_url` through the gateway, with which headers;
    `envelope`: the reply is the RL passthrough's envelope around the worker's reply."""

    worker_url: str
    url: str
    headers: dict[str, str]
    envelope: bool = False

    def check(self, response_headers: Mapping[str, str]) -> None:
        """Raise `GatewayError` when the gateway says another worker answered."""
        routed = self.misrouted_to(response_headers)
        if routed is not None:
            self._misrouted(routed)

    async def lines(self, response: httpx.Response) -> AsyncIterator[str]:
        """The worker's reply as lines (server-sent events, or one ``data:`` line for a
        non-streamed reply), unwrapping the passthrough's envelope."""
        if not self.envelope:
            async for line in response.aiter_lines():
                yield line
            return
        try:
            envelope = orjson.loads(await response.aread())
            status, body, routed = envelope["status"], envelope["body"], envelope["url"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise GatewayError(f"{self.url}: not a passthrough envelope ({e})") from e
        if not same_url(str(routed), self.worker_url):
            self._misrouted(str(routed))
        if not isinstance(status, int) or status >= 300:
            raise GatewayError(f"{self.url}: the worker answered HTTP {status}: {body!r:.500}")
        if isinstance(body, dict):
            yield "data: " + orjson.dumps(body).decode()
            return
        for line in str(body).splitlines():
            yield line

    def misrouted_to(self, response_headers: Mapping[str, str]) -> str | None:
        """The worker the gateway says answered, when it is not this route's."""
        routed = response_headers.get(ROUTED_WORKER_HEADER)
        return routed if routed and not same_url(routed, self.worker_url) else None

    def _misrouted(self, routed: str) -> None:
        raise GatewayError(f"{self.url}: pinned to {self.worker_url}, answered by {routed}")


class ModelGateway:
    """The model gateway in front of the workers: resolves a worker URL to the pin the
    running policy honours (module docstring), against the gateway's worker list read
    right before each request. `pin` defaults to what `policy` allows; `api_key` goes
    with the gateway's own routes (``/workers``, the passthrough) when the gateway gates
    them. `retry_s` bounds how long one pinned request waits for a gateway that is down
    or restarting, or for its worker to be listed (it is never sent elsewhere)."""

    def __init__(
        self,
        url: str,
        *,
        policy: str = "consistent_hashing",
        pin: PinMode | None = None,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout_s: float = 10.0,
        retry_s: float = 30.0,
    ):
        self.url = url.rstrip("/")
        self.policy = policy
        self.pin: PinMode = pin or default_pin(policy)
        self.retry_s = retry_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_http = http_client is None
        # Pinned requests another worker took (the list changed between its read and the
        # request): each was cancelled at its first byte and sent again.
        self.misroutes = 0

    async def workers(self) -> list[GatewayWorker]:
        """The gateway's workers now, in its own order (the order the target header
        indexes; it changes when the gateway restarts or its list changes)."""
        r = await self._http.get(self.url + "/workers", headers=self._auth)
        if r.status_code >= 300:
            raise GatewayError(f"{self.url}/workers: HTTP {r.status_code}: {r.text[:300]}")
        listed = r.json().get("workers") or []
        return [GatewayWorker(str(w["id"]), str(w["url"])) for w in listed]

    async def worker_urls(self) -> list[str]:
        return [w.url for w in await self.workers()]

    async def route(self, worker_url: str, path: str = "/generate") -> GatewayRoute:
        """How to send `path` to `worker_url` through the gateway, resolved against its
        list as it is now: good for one request sent at once (`stream` sends it, checks
        the reply and resolves again when the list changed)."""
        workers = await self.workers()
        index = _index(workers, worker_url)
        if index is None:
            listed = ", ".join(w.url for w in workers) or "none"
            raise WorkerNotListed(f"{worker_url} is not a worker of {self.url} (it has: {listed})")
        if self.pin == "target_worker":
            headers = {TARGET_WORKER_HEADER: str(index)}
            return GatewayRoute(worker_url, self.url + path, headers)
        passthrough = f"{self.url}/v1/rl/workers/{workers[index].id}/engine{path}"
        return GatewayRoute(worker_url, passthrough, dict(self._auth), True)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        http: httpx.AsyncClient,
        worker_url: str,
        body: bytes | Mapping[str, Any],
        headers: Mapping[str, str],
        path: str = "/generate",
    ) -> AsyncIterator[PinnedReply]:
        """POST `body` (encoded JSON, or an object to encode) to `path` of `worker_url`
        through the gateway and yield the reply
        of that worker (`PinnedReply`: a streamed response's `status_code`, `aread`,
        `aiter_lines`), sent again while the gateway is down, the worker is not listed, or
        the list changed under the request (module docstring); `GatewayError` once
        `retry_s` has passed. The reply is closed on exit."""
        content = body if isinstance(body, bytes) else orjson.dumps(dict(body))
        headers = {"Content-Type": "application/json", **headers}
        response, route = await self._open(http, worker_url, content, headers, path)
        try:
            yield PinnedReply(response, route)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> ModelGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ sending

    async def _open(
        self,
        http: httpx.AsyncClient,
        worker_url: str,
        content: bytes,
        headers: dict[str, str],
        path: str,
    ) -> tuple[httpx.Response, GatewayRoute]:
        """The open response of the pinned worker, after as many tries as it takes
        within `retry_s`."""
        deadline = time.monotonic() + self.retry_s
        for attempt in itertools.count():  # bounded by the deadline below
            try:
                route = await self.route(worker_url, path)
                request = http.build_request(
                    "POST", route.url, content=content, headers={**headers, **route.headers}
                )
                response = await http.send(request, stream=True)
            except (httpx.TransportError, WorkerNotListed) as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                problem = await self._must_resend(route, response)
                if problem is None:
                    return response, route
            wait = RETRY_WAITS_S[min(attempt, len(RETRY_WAITS_S) - 1)]
            if time.monotonic() + wait > deadline:
                raise GatewayError(
                    f"{self.url}: no reply from {worker_url} within {self.retry_s:g} s "
                    f"({attempt + 1} tries; last: {problem})"
                )
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # itertools.count() never ends

    async def _must_resend(self, route: GatewayRoute, response: httpx.Response) -> str | None:
        """Why `response` is not the pinned worker's reply and the request must be sent
        again (the response closed), or None."""
        routed = route.misrouted_to(response.headers)
        if routed is not None:
            # Closing the stream before its first token cancels it on that worker.
            await response.aclose()
            self.misroutes += 1
            logger.warning(
                "gateway %s sent a request pinned to %s to %s (its worker list changed); "
                "cancelled, resolving the pin again",
                self.url,
                route.worker_url,
                routed,
            )
            return f"answered by {routed}"
        if route.envelope and response.status_code == 404:
            text = (await response.aread()).decode(errors="replace")
            await response.aclose()
            if UNKNOWN_WORKER_CODE in text:  # an id of the gateway's previous list
                return f"HTTP 404: {text[:200]}"
            raise GatewayError(f"{route.url}: HTTP 404: {text[:500]}")
        if response.headers.get(ERROR_CODE_HEADER) == NO_WORKER_CODE:
            await response.aclose()
            return f"HTTP {response.status_code} {NO_WORKER_CODE}"
        return None


@dataclass
class PinnedReply:
    """The pinned worker's reply through the gateway: a streamed response's status,
    body and lines (the passthrough's envelope unwrapped)."""

    response: httpx.Response
    route: GatewayRoute

    @property
    def status_code(self) -> int:
        return self.response.status_code

    async def aread(self) -> bytes:
        return await self.response.aread()

    def aiter_lines(self) -> AsyncIterator[str]:
        return self.route.lines(self.response)


def _index(workers: list[GatewayWorker], url: str) -> int | None:
    return next((i for i, w in enumerate(workers) if same_url(w.url, url)), None)


class SessionPins:
    """The rollout's session → worker map, for the turns after a move: after
    ``handle.result()`` call ``pin(session, handle.server_url)``; the next turn goes to
    `worker(session)` (``migrator.submit`` through the gateway, or `route` for a caller
    that posts itself). A new session takes the worker with the fewest pinned sessions.
    At most `max_sessions` are kept, least recently used dropped first."""

    def __init__(self, gateway: ModelGateway, max_sessions: int = 100_000):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.gateway = gateway
        self.max_sessions = max_sessions
        self._pins: OrderedDict[str, str] = OrderedDict()

    def worker(self, session: str) -> str | None:
        url = self._pins.get(session)
        if url is not None:
            self._pins.move_to_end(session)
        return url

    def pin(self, session: str, worker_url: str) -> None:
        self._pins[session] = worker_url
        self._pins.move_to_end(session)
        while len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)

    def forget(self, session: str) -> None:
        self._pins.pop(session, None)

    async def choose(self, session: str) -> str:
        """The session's worker: its pin, else the gateway's worker with fewest pins."""
        pinned = self.worker(session)
        if pinned is not None:
            return pinned
        urls = await self.gateway.worker_urls()
        if not urls:
            raise GatewayError(f"{self.gateway.url} lists no workers")
        counts = {u: 0 for u in urls}
        for url in self._pins.values():
            if url in counts:
                counts[url] += 1
        chosen = min(urls, key=lambda u: counts[u])
        self.pin(session, chosen)
        return chosen

    async def route(self, session: str, path: str = "/generate") -> GatewayRoute:
        """The pinned route for the session's next call; the session also travels as
        ``X-SMG-Routing-Key`` (the gateway's metrics and sticky maps see it)."""
        route = await self.gateway.route(await self.choose(session), path)
        route.headers[ROUTING_KEY_HEADER] = session
        return route

    def __len__(self) -> int:
        return len(self._pins)
