"""Between two CP=2 servers, should each CP rank copy its pages from its twin, or should
one source CP rank fan out to every target CP rank? (CPU, Mooncake TCP on 127.0.0.1.)

    PYTHONPATH=python python benchmark/probes/probe_cp_fanout.py [--mb 64 256] [--repeats 3]

SGLang 0.5.12 keeps every page on every CP rank (K/V all-gathered in prefill), so both
plans deliver the same bytes. Four processes stand for the ranks: two source ranks and two
target ranks, each with its own `MooncakeTransport` (as each scheduler rank has) and one
registered buffer of `--mb` MiB. After a start barrier:
- `twin`: source rank r writes its buffer into target rank r, both at once;
- `fanout`: source rank 0 writes its buffer into both target ranks (two writes in flight),
  source rank 1 sends nothing.
The wall time from the barrier to the last completion is the migration's transfer time.
Prints one JSON line per (plan, size) with the median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

CHUNK = 1 << 20  # one write op per MiB, as a paged migration sends runs


def rank_main(conn: Connection, nbytes: int, seed: int) -> None:
    import numpy as np
    from sglang_kv_migration.paths.host.layout import Write
    from sglang_kv_migration.paths.host.mooncake import (
        MemoryRegion,
        MooncakeTransport,
        TransportConfig,
    )

    buffer = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    addr = int(buffer.ctypes.data)
    with MooncakeTransport(TransportConfig()) as transport:
        transport.register([MemoryRegion(addr, nbytes)])
        conn.send((transport.session_id, addr))
        while True:
            command = conn.recv()
            if command[0] == "quit":
                break
            _, peers, start_at = command  # [(session, addr)], a wall-clock start time
            ops_by_peer = [
                (
                    session,
                    [
                        Write(addr + o, dst + o, min(CHUNK, nbytes - o))
                        for o in range(0, nbytes, CHUNK)
                    ],
                    [MemoryRegion(dst, nbytes)],
                )
                for session, dst in peers
            ]
            while time.time() < start_at:
                time.sleep(0.0005)
            t0 = time.time()
            handles = [transport.write(s, ops, regions) for s, ops, regions in ops_by_peer]
            for h in handles:
                h.result(120)
            conn.send((t0, time.time()))


def run(nbytes: int, repeats: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    pipes, procs, info = [], [], []
    for r in range(4):  # 0, 1: source ranks; 2, 3: target ranks
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(child, nbytes, r), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    info = [c.recv() for c in pipes]
    plans = {
        "twin": {0: [info[2]], 1: [info[3]]},
        "fanout": {0: [info[2], info[3]]},
    }
    rows = []
    try:
        for _warm in range(1):  # first contact (handshake) outside the timing
            for src, peers in plans["twin"].items():
                pipes[src].send(("send", peers, time.time()))
            for src in plans["twin"]:
                pipes[src].recv()
        for plan, senders in plans.items():
            times = []
            for _ in range(repeats):
                start_at = time.time() + 0.2
                for src, peers in senders.items():
                    pipes[src].send(("send", peers, start_at))
                ends = [pipes[src].recv()[1] for src in senders]
                times.append(max(ends) - start_at)
            seconds = statistics.median(times)
            rows.append(
                {
                    "plan": plan,
                    "mib_per_target": nbytes >> 20,
                    "seconds": round(seconds, 4),
                    "gib_per_s_delivered": round(2 * nbytes / seconds / (1 << 30), 3),
                    "runs": [round(t, 4) for t in times],
                }
            )
    finally:
        for c in pipes:
            c.send(("quit",))
        for p in procs:
            p.join(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for mb in args.mb:
        for row in run(mb << 20, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
