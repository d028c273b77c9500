"""The migrate-vs-recompute cost model, with literal numbers and literal `/metrics` text."""

from __future__ import annotations

import pytest
from sglang_kv_migration.rollout.cost_model import (
    GPU_TO_GPU,
    HOST_TO_GPU,
    ROUTE_PRIORS,
    CostModel,
    MigrationCosts,
    PrefillCosts,
    bytes_per_token_from_session_info,
    parse_prometheus,
)
from sglang_kv_migration.wire.messages import (
    ExtraTokenSizeReply,
    RankSessionInfo,
    SessionInfoReply,
)


def _held(tokens: int, on_device: int) -> ExtraTokenSizeReply:
    """A source's size query: `tokens` held, `on_device` of them on its GPU."""
    return ExtraTokenSizeReply(success=True, matched_token_size=tokens, device_token_size=on_device)


# Two ranks of a source that sent 3 migrations: 600 MB in all, 0.3 s of transfer per rank.
SOURCE_METRICS = """\
# HELP sglang:kv_migration_bytes_total Bytes of KV cache sent (source) or committed (target).
# TYPE sglang:kv_migration_bytes_total counter
sglang:kv_migration_bytes_total{model_name="m",tp_rank="0",pp_rank="0",role="source"} 3.0e8
sglang:kv_migration_bytes_total{model_name="m",tp_rank="1",pp_rank="0",role="source"} 3.0e8
sglang:kv_migration_bytes_created{model_name="m",tp_rank="0",pp_rank="0",role="source"} 1.7e9
sglang:kv_migration_tokens_total{model_name="m",tp_rank="0",pp_rank="0",role="source"} 6000
sglang:kv_migration_tokens_total{model_name="m",tp_rank="1",pp_rank="0",role="source"} 6000
sglang:kv_migration_phase_seconds_sum{model_name="m",tp_rank="0",pp_rank="0",phase="transfer"} 0.3
sglang:kv_migration_phase_seconds_count{model_name="m",tp_rank="0",pp_rank="0",phase="transfer"} 3
sglang:kv_migration_phase_seconds_sum{model_name="m",tp_rank="1",pp_rank="0",phase="transfer"} 0.3
sglang:kv_migration_phase_seconds_count{model_name="m",tp_rank="1",pp_rank="0",phase="transfer"} 3
sglang:kv_migration_phase_seconds_bucket{tp_rank="0",phase="transfer",le="0.1"} 3
"""

# The target: 4 allocates of 10 ms and 4 commits of 5 ms (one rank), HiCache loaded 10000
# tokens back in 0.2 s, and SGLang timed 2 s of extend passes over 40000 computed tokens.
TARGET_METRICS = """\
sglang:kv_migration_phase_seconds_sum{model_name="m",tp_rank="0",pp_rank="0",phase="allocate"} 0.04
sglang:kv_migration_phase_seconds_count{model_name="m",tp_rank="0",pp_rank="0",phase="allocate"} 4
sglang:kv_migration_phase_seconds_sum{model_name="m",tp_rank="0",pp_rank="0",phase="commit"} 0.02
sglang:kv_migration_phase_seconds_count{model_name="m",tp_rank="0",pp_rank="0",phase="commit"} 4
sglang:load_back_duration_seconds_sum{model_name="m"} 0.2
sglang:load_back_duration_seconds_count{model_name="m"} 7
sglang:load_back_tokens_total{model_name="m"} 10000
sglang:forward_execution_seconds_total{model_name="m",category="extend"} 2.0
sglang:forward_execution_seconds_total{model_name="m",category="decode"} 9.0
sglang:realtime_tokens_total{model_name="m",mode="prefill_compute"} 40000
sglang:realtime_tokens_total{model_name="m",mode="prefill_cache"} 99999
sglang:realtime_tokens_total{model_name="m",mode="decode"} 123456
"""


def test_estimate_with_literal_costs() -> None:
    model = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.01, bytes_per_token=1000),
        PrefillCosts(seconds_per_token=1e-4),
    )
    # 8000 tokens: 8 MB / 1 GB/s = 8 ms + 10 ms = 18 ms against 0.8 s of prefill.
    est = model.estimate(8000)
    assert est.decision == "migrate"
    assert est.nbytes == 8_000_000
    assert est.migrate_s == pytest.approx(0.018)
    assert est.recompute_s == pytest.approx(0.8)
    # 50 tokens: 10.05 ms to move against 5 ms to recompute.
    est = model.estimate(50)
    assert (est.decision, est.nbytes) == ("recompute", 50_000)
    assert est.migrate_s == pytest.approx(0.01005)
    assert est.recompute_s == pytest.approx(0.005)


def test_explicit_bytes_margin_and_nothing_to_move() -> None:
    model = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.0),
        PrefillCosts(seconds_per_token=1e-6),
        margin=2.0,
    )
    # 1000 tokens, 1.5 MB: 1.5 ms to move vs 1 ms to recompute -> recompute.
    assert model.estimate(1000, nbytes=1_500_000).decision == "recompute"
    # 0.6 MB: 0.6 ms, but x2 margin = 1.2 ms > 1 ms -> still recompute; 0.4 MB migrates.
    assert model.estimate(1000, nbytes=600_000).decision == "recompute"
    assert model.estimate(1000, nbytes=400_000).decision == "migrate"
    assert model.estimate(0, nbytes=0) == model.estimate(-5)
    assert model.estimate(0).decision == "recompute"
    with pytest.raises(ValueError, match="bytes unknown"):
        model.estimate(10)


def test_parse_prometheus_labels_and_values() -> None:
    samples = parse_prometheus(
        '# TYPE x counter\nx_total{a="1",b="q\\"uote"} 2.5e3\nbare 7\nnot a sample\n'
        'y{le="+Inf"} +Inf\n'
    )
    assert [(s.name, dict(s.labels), s.value) for s in samples[:2]] == [
        ("x_total", {"a": "1", "b": 'q"uote'}, 2500.0),
        ("bare", {}, 7.0),
    ]
    assert samples[2].value == float("inf")
    assert len(samples) == 3


def test_learn_from_metrics() -> None:
    model = CostModel.from_metrics(SOURCE_METRICS, TARGET_METRICS, http_overhead_s=0.005)
    m = model.migration
    # 600 MB over 0.3 s of per-rank transfer time (two ranks in parallel) = 2 GB/s.
    assert m.bandwidth_bytes_per_s == pytest.approx(2e9)
    # 600 MB for 6000 tokens (each rank counts the same tokens).
    assert m.bytes_per_token == pytest.approx(1e5)
    # 10 ms allocate + 5 ms commit + 5 ms HTTP.
    assert m.overhead_s == pytest.approx(0.02)
    assert m.load_back_s_per_token == pytest.approx(2e-5)
    assert m.origin == "metrics"
    assert model.prefill.seconds_per_token == pytest.approx(5e-5)
    assert model.prefill.origin == "metrics"
    # 4000 tokens: 0.02 + 400 MB / 2 GB/s (0.2) + 4000 * 2e-5 (0.08) = 0.3 s vs 0.2 s.
    est = model.estimate(4000)
    assert est.migrate_s == pytest.approx(0.3)
    assert est.recompute_s == pytest.approx(0.2)
    assert est.decision == "recompute"
    # On the device path there is no host -> GPU load: 0.22 s vs 0.2 s, still recompute;
    # with a tenth of the bytes per token (MLA-like) it migrates.
    device = CostModel.from_metrics(SOURCE_METRICS, TARGET_METRICS, path="device")
    assert device.migration.load_back_s_per_token == 0.0
    assert device.estimate(4000).migrate_s == pytest.approx(0.22)
    assert device.estimate(4000, nbytes=40_000_000).decision == "migrate"


def test_missing_metrics_keep_the_prior() -> None:
    prior = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=3e9, overhead_s=0.03, bytes_per_token=7),
        PrefillCosts(seconds_per_token=2e-4, overhead_s=0.001),
    )
    assert CostModel.from_metrics(None, "", prior=prior) == prior
    # Timer off: SGLang still counts prefill tokens but not extend seconds.
    only_tokens = 'sglang:realtime_tokens_total{mode="prefill_compute"} 500\n'
    assert CostModel.from_metrics("", only_tokens, prior=prior).prefill == prior.prefill


def test_path_label_filters_series() -> None:
    text = (
        'sglang:kv_migration_bytes_total{role="source",path="host"} 1e9\n'
        'sglang:kv_migration_phase_seconds_sum{phase="transfer",path="host"} 1.0\n'
        'sglang:kv_migration_phase_seconds_count{phase="transfer",path="host"} 1\n'
        'sglang:kv_migration_bytes_total{role="source",path="device"} 1e9\n'
        'sglang:kv_migration_phase_seconds_sum{phase="transfer",path="device"} 0.01\n'
        'sglang:kv_migration_phase_seconds_count{phase="transfer",path="device"} 1\n'
    )
    host = CostModel.from_metrics(text, None, path="host").migration
    device = CostModel.from_metrics(text, None, path="device").migration
    assert host.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert device.bandwidth_bytes_per_s == pytest.approx(1e11)


def test_bytes_per_token_from_session_info() -> None:
    ranks = [
        RankSessionInfo(
            tp_rank=tp, pp_rank=0, page_size=1, fingerprint={}, host_kv_item_lens=[64] * 4
        )
        for tp in (0, 1)
    ]
    info = SessionInfoReply(success=True, ranks=ranks)
    assert bytes_per_token_from_session_info(info) == 512


# --------------------------------------------------------------------------- routes


def test_route_bytes_by_path_and_tier():
    from sglang_kv_migration.rollout.cost_model import route_bytes

    held = _held(100, 40)
    assert route_bytes("device", held, 2.0) == {"gpu_to_gpu": 80, "host_to_gpu": 120}
    assert route_bytes("host", held, 2.0) == {"host_to_host": 200}
    assert route_bytes("shared_host", held, 2.0) == {
        "gpu_to_shared_host": 80,
        "host_to_shared_host": 120,
    }


def test_the_shared_host_landing_is_priced_on_its_routes_with_the_load_back() -> None:
    """Into the target's host pool on one host: each tier's bytes on its own route
    (GPU -> host, host -> host through the GPU), far below the host path's Mooncake TCP;
    HiCache's load-back on the target is learned as the host path's is."""
    from sglang_kv_migration.rollout.cost_model import GPU_TO_SHARED_HOST, HOST_TO_SHARED_HOST

    model = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.01, bytes_per_token=1000),
        PrefillCosts(seconds_per_token=1e-6),
    )
    gpu, host = ROUTE_PRIORS[GPU_TO_SHARED_HOST], ROUTE_PRIORS[HOST_TO_SHARED_HOST]
    est = model.estimate(8000, path="shared_host", held=_held(8000, 4000))
    seconds = 4e6 / gpu.bandwidth_bytes_per_s + 4e6 / host.bandwidth_bytes_per_s
    assert est.path == "shared_host"
    assert est.migrate_s == pytest.approx(max(gpu.overhead_s, host.overhead_s) + seconds)
    # Without a size query its slowest route (host -> host) prices every byte.
    unasked = model.estimate(8000, path="shared_host")
    assert unasked.migrate_s == pytest.approx(host.overhead_s + 8e6 / host.bandwidth_bytes_per_s)
    # A 32K prefix of an 8B model held on the source's host tier: several times cheaper
    # than the host path's Mooncake TCP prior.
    held, nbytes = _held(32768, 0), 32768 * 131072
    priors = CostModel()
    shared = priors.estimate(32768, nbytes, path="shared_host", held=held)
    assert shared.migrate_s * 5 < priors.estimate(32768, nbytes, path="host").migrate_s
    learned = CostModel.from_metrics(SOURCE_METRICS, TARGET_METRICS, prior=model)
    assert learned.costs_for("shared_host").load_back_s_per_token == pytest.approx(2e-5)
    assert learned.costs_for("device").load_back_s_per_token == 0.0


def test_routes_combine_rates_and_fixed_costs():
    from sglang_kv_migration.rollout.cost_model import RouteCost, migration_costs_for_routes

    routes = {"gpu_to_gpu": RouteCost(1000.0, 0.5), "host_to_gpu": RouteCost(100.0, 0.25)}
    costs = migration_costs_for_routes({"gpu_to_gpu": 1000, "host_to_gpu": 100}, routes)
    # 1 s + 1 s for 1100 bytes, behind the larger fixed cost.
    assert costs.bandwidth_bytes_per_s == pytest.approx(550.0)
    assert costs.overhead_s == 0.5
    model = CostModel(migration=costs, prefill=PrefillCosts(seconds_per_token=1.0))
    assert model.estimate(3, nbytes=1100).migrate_s == pytest.approx(2.5)
    only_host = migration_costs_for_routes({"gpu_to_gpu": 0, "host_to_gpu": 100}, routes)
    assert (only_host.bandwidth_bytes_per_s, only_host.overhead_s) == (100.0, 0.25)
    with pytest.raises(ValueError, match="host_to_host"):
        migration_costs_for_routes({"host_to_host": 1}, routes)


def test_route_priors_favour_the_device_path_for_host_held_prefixes():
    # A 32K prefix of an 8B model held on the source's host tier: host -> GPU beats
    # host -> host by more than 10x with the measured priors.
    from sglang_kv_migration.rollout.cost_model import migration_costs_for_routes, route_bytes

    held = _held(32768, 0)
    per_token = 131072.0
    device = CostModel(
        migration=migration_costs_for_routes(route_bytes("device", held, per_token))
    ).estimate(32768, nbytes=round(32768 * per_token))
    host = CostModel(
        migration=migration_costs_for_routes(route_bytes("host", held, per_token))
    ).estimate(32768, nbytes=round(32768 * per_token))
    assert device.migrate_s * 10 < host.migrate_s


def test_each_path_is_priced_on_its_own_terms() -> None:
    """The device path has its own prior (no load-back; without a size query the
    host -> GPU route prices all its bytes); the host path uses `migration`;
    path-labelled series teach only their own path."""
    model = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.01, bytes_per_token=1000),
        PrefillCosts(seconds_per_token=1e-6),
    )
    host = model.estimate(8000, path="host")
    device = model.estimate(8000, path="device")
    assert (host.path, device.path) == ("host", "device")
    assert host.migrate_s == pytest.approx(0.01 + 8e6 / 1e9)
    slowest = ROUTE_PRIORS[HOST_TO_GPU]  # bytes/token shared
    assert device.migrate_s == pytest.approx(
        slowest.overhead_s + 8e6 / slowest.bandwidth_bytes_per_s
    )
    assert host.decision == device.decision == "recompute"  # 8 ms of prefill is cheaper
    labelled = (
        'sglang:kv_migration_bytes_total{tp_rank="0",role="source",path="device"} 4e9\n'
        'sglang:kv_migration_tokens_total{tp_rank="0",role="source",path="device"} 1000\n'
        'sglang:kv_migration_phase_seconds_sum{tp_rank="0",phase="transfer",path="device"} 0.01\n'
        'sglang:kv_migration_phase_seconds_count{tp_rank="0",phase="transfer",path="device"} 1\n'
    )
    learned = CostModel.from_metrics(labelled, "", prior=model)
    assert learned.costs_for("device").bandwidth_bytes_per_s == pytest.approx(4e11)
    # Unlabelled series would teach both; labelled ones reach the generic terms too.
    learned_host = CostModel.from_metrics(SOURCE_METRICS, TARGET_METRICS, prior=model)
    assert learned_host.costs_for("device").bandwidth_bytes_per_s == pytest.approx(
        slowest.bandwidth_bytes_per_s
    )
    assert learned_host.costs_for("host").bandwidth_bytes_per_s == pytest.approx(2e9)


def test_device_prior_is_priced_from_the_routes_of_the_size_query() -> None:
    """With the source's size query the device path's prior splits the bytes by tier:
    GPU -> GPU for the device-held tokens, host -> GPU for the rest; learned terms and the
    host path ignore it."""
    model = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.01, bytes_per_token=1000),
        PrefillCosts(seconds_per_token=1e-6),
    )
    gpu, host = ROUTE_PRIORS[GPU_TO_GPU], ROUTE_PRIORS[HOST_TO_GPU]
    half = _held(8000, 4000)
    est = model.estimate(8000, path="device", held=half)
    seconds = 4e6 / gpu.bandwidth_bytes_per_s + 4e6 / host.bandwidth_bytes_per_s
    assert est.migrate_s == pytest.approx(max(gpu.overhead_s, host.overhead_s) + seconds)
    on_gpu = _held(8000, 8000)
    assert model.estimate(8000, path="device", held=on_gpu).migrate_s == pytest.approx(
        gpu.overhead_s + 8e6 / gpu.bandwidth_bytes_per_s
    )
    on_host = _held(8000, 0)
    assert model.estimate(8000, path="device", held=on_host) == model.estimate(8000, path="device")
    assert model.estimate(8000, path="host", held=half) == model.estimate(8000, path="host")
    learned = CostModel(
        model.migration,
        model.prefill,
        by_path={"device": MigrationCosts(bandwidth_bytes_per_s=4e11, origin="metrics")},
    )
    assert learned.costs_for("device", half).bandwidth_bytes_per_s == 4e11


# --------------------------------------------------------------------------- learned routes


def _registry_text(*model_names: str) -> str:
    """The real registry's exposition text, only the series of these model names (other
    tests of the session record theirs in the same process-wide registry)."""
    from prometheus_client import REGISTRY, generate_latest

    wanted = tuple(f'model_name="{name}"' for name in model_names)
    lines = generate_latest(REGISTRY).decode().splitlines()
    return "\n".join(line for line in lines if any(w in line for w in wanted)) + "\n"


def test_route_names_are_the_servers() -> None:
    from sglang_kv_migration.paths import base
    from sglang_kv_migration.rollout.cost_model import (
        GPU_TO_SHARED_HOST,
        HOST_TO_HOST,
        HOST_TO_SHARED_HOST,
        LANDING,
        PATH_ROUTES,
    )

    ours = (GPU_TO_GPU, HOST_TO_GPU, LANDING, HOST_TO_HOST, GPU_TO_SHARED_HOST, HOST_TO_SHARED_HOST)
    assert ours == base.ROUTE_NAMES
    assert set(ROUTE_PRIORS) == set(base.ROUTE_NAMES)
    assert set(PATH_ROUTES) == set(base.PATH_NAMES)


def test_each_route_is_learned_from_the_servers_series() -> None:
    """Two source ranks report per-route bytes and seconds and per-path fixed seconds
    (`MigrationMetrics.routes`, as `source/transfers.py` records a finished send); the
    target its allocate and commit phases. Rates and fixed costs come from them, the
    landing route (no series) keeps its prior, and moves are priced by their routes."""
    from sglang_kv_migration.rollout.cost_model import HOST_TO_HOST, LANDING
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics
    from sglang_kv_migration.wire.moments import Phase

    for tp in (0, 1):  # one device send (half its bytes on each tier) and one host send
        ranks = MigrationMetrics("routes-src", tp, 0)
        ranks.routes("device", {GPU_TO_GPU: (10**9, 0.001), HOST_TO_GPU: (10**9, 0.02)}, 0.03)
        ranks.routes("host", {HOST_TO_HOST: (10**9, 0.5)}, 0.1)
    target = MigrationMetrics("routes-dst", 0, 0)
    target.phase(Phase.ALLOCATE, 0.01)
    target.phase(Phase.COMMIT, 0.005)
    source_text, target_text = _registry_text("routes-src"), _registry_text("routes-dst")
    assert 'route="host_to_gpu"' in source_text and "kv_migration_fixed_seconds" in source_text

    prior = CostModel(
        MigrationCosts(bandwidth_bytes_per_s=1e9, overhead_s=0.01, bytes_per_token=1000),
        PrefillCosts(seconds_per_token=1e-4),
    )
    model = CostModel.from_metrics(source_text, target_text, prior=prior, http_overhead_s=0.005)
    routes = model.routes
    # 2 GB on two ranks in 1 ms each: 2 TB/s; 2 GB in 20 ms each: 100 GB/s; 2 GB in 0.5 s: 4 GB/s.
    assert routes[GPU_TO_GPU].bandwidth_bytes_per_s == pytest.approx(2e12)
    assert routes[HOST_TO_GPU].bandwidth_bytes_per_s == pytest.approx(1e11)
    assert routes[HOST_TO_HOST].bandwidth_bytes_per_s == pytest.approx(4e9)
    # Fixed: the source's 30 ms (device) or 100 ms (host) + 10 ms allocate + 5 ms commit
    # + 5 ms HTTP.
    assert routes[GPU_TO_GPU].overhead_s == pytest.approx(0.05)
    assert routes[HOST_TO_GPU].overhead_s == pytest.approx(0.05)
    assert routes[HOST_TO_HOST].overhead_s == pytest.approx(0.12)
    assert {r: c.origin for r, c in routes.items()} == {
        GPU_TO_GPU: "metrics",
        HOST_TO_GPU: "metrics",
        HOST_TO_HOST: "metrics",
        LANDING: "prior",
        "gpu_to_shared_host": "prior",
        "host_to_shared_host": "prior",
    }
    assert routes[LANDING] == ROUTE_PRIORS[LANDING]

    # 8000 tokens, 8 MB: half held on the GPU (4 MB at 2 TB/s + 4 MB at 100 GB/s).
    half = _held(8000, 4000)
    device = model.estimate(8000, path="device", held=half)
    assert device.migrate_s == pytest.approx(0.05 + 4e6 / 2e12 + 4e6 / 1e11)
    # Without a size query: all on host -> GPU, the device path's slowest route.
    assert model.estimate(8000, path="device").migrate_s == pytest.approx(0.05 + 8e6 / 1e11)
    # The host path, its route measured: priced from it.
    host = model.estimate(8000, path="host")
    assert host.migrate_s == pytest.approx(0.12 + 8e6 / 4e9)
    assert model.costs_for("host").origin == "routes"
    # Learning again from the learned model changes nothing.
    again = CostModel.from_metrics(source_text, target_text, prior=model, http_overhead_s=0.005)
    assert again == model


def test_routes_without_the_target_keep_their_prior_fixed_cost() -> None:
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics

    MigrationMetrics("routes-alone", 0, 0).routes("device", {HOST_TO_GPU: (5 * 10**8, 0.01)}, 0.2)
    model = CostModel.from_metrics(_registry_text("routes-alone"), None)
    learned = model.routes[HOST_TO_GPU]
    assert learned.bandwidth_bytes_per_s == pytest.approx(5e10)
    assert learned.overhead_s == ROUTE_PRIORS[HOST_TO_GPU].overhead_s  # no target numbers
    assert model.routes[GPU_TO_GPU] == ROUTE_PRIORS[GPU_TO_GPU]
    # No host route measured: the host path keeps the generic terms.
    assert "host" not in model.by_path
    assert model.costs_for("host") == model.migration
    # No series at all: every route is its prior.
    assert CostModel.from_metrics("", "").routes == dict(ROUTE_PRIORS)
