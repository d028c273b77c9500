"""Start and talk to real SGLang servers with this plugin (GPU machine only).

Shared by `test/gpu/test_gpu_migration.py` and `benchmark/bench_migration_vs_prefill.py`.
Each server is the stock `python -m sglang.launch_server` with a dummy-weight Llama
written here (no downloads) and `--skip-tokenizer-init`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 480
OUT_DIR = Path(os.environ.get("KVMIG_GPU_OUT", "/tmp/kvmig-gpu-out"))

TINY_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
}
# Llama-3-8B's shape: dummy weights make the compute and the KV size real.
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
}


def write_model(shape: dict, model_dir: Path) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def launch(port: int, model_dir: Path, extra: list[str]) -> subprocess.Popen:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log = open(OUT_DIR / f"server-{port}.log", "w")
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--load-format", "dummy", "--skip-tokenizer-init",
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--disable-cuda-graph", "--enable-hierarchical-cache", "--enable-kv-migration",
        "--kv-migration-hostname", "127.0.0.1", "--kv-migration-protocol", "tcp",
        "--host", "127.0.0.1", "--port", str(port),
        *extra,
    ]  # fmt: skip
    log.write(" ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen) -> None:
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


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def generate(url: str, input_ids: list[int], max_new_tokens: int = 24) -> dict:
    r = httpx.post(
        url + "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        },
        timeout=600,
    )
    r.raise_for_status()
    return r.json()


def migrate_cli(source: str, target: str, input_ids: list[int]) -> dict:
    """Run `sglang-kv-migrate --json` as an operator would; returns its JSON."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    ids_file = OUT_DIR / "ids.json"
    ids_file.write_text(json.dumps(input_ids))
    exe = shutil.which("sglang-kv-migrate")
    args = ["--source", source, "--target", target, "--input-ids-file", str(ids_file), "--json"]
    # `pip install --target` writes no console-script wrapper: run the module then.
    cmd = [exe, *args] if exe else [sys.executable, "-m", "sglang_kv_migration.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print("$", " ".join(cmd[:4]), "...", "->", proc.returncode, proc.stdout.strip()[:2000])
    if proc.returncode != 0:
        raise AssertionError(proc.stderr + proc.stdout)
    return json.loads(proc.stdout)


def record(name: str, value: object) -> None:
    print(f"[gpu-result] {name}: {json.dumps(value)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with open(OUT_DIR / "results.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "value": value}) + "\n")
