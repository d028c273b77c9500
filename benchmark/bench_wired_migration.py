"""Host-path migrations through the real wired code on CPU, against raw Mooncake writes.

Two spawned processes each run a real `MigrationSchedulerSide` over a real SGLang
`HiRadixCache` from the CPU harness (`test/support/_migration_peer.py`; Llama-3-8B-shaped KV,
32 layers, 8 KV heads, head dim 128, bf16 = 128 KiB per token) with its own Mooncake
engine (TCP on 127.0.0.1). Per cell both host pools' free lists are shuffled page by page
(the worst case), the source holds the prefix on host, and one migration is the three
scheduler-side operations as the HTTP layer runs them: allocate on the target, transfer
on the source (handler, then the per-iteration poll until it replies), commit on the
target (with a staged write: the scatter off the scheduler thread, polled until it
replies). Each side's time is measured in its own process, so only the pipe hops between
the phases are left out. Side by side, in the same run: one contiguous raw write of the
same bytes (source staging arena -> target staging arena, one entry) and the same bytes as
16 entries. Variants: ``staged`` (the target grants a staging extent and copies pages
into their slots as the progress markers arrive: the default), ``serial`` (staged, but
the target copies everything at commit, as before the overlap) and ``direct`` (the
client asks for no extent, as with ``--kv-migration-staging-mb 0``). The last repeat of
every cell is checked byte for byte (KV loaded back to the device pool on both sides).

    .venv/bin/python benchmark/bench_wired_migration.py                 # default cells
    .venv/bin/python benchmark/bench_wired_migration.py --tokens 1024 --variants staged direct

Also reports, per migration, the longest time the migration code spent on either side's
scheduler thread in one loop iteration (`metrics.LoopTimer`: handlers + poll), and what
that iteration consisted of: each handler by request type, the poll's steps, garbage
collections inside them (`gc`), with the thread's CPU time per part (wall minus CPU:
time off the CPU, preempted or waiting for the GIL).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))
from pipe_rpc import Remote, serve  # noqa: E402  (test/ is on the path now)

REPLY_S = 600.0
START_S = 300.0
RAW_PIECES = 16
SHAPE = {"layer_num": 32, "head_num": 8, "head_dim": 128}
# --scheduler-loops: (spin between polls, the poll offers the GIL to helper threads)
LOOPS = {"sleep": (False, True), "spin": (True, True), "spin-no-yield": (True, False)}
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


# --------------------------------------------------------------------------------------
# The peer process: `_migration_peer._Server` plus timing commands
# --------------------------------------------------------------------------------------


def _server_class() -> type:
    from _migration_peer import _Server

    class BenchServer(_Server):
        def timed_call(self, name: str, request: Any) -> tuple[Any, float, Worst]:
            """(reply, seconds, the longest iteration of our scheduler-thread time)."""
            timer = self.side.diagnostics.loop_timer
            timer.diagnose()  # idempotent
            timer.reset()
            start = time.perf_counter()
            reply = self.call(name, request)
            worst = Worst(timer.max_s, dict(timer.worst_parts), dict(timer.worst_probe_parts))
            return reply, time.perf_counter() - start, worst

        def set_overlap(self, on: bool) -> None:
            self.side.target.staging.overlap = on

        def arena(self) -> list[int]:
            return self.side.target.staging.region

        def raw_write(self, session_id: str, peer_arena: list[int], nbytes: int, pieces: int):
            """One write of ``nbytes`` from this side's arena into the peer's."""
            from sglang_kv_migration.paths.host.mooncake import MemoryRegion, WriteOp

            base = self.side.target.staging.region[0]
            step = -(-nbytes // pieces)
            ops = [
                WriteOp(base + o, peer_arena[0] + o, min(step, nbytes - o))
                for o in range(0, nbytes, step)
            ]
            start = time.perf_counter()
            handle = self.side.paths["host"].transport.write(
                session_id, ops, [MemoryRegion(*peer_arena)]
            )
            while not handle.done():  # as the scheduler loop would poll it
                time.sleep(0.0005)
            handle.result()
            return time.perf_counter() - start

        def touch_host_pool(self) -> None:
            """Write every byte of the host pool once. SGLang pins (and so faults in) its
            host pool at start-up; the CPU harness's is lazily mapped, and first-touch
            page faults would otherwise be timed inside the first write to each slot."""
            import torch

            for buf in self.side.identity.layout.buffers:
                view = (ctypes.c_uint8 * buf.length).from_address(buf.ptr)
                torch.frombuffer(view, dtype=torch.uint8).fill_(0x5A)

        def insert_on_host(self, tokens: list[int], seed: int) -> None:
            """Drop the previous prefix, insert this one, back it up to host, free the
            device copy (the source's pages on host, in a pool of bounded size)."""
            self.harness.cache.evict_host(self.harness.host_pool.size)
            self.insert(tokens, seed, True)
            self.evict_device()

    return BenchServer


def peer_main(conn: Connection) -> None:
    import cpu_harness

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu_harness.install_cpu_shims()
    import sglang_kv_migration.server.scheduler.scheduler_side  # noqa: F401  (the slow import, up front)

    server = _server_class()()
    conn.send(("ready", None))

    # Between commands too, a spinning loop keeps polling (SGLang's does, idle or not).
    # (Without spin: 5 ms naps; the phases are timed inside this process, not affected.)
    def between() -> None:
        server.idle_iteration() if server.spin else time.sleep(0.005)

    serve(conn, server, REPLY_S, between)


# --------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------


@dataclass
class Worst:
    """One side's longest iteration: its total and parts (seconds; `LoopTimer`)."""

    total_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    # Per part: (thread CPU s, voluntary, involuntary context switches).
    probe_parts: dict[str, tuple[float, int, int]] = field(default_factory=dict)

    def max(self, other: Worst) -> Worst:
        return other if other.total_s > self.total_s else self

    def describe(self) -> str:
        """Parts over 50 us, largest first: 'name wall ms (cpu ms, switches v/i)'."""
        described = []
        for name, seconds in sorted(self.parts.items(), key=lambda kv: -kv[1]):
            if seconds < 5e-5:
                continue
            text = f"{_short(name)} {seconds * 1e3:.2f}"
            if name in self.probe_parts:
                cpu, voluntary, involuntary = self.probe_parts[name]
                text += f" (cpu {cpu * 1e3:.2f}, sw {voluntary}/{involuntary})"
            described.append(text)
        return ", ".join(described)


def _short(part: str) -> str:
    """`TransferRequestKVCacheReqInput` -> `TransferRequestKVCache` (tables stay narrow)."""
    return part.removesuffix("ReqInput")


@dataclass
class Row:
    layout: str
    page_size: int
    tokens: int
    mib: float
    variant: str
    plan: str
    entries: int
    migration_ms: float  # allocate + transfer + commit, median
    allocate_ms: float
    transfer_ms: float
    commit_ms: float  # includes the staged scatter
    raw_contiguous_ms: float
    raw_pieces_ms: float
    ratio: float  # migration / raw contiguous
    pieces_ratio: float
    migration_ms_range: tuple[float, float]  # the repeats' smallest and largest migration
    ratio_range: tuple[float, float]  # each repeat's migration / its contiguous write
    repeats_ms: dict[str, list[float]]  # every repeat of each timed part
    source_loop_max_ms: float  # longest iteration of our code on the source's loop (max)
    target_loop_max_ms: float
    ok: bool
    source_worst: str = ""  # the source's longest iteration, by part (ms)
    target_worst: str = ""
    loop: str = "sleep"  # --scheduler-loops mode of the stand-in scheduler loops


def run_cell(
    src: Remote, dst: Remote, layout: str, page_size: int, tokens: int, variant: str, repeats: int
) -> Row:
    from sglang_kv_migration.server.messages import (
        AllocateTokenForTransferReqInput,
        CommitTransferRequestKVCacheReqInput,
        GetTransferSessionInfoReqInput,
        TransferRequestKVCacheReqInput,
    )
    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

    nbytes = tokens * BYTES_PER_TOKEN
    # Room for the migration plus the raw writes' bytes, on both sides.
    arena = (-(-nbytes // (1 << 20)) + 1) << 20
    cfg = {"attention": "mha", "host_layout": layout, "page_size": page_size, **SHAPE}
    cfg["device_tokens"] = tokens + 2 * page_size
    # Both sides have an arena (the raw writes use them); "direct" asks for no extent.
    # Each side keeps one or two prefixes on host (older ones are evicted).
    src.do("setup", {**cfg, "hicache_ratio": 2.5}, 60.0, {"staging_bytes": arena})
    dst.do("setup", {**cfg, "hicache_ratio": 2.5}, 60.0, {"staging_bytes": arena})
    # "serial": staged, but the target copies the extent only at commit (no overlap).
    dst.do("set_overlap", variant != "serial")
    src.do("touch_host_pool")
    dst.do("touch_host_pool")
    info = dst.do("call", "get_transfer_session_info", GetTransferSessionInfoReqInput())
    src_info = src.do("call", "get_transfer_session_info", GetTransferSessionInfoReqInput())
    rank = info.ranks[0]
    peer_arena = dst.do("arena")
    src.do("fragment_host", 1)
    samples: dict[str, list[float]] = {k: [] for k in ("alloc", "xfer", "commit", "raw", "raw16")}
    loop_src, loop_dst, plan, entries, ok = Worst(), Worst(), "", 0, True
    for r in range(repeats):
        prefix = list(range(1_000_000 * (r + 1), 1_000_000 * (r + 1) + tokens))
        src.do("insert_on_host", prefix, r)
        dst.do("fragment_host", 100 + r)
        mid = f"bench-{layout}-{page_size}-{tokens}-{variant}-{r}"
        alloc, t_alloc, l_alloc = dst.do(
            "timed_call",
            "allocate_token_for_transfer",
            AllocateTokenForTransferReqInput(
                input_ids=prefix,
                migration_id=mid,
                source_fingerprints=[x.fingerprint for x in src_info.ranks],
                source_instance=src_info.instance_id,
                staging=variant != "direct",
            ),
        )
        assert alloc.success, alloc.message
        target = TransferRequestKVCacheTarget(
            tp=0,
            pp=0,
            session_id=rank.session_id,
            host_kv_data_ptrs=rank.host_kv_data_ptrs,
            host_kv_data_lens=rank.host_kv_data_lens,
            host_kv_item_lens=rank.host_kv_item_lens,
            kv_indices=alloc.ranks[0].kv_indices,
            fingerprint=rank.fingerprint,
            grant=alloc.ranks[0].grant,
            staging=alloc.ranks[0].staging,
        )
        sent, t_xfer, l_xfer = src.do(
            "timed_call",
            "transfer_request_kvcache",
            TransferRequestKVCacheReqInput(
                input_ids=prefix,
                matched_token_size=alloc.matched_token_size,
                extra_token_size=alloc.extra_token_size,
                target_per_rank=[target],
                migration_id=mid,
            ),
        )
        assert sent.success, sent.message
        committed, t_commit, l_commit = dst.do(
            "timed_call",
            "commit_transfer_request_kvcache",
            CommitTransferRequestKVCacheReqInput(
                migration_id=mid, receipts=[x.receipt for x in sent.ranks]
            ),
        )
        assert committed.success, committed.message
        raw = src.do("raw_write", rank.session_id, peer_arena, nbytes, 1)
        raw16 = src.do("raw_write", rank.session_id, peer_arena, nbytes, RAW_PIECES)
        for key, value in zip(samples, (t_alloc, t_xfer, t_commit, raw, raw16), strict=True):
            samples[key].append(value)
        loop_src = loop_src.max(l_xfer)
        loop_dst = loop_dst.max(l_alloc).max(l_commit)
        plan, entries = sent.ranks[0].plan, sent.ranks[0].entries
        if r == repeats - 1:
            ok = src.do("kv_digest", prefix) == dst.do("kv_digest", prefix)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    migration = med["alloc"] + med["xfer"] + med["commit"]
    # Per repeat: the migration and its ratio to that repeat's contiguous write.
    parts = zip(samples["alloc"], samples["xfer"], samples["commit"], strict=True)
    each = [sum(x) * 1e3 for x in parts]
    each_ratio = [m / (raw * 1e3) for m, raw in zip(each, samples["raw"], strict=True)]
    return Row(
        layout=layout,
        page_size=page_size,
        tokens=tokens,
        mib=nbytes / (1 << 20),
        variant=variant,
        plan=plan,
        entries=entries,
        migration_ms=round(migration, 1),
        allocate_ms=round(med["alloc"], 1),
        transfer_ms=round(med["xfer"], 1),
        commit_ms=round(med["commit"], 1),
        raw_contiguous_ms=round(med["raw"], 1),
        raw_pieces_ms=round(med["raw16"], 1),
        ratio=round(migration / med["raw"], 2),
        migration_ms_range=(round(min(each), 1), round(max(each), 1)),
        ratio_range=(round(min(each_ratio), 2), round(max(each_ratio), 2)),
        repeats_ms={k: [round(x * 1e3, 2) for x in v] for k, v in samples.items()},
        pieces_ratio=round(migration / med["raw16"], 2),
        source_loop_max_ms=round(loop_src.total_s * 1e3, 2),
        target_loop_max_ms=round(loop_dst.total_s * 1e3, 2),
        ok=ok,
        source_worst=loop_src.describe(),
        target_worst=loop_dst.describe(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["layer_first"])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument(
        "--variants", nargs="+", default=["staged"], choices=["staged", "serial", "direct"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--scheduler-loops", nargs="+", choices=list(LOOPS), default=["sleep"],
        help="between polls the stand-in scheduler loop sleeps 0.5 ms (GIL free) or, like "
        "SGLang's, spins in Python (GIL held: helper threads get it when the poll offers "
        "it, or with spin-no-yield only every 5 ms switch interval)",
    )  # fmt: skip
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}", flush=True)
    src, dst = Remote.spawn("source", peer_main), Remote.spawn("target", peer_main)
    rows: list[Row] = []
    try:
        for remote in (src, dst):
            if not remote.conn.poll(START_S) or remote.conn.recv()[0] != "ready":
                raise RuntimeError(f"{remote.name} did not start")
        cells = [
            (loop, layout, page_size, tokens, variant)
            for layout in args.layouts
            for page_size in args.page_sizes
            for tokens in args.tokens
            for variant in args.variants
            for loop in args.scheduler_loops
        ]
        for loop, layout, page_size, tokens, variant in cells:
            for remote in (src, dst):
                remote.do("set_spin", *LOOPS[loop])
            row = run_cell(src, dst, layout, page_size, tokens, variant, args.repeats)
            row.loop = loop
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
    finally:
        src.stop()
        dst.stop()
    print(f"load average after: {os.getloadavg()}")
    print(
        "| loop | layout | page | tokens (MiB) | variant | plan, entries | migration ms "
        "(allocate / transfer / commit; min–max) | raw contiguous ms (x16) | ratio "
        "(min–max; vs x16) | "
        "loop max ms source / target | bytes equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.loop} | {r.layout} | {r.page_size} | {r.tokens} ({r.mib:.0f}) | {r.variant} | "
            f"{r.plan}, {r.entries} | {r.migration_ms:.0f} ({r.allocate_ms:.0f} / "
            f"{r.transfer_ms:.0f} / {r.commit_ms:.0f}; {r.migration_ms_range[0]:.0f}–"
            f"{r.migration_ms_range[1]:.0f}) | {r.raw_contiguous_ms:.0f} "
            f"({r.raw_pieces_ms:.0f}) | **{r.ratio:.2f}** ({r.ratio_range[0]:.2f}–"
            f"{r.ratio_range[1]:.2f}; x16 {r.pieces_ratio:.2f}) | "
            f"{r.source_loop_max_ms:.1f} / {r.target_loop_max_ms:.1f} | {r.ok} |"
        )
    print(
        "\nWorst iteration by part, wall ms (thread CPU ms, context switches voluntary / "
        "involuntary); gc: collections inside our parts"
    )
    print("| loop | layout | page | tokens | variant | source | target |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.loop} | {r.layout} | {r.page_size} | {r.tokens} | {r.variant} | "
            f"{r.source_loop_max_ms:.2f}: {r.source_worst} | "
            f"{r.target_loop_max_ms:.2f}: {r.target_worst} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
