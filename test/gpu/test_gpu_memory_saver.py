"""The device path between real SGLang 0.5.12 servers started with --enable-memory-saver.

Run on the lent GPU machine (never in CI), after installing the wheel sets, this package
and torch_memory_saver (carried as a wheel: `pip download torch_memory_saver==0.0.10`):

    KVMIG_GPU_OUT=$OUT/saver KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=16 \
        python3 -m pytest -m gpu -s -p no:cacheprovider test/gpu/test_gpu_memory_saver.py

Both servers run `--enable-memory-saver`: their KV pools are torch_memory_saver mappings
that CUDA IPC cannot export, so the target advertises a landing arena
(`--kv-migration-landing-mb`, small here so that a 2K prompt of the small Llama moves in
several rounds) and copies it into its pool at commit (`paths/device/landing.py`).
Checked: auto takes the device path with no fallback for a prefix the source holds on
its GPU, only on its host tier, or half and half; the target serves every migrated
token from its GPU with the output the source gives from its own cache; a kv-cache
release/resume of either server between migrations (a new epoch, a new arena) does not
stop the next migration; an allocation pending across a release is refused (410) and
an allocation while released too (503).

`KVMIG_TP=2` (an nvidia-h200-x2 machine): both servers run `--tp-size 2` on GPUs 0 and 1,
each rank with its own landing arena; rank r of the source copies into rank r of the
target, and a release/resume covers both ranks. Not run yet:

    KVMIG_GPU_OUT=$OUT/saver-tp2 KVMIG_TP=2 KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=16 \
        python3 -m pytest -m gpu -s -p no:cacheprovider test/gpu/test_gpu_memory_saver.py
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TEST_MODELS,
    ServerSpec,
    cached_details,
    flush_cache,
    generate,
    kv_pool_usage,
    record,
    running_servers,
    wait_for_value,
    write_model,
)
from test_gpu_device_path import (  # noqa: E402
    Servers,
    _aligned,
    _check_any_tier_migration,
    _push_to_host,
    _summary,
    _tokens,
)

pytestmark = pytest.mark.gpu

PAGE_SIZE = int(os.environ.get("KVMIG_PAGE_SIZE", "16"))
ATTENTION = os.environ.get("KVMIG_ATTENTION", "mha").lower()
LANDING_MB = int(os.environ.get("KVMIG_LANDING_MB", "16"))
TP_SIZE = int(os.environ.get("KVMIG_TP", "1"))
MAX_TOTAL_TOKENS = 65536


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    shape, model_dir = TEST_MODELS[ATTENTION]
    write_model(shape, model_dir)
    common = ["--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.2"]
    common += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--enable-metrics"]
    common += ["--enable-memory-saver", "--kv-migration-landing-mb", str(LANDING_MB)]
    common += ["--tp-size", str(TP_SIZE)]  # both servers on GPUs 0..TP_SIZE-1
    specs = [ServerSpec(30610, common, gpu_id=0), ServerSpec(30620, common, gpu_id=0)]
    record("memory_saver_config", {"attention": ATTENTION, "page_size": PAGE_SIZE,
                                   "landing_mb": LANDING_MB, "tp_size": TP_SIZE,
                                   "model": shape})  # fmt: skip
    with running_servers(model_dir, specs) as (source, target):
        yield Servers(source, target, "", PAGE_SIZE, int(shape["vocab_size"]))


@pytest.fixture(scope="module")
def client() -> Iterator[MigrationClient]:
    with MigrationClient() as c:  # one client: session info cached across releases
        yield c


def _memory(url: str, action: str) -> None:
    """`/release_memory_occupation` or `/resume_memory_occupation` of the KV cache, once
    the server is idle (SGLang asserts so for a release)."""
    wait_for_value(
        lambda: kv_pool_usage(url),
        lambda load: load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0,
        timeout_s=60,
        interval_s=0.2,
    )
    r = httpx.post(f"{url}/{action}_memory_occupation", json={"tags": ["kv_cache"]}, timeout=120)
    r.raise_for_status()


def _device_ads(client: MigrationClient, url: str) -> list[dict[str, Any]]:
    """Every rank's device-path advertisement (one per TP rank)."""
    ranks = client.call(url, "/get_transfer_session_info", {})["ranks"]
    return [rank["paths"]["device"] for rank in ranks]


def test_both_servers_advertise_a_landing_arena(servers: Servers, client: MigrationClient):
    for url in (servers.source, servers.target):
        ads = _device_ads(client, url)
        assert len(ads) == TP_SIZE, ads
        for ad in ads:
            assert ad["landing_tokens"] > 0 and ad["buffers"], ad


@pytest.mark.parametrize("tier", ["gpu", "host", "mixed"])
def test_memory_saver_target_serves_the_migrated_prompt_from_its_gpu(
    servers: Servers, client: MigrationClient, tier: str
):
    s = servers
    rng = random.Random(10 + ["gpu", "host", "mixed"].index(tier))
    flush_cache(s.source)
    flush_cache(s.target)
    prompt = _tokens(rng, 2001, s.vocab_size)
    generate(s.source, prompt, 1)
    expected = _aligned(len(prompt) - 1, s.page_size)
    host_tokens = 0
    if tier != "gpu":
        _push_to_host(s, rng)
        host_tokens = expected
    if tier == "mixed":
        half = _aligned(1000, s.page_size)
        generate(s.source, prompt[:half] + _tokens(rng, 64, s.vocab_size), 1)  # half back
        host_tokens = expected - half
    _check_any_tier_migration(s, client, prompt, f"memory_saver_{tier}", host_tokens)


def test_release_and_resume_between_migrations(servers: Servers, client: MigrationClient):
    s = servers
    rng = random.Random(20)
    results: dict[str, Any] = {}
    for who in ("target", "source"):
        url = s.target if who == "target" else s.source
        before = [ad["instance_id"] for ad in _device_ads(client, url)]
        _memory(url, "release")
        _memory(url, "resume")
        after = _device_ads(client, url)
        for old_id, ad in zip(before, after, strict=True):  # every rank: a new arena
            assert ad["instance_id"] != old_id and ad["landing_tokens"] > 0, (before, after)
        prompt = _tokens(rng, 1500, s.vocab_size)
        generate(s.source, prompt, 1)
        reference = generate(s.source, prompt)
        result = client.migrate(s.source, s.target, prompt[:-1])  # cached, now stale, info
        on_target = generate(s.target, prompt)
        results[who] = {"result": _summary(result), "details": cached_details(on_target)}
        assert result.path == "device" and not result.fallback_reason, result
        assert on_target["output_ids"] == reference["output_ids"]
        assert cached_details(on_target)["device"] >= result.migrated_token_size > 0
    record("memory_saver_release_resume", results)


def test_an_allocation_across_a_release_is_refused(servers: Servers, client: MigrationClient):
    s = servers
    rng = random.Random(30)
    prompt = _tokens(rng, 512, s.vocab_size)
    fingerprints = [r["fingerprint"] for r in client.call(
        s.source, "/get_transfer_session_info", {})["ranks"]]  # fmt: skip
    body = {"input_ids": prompt, "source_fingerprints": fingerprints, "path": "device"}

    def allocate() -> httpx.Response:  # the target mints the migration id
        return httpx.post(f"{s.target}/allocate_token_for_transfer", json=body, timeout=60)

    pending = allocate()
    assert pending.status_code == 200, pending.text
    _memory(s.target, "release")
    try:
        commit = httpx.post(
            f"{s.target}/commit", json={"migration_id": pending.json()["migration_id"]},
            timeout=60,
        )  # fmt: skip
        during = allocate()
    finally:
        _memory(s.target, "resume")
    after = allocate()
    record("memory_saver_refusals", {"commit": [commit.status_code, commit.text],
                                     "during": [during.status_code, during.text],
                                     "after": after.status_code})  # fmt: skip
    assert commit.status_code == 410 and "released its KV cache" in commit.text
    assert during.status_code == 503 and "released its KV cache memory" in during.text
    assert after.status_code == 200, after.text
    abort = httpx.post(
        f"{s.target}/abort_transfer",
        json={"migration_id": after.json()["migration_id"]},
        timeout=60,
    )
    assert abort.status_code == 200, abort.text
