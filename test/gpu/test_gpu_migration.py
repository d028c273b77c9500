"""Two real SGLang 0.5.12 servers on one GPU: migrate a prefix, the target serves it cached.

Run on the lent GPU machine (never in CI), from the repo root:

    KVMIG_GPU_OUT=$OUT python3 -m pytest -m gpu -s test/gpu/test_gpu_migration.py

Each server is the stock `python -m sglang.launch_server` with this package installed
(its plugin adds `--enable-kv-migration`), a small dummy-weight Llama written here (no
downloads) and `--skip-tokenizer-init`. The migration runs through the installed
`sglang-kv-migrate` console script, as an operator would run it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.gpu

STARTUP_TIMEOUT_S = 420
OUT_DIR = Path(os.environ.get("KVMIG_GPU_OUT", "/tmp/kvmig-gpu-out"))
MODEL_DIR = Path("/tmp/kvmig-tiny-llama")


def _write_model() -> None:
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (MODEL_DIR / "config.json").write_text(json.dumps(config))


def _launch(port: int, extra: list[str]) -> subprocess.Popen:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log = open(OUT_DIR / f"server-{port}.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(MODEL_DIR),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--attention-backend",
        "triton",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--enable-hierarchical-cache",
        "--enable-kv-migration",
        "--kv-migration-hostname",
        "127.0.0.1",
        "--kv-migration-protocol",
        "tcp",
        "--mem-fraction-static",
        "0.25",
        "--max-total-tokens",
        "65536",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    log.write(" ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}; see its log")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server {url} not ready in {STARTUP_TIMEOUT_S}s")


@pytest.fixture(scope="module")
def servers():
    _write_model()
    page_size = os.environ.get("KVMIG_PAGE_SIZE", "1")
    extra = ["--page-size", page_size]
    procs = {port: _launch(port, extra) for port in (30100, 30200)}
    try:
        urls = []
        for port, proc in procs.items():
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc)
            urls.append(url)
        yield urls[0], urls[1], int(page_size)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _generate(url: str, input_ids: list[int], max_new_tokens: int = 24) -> dict:
    r = httpx.post(
        url + "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        },
        timeout=300,
    )
    r.raise_for_status()
    return r.json()


def _migrate_cli(source: str, target: str, input_ids: list[int]) -> dict:
    ids_file = OUT_DIR / "ids.json"
    ids_file.write_text(json.dumps(input_ids))
    exe = shutil.which("sglang-kv-migrate") or str(
        Path(sys.executable).parent / "sglang-kv-migrate"
    )
    cmd = [exe, "--source", source, "--target", target, "--input-ids-file", str(ids_file), "--json"]
    if not Path(exe).exists():  # installed with --target: no script, run the module
        cmd = [sys.executable, "-m", "sglang_kv_migration.cli", *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print("$", " ".join(cmd[:7]), "...", "->", proc.returncode, proc.stdout.strip()[:2000])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(proc.stdout)


def _record(name: str, value: object) -> None:
    print(f"[gpu-result] {name}: {json.dumps(value)}")
    with open(OUT_DIR / "results.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "value": value}) + "\n")


def test_migrated_prefix_is_served_from_cache(servers):
    source, target, page_size = servers
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(2001)]

    # A control on the target: a fresh prompt there has no cache hit.
    control = _generate(target, [rng.randrange(3, 32000) for _ in range(500)], 4)
    assert control["meta_info"]["cached_tokens"] == 0

    t0 = time.perf_counter()
    on_source = _generate(source, prompt)
    source_prefill_s = time.perf_counter() - t0

    # SGLang always computes the last prompt token, so a request can hit at most
    # len(prompt) - 1 cached tokens: migrate exactly that prefix.
    result = _migrate_cli(source, target, prompt[:-1])
    expected = (len(prompt) - 1) // page_size * page_size
    assert result["success"] is True
    assert result["migrated_token_size"] == expected
    assert result["matched_after_commit"] == expected

    t0 = time.perf_counter()
    on_target = _generate(target, prompt)
    target_s = time.perf_counter() - t0
    _record(
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
    first = _generate(source, prompt, 32)
    continuation = prompt + first["output_ids"]

    held = httpx.post(
        source + "/get_request_extra_token_size", json={"input_ids": continuation}, timeout=60
    ).json()
    result = _migrate_cli(source, target, continuation[:-1])
    assert result["migrated_token_size"] > len(prompt) - page_size

    on_target = _generate(target, continuation, 16)
    on_source = _generate(source, continuation, 16)
    _record(
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
    _record("session_info_rank0_fingerprint", info["ranks"][0]["fingerprint"])
    assert info["success"] and len(info["ranks"]) == 1
