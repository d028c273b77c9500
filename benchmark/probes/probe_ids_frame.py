"""What the target's scheduler thread spends on one allocate from the allocate channel
before its handler runs, with the ids as base64 inside the JSON against the ids in a
frame of their own (feature "source_allocate", `server/same_host/allocate_channel.py`), CPU.

Both forms of the same allocate (32K ids by default) go through what the target runs on
its scheduler thread: the JSON parse and `channel_allocations.allocate_request` (the route's
validation). Interleaved, side by side in one run; medians.

    .venv/bin/python benchmark/probes/probe_ids_frame.py [--tokens 32768] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    import cpu_harness

    cpu_harness.install_cpu_shims()  # channel_allocations imports SGLang
    import orjson
    from sglang_kv_migration.server.target import channel_allocations
    from sglang_kv_migration.wire import binary_ids

    ids = list(range(1000, 1000 + args.tokens))
    fields = {"source_fingerprints": [{"model": "m"}], "path": "device",
              "index_format": "ranges", "nothing_ok": True, "source_commit": True,
              "expect_epoch": "e" * 40}  # fmt: skip
    with_ids = {**fields, binary_ids.FIELD: binary_ids.encode(ids)}
    in_json = orjson.dumps({"secret": "a" * 32, "allocate": with_ids})
    bare = orjson.dumps({"secret": "a" * 32, "allocate": fields})
    frame = binary_ids.to_bytes(ids)

    def base64_form() -> None:
        message = orjson.loads(in_json)
        channel_allocations.allocate_request(
            message["allocate"], migration_id="m", weight_version=""
        )

    def frame_form() -> None:
        message = orjson.loads(bare)
        channel_allocations.allocate_request(
            message["allocate"], migration_id="m", weight_version="", ids=frame
        )

    times: dict[str, list[float]] = {"base64 in the JSON": [], "ids frame": []}
    for _ in range(args.repeats):
        for name, run in (("base64 in the JSON", base64_form), ("ids frame", frame_form)):
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    print(f"{args.tokens} ids, {args.repeats} repeats, median us on the target's thread:")
    for name, values in times.items():
        print(f"  {name:20s} {statistics.median(values) * 1e6:8.0f}")
    print(f"message bytes: {len(in_json)} against {len(bare)} + a frame of {len(frame)}")


if __name__ == "__main__":
    main()
