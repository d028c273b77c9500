"""When does moving KV beat recomputing it? A two-line cost model, fed by `/metrics`.

    migrate_s   = overhead_s + bytes / bandwidth + tokens * load_back_s_per_token
    recompute_s = prefill_overhead_s + tokens * prefill_s_per_token

`tokens` are the page-aligned tokens the source holds beyond what the target already
holds (what a migration would move, and what the target would otherwise prefill). The
decision is `migrate` when ``migrate_s * margin < recompute_s``, else `recompute`; a
`CostEstimate` carries both numbers so callers can log why.

Where the numbers come from (`CostModel.from_metrics`), all from the servers' own
Prometheus text (`--enable-metrics`):

- migration, source side (`sglang_kv_migration.server.diag.metrics`): bandwidth = bytes sent by all
  ranks ÷ the mean per-rank transfer time (`sglang:kv_migration_bytes_total{role="source"}`,
  `sglang:kv_migration_phase_seconds{phase="transfer"}`); bytes per token = bytes ÷ tokens
  (`sglang:kv_migration_tokens_total{role="source"}`, counted once per rank);
- migration, target side: fixed overhead = mean allocate + mean commit phase time
  (`sglang:kv_migration_phase_seconds{phase="allocate"|"commit"}`) plus the client's HTTP
  round trips (`http_overhead_s`); load-back cost per token, host path only, from
  HiCache's `sglang:load_back_duration_seconds` ÷ `sglang:load_back_tokens_total`;
- re-prefill, target side (SGLang's own collector): seconds per token =
  `sglang:forward_execution_seconds_total{category="extend"}` ÷
  `sglang:realtime_tokens_total{mode="prefill_compute"}`. SGLang records the former only
  with `SGLANG_ENABLE_METRICS_DEVICE_TIMER=1`; without it the prior below stays.

Anything the metrics cannot tell (no migration yet, timer off) keeps the prior it was
built with: by default the H200 numbers of `docs/benchmarks.md` / DESIGN.md (Mooncake TCP
≈ 2.5 GB/s, Llama-3-8B-shaped re-prefill of 32K tokens ≈ 2.65 s). Series that carry a
`path` label are filtered by `path=` when one is given;
series without it count for every path.

Per path. A move is priced by the path it will take (`estimate(..., path=)`):
`by_path[path]` where the model has one, else `migration`. By default only the two
same-host paths have their own terms: the device path (pinned host pool or GPU pages
copied into the target's GPU slots; no load-back on the target) and the shared-host path
(the same pages copied into the target's host pool; HiCache's load-back at the target,
learned as the host path's), so a model built with one `MigrationCosts` prices the host
path with it too. `from_metrics` learns `migration` from every series and
`by_path[p]` from series labelled ``path="p"`` of the names above (none carries one yet).

Per route. `routes` holds what each route a migration's bytes can take costs — GPU -> GPU,
host -> GPU, landing buffer (`LANDING`: GPU -> a buffer on the target's GPU -> its own
scatter, for `--enable-memory-saver` targets), host -> host: `ROUTE_PRIORS` until
`from_metrics` measures them (`learn_route_costs`) from the source's per-route series
(`sglang:kv_migration_route_bytes_total{path, route}` ÷ the mean per-rank
`sglang:kv_migration_route_seconds_total{path, route}`: the copy or wire time) and its
fixed cost per path (`sglang:kv_migration_fixed_seconds{path}`: the transfer phase minus
the routes' time), plus the target's mean allocate + commit and `http_overhead_s`; a
route the metrics do not show keeps its prior. Route-priced terms (``origin ==
"routes"``: the device path's default) are priced per move from the routes their bytes
take when the caller passes the source's size query (``estimate(..., held=)``: GPU -> GPU
for the ``device_token_size`` tokens, host -> GPU for the rest, in turn: the sum of the
routes' times behind the largest fixed cost); without it, the path's slowest route
(`PATH_ROUTES`, host -> GPU for the device path) prices them all. Once the host -> host
route is measured, the host path is route-priced too (its load-back and bytes per token
stay `migration`'s); before that its terms are `migration`'s. No path is priced on the
landing route yet: the servers report it once a path writes through a landing buffer,
and `routes[LANDING]` learns it like any other.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, SessionInfoReply
from sglang_kv_migration.wire.moments import Phase

Decision = Literal["migrate", "recompute"]

# Priors (see the module docstring): used where no metric says otherwise.
DEFAULT_BANDWIDTH_BYTES_PER_S = 2.5e9  # the host path: Mooncake TCP (HOST_TO_HOST below)
DEFAULT_MIGRATION_OVERHEAD_S = 0.02
DEFAULT_PREFILL_S_PER_TOKEN = 8.0e-5
# A migration's trips outside the handlers (HTTP client and server, the hops to and from
# the scheduler): two trips, 4.9 ms on the H200 (docs/benchmarks-history.md, "Two trips on the
# H200"); a client that sends /commit itself pays a third.
DEFAULT_HTTP_OVERHEAD_S = 0.005

# --------------------------------------------------------------------------- routes

# How a migration's bytes travel. The device path (one host) copies the pages the
# source holds on its GPU GPU -> GPU and those only in its host pool host -> GPU, one
# after the other on one stream; the host path moves everything host -> host. A target
# whose KV pools cannot be exported (`--enable-memory-saver`) is written through a
# landing buffer on its GPU and scatters from there (`LANDING`). The servers report
# each route by these names (`paths/base.py`: `ROUTE_NAMES`; a unit test ties them).
GPU_TO_GPU = "gpu_to_gpu"
HOST_TO_GPU = "host_to_gpu"
LANDING = "landing"
HOST_TO_HOST = "host_to_host"
# The shared-host path (one host, into the target's host pool): the source's GPU pages
# and its host-only pages, both written by the source's GPU into the mapped pool.
GPU_TO_SHARED_HOST = "gpu_to_shared_host"
HOST_TO_SHARED_HOST = "host_to_shared_host"
# `MigrationCosts.origin` of terms priced per move from the routes the bytes take.
ROUTES = "routes"
SHARED_HOST_PATH = "shared_host"


@dataclass(frozen=True)
class RouteCost:
    bandwidth_bytes_per_s: float
    overhead_s: float  # fixed cost of a migration that takes this route (control plane)
    origin: str = "prior"  # or "metrics" (`learn_route_costs`)


# Priors measured on an H200 (Llama-3-8B shape): the page kernel GPU -> GPU
# ~1.7 TB/s, pinned host -> GPU 51.3 GB/s (93% of PCIe Gen5); one 8K device-path
# migration 43 ms end to end, so ~40 ms is fixed; host -> host is the host path's
# Mooncake TCP prior (docs/benchmarks.md). The landing route is not measured yet: two
# GPU copies at the page kernel's rate (into the buffer, then the target's scatter) and
# one more round trip per round. Neither are the shared-host routes: GPU -> host is
# priced at 80% of the host -> GPU rate (the same PCIe link the other way), host -> host
# at half of it (every byte crosses the link twice, once each way).
ROUTE_PRIORS: Mapping[str, RouteCost] = {
    GPU_TO_GPU: RouteCost(1.7e12, 0.04),
    HOST_TO_GPU: RouteCost(51.3e9, 0.04),
    LANDING: RouteCost(0.85e12, 0.05),
    HOST_TO_HOST: RouteCost(DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_MIGRATION_OVERHEAD_S),
    GPU_TO_SHARED_HOST: RouteCost(41e9, 0.04),
    HOST_TO_SHARED_HOST: RouteCost(25.6e9, 0.04),
}
# The routes a path's bytes can take, the slowest first: without a size query that one
# prices them all.
PATH_ROUTES: Mapping[str, tuple[str, ...]] = {
    "device": (HOST_TO_GPU, GPU_TO_GPU),
    SHARED_HOST_PATH: (HOST_TO_SHARED_HOST, GPU_TO_SHARED_HOST),
    "host": (HOST_TO_HOST,),
}


@dataclass(frozen=True)
class MigrationCosts:
    """What a migration costs on one path."""

    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S
    overhead_s: float = DEFAULT_MIGRATION_OVERHEAD_S
    bytes_per_token: float | None = None  # None: the caller must give bytes
    load_back_s_per_token: float = 0.0  # host path: target's host -> GPU load
    origin: str = "prior"  # "prior", "metrics" or ROUTES (priced per move from ROUTE_PRIORS)


@dataclass(frozen=True)
class PrefillCosts:
    """What re-running prefill on the target costs."""

    seconds_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    overhead_s: float = 0.0
    origin: str = "prior"


@dataclass(frozen=True)
class CostEstimate:
    decision: Decision
    tokens: int
    nbytes: int
    migrate_s: float
    recompute_s: float
    path: str = ""  # the path the migration was priced for ("": the model's default)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _default_path_costs() -> dict[str, MigrationCosts]:
    """The same-host paths' priors: the slower of their routes (host -> GPU, host ->
    shared host) until a size query says which route the bytes take
    (`CostModel.costs_for`)."""
    return {
        path: MigrationCosts(
            bandwidth_bytes_per_s=ROUTE_PRIORS[PATH_ROUTES[path][0]].bandwidth_bytes_per_s,
            overhead_s=ROUTE_PRIORS[PATH_ROUTES[path][0]].overhead_s,
            origin=ROUTES,
        )
        for path in ("device", SHARED_HOST_PATH)
    }


@dataclass(frozen=True)
class CostModel:
    migration: MigrationCosts = MigrationCosts()
    prefill: PrefillCosts = PrefillCosts()
    # Migrate only when it is this much cheaper (>1 favours recomputation).
    margin: float = 1.0
    # Paths priced on their own (see the module docstring); others use `migration`.
    by_path: Mapping[str, MigrationCosts] = dataclasses.field(default_factory=_default_path_costs)
    # What each route costs: the priors, or what `from_metrics` measured.
    routes: Mapping[str, RouteCost] = dataclasses.field(default_factory=lambda: dict(ROUTE_PRIORS))

    def costs_for(
        self, path: str | None, held: ExtraTokenSizeReply | None = None
    ) -> MigrationCosts:
        """The migration terms of `path`; bytes per token are the layout's, on any path.
        Route-priced terms (``origin == "routes"``) take their rate and fixed cost from
        `routes`: split by the routes the bytes of `held` (the source's size query)
        take, or, without it, all on the path's slowest route (`PATH_ROUTES`)."""
        costs = self.by_path.get(path or "", self.migration)
        if costs.origin == ROUTES and path in PATH_ROUTES:
            shares = route_bytes(path, held, 1.0) if held is not None else {PATH_ROUTES[path][0]: 1}
            if any(shares.values()):  # some bytes to move: the routes' terms
                routed = migration_costs_for_routes(shares, self.routes)
                costs = dataclasses.replace(
                    costs,
                    bandwidth_bytes_per_s=routed.bandwidth_bytes_per_s,
                    overhead_s=routed.overhead_s,
                )
        if costs.bytes_per_token is None and self.migration.bytes_per_token is not None:
            costs = dataclasses.replace(costs, bytes_per_token=self.migration.bytes_per_token)
        return costs

    def estimate(
        self,
        tokens: int,
        nbytes: int | None = None,
        *,
        path: str | None = None,
        held: ExtraTokenSizeReply | None = None,
    ) -> CostEstimate:
        """Both estimates for moving `tokens` tokens (`nbytes` bytes on all ranks) over
        `path` (None: `migration`'s terms); `held`, the source's size query, tells which
        routes route-priced terms take (see `costs_for`).

        `nbytes` defaults to ``tokens * bytes_per_token``; with neither, the model cannot
        price the transfer and raises `ValueError`. Nothing to move (``tokens <= 0``) is
        always `recompute`, at zero cost both ways.
        """
        if tokens <= 0:
            return CostEstimate("recompute", 0, 0, 0.0, 0.0, path or "")
        m = self.costs_for(path, held)
        if nbytes is None:
            if m.bytes_per_token is None:
                raise ValueError("bytes unknown: pass nbytes or learn bytes_per_token")
            nbytes = round(tokens * m.bytes_per_token)
        migrate_s = (
            m.overhead_s + nbytes / m.bandwidth_bytes_per_s + tokens * m.load_back_s_per_token
        )
        recompute_s = self.prefill.overhead_s + tokens * self.prefill.seconds_per_token
        decision: Decision = "migrate" if migrate_s * self.margin < recompute_s else "recompute"
        return CostEstimate(decision, tokens, nbytes, migrate_s, recompute_s, path or "")

    @classmethod
    def from_metrics(
        cls,
        source_metrics: str | None,
        target_metrics: str | None,
        *,
        path: str | None = None,
        prior: CostModel | None = None,
        http_overhead_s: float = DEFAULT_HTTP_OVERHEAD_S,
    ) -> CostModel:
        """A model whose terms come from the two servers' `/metrics` text where they can.

        Either text may be None (server unreachable, metrics off): its terms keep `prior`.
        """
        base = prior or cls()
        source = parse_prometheus(source_metrics or "")
        target = parse_prometheus(target_metrics or "")
        migration = learn_migration_costs(
            source, target, path=path, prior=base.migration, http_overhead_s=http_overhead_s
        )
        by_path = {
            name: learn_migration_costs(
                _labelled(source, name),
                _labelled(target, name),
                path=name,
                prior=prior_costs,
                http_overhead_s=http_overhead_s,
            )
            for name, prior_costs in base.by_path.items()
        }
        routes = learn_route_costs(
            source, target, prior=base.routes, http_overhead_s=http_overhead_s
        )
        host = by_path.get("host")
        if routes[HOST_TO_HOST].origin == "metrics" and (host is None or host.origin == ROUTES):
            # Its route measured, the host path is priced from it (load-back and bytes
            # per token stay the generic terms').
            by_path["host"] = dataclasses.replace(migration, origin=ROUTES)
        shared = by_path.get(SHARED_HOST_PATH)
        if shared is not None and shared.origin == ROUTES:
            # Landed in the host pool, its pages are loaded back by HiCache like the host
            # path's: the same load-back per token.
            by_path[SHARED_HOST_PATH] = dataclasses.replace(
                shared, load_back_s_per_token=migration.load_back_s_per_token
            )
        prefill = learn_prefill_costs(target, prior=base.prefill)
        return dataclasses.replace(
            base, migration=migration, prefill=prefill, by_path=by_path, routes=routes
        )


# --------------------------------------------------------------------------- route math


def route_bytes(path: str, held: ExtraTokenSizeReply, bytes_per_token: float) -> dict[str, int]:
    """Bytes per route for moving what the size query `held` reports (tokens held beyond
    what the target has are approximated by the source's tiers: device first)."""
    total = held.matched_token_size
    on_device = min(total, held.device_token_size)
    if path == "host":
        return {HOST_TO_HOST: round(total * bytes_per_token)}
    if path == SHARED_HOST_PATH:
        return {
            GPU_TO_SHARED_HOST: round(on_device * bytes_per_token),
            HOST_TO_SHARED_HOST: round((total - on_device) * bytes_per_token),
        }
    return {
        GPU_TO_GPU: round(on_device * bytes_per_token),
        HOST_TO_GPU: round((total - on_device) * bytes_per_token),
    }


def migration_costs_for_routes(
    nbytes_by_route: Mapping[str, int],
    routes: Mapping[str, RouteCost] = ROUTE_PRIORS,
    bytes_per_token: float | None = None,
) -> MigrationCosts:
    """One `MigrationCosts` for bytes that take several routes in turn: the largest fixed
    cost of the routes used, and the bandwidth that moves all bytes in the summed time."""
    used = {r: n for r, n in nbytes_by_route.items() if n > 0}
    if not used:
        return MigrationCosts(overhead_s=0.0, bytes_per_token=bytes_per_token, origin=ROUTES)
    unknown = set(used) - set(routes)
    if unknown:
        raise ValueError(f"no cost for route(s) {sorted(unknown)}")
    seconds = sum(n / routes[r].bandwidth_bytes_per_s for r, n in used.items())
    return MigrationCosts(
        bandwidth_bytes_per_s=sum(used.values()) / seconds,
        overhead_s=max(routes[r].overhead_s for r in used),
        bytes_per_token=bytes_per_token,
        origin=ROUTES,
    )


# --------------------------------------------------------------------------- learning


def learn_migration_costs(
    source: list[Sample],
    target: list[Sample],
    *,
    path: str | None = None,
    prior: MigrationCosts = MigrationCosts(),
    http_overhead_s: float = DEFAULT_HTTP_OVERHEAD_S,
) -> MigrationCosts:
    """Migration terms from parsed source and target samples (see the module docstring)."""
    costs = prior
    source = _on_path(source, path)
    target = _on_path(target, path)

    transfer_count = _samples(
        source, "sglang:kv_migration_phase_seconds_count", phase=Phase.TRANSFER
    )
    transfer_s = _total(source, "sglang:kv_migration_phase_seconds_sum", phase=Phase.TRANSFER)
    sent_bytes = _total(source, "sglang:kv_migration_bytes_total", role="source")
    token_series = _samples(source, "sglang:kv_migration_tokens_total", role="source")
    ranks = len(transfer_count)
    if ranks and transfer_s > 0 and sent_bytes > 0:
        costs = dataclasses.replace(
            costs, bandwidth_bytes_per_s=sent_bytes / (transfer_s / ranks), origin="metrics"
        )
    sent_tokens = sum(s.value for s in token_series) / max(1, len(token_series))
    if sent_tokens > 0 and sent_bytes > 0:
        costs = dataclasses.replace(costs, bytes_per_token=sent_bytes / sent_tokens)

    allocate = _mean(target, "sglang:kv_migration_phase_seconds", phase=Phase.ALLOCATE)
    commit = _mean(target, "sglang:kv_migration_phase_seconds", phase=Phase.COMMIT)
    if allocate is not None and commit is not None:
        costs = dataclasses.replace(
            costs, overhead_s=allocate + commit + http_overhead_s, origin="metrics"
        )

    load_s = _total(target, "sglang:load_back_duration_seconds_sum")
    load_tokens = _total(target, "sglang:load_back_tokens_total")
    if load_s > 0 and load_tokens > 0 and path != "device":
        costs = dataclasses.replace(costs, load_back_s_per_token=load_s / load_tokens)
    return costs


ROUTE_BYTES = "sglang:kv_migration_route_bytes_total"
ROUTE_SECONDS = "sglang:kv_migration_route_seconds_total"
FIXED_SECONDS = "sglang:kv_migration_fixed_seconds"


def learn_route_costs(
    source: list[Sample],
    target: list[Sample],
    *,
    prior: Mapping[str, RouteCost] = ROUTE_PRIORS,
    http_overhead_s: float = DEFAULT_HTTP_OVERHEAD_S,
) -> dict[str, RouteCost]:
    """Each route's rate and fixed cost from the source's route series, else `prior`.

    Rate: the route's bytes on all ranks ÷ its mean per-rank seconds. Fixed cost: the mean
    of the source's fixed seconds on the paths that used the route, plus the target's
    mean allocate and commit and the client's HTTP round trips (learned only with both
    texts' numbers; otherwise the prior's stays)."""
    routes = dict(prior)
    allocate = _mean(target, "sglang:kv_migration_phase_seconds", phase=Phase.ALLOCATE)
    commit = _mean(target, "sglang:kv_migration_phase_seconds", phase=Phase.COMMIT)
    for route in sorted({s.labels.get("route", "") for s in _samples(source, ROUTE_BYTES)}):
        byte_series = _samples(source, ROUTE_BYTES, route=route)
        nbytes = sum(s.value for s in byte_series)
        seconds = _total(source, ROUTE_SECONDS, route=route)
        if not route or nbytes <= 0 or seconds <= 0:
            continue
        ranks = len({_rank(s) for s in byte_series})
        was = routes.get(route, RouteCost(0.0, DEFAULT_MIGRATION_OVERHEAD_S))
        overhead = was.overhead_s
        paths = {s.labels.get("path", "") for s in byte_series}
        count = sum(_total(source, FIXED_SECONDS + "_count", path=p) for p in paths)
        if count > 0 and allocate is not None and commit is not None:
            fixed = sum(_total(source, FIXED_SECONDS + "_sum", path=p) for p in paths) / count
            overhead = fixed + allocate + commit + http_overhead_s
        routes[route] = RouteCost(nbytes / (seconds / ranks), overhead, "metrics")
    return routes


def learn_prefill_costs(
    target: list[Sample], *, prior: PrefillCosts = PrefillCosts()
) -> PrefillCosts:
    """Re-prefill seconds per token from SGLang's own counters, else `prior`."""
    seconds = _total(target, "sglang:forward_execution_seconds_total", category="extend")
    tokens = _total(target, "sglang:realtime_tokens_total", mode="prefill_compute")
    if seconds > 0 and tokens > 0:
        return dataclasses.replace(prior, seconds_per_token=seconds / tokens, origin="metrics")
    return prior


def bytes_per_token_from_session_info(info: SessionInfoReply) -> int:
    """KV bytes one token occupies on all ranks together, from a `/get_transfer_session_info`
    reply: every host buffer holds ``item_len`` bytes per token slot."""
    return sum(sum(rank.host_kv_item_lens) for rank in info.ranks)


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of the Prometheus text format; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"') for k, v in _LABEL.findall(match.group(3) or "")}
        samples.append(Sample(match.group(1), labels, value))
    return samples


def _samples(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def _total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in _samples(samples, name, **labels))


def _mean(samples: Iterable[Sample], histogram: str, **labels: str) -> float | None:
    count = _total(samples, histogram + "_count", **labels)
    if count <= 0:
        return None
    return _total(samples, histogram + "_sum", **labels) / count


def _rank(sample: Sample) -> tuple[str, str, str]:
    labels = sample.labels
    return labels.get("model_name", ""), labels.get("tp_rank", ""), labels.get("pp_rank", "")


def _labelled(samples: list[Sample], path: str) -> list[Sample]:
    """Only the samples that name `path` (what a path's own terms are learned from)."""
    return [s for s in samples if s.labels.get("path") == path]


def _on_path(samples: list[Sample], path: str | None) -> list[Sample]:
    if path is None:
        return samples
    return [s for s in samples if s.labels.get("path", path) == path]
