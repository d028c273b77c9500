"""What one radix walk over a long prefix costs: SGLang's HiRadixCache.match_prefix, and
`sglang_adapter.match_held_prefix` (which our code calls), on the CPU harness (real SGLang
cache objects), interleaved.

    PYTHONPATH=python:test/support .venv/bin/python benchmark/bench_radix_match.py --tokens 32768

At page size 1 SGLang's match is a Python loop over the tokens; the adapter walks the same
tree comparing each node's key as whole lists (`sglang_adapter.radix_tree._walk`). At
other page sizes both are SGLang's walk. Prints the median and minimum of `--repeats`
walks of each, ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "support"))
    from cpu_harness import HarnessConfig, build_harness, install_cpu_shims

    install_cpu_shims()
    from sglang_kv_migration import sglang_adapter

    h = build_harness(
        HarnessConfig(
            page_size=args.page_size,
            layer_num=2,
            device_tokens=args.tokens + 8192,
            head_num=1,
            head_dim=8,
        )
    )
    tokens = list(range(100, 100 + args.tokens))
    h.insert_random(tokens, seed=1)
    walks = {
        "sglang match_prefix": lambda: len(h.match(tokens).device_indices),
        "adapter match_held_prefix": lambda: (
            sglang_adapter.match_held_prefix(h.cache, tokens, None).length
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in walks}
    for _ in range(args.repeats):
        for name, walk in walks.items():
            t0 = time.perf_counter()
            held = walk()
            times[name].append(time.perf_counter() - t0)
            assert held == args.tokens, (name, held)
    for name, samples in times.items():
        print(
            f"{args.tokens} tokens, page {args.page_size}, {name}: median "
            f"{statistics.median(samples) * 1e3:.2f} ms, min {min(samples) * 1e3:.2f} ms"
        )
    h.close()


if __name__ == "__main__":
    main()
