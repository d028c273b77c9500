"""Migration vs re-prefill on two real SGLang servers (GPU machine only).

For each prompt length N: the target's cost of serving a fresh N-token prompt (full
prefill) vs migrating the prefix from the source (`sglang-kv-migrate`) and then serving
the same prompt from the migrated pages (host → GPU load-back + one token of prefill).
One output token per request, so the numbers are time to first token. "migrate ms" is
the client's own total (all six calls), without the CLI interpreter's start-up.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_migration_vs_prefill.py \
        --shape llama3-8b --lengths 1024 4096 16384

Writes `$KVMIG_GPU_OUT/bench.json` and prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    generate,
    launch,
    migrate_cli,
    stop,
    wait_ready,
    write_model,
)

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY_LLAMA}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model_dir = write_model(SHAPES[args.shape], Path(f"/tmp/kvmig-{args.shape}"))
    extra = ["--page-size", str(args.page_size), "--mem-fraction-static", "0.3"]
    extra += ["--max-total-tokens", "65536", "--context-length", "32768"]
    procs = [launch(port, model_dir, extra) for port in (30300, 30400)]
    source, target = "http://127.0.0.1:30300", "http://127.0.0.1:30400"
    rows = []
    try:
        for url, proc in zip((source, target), procs, strict=True):
            wait_ready(url, proc)
        rng = random.Random(0)
        # Warm both servers (Triton kernels compile on first use).
        for url in (source, target):
            generate(url, [rng.randrange(3, 32000) for _ in range(2048)], 1)
        for n in args.lengths:
            for rep in range(args.repeats):
                rows.append(_measure(source, target, n, rep, rng))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(procs)
    (OUT_DIR / "bench.json").write_text(json.dumps(rows, indent=1))
    print(
        "\n| prompt tokens | target re-prefill ms | migrate ms (transfer ms) | "
        "target cached request ms | migrate + cached ms | MiB moved | GiB/s transfer |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['prefill_ms']:.1f} | {r['client_total_ms']:.1f} "
            f"({r['transfer_ms']:.1f}) | {r['cached_request_ms']:.1f} | "
            f"{r['client_total_ms'] + r['cached_request_ms']:.1f} | {r['bytes'] / 2**20:.0f} | "
            f"{r['bytes'] / 2**30 / (r['transfer_ms'] / 1e3):.2f} |"
        )


def _measure(source: str, target: str, n: int, rep: int, rng: random.Random) -> dict:
    fresh = [rng.randrange(3, 32000) for _ in range(n)]
    t0 = time.perf_counter()
    baseline = generate(target, fresh, 1)
    prefill_s = time.perf_counter() - t0
    assert baseline["meta_info"]["cached_tokens"] == 0

    prompt = [rng.randrange(3, 32000) for _ in range(n)]
    generate(source, prompt, 1)
    t0 = time.perf_counter()
    result = migrate_cli(source, target, prompt[:-1])
    migrate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    served = generate(target, prompt, 1)
    cached_s = time.perf_counter() - t0
    return {
        "tokens": n,
        "repeat": rep,
        "prefill_ms": prefill_s * 1e3,
        "cli_wall_ms": migrate_s * 1e3,  # includes the CLI's interpreter start-up
        "client_total_ms": result["timings"]["total"] * 1e3,
        "transfer_ms": result["timings"]["transfer"] * 1e3,
        "cached_request_ms": cached_s * 1e3,
        "cached_tokens": served["meta_info"]["cached_tokens"],
        "cached_details": served["meta_info"].get("cached_tokens_details"),
        "bytes": result["migrated_bytes"],
        "migrated_tokens": result["migrated_token_size"],
    }


if __name__ == "__main__":
    main()
