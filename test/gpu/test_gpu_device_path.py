"""Same-host device path (GPU -> GPU through CUDA IPC) between real SGLang 0.5.12 servers.

Run on the lent GPU machine (never in CI), from the repo root, after installing the wheel
sets and this package as `../shared/gpu/README.md` says (nothing else to install):

    KVMIG_GPU_OUT=$OUT/mha-page1 KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=1 \
        python3 -m pytest -m gpu -s -p no:cacheprovider test/gpu/test_gpu_device_path.py

Parameters (environment):
- `KVMIG_ATTENTION`: `mha` (small dummy Llama) or `mla` (small dummy DeepseekV2, MLA pool).
- `KVMIG_PAGE_SIZE`: `--page-size` of every server (1, 16, 64, ...).
- `KVMIG_TP=2`: every server runs `--tp-size 2` on GPUs 0 and 1 (an nvidia-h200-x2
  machine); rank r of the source copies into rank r of the target, on the same GPU.
  Not run yet.
- `KVMIG_PP=2`: every server runs `--pp-size 2` on GPUs 0 and 1: stage s (its own
  layers, on GPU s) of the source copies into stage s of the target, on the same GPU.
  SGLang 0.5.12 accepts `--pp-size 2` with `--enable-hierarchical-cache` and turns the
  overlap scheduler off for PP by itself (`--disable-overlap-schedule` is passed anyway).
  Under PP, `/v1/loads` (the pool checks below) reports stage 0 only. Not run yet.
  `KVMIG_TP`/`KVMIG_PP` > 1 cannot be combined with `KVMIG_TWO_GPUS=1` on a 2-GPU machine.
- `KVMIG_PORT_BASE`: the servers listen on base+10/20/30 (default 30500), so two
  configurations can run side by side on one GPU.
- `KVMIG_TWO_GPUS=1`: the target runs on GPU 1 (`--base-gpu-id 1`, an nvidia-h200-x2
  machine), so the device path crosses GPUs; otherwise all servers share GPU 0.

Three servers: `source` and `target` with the default `--kv-migration-paths`
(device,host), and `host_only` with `--kv-migration-paths host`. Migrations run through
the Python client in this process (`MigrationClient().migrate(..., path=...)`).

Greedy outputs are compared with the *source serving the same prompt from its own cache*
(a second request there), not with its first, fresh request: with MLA a fresh prompt is
prefilled by the MHA kernels and a cached prefix by the absorbed-MLA kernels, so only the
cached run is the same computation as the target's. Dummy weights make the output
degenerate; equal output_ids is weak evidence, `cached_tokens_details.device` is the real
check that the target served the migrated pages from its GPU.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TEST_MODELS,
    ServerSpec,
    cached_details,
    cached_tokens,
    flush_cache,
    generate,
    kv_pool_usage,
    record,
    running_servers,
    settled_used_tokens,
    wait_for_value,
    write_model,
)

pytestmark = pytest.mark.gpu

PAGE_SIZE = int(os.environ.get("KVMIG_PAGE_SIZE", "1"))
ATTENTION = os.environ.get("KVMIG_ATTENTION", "mha").lower()
TWO_GPUS = os.environ.get("KVMIG_TWO_GPUS", "") == "1"
TP_SIZE = int(os.environ.get("KVMIG_TP", "1"))
PP_SIZE = int(os.environ.get("KVMIG_PP", "1"))
# Another base runs a second configuration beside this one on the same GPU.
PORT_BASE = int(os.environ.get("KVMIG_PORT_BASE", "30500"))
MAX_TOTAL_TOKENS = 65536  # GPU KV pool per server; host pool = 2x (hicache_ratio)
POOL_SETTLE_TIMEOUT_S = 90.0  # > the 60 s default watchdog: quarantined slots come back


@dataclass(frozen=True)
class Servers:
    source: str
    target: str
    host_only: str
    page_size: int
    vocab_size: int


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    if ATTENTION not in TEST_MODELS:
        raise ValueError(f"KVMIG_ATTENTION must be one of {sorted(TEST_MODELS)}, got {ATTENTION}")
    if TWO_GPUS and TP_SIZE * PP_SIZE > 1:
        pytest.skip("KVMIG_TWO_GPUS=1 puts the target on GPU 1; with TP/PP > 1 it needs more GPUs")
    shape, model_dir = TEST_MODELS[ATTENTION]
    write_model(shape, model_dir)
    common = ["--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.2"]
    common += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--enable-metrics"]
    common += ["--tp-size", str(TP_SIZE), "--pp-size", str(PP_SIZE)]
    if PP_SIZE > 1:
        common.append("--disable-overlap-schedule")  # SGLang forces it for PP anyway
    specs = [
        ServerSpec(PORT_BASE + 10, common, gpu_id=0),
        ServerSpec(PORT_BASE + 20, common, gpu_id=1 if TWO_GPUS else 0),
        ServerSpec(PORT_BASE + 30, [*common, "--kv-migration-paths", "host"], gpu_id=0),
    ]
    record(
        "device_path_config",
        {
            "attention": ATTENTION,
            "page_size": PAGE_SIZE,
            "two_gpus": TWO_GPUS,
            "tp_size": TP_SIZE,
            "pp_size": PP_SIZE,
            "model": shape,
        },
    )
    with running_servers(model_dir, specs) as (source, target, host_only):
        yield Servers(source, target, host_only, PAGE_SIZE, int(shape["vocab_size"]))


@pytest.fixture(scope="module")
def client() -> Iterator[MigrationClient]:
    # One client for the module: it may cache session info across migrations.
    with MigrationClient() as c:
        yield c


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]  # no bos/eos ids


def _aligned(n: int, page_size: int) -> int:
    return n // page_size * page_size


def _summary(result: Any) -> dict[str, Any]:
    d = result.to_dict()
    copy_s = float(d.get("copy_seconds") or 0.0)
    d["copy_gb_per_s"] = d["migrated_bytes"] / copy_s / 1e9 if copy_s > 0 else None
    return d


def _allocating_client(transport: httpx.BaseTransport, s: Servers) -> MigrationClient:
    """A client that sends its own allocate trip (it does not see "source_allocate"),
    so a test can act between the allocate and the copy."""
    allocating = MigrationClient(http_client=httpx.Client(transport=transport, timeout=120))
    for url in (s.source, s.target):
        info = allocating.session_info(url)  # the cached info it plans from
        info.features = [f for f in info.features if f != "source_allocate"]
    return allocating


class _AfterAllocate(httpx.BaseTransport):
    """Real HTTP, plus a hook on the first call the client makes after a successful
    allocate on the target (whatever that call is: the copy is driven from there). The
    hook may return a response to send instead of the real call. Calls to abort pass."""

    def __init__(
        self,
        hook: Callable[[httpx.Request], httpx.Response | None],
        inner: httpx.BaseTransport | None = None,
    ):
        self._inner = inner or httpx.HTTPTransport()
        self._hook = hook
        self.allocate_reply: dict[str, Any] | None = None
        self.hooked_path: str | None = None
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if self.allocate_reply is not None and self.hooked_path is None and "abort" not in path:
            self.hooked_path = path
            replaced = self._hook(request)
            if replaced is not None:
                return replaced
        response = self._inner.handle_request(request)
        if "allocate" in path and response.status_code < 300:
            response.read()
            self.allocate_reply = response.json()
        return response

    def close(self) -> None:
        self._inner.close()


def test_device_path_prompt_served_from_target_gpu(servers: Servers, client: MigrationClient):
    s = servers
    rng = random.Random(0)
    prompt = _tokens(rng, 2001, s.vocab_size)

    control = generate(s.target, _tokens(rng, 500, s.vocab_size), 4)
    assert cached_tokens(control) == 0

    fresh = generate(s.source, prompt)
    reference = generate(s.source, prompt)  # served from the source's own cache

    # SGLang always computes the last prompt token: migrate exactly the prefix before it.
    expected = _aligned(len(prompt) - 1, s.page_size)
    result = client.migrate(s.source, s.target, prompt[:-1], path="device")
    on_target = generate(s.target, prompt)
    details = cached_details(on_target)
    record(
        "device_prompt",
        {
            "attention": ATTENTION,
            "page_size": s.page_size,
            "two_gpus": TWO_GPUS,
            "prompt_tokens": len(prompt),
            "result": _summary(result),
            "source_fresh_output_ids": fresh["output_ids"],
            "source_cached_output_ids": reference["output_ids"],
            "source_cached_details": cached_details(reference),
            "target_output_ids": on_target["output_ids"],
            "target_cached_tokens": cached_tokens(on_target),
            "target_cached_details": details,
            "fresh_equals_cached_on_source": fresh["output_ids"] == reference["output_ids"],
        },
    )
    assert result.path == "device", result
    assert result.migrated_token_size == expected
    assert result.matched_after_commit == expected
    assert result.migrated_bytes > 0 and result.copy_seconds > 0
    # Single-rank servers list "source_allocate": one call, the source allocated on the
    # target through its channel (TP/PP servers: the client's own allocate trip).
    one_trip = "source_allocate" in client.session_info(s.target).features
    assert ("allocate" in result.timings) != one_trip, result.timings
    assert on_target["output_ids"] == reference["output_ids"]
    assert cached_tokens(on_target) >= expected
    assert details["device"] >= expected, details


def test_device_path_continuation_of_an_aborted_request(servers: Servers, client: MigrationClient):
    """The RL case: prompt + generated tokens move GPU to GPU and continue on the target."""
    s = servers
    rng = random.Random(1)
    prompt = _tokens(rng, 1500, s.vocab_size)
    first = generate(s.source, prompt, 32)
    continuation = prompt + first["output_ids"]

    result = client.migrate(s.source, s.target, continuation[:-1], path="device")
    on_target = generate(s.target, continuation, 16)
    on_source = generate(s.source, continuation, 16)
    record(
        "device_continuation",
        {
            "continuation_tokens": len(continuation),
            "result": _summary(result),
            "target_cached_details": cached_details(on_target),
            "source_cached_details": cached_details(on_source),
            "outputs_equal": on_target["output_ids"] == on_source["output_ids"],
        },
    )
    assert result.path == "device", result
    assert result.migrated_token_size > len(prompt) - s.page_size
    assert on_target["output_ids"] == on_source["output_ids"]
    assert cached_details(on_target)["device"] >= result.migrated_token_size


def test_auto_path_prefers_device(servers: Servers, client: MigrationClient):
    s = servers
    rng = random.Random(2)
    prompt = _tokens(rng, 1200, s.vocab_size)
    generate(s.source, prompt, 1)

    result = client.migrate(s.source, s.target, prompt[:-1])  # path=None: auto
    on_target = generate(s.target, prompt, 4)
    record(
        "auto_same_host",
        {"result": _summary(result), "target_cached_details": cached_details(on_target)},
    )
    assert result.path == "device", result
    assert not result.fallback_reason, result.fallback_reason
    assert cached_details(on_target)["device"] >= result.migrated_token_size > 0


def test_host_only_server_gets_the_host_path(servers: Servers, client: MigrationClient):
    """A server started with `--kv-migration-paths host`: path="device" is refused,
    auto falls back to host and says why."""
    s = servers
    rng = random.Random(3)
    prompt = _tokens(rng, 1800, s.vocab_size)
    generate(s.source, prompt, 1)
    expected = _aligned(len(prompt) - 1, s.page_size)
    used_before = settled_used_tokens(s.host_only)

    with pytest.raises(MigrationFailed) as refused:
        client.migrate(s.source, s.host_only, prompt[:-1], path="device")
    used_after_refusal = settled_used_tokens(s.host_only)

    result = client.migrate(s.source, s.host_only, prompt[:-1])
    on_target = generate(s.host_only, prompt)
    reference = generate(s.source, prompt)
    record(
        "host_only_fallback",
        {
            "device_refusal": {
                "phase": refused.value.phase,
                "message": refused.value.message,
                "rolled_back": refused.value.rolled_back,
            },
            "used_before": used_before,
            "used_after_refusal": used_after_refusal,
            "result": _summary(result),
            "target_cached_details": cached_details(on_target),
            "outputs_equal": on_target["output_ids"] == reference["output_ids"],
        },
    )
    assert used_after_refusal == used_before
    assert result.path == "host", result
    assert result.fallback_reason, "auto fell back without saying why"
    assert result.migrated_token_size == expected
    assert on_target["output_ids"] == reference["output_ids"]
    assert cached_tokens(on_target) >= expected
    assert cached_details(on_target)["host"] >= expected


def test_abort_of_a_device_allocation_returns_the_target_pool(
    servers: Servers, client: MigrationClient
):
    """The call after allocate fails (injected in the client's HTTP transport): the
    client aborts, and the target's device pool returns to its size before; the same
    prefix then migrates normally into the reused slots."""
    s = servers
    rng = random.Random(4)
    prompt = _tokens(rng, 1025, s.vocab_size)
    generate(s.source, prompt, 1)
    expected = _aligned(len(prompt) - 1, s.page_size)

    before = settled_used_tokens(s.target)
    during: dict[str, int] = {}

    def fail_the_copy(request: httpx.Request) -> httpx.Response:
        during.update(kv_pool_usage(s.target))
        return httpx.Response(503, json={"success": False, "message": "injected by the test"})

    transport = _AfterAllocate(fail_the_copy)
    with _allocating_client(transport, s) as failing:
        with pytest.raises(MigrationFailed) as failed:
            failing.migrate(s.source, s.target, prompt[:-1], path="device")
    after_abort = wait_for_value(
        lambda: kv_pool_usage(s.target)["num_used_tokens"],
        lambda used: used == before,
        timeout_s=POOL_SETTLE_TIMEOUT_S,
        interval_s=0.5,
    )

    retry = client.migrate(s.source, s.target, prompt[:-1], path="device")
    on_target = generate(s.target, prompt, 8)
    reference = generate(s.source, prompt, 8)
    record(
        "device_abort",
        {
            "calls": transport.paths,
            "failed_call": transport.hooked_path,
            "phase": failed.value.phase,
            "rolled_back": failed.value.rolled_back,
            "used_before": before,
            "used_while_allocated": during.get("num_used_tokens"),
            "used_after_abort": after_abort,
            "retry": _summary(retry),
            "retry_target_cached_details": cached_details(on_target),
        },
    )
    assert transport.allocate_reply is not None, transport.paths
    assert failed.value.rolled_back, failed.value
    assert during["num_used_tokens"] - before >= expected, (before, during)
    assert after_abort == before
    assert retry.path == "device" and retry.migrated_token_size == expected
    assert on_target["output_ids"] == reference["output_ids"]
    assert cached_details(on_target)["device"] >= expected


def test_flush_drops_a_pending_device_allocation(servers: Servers, client: MigrationClient):
    """RL frameworks flush after a weight update. A flush between allocate and the copy
    drops the pending device allocation: the migration fails (commit answers "gone"),
    the pool comes back, and the prefix migrates normally afterwards."""
    s = servers
    rng = random.Random(5)
    prompt = _tokens(rng, 777, s.vocab_size)
    generate(s.source, prompt, 1)
    expected = _aligned(len(prompt) - 1, s.page_size)

    flush_cache(s.target)
    base = settled_used_tokens(s.target)
    flushed: dict[str, Any] = {}

    def flush_then_continue(request: httpx.Request) -> None:
        flushed["used_while_allocated"] = kv_pool_usage(s.target)["num_used_tokens"]
        flush_cache(s.target)
        flushed["ok"] = True
        return None

    transport = _AfterAllocate(flush_then_continue)
    with _allocating_client(transport, s) as c:
        with pytest.raises(MigrationFailed) as failed:
            c.migrate(s.source, s.target, prompt[:-1], path="device")
    after = wait_for_value(
        lambda: kv_pool_usage(s.target)["num_used_tokens"],
        lambda used: used == base,
        timeout_s=POOL_SETTLE_TIMEOUT_S,
        interval_s=0.5,
    )
    retry = client.migrate(s.source, s.target, prompt[:-1], path="device")
    on_target = generate(s.target, prompt, 4)
    record(
        "device_flush",
        {
            "calls": transport.paths,
            "phase": failed.value.phase,
            "message": failed.value.message,
            "status": failed.value.status_code,
            "used_base": base,
            **flushed,
            "used_after": after,
            "retry": _summary(retry),
            "retry_target_cached_details": cached_details(on_target),
        },
    )
    assert flushed.get("ok") is True
    assert flushed["used_while_allocated"] - base >= expected
    assert failed.value.phase in ("transfer", "commit"), failed.value
    assert after == base
    assert retry.path == "device" and retry.migrated_token_size == expected
    assert cached_details(on_target)["device"] >= expected


def _push_to_host(s: Servers, rng: random.Random) -> int:
    """Push ~1.3 pools of other prompts through the source: what it held on GPU goes to
    its host tier (write-through kept a copy; < 2 pools, so the host tier still has it)."""
    pool = kv_pool_usage(s.source)["max_total_num_tokens"]
    flood_len = 7000  # fits the 8192-token context of both test models
    flood = 0
    while flood < 1.3 * pool:
        generate(s.source, _tokens(rng, flood_len, s.vocab_size), 1)
        flood += flood_len
    return flood


def _held_on_host_only(s: Servers, rng: random.Random, n: int) -> list[int]:
    """A fresh prompt of `n` tokens the source holds only on its host tier (both caches
    flushed first)."""
    flush_cache(s.source)
    flush_cache(s.target)
    prompt = _tokens(rng, n, s.vocab_size)
    generate(s.source, prompt, 1)
    _push_to_host(s, rng)
    return prompt


def _check_any_tier_migration(
    s: Servers, client: MigrationClient, prompt: list[int], name: str, host_tokens: int
) -> None:
    """Auto must take the device path with no fallback; the target serves every migrated
    token from its GPU and answers as the source does from its own cache."""
    expected = _aligned(len(prompt) - 1, s.page_size)
    held = client.call(s.source, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})
    assert held["matched_token_size"] == expected, held  # still on the source
    assert held["matched_token_size"] - held["device_token_size"] >= host_tokens, held
    result = client.migrate(s.source, s.target, prompt[:-1])  # auto
    on_target = generate(s.target, prompt)
    reference = generate(s.source, prompt)
    record(
        name,
        {
            "source_held": held,
            "result": _summary(result),
            "target_cached_details": cached_details(on_target),
            "source_reload_details": cached_details(reference),
            "outputs_equal": on_target["output_ids"] == reference["output_ids"],
        },
    )
    assert result.path == "device" and not result.fallback_reason, result
    assert result.migrated_token_size == expected
    assert on_target["output_ids"] == reference["output_ids"]
    assert cached_details(on_target)["device"] >= expected, cached_details(on_target)


def test_device_path_when_the_source_holds_the_prefix_only_on_host(
    servers: Servers, client: MigrationClient
):
    """(b) The prompt evicted from the source's GPU (host tier only): the device path reads
    the source's pinned host pool in place; the size query says device_token_size 0."""
    s = servers
    rng = random.Random(6)
    prompt = _held_on_host_only(s, rng, 2001)
    expected = _aligned(len(prompt) - 1, s.page_size)
    _check_any_tier_migration(s, client, prompt, "device_source_on_host", expected)


def test_device_path_when_the_source_holds_half_on_device_half_on_host(
    servers: Servers, client: MigrationClient
):
    """(c) Mixed: after the push to host, a request that shares the first half loads that
    half back to the source's GPU; the second half stays on host only."""
    s = servers
    rng = random.Random(7)
    prompt = _held_on_host_only(s, rng, 2001)
    half = _aligned(1000, s.page_size)
    generate(s.source, prompt[:half] + _tokens(rng, 64, s.vocab_size), 1)  # loads half back
    held = client.call(s.source, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})
    assert held["device_token_size"] >= half, held
    expected = _aligned(len(prompt) - 1, s.page_size)
    _check_any_tier_migration(s, client, prompt, "device_source_mixed", expected - half)


def test_moves_batched_in_one_call_each_serve_from_the_target_gpu(
    servers: Servers, client: MigrationClient
):
    """Feature "transfer_batch": three prompts, one of them held only on the source's
    host tier, moved by one `migrate_many` (their transfers in one call; the copies of
    the moves the source starts in one iteration launched together): each is served
    from the target's GPU with the source's answer."""
    from sglang_kv_migration.client import MigrationResult, Move

    s = servers
    rng = random.Random(8)
    on_host = _held_on_host_only(s, rng, 1201)
    prompts = [on_host, _tokens(rng, 1601, s.vocab_size), _tokens(rng, 801, s.vocab_size)]
    for p in prompts[1:]:
        generate(s.source, p, 1)
    results = client.migrate_many([Move(s.source, s.target, p[:-1]) for p in prompts])
    served = [generate(s.target, p) for p in prompts]
    references = [generate(s.source, p) for p in prompts]
    record(
        "device_batched_moves",
        {
            "results": [_summary(r) if isinstance(r, MigrationResult) else str(r) for r in results],
            "target_cached_details": [cached_details(o) for o in served],
            "outputs_equal": [
                o["output_ids"] == r["output_ids"] for o, r in zip(served, references, strict=True)
            ],
        },
    )
    for p, result, on_target, reference in zip(prompts, results, served, references, strict=True):
        expected = _aligned(len(p) - 1, s.page_size)
        assert isinstance(result, MigrationResult), result
        assert result.path == "device" and not result.fallback_reason, result
        assert result.migrated_token_size == expected
        assert on_target["output_ids"] == reference["output_ids"]
        assert cached_details(on_target)["device"] >= expected, cached_details(on_target)


def test_route_metrics_teach_the_cost_model(servers: Servers):
    """Runs after the migrations above (fresh, host-only and mixed prefixes on the device
    path): the source reported bytes and copy time per route and its fixed cost, and the
    cost model learns the GPU -> GPU and host -> GPU rates from the two `/metrics` texts."""
    from sglang_kv_migration.rollout.cost_model import GPU_TO_GPU, HOST_TO_GPU, CostModel

    source_text = httpx.get(servers.source + "/metrics", timeout=30).text
    target_text = httpx.get(servers.target + "/metrics", timeout=30).text
    routes = CostModel.from_metrics(source_text, target_text).routes
    record(
        "route_costs",
        {
            "series": [
                line
                for line in source_text.splitlines()
                if line.startswith(("sglang:kv_migration_route_", "sglang:kv_migration_fixed"))
            ][:40],
            "routes": {name: vars(cost) for name, cost in routes.items()},
        },
    )
    for route in (GPU_TO_GPU, HOST_TO_GPU):
        assert routes[route].origin == "metrics", routes[route]
        # A real rate (the tiny model's copies are a few MB, so launch latency weighs in;
        # the Llama-3-8B-shaped rates are in docs/benchmarks.md).
        assert routes[route].bandwidth_bytes_per_s > 2e9, routes[route]
        assert 0 < routes[route].overhead_s < 5, routes[route]
