"""The host-tier landing between real SGLang 0.5.12 servers on one GPU: a target whose GPU
pool is full takes a same-host move into its host tier through shared memory (path
`shared_host`), never the host path's Mooncake TCP, and serves it from there.

Run on the lent GPU machine (never in CI), from the repo root:

    KVMIG_GPU_OUT=$OUT/landing KVMIG_PAGE_SIZE=16 \
        python3 -m pytest -m gpu -s -p no:cacheprovider test/gpu/test_gpu_host_landing.py

Two servers with the default `--kv-migration-paths` (device,shared_host,host), a tiny
dummy Llama. The target's GPU pool is held full by its own running requests, paused in
place (`full_pool.py`: nothing evictable); the client's auto path is refused by the
device path at allocate ("device KV pool is full") and lands the prefix in the target's
host tier (`MigrationResult.path` "shared_host", `landing_tier` "host"). Once the
requests end, the target serves the prompt: `cached_tokens_details.host` counts the
moved tokens (HiCache loaded them back) and the greedy output equals the source's own
cached answer. Both servers' host pools live in memory files and are pinned, so both
read their host tier in place (`paths.shared_host.tiers` lists "host").
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tier_placement  # noqa: E402
from full_pool import FullPool  # noqa: E402
from real_servers import (  # noqa: E402
    TEST_MODELS,
    ServerSpec,
    cached_details,
    flush_cache,
    generate,
    record,
    running_servers,
    write_model,
)

pytestmark = pytest.mark.gpu

PAGE_SIZE = int(os.environ.get("KVMIG_PAGE_SIZE", "16"))
PORT_BASE = int(os.environ.get("KVMIG_PORT_BASE", "30700"))
TARGET_POOL = 8192  # the target's GPU KV pool, tokens
SOURCE_POOL = 16384  # tokens; its host pool holds twice that (SGLang's default hicache ratio)
FLOOD_PROMPT = 4096  # what pushes a prompt out of the source's GPU, a few at a time
PROMPT = 2049  # the moved prompts: 2048 tokens move (its last is recomputed)
# The target's own requests: 4 x 1600 prompt tokens leave < 1800 of 8192 free, less than
# a moved prompt's 2048 (admitted together: 4 x (1600 + 0.7 x 512) < 8192).
DECODES, DECODE_PROMPT, DECODE_NEW = 4, 1600, 512


@dataclass(frozen=True)
class Servers:
    source: str
    target: str
    vocab_size: int


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    shape, model_dir = TEST_MODELS["mha"]
    write_model(shape, model_dir)
    common = ["--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.2", "--enable-metrics"]
    specs = [
        ServerSpec(PORT_BASE + 10, [*common, "--max-total-tokens", str(SOURCE_POOL)], gpu_id=0),
        ServerSpec(PORT_BASE + 20, [*common, "--max-total-tokens", str(TARGET_POOL)], gpu_id=0),
    ]
    # Started together: their pools are capped far below what either measures free, so
    # a neighbour's loading cannot shrink them (one after the other: ~40 s more).
    with running_servers(model_dir, specs) as (source, target):
        yield Servers(source, target, int(shape["vocab_size"]))


@pytest.fixture(scope="module")
def client() -> Iterator[MigrationClient]:
    with MigrationClient() as c:
        yield c


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def _full_target(s: Servers, seed: int) -> FullPool:
    return FullPool(
        s.target,
        decodes=DECODES,
        prompt_tokens=DECODE_PROMPT,
        max_new_tokens=DECODE_NEW,
        vocab_size=s.vocab_size,
        seed=seed,
    )


def _place_on_host_tier(
    s: Servers, client: MigrationClient, prompt: list[int], rng: random.Random
) -> tier_placement.Placement:
    """`prompt` cached on the source, then flooded out of its GPU pool but not out of its
    host pool (`tier_placement.py`: a flood of twice the GPU pool overflows a host pool of
    twice the GPU pool and loses the prompt from both tiers)."""
    return tier_placement.place_in_host_tier(
        {"prompt": prompt},
        serve=lambda ids: generate(s.source, ids, 1),
        held=lambda ids: client.call(s.source, "/get_request_extra_token_size",
                                     {"input_ids": ids[:-1]}),
        fresh=lambda n: _tokens(rng, n, s.vocab_size),
        device_tokens=SOURCE_POOL,
        page_size=PAGE_SIZE,
        flood_prompt_tokens=FLOOD_PROMPT,
    )  # fmt: skip


def _summary(result: Any) -> dict[str, Any]:
    keep = ("path", "landing_tier", "fallback_reason", "migrated_token_size", "migrated_bytes")
    d = result.to_dict()
    return {**{k: d[k] for k in keep}, "copy_ms": d["copy_seconds"] * 1e3,
            "timings_ms": {k: v * 1e3 for k, v in d["timings"].items()},
            "transfer_steps_ms": d["transfer_steps_ms"]}  # fmt: skip


def test_both_servers_keep_their_host_pools_in_shared_pinned_memory(servers: Servers):
    for url in (servers.source, servers.target):
        info = httpx.post(url + "/get_transfer_session_info", json={}, timeout=30).json()
        paths = info["ranks"][0]["paths"]
        assert list(paths) == ["device", "shared_host", "host"], paths
        # The host tier is read in place only from a pinned pool: the memory file was
        # registered with CUDA as SGLang's own allocation is.
        assert paths["shared_host"]["tiers"] == ["device", "host"], paths["shared_host"]
        assert paths["device"]["tiers"] == ["device", "host"]


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_a_full_target_gpu_takes_the_move_into_its_host_tier(
    servers: Servers, client: MigrationClient, tier: str
):
    s = servers
    rng = random.Random(11 if tier == "gpu" else 12)
    for url in (s.source, s.target):
        flush_cache(url)
    prompt = _tokens(rng, PROMPT, s.vocab_size)
    moved = tier_placement.whole_tokens(prompt, PAGE_SIZE)
    placed = None
    if tier == "host":  # pushed out of the source's GPU by other prompts, whole on host
        placed = _place_on_host_tier(s, client, prompt, rng)
    else:
        generate(s.source, prompt, 1)
    held = client.call(s.source, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})
    with _full_target(s, seed=3) as full:
        result = client.migrate(s.source, s.target, prompt[:-1])  # auto
    on_target = generate(s.target, prompt)
    # The source's own cached answer (after the move: serving it loads a host-tier
    # prefix back to the source's GPU).
    reference = generate(s.source, prompt)
    details = cached_details(on_target)
    record(
        f"host_landing_{tier}",
        {
            "page_size": PAGE_SIZE,
            "source_held": held,
            "placement": placed.to_dict() if placed else None,
            "target_free_tokens_while_full": full.free_tokens,
            "target_usage_while_full": full.usage,
            "result": _summary(result),
            "target_cached_details": details,
            "outputs_equal": on_target["output_ids"] == reference["output_ids"],
        },
    )
    assert full.free_tokens < moved, "the target's GPU pool was not full"
    assert held["matched_token_size"] == moved, held  # the source held all of it
    if tier == "host":
        assert placed is not None and placed.all_placed, placed
        assert held["device_token_size"] == 0, held
    assert (result.path, result.landing_tier) == ("shared_host", "host"), result
    assert "device KV pool is full" in result.fallback_reason, result.fallback_reason
    assert result.migrated_token_size == moved
    # Read where it lay: the source's host tier in place, through its GPU.
    copied = {"gpu": "copy_device", "host": "copy_host"}[tier]
    assert set(result.transfer_steps_ms[0]) & {"copy_device", "copy_host"} == {copied}, result
    assert details["host"] >= moved, details
    assert on_target["output_ids"] == reference["output_ids"]


def test_a_pinned_shared_host_move_into_a_target_with_room(
    servers: Servers, client: MigrationClient
):
    """With room on the GPU the path still lands in the host tier when pinned: HiCache
    loads it back for the next request."""
    s = servers
    rng = random.Random(13)
    for url in (s.source, s.target):
        flush_cache(url)
    prompt = _tokens(rng, PROMPT, s.vocab_size)
    generate(s.source, prompt, 1)
    reference = generate(s.source, prompt)
    result = client.migrate(s.source, s.target, prompt[:-1], path="shared_host")
    on_target = generate(s.target, prompt)
    record("host_landing_pinned", {"result": _summary(result),
                                   "target_cached_details": cached_details(on_target)})  # fmt: skip
    assert (result.path, result.landing_tier, result.fallback_reason) == (
        "shared_host", "host", "",
    )  # fmt: skip
    assert result.copy_seconds > 0
    assert cached_details(on_target)["host"] >= result.migrated_token_size > 0
    assert on_target["output_ids"] == reference["output_ids"]
