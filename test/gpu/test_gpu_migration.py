"""Two real SGLang 0.5.12 servers: migrate a prefix (host path), the target serves it cached.

Run on the lent GPU machine (never in CI), from the repo root:

    KVMIG_GPU_OUT=$OUT python3 -m pytest -m gpu -s test/gpu/test_gpu_migration.py

Each server is the stock `python -m sglang.launch_server` with this package installed
(its plugin adds `--enable-kv-migration`), a small dummy-weight Llama written here (no
downloads) and `--skip-tokenizer-init`. The migration runs through the installed
`sglang-kv-migrate` console script, as an operator would run it.

Parameters (environment):
- `KVMIG_PAGE_SIZE`: `--page-size` of both servers (default 1).
- `KVMIG_TP=2`: both servers run `--tp-size 2` on GPUs 0 and 1 (an nvidia-h200-x2
  machine); rank r of the source writes into rank r of the target.
- `KVMIG_PP=2`: both servers run `--pp-size 2` on GPUs 0 and 1: stage 0 holds layers
  0-3 of the 8-layer model, stage 1 layers 4-7, and stage s of the source writes its own
  layers into stage s of the target. SGLang 0.5.12 accepts `--pp-size 2` with
  `--enable-hierarchical-cache`; it turns the overlap scheduler off for PP by itself
  (`_handle_pipeline_parallelism`), piecewise CUDA graphs too, and syncs the device pool
  size across stages (MIN over the world group), so the default `--hicache-ratio` gives
  every stage the same host pool in tokens. `--disable-overlap-schedule` is passed
  anyway to say so. `KVMIG_TP=2 KVMIG_PP=2` needs four GPUs.
Under PP, `/v1/loads` and SGLang's own control replies come from stage 0 only.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TINY_LLAMA,
    generate,
    launch,
    migrate_cli,
    record,
    stop,
    wait_ready,
    write_model,
)

pytestmark = pytest.mark.gpu

MODEL_DIR = Path("/tmp/kvmig-tiny-llama")
# K and V, every layer, all KV heads, bf16: summed over the ranks of a TP/PP server.
KV_BYTES_PER_TOKEN = (
    TINY_LLAMA["num_hidden_layers"]
    * 2
    * TINY_LLAMA["num_key_value_heads"]
    * (TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"])
    * 2
)
TP_SIZE = int(os.environ.get("KVMIG_TP", "1"))
PP_SIZE = int(os.environ.get("KVMIG_PP", "1"))


def parallel_flags() -> list[str]:
    """Both servers on GPUs 0..TP*PP-1 (the default --base-gpu-id 0)."""
    flags = ["--tp-size", str(TP_SIZE), "--pp-size", str(PP_SIZE)]
    if PP_SIZE > 1:
        flags.append("--disable-overlap-schedule")  # SGLang forces it for PP anyway
    return flags


@pytest.fixture(scope="module")
def servers():
    model_dir = write_model(TINY_LLAMA, MODEL_DIR)
    page_size = os.environ.get("KVMIG_PAGE_SIZE", "1")
    extra = ["--page-size", page_size, "--mem-fraction-static", "0.25", "--enable-metrics"]
    extra += ["--max-total-tokens", "65536", *parallel_flags()]
    record("migration_config", {"page_size": int(page_size), "tp": TP_SIZE, "pp": PP_SIZE})
    procs = {port: launch(port, model_dir, extra) for port in (30100, 30200)}
    try:
        urls = []
        for port, proc in procs.items():
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            urls.append(url)
        yield urls[0], urls[1], int(page_size)
    finally:
        stop(list(procs.values()))


def test_migrated_prefix_is_served_from_cache(servers):
    source, target, page_size = servers
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(2001)]

    # A control on the target: a fresh prompt there has no cache hit.
    control = generate(target, [rng.randrange(3, 32000) for _ in range(500)], 4)
    assert control["meta_info"]["cached_tokens"] == 0

    t0 = time.perf_counter()
    on_source = generate(source, prompt)
    source_prefill_s = time.perf_counter() - t0

    # SGLang always computes the last prompt token, so a request can hit at most
    # len(prompt) - 1 cached tokens: migrate exactly that prefix.
    result = migrate_cli(source, target, prompt[:-1])
    expected = (len(prompt) - 1) // page_size * page_size
    assert result["success"] is True
    assert result["migrated_token_size"] == expected
    assert result["matched_after_commit"] == expected
    # K and V of every layer moved, whichever (tp, pp) rank holds it (bf16 KV).
    assert result["migrated_bytes"] == expected * KV_BYTES_PER_TOKEN

    t0 = time.perf_counter()
    on_target = generate(target, prompt)
    target_s = time.perf_counter() - t0
    record(
        "prompt",
        {
            "page_size": page_size,
            "prompt_tokens": len(prompt),
            "migrated_tokens": result["migrated_token_size"],
            "migrated_bytes": result["migrated_bytes"],
            "migration_timings_s": result["timings"],
            "source_output_ids": on_source["output_ids"],
            "target_output_ids": on_target["output_ids"],
            "source_meta_cached_tokens": on_source["meta_info"]["cached_tokens"],
            "target_meta": {
                k: on_target["meta_info"].get(k) for k in ("cached_tokens", "cached_tokens_details")
            },
            "source_request_s": source_prefill_s,
            "target_request_s": target_s,
        },
    )
    assert on_target["output_ids"] == on_source["output_ids"]
    assert on_target["meta_info"]["cached_tokens"] >= result["migrated_token_size"]


def test_aborted_request_continuation(servers):
    """The RL case: move prompt + generated tokens, continue on the target."""
    source, target, page_size = servers
    rng = random.Random(1)
    prompt = [rng.randrange(3, 32000) for _ in range(1500)]
    first = generate(source, prompt, 32)
    continuation = prompt + first["output_ids"]

    held = httpx.post(
        source + "/get_request_extra_token_size", json={"input_ids": continuation}, timeout=60
    ).json()
    result = migrate_cli(source, target, continuation[:-1])
    assert result["migrated_token_size"] > len(prompt) - page_size

    on_target = generate(target, continuation, 16)
    on_source = generate(source, continuation, 16)
    record(
        "continuation",
        {
            "continuation_tokens": len(continuation),
            "source_held": held["matched_token_size"],
            "migrated_tokens": result["migrated_token_size"],
            "migration_timings_s": result["timings"],
            "target_cached_tokens": on_target["meta_info"]["cached_tokens"],
            "target_cached_details": on_target["meta_info"].get("cached_tokens_details"),
            "outputs_equal": on_target["output_ids"] == on_source["output_ids"],
        },
    )
    assert on_target["output_ids"] == on_source["output_ids"]
    assert on_target["meta_info"]["cached_tokens"] >= result["migrated_token_size"]


def test_endpoint_errors_on_real_server(servers):
    source, target, _ = servers
    r = httpx.post(target + "/commit", json={"migration_id": "nope"}, timeout=30)
    assert r.status_code == 404, r.text
    r = httpx.post(target + "/get_request_extra_token_size", json={"input_ids": "x"}, timeout=30)
    assert r.status_code == 400, r.text
    info = httpx.post(source + "/get_transfer_session_info", timeout=30).json()
    record("session_info_fingerprints", [r["fingerprint"] for r in info["ranks"]])
    assert info["success"]
    # Every (tp, pp) rank of the server answers, gathered across TP ranks and PP stages.
    positions = [(r["tp_rank"], r["pp_rank"]) for r in info["ranks"]]
    assert positions == [(tp, pp) for pp in range(PP_SIZE) for tp in range(TP_SIZE)]
    for rank in info["ranks"]:
        fp = rank["fingerprint"]
        assert (fp["tp_size"], fp["pp_size"]) == (TP_SIZE, PP_SIZE)
        assert (fp["tp_rank"], fp["pp_rank"]) == (rank["tp_rank"], rank["pp_rank"])
    # Each stage's pools hold its own layers: stage starts rise from layer 0.
    starts = [info["ranks"][pp * TP_SIZE]["fingerprint"]["start_layer"] for pp in range(PP_SIZE)]
    assert starts[0] == 0 and starts == sorted(set(starts))


def test_metrics_are_exported_by_real_servers(servers):
    """Runs after the migrations above: both sides exported their counters on /metrics."""
    source, target, _ = servers

    def samples(url: str) -> list[str]:
        text = httpx.get(url + "/metrics", timeout=30).text
        return [line for line in text.splitlines() if line.startswith("sglang:kv_migration_")]

    on_source, on_target = samples(source), samples(target)
    record("metrics", {"source": on_source[:40], "target": on_target[:40]})

    def value(lines: list[str], name: str, *fragments: str) -> float:
        for line in lines:
            if line.startswith(name + "{") and all(f in line for f in fragments):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert value(on_source, "sglang:kv_migration_total", 'role="source"', 'outcome="sent"') >= 2
    assert value(on_target, "sglang:kv_migration_total", 'outcome="committed"') >= 2
    assert value(on_target, "sglang:kv_migration_bytes_total", 'role="target"') > 0

    # Per route (whichever path the CLI's auto choice took) and the fixed cost per path,
    # for the cost model: every rank of every path, summed.
    def total(lines: list[str], name: str) -> float:
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{"))

    assert total(on_source, "sglang:kv_migration_route_bytes_total") > 0
    assert total(on_source, "sglang:kv_migration_route_seconds_total") > 0
    assert total(on_source, "sglang:kv_migration_fixed_seconds_count") >= 2


def test_flush_cache_drops_a_pending_allocation(servers):
    """RL frameworks flush after a weight update: a pending allocation must not survive."""
    source, target, _ = servers
    info = httpx.post(source + "/get_transfer_session_info", timeout=30).json()
    alloc = httpx.post(
        target + "/allocate_token_for_transfer",
        json={
            "input_ids": list(range(5000, 5256)),
            "source_fingerprints": [r["fingerprint"] for r in info["ranks"]],
        },
        timeout=60,
    ).json()
    assert alloc["success"], alloc
    flushed = httpx.post(target + "/flush_cache", timeout=60)
    commit = httpx.post(
        target + "/commit", json={"migration_id": alloc["migration_id"]}, timeout=60
    )
    record("flush", {"flush_status": flushed.status_code, "commit": commit.json()})
    assert flushed.status_code == 200, flushed.text
    assert commit.status_code == 410 and "flushed" in commit.json()["message"]
