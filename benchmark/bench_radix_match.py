"""What one radix walk over a long prefix costs: SGLang's HiRadixCache.match_prefix through
`sglang_adapter.match_held_prefix`, on the CPU harness (real SGLang cache objects).

    PYTHONPATH=python:test/support .venv/bin/python benchmark/bench_radix_match.py --tokens 32768

At page size 1 SGLang's match is a Python loop over the tokens, so every walk a migration
makes over its prefix costs this much (issue 21: the target's commit no longer makes one).
Prints the median and minimum of `--repeats` walks, ms.
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
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        held = sglang_adapter.match_held_prefix(h.cache, tokens, None).length
        times.append(time.perf_counter() - t0)
    print(
        f"{args.tokens} tokens, page {args.page_size}: matched {held}; median "
        f"{statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms"
    )
    h.close()


if __name__ == "__main__":
    main()
