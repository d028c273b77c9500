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

Nothing here imports SGLang, `server/` or `paths/`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx
import orjson

from sglang_kv_migration.rollout.request_migration import GenerateFailed

TARGET_WORKER_HEADER = "X-SMG-Target-Worker"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"

# target_worker: X-SMG-Target-Worker on the gateway's /generate (consistent_hashing);
# rl_passthrough: the RL control plane's per-worker passthrough (any policy, --enable-rl).
PinMode = Literal["target_worker", "rl_passthrough"]
POLICIES_WITH_TARGET_HEADER = frozenset({"consistent_hashing"})


class GatewayError(GenerateFailed):
    """The gateway could not pin a request: an unknown worker, a refused passthrough, or
    a reply from another worker than the one asked for."""


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
    gateway: ModelGateway | None = field(default=None, compare=False, repr=False)

    def check(self, response_headers: Mapping[str, str]) -> None:
        """Raise `GatewayError` when the gateway says another worker answered."""
        routed = response_headers.get(ROUTED_WORKER_HEADER)
        if routed and not same_url(routed, self.worker_url):
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

    def _misrouted(self, routed: str) -> None:
        if self.gateway is not None:
            self.gateway.forget()  # the worker list changed: read it again next time
        raise GatewayError(f"{self.url}: pinned to {self.worker_url}, answered by {routed}")


class ModelGateway:
    """The model gateway in front of the workers: resolves a worker URL to the pin the
    running policy honours (module docstring). `pin` defaults to what `policy` allows;
    `api_key` goes with the gateway's own routes (``/workers``, the passthrough) when
    the gateway gates them. The worker list is read once and again when a worker is not
    in it or a reply came from another worker."""

    def __init__(
        self,
        url: str,
        *,
        policy: str = "consistent_hashing",
        pin: PinMode | None = None,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout_s: float = 10.0,
    ):
        self.url = url.rstrip("/")
        self.policy = policy
        self.pin: PinMode = pin or default_pin(policy)
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_http = http_client is None
        self._workers: list[GatewayWorker] | None = None

    async def workers(self, refresh: bool = False) -> list[GatewayWorker]:
        """The gateway's workers in its own order (the order the target header indexes)."""
        if self._workers is None or refresh:
            r = await self._http.get(self.url + "/workers", headers=self._auth)
            if r.status_code >= 300:
                raise GatewayError(f"{self.url}/workers: HTTP {r.status_code}: {r.text[:300]}")
            listed = r.json().get("workers") or []
            self._workers = [GatewayWorker(str(w["id"]), str(w["url"])) for w in listed]
        return list(self._workers)

    async def worker_urls(self) -> list[str]:
        return [w.url for w in await self.workers()]

    def forget(self) -> None:
        self._workers = None

    async def route(self, worker_url: str, path: str = "/generate") -> GatewayRoute:
        """How to send `path` to `worker_url` through the gateway."""
        workers = await self.workers()
        index = _index(workers, worker_url)
        if index is None:
            workers = await self.workers(refresh=True)
            index = _index(workers, worker_url)
        if index is None:
            listed = ", ".join(w.url for w in workers) or "none"
            raise GatewayError(f"{worker_url} is not a worker of {self.url} (it has: {listed})")
        if self.pin == "target_worker":
            headers = {TARGET_WORKER_HEADER: str(index)}
            return GatewayRoute(worker_url, self.url + path, headers, gateway=self)
        passthrough = f"{self.url}/v1/rl/workers/{workers[index].id}/engine{path}"
        return GatewayRoute(worker_url, passthrough, dict(self._auth), True, gateway=self)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> ModelGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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
