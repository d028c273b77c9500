"""Start and talk to real SGLang servers with this plugin (GPU machine only).

Shared by `test/gpu/test_gpu_migration.py`, `test/gpu/test_gpu_device_path.py`,
`benchmark/bench_migration_vs_prefill.py` and `benchmark/bench_device_path.py`. Each server
is the stock `python -m sglang.launch_server` with a dummy-weight model written here (no
downloads: a Llama for MHA, a DeepseekV2 for MLA) and `--skip-tokenizer-init`.
Nothing extra to install: this uses only what the GPU wheel sets already carry (httpx,
pytest, this package).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

# The benchmarks import this module with only test/gpu on sys.path (pytest's conftest adds
# test/support for the tests): the shared timing helpers live there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from timing import wait_until  # noqa: E402

T = TypeVar("T")

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
# A small DeepSeek-V2-style model for MLA pools. The attention dims are DeepSeek-V2(-Lite)'s
# own (kv_lora_rank 512 + rope 64 = 576 per token per layer, one latent "head"), which
# the Triton MLA kernels special-case; no q LoRA. SGLang 0.5.12 reads the MoE fields at
# start-up (expert-location metadata adds `n_routed_experts` to an int), so they must be
# set, but `first_k_dense_replace` = all layers makes every layer a dense MLP: no MoE
# kernels run. Served with `--attention-backend triton` (extend: MHA on a fresh prompt,
# absorbed MLA once there is a cached prefix).
TINY_DEEPSEEK_V2_MLA = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "first_k_dense_replace": 4,  # == num_hidden_layers: no MoE layer
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
}

# The V2 shape above with DeepSeek-V3.2's attention and indexer dims: 4 layers, hidden 1024, all
# dense (first_k_dense_replace = layers: no MoE kernel runs; SGLang still reads the MoE
# fields). 64 query heads: FlashMLA's sparse kernels take 64 or 128 heads per rank.
TINY_DEEPSEEK_V32_NSA = {
    **TINY_DEEPSEEK_V2_MLA,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 512,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    # V3.2's router settings (read by SGLang, never run: no MoE layer).
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
}

# Where SGLang 0.5.12's NSA backend and indexer import their kernels from.
NSA_KERNEL_MODULES = (
    "sgl_kernel.flash_mla",  # flash_mla_sparse_fwd (prefill), flash_mla_with_kvcache
    "sgl_kernel.flash_attn",  # fa3 decode
    "deep_gemm",  # the indexer's fp8 MQA logits
    "fast_hadamard_transform",  # the indexer's rotation
    "tilelang",
)


def nsa_kernel_modules() -> dict[str, str]:
    """Which of the modules SGLang's NSA path needs import here ("ok: <file>" or the
    error): what a server that does not start lacks."""
    import importlib

    found = {}
    for name in NSA_KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = f"ok: {getattr(module, '__file__', '')}"
        except Exception as exc:  # ImportError, or an OSError from a missing .so: recorded
            found[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return found


# KVMIG_ATTENTION=mha|mla picks the small test model.
TEST_MODELS: dict[str, tuple[dict[str, Any], Path]] = {
    "mha": (TINY_LLAMA, Path("/tmp/kvmig-tiny-llama")),
    "mla": (TINY_DEEPSEEK_V2_MLA, Path("/tmp/kvmig-tiny-deepseek-v2-mla")),
}


def write_model(shape: dict, model_dir: Path) -> Path:
    """A config-only model directory (dummy weights). `shape` overrides the Llama
    defaults, including `architectures` / `model_type` for other families."""
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


def write_tokenizer(model_dir: Path, vocab_size: int) -> Path:
    """A word-level tokenizer with one word per token id ("t0" ... "tN"), written into
    `model_dir`: no download, and every id round-trips, which is all a benchmark on dummy
    weights needs from a tokenizer (`bench_serving` reads `completion_tokens` only from
    replies that carry text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="t1", eos_token="t2", unk_token="t0"
    )
    fast.save_pretrained(str(model_dir))
    return model_dir


def launch(
    port: int,
    model_dir: Path,
    extra: list[str],
    gpu_id: int | None = None,
    *,
    migration: bool = True,
    tokenizer: bool = False,
    cuda_graph: bool = False,
    dp_size: int = 1,
    hicache: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start one server; `gpu_id` adds `--base-gpu-id` (the server's first GPU).

    `dp_size` > 1 adds `--dp-size` (no DP attention): SGLang 0.5.12 puts DP rank r on GPU
    `gpu_id` + r (its `--gpu-id-step` must be >= 1), so such a server needs `dp_size`
    GPUs. Two DP ranks cannot share one GPU: listing a GPU twice in CUDA_VISIBLE_DEVICES
    makes CUDA fail with error 101 (invalid device ordinal) before any rank starts.

    `cuda_graph=True` leaves out `--disable-cuda-graph` (decode replays captured graphs, as
    in production; start-up captures them first).
    `migration=False` leaves out the plugin's flags (HiCache stays on): the "off" server
    of an overhead comparison. `tokenizer=True` keeps SGLang's tokenizer (the model
    directory must hold one, see `write_tokenizer`), which `sglang.bench_serving` needs.
    `hicache=False` leaves out `--enable-hierarchical-cache` (with `migration=False`:
    SGLang as its users run it). `env`: variables set for the server beside this
    process's (e.g. `SGLANG_PLUGINS=none`: SGLang loads no plugin, this one included).
    """
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if dp_size > 1:
        extra = [*extra, "--dp-size", str(dp_size)]
    if gpu_id is not None:
        extra = [*extra, "--base-gpu-id", str(gpu_id)]
    if migration:
        extra = [
            "--enable-kv-migration", "--kv-migration-hostname", "127.0.0.1",
            "--kv-migration-protocol", "tcp", *extra,
        ]  # fmt: skip
    # Diagnosis runs add server flags to every server (e.g. --gc-warning-threshold-secs).
    extra = [*extra, *shlex.split(os.environ.get("KVMIG_EXTRA_SERVER_FLAGS", ""))]
    # With a tokenizer SGLang builds a grammar backend; xgrammar is not in the wheel set.
    tokenizer_flags = ["--grammar-backend", "none"] if tokenizer else ["--skip-tokenizer-init"]
    extra = [*tokenizer_flags, *extra]
    log = open(OUT_DIR / f"server-{port}.log", "w")
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--load-format", "dummy",
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        *([] if cuda_graph else ["--disable-cuda-graph"]),
        *(["--enable-hierarchical-cache"] if hicache else []),
        "--host", "127.0.0.1", "--port", str(port),
        *extra,
    ]  # fmt: skip
    log.write(" ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd]) + "\n")
    log.flush()
    full_env = {**os.environ, **env} if env else None
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def server_log_tail(url: str, lines: int = 80) -> str:
    """The last `lines` lines of the log `launch` wrote for the server at `url`."""
    path = OUT_DIR / f"server-{url.rsplit(':', 1)[-1]}.log"
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    """Wait (bounded) until `url` answers /health; a server that exits first raises
    with its log's tail, so a failed start says why in the test report itself."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server {url} exited with {proc.returncode}; its log ends:\n"
                + server_log_tail(url)
            )
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(
        f"server {url} not ready in {STARTUP_TIMEOUT_S}s; its log ends:\n" + server_log_tail(url)
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class ServerSpec:
    """One server to start: its port, extra flags and (optionally) its GPU."""

    port: int
    extra: list[str] = field(default_factory=list)
    gpu_id: int | None = None
    cuda_graph: bool = False  # see `launch`
    dp_size: int = 1  # see `launch`: every DP rank on `gpu_id`
    migration: bool = True  # see `launch`
    hicache: bool = True  # see `launch`
    env: dict[str, str] = field(default_factory=dict)  # see `launch`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def running_servers(
    model_dir: Path, specs: list[ServerSpec], sequential: bool = False
) -> Iterator[list[str]]:
    """Start the servers, wait (bounded) until each answers /health, yield their URLs in
    `specs` order, stop them all on exit.

    `sequential=True` starts each only after the previous one is ready. Use it when
    servers share a GPU and their KV pools are large: SGLang sizes the pool from the free
    memory it measures around its own weight loading, and a neighbour loading at the
    same moment makes that measurement racy. Later servers also reuse the Triton cache
    the first one compiled.
    """
    procs: list[subprocess.Popen] = []
    try:
        if sequential:
            for spec in specs:
                procs.append(_launch(spec, model_dir))
                wait_ready(spec.url, procs[-1])
        else:
            procs = [_launch(s, model_dir) for s in specs]
            for spec, proc in zip(specs, procs, strict=True):
                wait_ready(spec.url, proc)
        yield [spec.url for spec in specs]
    finally:
        stop(procs)


def _launch(spec: ServerSpec, model_dir: Path) -> subprocess.Popen:
    return launch(
        spec.port,
        model_dir,
        spec.extra,
        spec.gpu_id,
        cuda_graph=spec.cuda_graph,
        dp_size=spec.dp_size,
        migration=spec.migration,
        hicache=spec.hicache,
        env=spec.env,
    )


def generate(
    url: str, input_ids: list[int], max_new_tokens: int = 24, dp_rank: int | None = None
) -> dict:
    """Greedy `/generate`; `dp_rank` routes it to that DP rank of a `--dp-size` server."""
    from sglang_kv_migration.rollout.dp_routing import routed_body

    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        **routed_body({}, dp_rank),
    }
    r = generate_client().post(url + "/generate", json=body)
    r.raise_for_status()
    return r.json()


_GENERATE_CLIENT: httpx.Client | None = None


def generate_client() -> httpx.Client:
    """The one HTTP client `generate` sends through, kept for the process. A client per
    call (what `httpx.post` makes) builds an SSL context first, ~5-20 ms of the caller's
    CPU, and opens a new connection: a TTFT timed that way is partly the client's."""
    global _GENERATE_CLIENT
    if _GENERATE_CLIENT is None:
        _GENERATE_CLIENT = httpx.Client(timeout=600)
    return _GENERATE_CLIENT


def timed_generate(url: str, input_ids: list[int], max_new_tokens: int = 1) -> tuple[dict, float]:
    """`generate` and its wall time seen by the caller (with max_new_tokens=1: TTFT)."""
    t0 = time.perf_counter()
    out = generate(url, input_ids, max_new_tokens)
    return out, time.perf_counter() - t0


def cached_tokens(out: dict) -> int:
    return int(out["meta_info"].get("cached_tokens") or 0)


def cached_details(out: dict) -> dict[str, Any]:
    """`meta_info.cached_tokens_details` of a /generate reply ({"device": d, "host": h}).
    SGLang omits it when nothing was cached; then both are 0."""
    details = out["meta_info"].get("cached_tokens_details") or {}
    return {
        "device": int(details.get("device") or 0),
        "host": int(details.get("host") or 0),
        **{k: v for k, v in details.items() if k not in ("device", "host")},
    }


def kv_pool_usage(url: str) -> dict[str, int]:
    """The GPU KV pool of DP rank 0 from SGLang's `GET /v1/loads?include=core`.

    `num_used_tokens` = max_total_num_tokens - (allocator available + tree evictable):
    slots a pending migration holds count as used; cached, unlocked tree nodes do not.
    """
    r = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=30)
    r.raise_for_status()
    load = r.json()["loads"][0]
    return {
        "num_used_tokens": int(load["num_used_tokens"]),
        "max_total_num_tokens": int(load["max_total_num_tokens"]),
        "num_running_reqs": int(load.get("num_running_reqs", 0)),
        "num_waiting_reqs": int(load.get("num_waiting_reqs", 0)),
    }


def prefill_tokens(urls: list[str]) -> float | None:
    """SGLang's own count of prompt tokens computed (not served from cache), all servers;
    None when one server's /metrics cannot be read."""
    from sglang_kv_migration.rollout.cost_model import parse_prometheus

    total = 0.0
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return None
        total += sum(
            s.value
            for s in parse_prometheus(text)
            if s.name == "sglang:realtime_tokens_total"
            and s.labels.get("mode") == "prefill_compute"
        )
    return total


def flush_cache(url: str, timeout_s: float = 60.0) -> None:
    """Drop the server's radix cache (device and host tiers). SGLang refuses (400) while
    requests run, and this plugin while a migration still reads pinned pages: retry,
    bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/flush_cache", params={"timeout": 10}, timeout=120)
        if r.status_code == 200:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{url}/flush_cache -> {r.status_code}: {r.text[:500]}")
        time.sleep(0.5)


def wait_for_value(
    probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, interval_s: float = 0.2
) -> T:
    """Call `probe` until `done(value)` (polled by `timing.wait_until`); return that value.
    Raises TimeoutError with the last value after `timeout_s`."""
    last: list[T] = []

    def check() -> bool:
        last[:] = [probe()]
        return done(last[0])

    if not wait_until(check, timeout_s, interval_s):
        raise TimeoutError(f"condition not met in {timeout_s}s; last value {last[0]!r}")
    return last[0]


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


def settled_used_tokens(url: str) -> int:
    """The pool's used tokens once the server is idle and two reads 0.5 s apart agree
    (write-through backups hold node locks for a moment after a request)."""
    previous: list[int] = []

    def probe() -> tuple[int, int]:
        usage = kv_pool_usage(url)
        return usage["num_used_tokens"], usage["num_running_reqs"] + usage["num_waiting_reqs"]

    def done(value: tuple[int, int]) -> bool:
        used, busy = value
        stable = bool(previous) and previous[-1] == used and busy == 0
        previous.append(used)
        return stable

    return wait_for_value(probe, done, timeout_s=60, interval_s=0.5)[0]
