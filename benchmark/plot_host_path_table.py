"""Plot `bench_host_path_gpu.py --parts table` results: host-path migration vs re-prefill.

For each results file (one label each) and each pool state (fresh, churned), the median
over repeats of (migration + the target's request from the migrated pages) / re-prefill
of the same length, against the prefix length; below 1 the migration wins. Needs
matplotlib (not a dependency of the package).

    python benchmark/plot_host_path_table.py OUT.png LABEL=results.json [LABEL=...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def medians(rows: list[dict]) -> tuple[list[int], list[float]]:
    """Per length: median of (migrate + cached request) / re-prefill over the repeats."""
    by_length: dict[int, list[float]] = {}
    for row in rows:
        by_length.setdefault(row["tokens"], []).append(row["migrate_plus_cached_over_prefill"])
    lengths = sorted(by_length)
    return lengths, [statistics.median(by_length[n]) for n in lengths]


def main() -> None:
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        raise SystemExit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, arg in enumerate(sys.argv[2:]):
        label, path = arg.split("=", 1)
        data = json.loads(Path(path).read_text())
        color = f"C{i}"
        for state, style in (("fresh", "-o"), ("churned", "--s")):
            rows = data.get(f"table_{state}", [])
            if rows:
                x, y = medians(rows)
                ax.plot(x, y, style, color=color, label=f"{label}, {state} pools")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens (Llama-3-8B shape, 128 KiB per token)")
    ax.set_ylabel("(migration + cached request) / re-prefill")
    ax.set_title("Host path (Mooncake TCP, one H200 host) vs re-prefill; below 1 wins")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=120)
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()
