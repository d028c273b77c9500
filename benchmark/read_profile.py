"""Print what the servers' opt-in profiles found (`server/diag/profiling.py`): per scheduler
rank, the functions under our handlers and polls by cumulative and own time, and the
garbage collections (count and ms per generation, the long ones).

    SGLANG_KV_MIGRATION_PROFILE_DIR=/tmp/prof python3 benchmark/bench_device_path.py ...
    python3 benchmark/read_profile.py /tmp/prof [--top 40]
"""

from __future__ import annotations

import argparse
import io
import json
import pstats
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    for prof in sorted(args.directory.glob("*.prof")):
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            stats = pstats.Stats(str(prof), stream=out)
            stats.strip_dirs().sort_stats(order).print_stats(args.top)
            print(f"==== {prof.name} by {order}\n{out.getvalue()}")
    for report in sorted(args.directory.glob("*-gc.json")):
        data = json.loads(report.read_text())
        long = data["long"]
        print(f"==== {report.name}: {json.dumps(data['by_generation'])}; {len(long)} of >= 1 ms")
        for item in sorted(long, key=lambda g: -g["ms"])[:15]:
            print("   ", json.dumps(item))


if __name__ == "__main__":
    main()
