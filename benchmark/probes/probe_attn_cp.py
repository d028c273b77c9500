"""Does stock SGLang 0.5.12 run a HiCache server with attention context parallelism (CP) for
a small DeepSeek-V3.2-shaped NSA model, and where does it keep the KV? (nvidia-h200-x2.)

    KVMIG_GPU_OUT=$OUT python3 benchmark/probes/probe_attn_cp.py            # both variants
    KVMIG_GPU_OUT=$OUT python3 benchmark/probes/probe_attn_cp.py --variants attn-cp

Stock SGLang only: no `--enable-kv-migration` (this plugin refuses `--attn-cp-size > 1`
at start-up today). A config-only model (dummy weights, `DeepseekV32ForCausalLM`, 4 dense
layers, hidden 1024, MLA with q/kv LoRA 512 + rope 64, an NSA indexer of 64 heads x 128
with `index_topk` 2048) is served with `--tp-size 2 --enable-hierarchical-cache
--load-format dummy --skip-tokenizer-init` and, per variant:
- `attn-cp`: `--attn-cp-size 2` (the CP process groups; attention TP size 2/2 = 1);
- `nsa-prefill-cp`: `--enable-nsa-prefill-context-parallel` (SGLang sets attn_cp_size =
  tp/dp itself and splits each prefill over the CP ranks, round-robin by default).
Per variant it records whether the server came up (or the error lines of its log), and if
it did: a 1,000-token prompt (dense path: shorter than `index_topk`) and a 3,000-token
one (sparse path) served twice, `cached_tokens` / `cached_tokens_details` of the repeat,
equal greedy output, the `KV Cache is allocated` log lines (one per rank: pool sizes), and
the server's own view of its CP settings (`/server_info`). Writes
`$KVMIG_GPU_OUT/probe_attn_cp.json`.

What SGLang 0.5.12's source says (read on CPU, 2026-12-01):
1. **`--attn-cp-size 2` with `--enable-hierarchical-cache` is not refused.**
   `ServerArgs._handle_context_parallelism` only asserts tp % cp == 0, tp % (dp * cp) == 0
   and no aiter all-reduce fusion; `_handle_cache_compatibility` and the HiCache checks
   say nothing about CP. The one CP refusal near the cache is for
   `--prefill-only-disable-kv-cache`. HiRadixCache takes NSA pools (its host pool is
   attached by `attach_hybrid_nsa_pool_to_hiradix_cache`, which is handed the attention
   CP group), and the HiCache storage config carries `attn_cp_rank` / `attn_cp_size`.
   Checked on CPU with the CUDA queries faked as one H200 (sm90): `ServerArgs` accepts
   `--tp-size 2 --attn-cp-size 2 --enable-hierarchical-cache` and `--tp-size 2
   --enable-nsa-prefill-context-parallel --enable-hierarchical-cache` for this model,
   both ending with attn_cp_size 2, attention backend `nsa`, page size 64 (forced for
   DSA), KV dtype bfloat16, NSA prefill `flashmla_sparse` / decode `fa3`, HiCache
   layout `layer_first`, io `kernel`. So statically compatible; whether it runs is what
   this probe finds out. Expect a failure from our wheel set rather than from CP: the
   trimmed sglang-kernel drops `flashmla_ops` (14.5 MB) and `flash_ops` (FA3, 1 GB), and
   `sgl-deep-gemm` (the indexer calls `deep_gemm.get_num_sms()` when it is built) is not
   carried. The probe first records which of these import (`kernels`). For a real try:
   keep `flashmla_ops` in the trim, carry the sgl-deep-gemm wheel, and pass
   `--extra --nsa-decode-backend flashmla_sparse` (FA3 does not fit in a call).
2. **CP splits the computation, not the KV: every CP rank stores every token.** With
   NSA prefill CP, rank r computes q/k for tokens i with i % cp == r (round-robin-split;
   in-seq-split: 2*cp chunks, zig-zag), then the MLA latent K (`rebuild_cp_kv_cache` in
   `forward_mla.py`) and the indexer's K (`cp_all_gather_rerange_output` in
   `nsa_indexer.py`) are all-gathered back into sequence order and each rank writes the
   whole sequence into its own pool at `out_cache_loc` (`cp_allgather_and_save_kv_cache`
   in `layers/utils/cp_utils.py` does the same for MHA backends: "write the full result
   into each rank's local memory pool"). Every rank runs the same scheduler and radix
   tree, so the page ids agree. With `--attn-cp-size 2` alone (no NSA prefill CP) the
   model does not split at all: attention TP size is 1 and each rank computes every
   token. Either way the pages are replicated across CP ranks, not sharded — which
   contradicts the reason given by this plugin's start-up refusal ("a prefix's KV pages
   are spread over CP ranks"); if the probe runs, migrating rank r -> rank r (or from
   one CP rank to all) is a candidate, to be checked with identical greedy output.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "gpu"))
from real_servers import (  # noqa: E402
    OUT_DIR,
    TINY_DEEPSEEK_V32_NSA,
    cached_details,
    cached_tokens,
    generate,
    nsa_kernel_modules,
    stop,
    write_model,
)

VARIANTS = {
    "attn-cp": ["--attn-cp-size", "2"],
    "nsa-prefill-cp": ["--enable-nsa-prefill-context-parallel"],
}
PROMPT_TOKENS = (1000, 3000)  # below and above index_topk: dense and sparse NSA prefill
LOG_KEYS = ("KV Cache is allocated", "context parallel", "Context Parallel", "page size",
            "nsa", "NSA", "attn_cp", "hierarchical", "HiCache")  # fmt: skip
ERROR_KEYS = ("Error", "error", "assert", "Exception", "Traceback", "not supported")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=30810)
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more server flags, e.g. --nsa-prefill-backend tilelang")  # fmt: skip
    args = parser.parse_args()
    model_dir = write_model(TINY_DEEPSEEK_V32_NSA, Path("/tmp/kvmig-tiny-deepseek-v32-nsa"))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "model": TINY_DEEPSEEK_V32_NSA,
        "kernels": nsa_kernel_modules(),
        "variants": {},
    }
    print(json.dumps({"kernels": result["kernels"]}), flush=True)
    for i, name in enumerate(args.variants):
        flags = ["--tp-size", str(args.tp_size), *VARIANTS[name], *args.extra]
        row = _probe(model_dir, args.port + 10 * i, flags, args.startup_timeout, name)
        result["variants"][name] = row
        print(json.dumps({name: row})[:4000], flush=True)
        (OUT_DIR / "probe_attn_cp.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT_DIR / 'probe_attn_cp.json'}", flush=True)


def _probe(model_dir: Path, port: int, flags: list[str], timeout_s: float, name: str) -> dict:
    log_path = OUT_DIR / f"server-cp-{name}.log"
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--load-format", "dummy", "--skip-tokenizer-init", "--enable-hierarchical-cache",
        "--sampling-backend", "pytorch", "--disable-cuda-graph",
        "--mem-fraction-static", "0.3", "--max-total-tokens", "65536",
        "--context-length", "8192", "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip
    row: dict[str, Any] = {"command": " ".join(cmd)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        row["started"] = _wait(url, proc, timeout_s)
        row["startup_s"] = time.monotonic() - t0
        if row["started"]:
            row.update(_serve(url))
    except Exception as e:  # a probe: record what went wrong and go on to the next variant
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop([proc])
    row["exit_code"] = proc.returncode
    lines = log_path.read_text(errors="replace").splitlines()
    row["log_lines"] = [ln[:400] for ln in lines if any(k in ln for k in LOG_KEYS)][-40:]
    if not row.get("started") or "error" in row:
        row["error_lines"] = [ln[:600] for ln in lines if any(k in ln for k in ERROR_KEYS)][-30:]
        row["log_tail"] = [ln[:600] for ln in lines[-25:]]
    return row


def _wait(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once /health answers 200; False if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def _serve(url: str) -> dict[str, Any]:
    """Serve each prompt twice; the repeat shows what the (replicated or not) cache holds."""
    info = httpx.get(url + "/server_info", timeout=30).json()
    keys = ("tp_size", "attn_cp_size", "enable_nsa_prefill_context_parallel",
            "nsa_prefill_cp_mode", "page_size", "attention_backend", "nsa_prefill_backend",
            "nsa_decode_backend", "kv_cache_dtype", "enable_hierarchical_cache",
            "hicache_mem_layout", "enable_dp_attention", "dp_size")  # fmt: skip
    out: dict[str, Any] = {"server_info": {k: info.get(k) for k in keys}, "prompts": []}
    rng = random.Random(0)
    for n in PROMPT_TOKENS:
        prompt = [rng.randrange(3, 32000) for _ in range(n)]
        first = generate(url, prompt, 8)
        again = generate(url, prompt, 8)
        out["prompts"].append({
            "tokens": n,
            "first_cached_tokens": cached_tokens(first),
            "repeat_cached_tokens": cached_tokens(again),
            "repeat_cached_details": cached_details(again),
            "same_output": first["output_ids"] == again["output_ids"],
        })  # fmt: skip
    return out


if __name__ == "__main__":
    main()
