"""Host path vs pool fragmentation, on CPU: migration vs raw Mooncake writes of the same bytes.

Two spawned processes each hold a real SGLang host pool (``MHATokenToKVPoolHost`` built by
the CPU harness of ``test/support/cpu_harness.py``) registered with its own Mooncake Transfer
Engine (TCP on 127.0.0.1). Per host layout, page size, pool state and migration size the
source moves ``tokens`` slots of its pool into slots the target allocated, and the same
run times, side by side:

- ``migration``: what the source's host path does for one rank, from page indices to
  completion: ``plan_writes`` + ``write`` (``--paths plan``; the code before issue 11),
  ``write_pages`` (``--paths pages``: planning in the transport's worker, gathered
  through pinned staging), and ``write_pages`` into a target staging region followed by
  the target's ``scatter_from_staging`` (``--paths staged``, the protocol extension);
- ``raw contiguous``: one contiguous write of the same number of bytes (the transport's
  limit for those bytes);
- ``raw same entries``: ``write`` of the exact entry list ``plan_writes`` produced,
  planned beforehand (Mooncake's cost for that entry count).

Pool state ``fresh`` allocates from a new pool (contiguous slots); ``fragmented``
shuffles both pools' free lists page by page first (the worst case: every page its own
run). Every timed migration is checked byte for byte on its last repeat: the target's
pages equal the source's. Medians over ``--repeats``; ratios are against raw contiguous.

    .venv/bin/python benchmark/bench_host_fragmentation.py            # full run
    .venv/bin/python benchmark/bench_host_fragmentation.py --quick    # small, ~2 min

Prints one JSON line per cell and a markdown table at the end; ``--json PATH`` also
writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "test" / "support"))
sys.path.insert(0, str(_ROOT / "python"))
from pipe_rpc import Remote, serve  # noqa: E402  (test/ is on the path now)

REPLY_S = 600.0
_LOOP_S = 0.0005  # the stand-in scheduler loop's sleep between polls
RAW_PIECES = 16  # "raw 16 entries": the same contiguous bytes cut into this many entries
START_S = 300.0
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


LLAMA3_8B = Shape(layers=32, kv_heads=8, head_dim=128)  # 128 KiB per token
QUICK = Shape(layers=8, kv_heads=8, head_dim=128)  # 32 KiB per token


# --------------------------------------------------------------------------------------
# The peer process: one host pool, one transport
# --------------------------------------------------------------------------------------


class _Peer:
    """One server's host pool and transport; commands arrive over a Pipe."""

    def __init__(self) -> None:
        self.harness: Any = None
        self.transport: Any = None
        self.layout: Any = None
        self.staging: Any = None  # target: the region sources write into (--paths staged)
        self.scatterer: Any = None

    # -- setup ----------------------------------------------------------------

    def setup(
        self,
        layout: str,
        page_size: int,
        shape: dict,
        pool_tokens: int,
        chunk_bytes: int | None,
        entry_bytes: int | None,
    ) -> dict:
        import cpu_harness
        import torch
        from sglang_kv_migration.paths.host.layout import HostPoolLayout
        from sglang_kv_migration.paths.host.mooncake import (
            MemoryRegion,
            MooncakeTransport,
            TransportConfig,
        )

        self.close()
        device_tokens = 512
        cfg = cpu_harness.HarnessConfig(
            host_layout=layout,
            page_size=page_size,
            device_tokens=device_tokens,
            hicache_ratio=pool_tokens / device_tokens,
            layer_num=shape["layers"],
            head_num=shape["kv_heads"],
            head_dim=shape["head_dim"],
        )
        self.harness = cpu_harness.build_harness(cfg)
        pool = self.harness.host_pool
        self.layout = HostPoolLayout.from_host_pool(pool)
        # Distinct 8-byte words everywhere, so a misplaced page cannot go unnoticed.
        words = pool.kv_buffer.view(-1).view(torch.int64)
        torch.arange(words.numel(), out=words)
        words.mul_(0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF).add_(os.getpid())
        config = TransportConfig(hostname="127.0.0.1")
        if chunk_bytes is not None:
            config = dataclasses.replace(config, staging_chunk_bytes=chunk_bytes)
        if entry_bytes is not None:
            config = dataclasses.replace(config, staging_entry_bytes=entry_bytes)
        self.transport = MooncakeTransport(config)
        kv = pool.kv_buffer
        self.transport.register([MemoryRegion(kv.data_ptr(), kv.nbytes)])
        return {
            "session_id": self.transport.session_id,
            "data_ptrs": self.layout.data_ptrs,
            "data_lens": self.layout.data_lens,
            "item_lens": self.layout.item_lens,
            "page_size": page_size,
            "pool_slots": int(pool.size),
            "kv_base": kv.data_ptr(),
            "kv_nbytes": kv.nbytes,
        }

    def alloc(self, tokens: int, fragmented: bool, seed: int) -> list[int]:
        import torch

        pool = self.harness.host_pool
        pool.clear()
        if fragmented:
            ps = pool.page_size
            gen = torch.Generator().manual_seed(seed)
            pages = torch.randperm(pool.size // ps, generator=gen)
            pool.free_slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        return pool.alloc(tokens).tolist()

    def make_staging(self, nbytes: int) -> dict:
        import torch
        from sglang_kv_migration.paths.host.mooncake import MemoryRegion

        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = torch.zeros(nbytes, dtype=torch.uint8)  # as StagingArena: pre-faulted
            self.transport.register([MemoryRegion(self.staging.data_ptr(), nbytes)])
        return {"addr": self.staging.data_ptr(), "length": nbytes}

    # -- timed operations (source) --------------------------------------------

    def migrate(self, path: str, peer: dict, src: list[int], dst: list[int]) -> dict:
        """One migration as the source's scheduler thread would run it: submit, then poll
        the handle once per (0.5 ms) loop iteration. ``stall_ms`` is the longest the loop
        could not run: the submit call, or the worst iteration beyond its sleep."""
        from sglang_kv_migration.paths.host.layout import plan_writes
        from sglang_kv_migration.paths.host.mooncake import MemoryRegion

        peer_layout = _peer_layout(peer)
        regions = _regions(peer)
        cpu = self._worker_cpu_s()
        start = time.perf_counter()
        if path == "plan":
            ops = plan_writes(self.layout, src, peer_layout, dst)
            handle = self.transport.write(peer["session_id"], ops, regions)
        else:
            staging = None
            if path == "staged":
                staging = MemoryRegion(peer["staging"]["addr"], peer["staging"]["length"])
                regions = [*regions, staging]
            handle = self.transport.write_pages(
                peer["session_id"],
                self.layout,
                src,
                peer_layout,
                dst,
                regions,
                dst_staging=staging,
            )
        stall = _poll_loop(handle, start)
        stats = handle.result(REPLY_S)
        wall = time.perf_counter() - start
        return {
            "s": wall,
            "entries": stats.entries,
            "plan": stats.plan,
            "cpu": (self._worker_cpu_s() - cpu) / wall,
            "stall_ms": stall * 1e3,
        }

    def _worker_cpu_s(self) -> float:
        """CPU seconds of the transport's worker threads, one per peer (plans, gathers,
        waits)."""
        total = 0.0
        # benchmark only: the threads that wait on the wire (`MooncakeTransport.workers`)
        for thread in self.transport.workers.all_threads():
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        return total

    def raw_contiguous(self, peer: dict, nbytes: int, pieces: int = 1) -> dict:
        """The same bytes from one contiguous range to another, as ``pieces`` equal
        entries (the engine moves the entries of a batch concurrently)."""
        from sglang_kv_migration.paths.host.mooncake import WriteOp

        kv_base = self.harness.host_pool.kv_buffer.data_ptr()
        step = -(-nbytes // pieces)
        ops = [
            WriteOp(kv_base + o, peer["kv_base"] + o, min(step, nbytes - o))
            for o in range(0, nbytes, step)
        ]
        start = time.perf_counter()
        handle = self.transport.write(peer["session_id"], ops, _regions(peer))
        stall = _poll_loop(handle, start)  # the machine's own noise: no planning, one entry
        stats = handle.result(REPLY_S)
        return {"s": time.perf_counter() - start, "entries": stats.entries, "stall_ms": stall * 1e3}

    def raw_entries(self, peer: dict, src: list[int], dst: list[int]) -> dict:
        from sglang_kv_migration.paths.host.layout import plan_writes

        ops = plan_writes(self.layout, src, _peer_layout(peer), dst)
        start = time.perf_counter()
        stats = self.transport.write(peer["session_id"], ops, _regions(peer)).result(REPLY_S)
        return {"s": time.perf_counter() - start, "entries": stats.entries}

    # -- target side ----------------------------------------------------------

    def scatter(self, dst: list[int]) -> dict:
        from sglang_kv_migration.paths.host.staging import StagingScatterer

        if self.scatterer is None:
            self.scatterer = StagingScatterer()
        start = time.perf_counter()
        self.scatterer.submit(self.layout, self.staging, dst).result(REPLY_S)
        return {"s": time.perf_counter() - start}

    def zero(self, slots: list[int]) -> None:
        for b, offset in _page_views(self.layout, slots):
            b[offset] = 0

    def digest(self, slots: list[int]) -> str:
        h = hashlib.sha256()
        for b, offset in _page_views(self.layout, slots):
            h.update(b[offset].tobytes())
        return h.hexdigest()

    def close(self) -> None:
        if self.scatterer is not None:
            self.scatterer.close()
            self.scatterer = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.harness is not None:
            self.harness.close()
            self.harness = None
        self.staging = None
        gc.collect()  # the cache's reference cycles would keep a GiB-sized pool alive


def _poll_loop(handle: Any, start: float) -> float:
    """Poll ``handle`` every `_LOOP_S` like a scheduler loop; return the longest the loop
    was held: the submit call (``start`` until now) or an iteration beyond its sleep."""
    submitted = time.perf_counter()
    stall, last = submitted - start, submitted
    for _ in range(int(REPLY_S / _LOOP_S)):
        if handle.done():
            break
        time.sleep(_LOOP_S)
        now = time.perf_counter()
        stall, last = max(stall, now - last - _LOOP_S), now
    return stall


def _page_views(layout: Any, slots: list[int]) -> list[tuple[Any, Any]]:
    """Per buffer: (pages x page bytes uint8 view, page ids in slot order)."""
    import ctypes

    import numpy as np

    ps = layout.page_size
    page_ids = np.asarray(slots[::ps], dtype=np.int64) // ps
    views = []
    for buf in layout.buffers:
        raw = (ctypes.c_uint8 * buf.length).from_address(buf.ptr)
        arr = np.frombuffer(raw, dtype=np.uint8).reshape(-1, ps * buf.item_len)
        views.append((arr, page_ids))
    return views


def _peer_layout(peer: dict) -> Any:
    from sglang_kv_migration.paths.host.layout import HostPoolLayout

    return HostPoolLayout.from_published(
        peer["data_ptrs"], peer["data_lens"], peer["item_lens"], peer["page_size"]
    )


def _regions(peer: dict) -> list[Any]:
    from sglang_kv_migration.paths.host.mooncake import MemoryRegion

    return [MemoryRegion(peer["kv_base"], peer["kv_nbytes"])]


def peer_main(conn: Connection) -> None:
    import cpu_harness

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu_harness.install_cpu_shims()
    import sglang.srt.mem_cache.hiradix_cache  # noqa: F401  (the slow import, up front)

    switch = os.environ.get("KVMIG_BENCH_SWITCH_INTERVAL_S")
    if switch:  # to tell GIL hand-over delays from CPU contention in the loop stall
        sys.setswitchinterval(float(switch))
    peer = _Peer()
    conn.send(("ready", None))
    serve(conn, peer, REPLY_S)


# --------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    layout: str
    page_size: int
    pool: str
    tokens: int
    mib: float
    path: str
    plan: str  # what write_pages chose (direct / gather / staged); "-" for plan_writes
    entries: int
    migration_ms: float
    raw_contiguous_ms: float
    raw_pieces_ms: float  # the same contiguous bytes as RAW_PIECES concurrent entries
    raw_entries_ms: float
    ratio: float  # migration / raw contiguous
    pieces_ratio: float  # migration / raw contiguous in RAW_PIECES entries
    raw_entries_ratio: float  # raw same entries / raw contiguous
    worker_cores: float  # source transfer worker's CPU seconds per migration second (median)
    max_stall_ms: float  # longest the source's stand-in scheduler loop was held (max)
    control_stall_ms: float  # the same during the raw contiguous writes: the noise floor
    ok: bool


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def run_cell(
    src: Remote,
    dst: Remote,
    peer: dict,
    layout: str,
    page_size: int,
    pool: str,
    tokens: int,
    paths: list[str],
    repeats: int,
    bytes_per_token: int,
    seed: int,
    raw_entries_too: bool = True,
) -> list[Row]:
    fragmented = pool == "fragmented"
    src_slots = src.do("alloc", tokens, fragmented, seed)
    dst_slots = dst.do("alloc", tokens, fragmented, seed + 1)
    nbytes = tokens * bytes_per_token
    if "staged" in paths:
        peer = {**peer, "staging": dst.do("make_staging", nbytes)}
    want = src.do("digest", src_slots)
    raw_c, raw_p, raw_e, raw_entries, control_stalls = [], [], [], 0, []
    for _ in range(repeats):
        r = src.do("raw_contiguous", peer, nbytes)
        raw_c.append(r["s"])
        control_stalls.append(r["stall_ms"])
        raw_p.append(src.do("raw_contiguous", peer, nbytes, RAW_PIECES)["s"])
        if raw_entries_too:
            r = src.do("raw_entries", peer, src_slots, dst_slots)
            raw_e.append(r["s"])
            raw_entries = r["entries"]
        else:  # a million entries outlast the 30 s transfer deadline
            raw_e.append(float("nan"))
    rows = []
    for path in paths:
        times, cores, stalls, entries, plan = [], [], [], 0, ""
        failed = ""
        for _ in range(repeats):
            dst.do("zero", dst_slots)
            try:
                r = src.do("migrate", path, peer, src_slots, dst_slots)
            except RuntimeError as e:  # e.g. the transfer deadline: report it, go on
                failed = str(e).strip().splitlines()[-1]
                print(f"{layout} page {page_size} {pool} {tokens} {path}: {failed}", flush=True)
                times, cores, stalls = [float("nan")], [float("nan")], [float("nan")]
                break
            cores.append(r["cpu"])
            seconds = r["s"]
            stalls.append(r["stall_ms"])
            plan = r["plan"]
            if plan == "staged":  # the target scatters before it commits
                seconds += dst.do("scatter", dst_slots)["s"]
            times.append(seconds)
            entries = r["entries"]
        ok = not failed and dst.do("digest", dst_slots) == want
        rc, re_, rp = _median_ms(raw_c), _median_ms(raw_e), _median_ms(raw_p)
        m = _median_ms(times)
        rows.append(
            Row(
                layout=layout,
                page_size=page_size,
                pool=pool,
                tokens=tokens,
                mib=nbytes / 2**20,
                path=path,
                plan=plan if path != "plan" else "-",
                entries=entries or raw_entries,
                migration_ms=m,
                raw_contiguous_ms=rc,
                raw_pieces_ms=rp,
                raw_entries_ms=re_,
                ratio=m / rc,
                pieces_ratio=m / rp,
                raw_entries_ratio=re_ / rc,
                worker_cores=statistics.median(cores),
                max_stall_ms=max(stalls),
                control_stall_ms=max(control_stalls),
                ok=ok,
            )
        )
        print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def planning_stall(tokens: int, shape: Shape, repeats: int) -> None:
    """In one process, no engine: how long `staging.plan_pages` (as the transport's worker
    runs it, on one torch thread) keeps a 0.5 ms loop on another thread from running, for
    a fragmented layer_first pool at page size 1; the control keeps the worker busy with
    GIL-free torch work instead (this machine's own scheduling noise)."""
    import threading

    import torch
    from sglang_kv_migration.paths.host import staging
    from sglang_kv_migration.paths.host.layout import HostPoolLayout

    slots = 2 * tokens
    nbytes = 2 * shape.layers * slots * (shape.bytes_per_token // (2 * shape.layers))

    def layout(base: int) -> HostPoolLayout:  # addresses only: nothing is read or written
        return HostPoolLayout.from_contiguous_buffer(
            attention="mha",
            host_layout="layer_first",
            base_ptr=base,
            nbytes=nbytes,
            layer_num=shape.layers,
            page_size=1,
            num_slots=slots,
        )

    src, dst = layout(1 << 40), layout(1 << 42)
    gen = torch.Generator().manual_seed(0)
    src_slots = torch.randperm(slots, generator=gen)[:tokens]
    dst_slots = torch.randperm(slots, generator=gen)[:tokens].tolist()  # as it arrives

    def plan(kind: str) -> None:
        extra = {"dst_staging_addr": 1 << 44, "dst_staging_length": 1 << 40}
        staging.plan_pages(
            src,
            src_slots,
            dst,
            dst_slots,
            chunk_bytes=16 << 20,
            **(extra if kind == "staged" else {}),
        )

    def busy() -> None:
        x = torch.zeros(1 << 22)
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            x.add_(1)

    for name, work in (
        ("control", busy),
        ("gather plan", lambda: plan("gather")),
        ("staged plan", lambda: plan("staged")),
    ):
        worst = []
        for _ in range(repeats):

            def run(work=work) -> None:
                torch.set_num_threads(1)
                work()

            thread = threading.Thread(target=run)
            start = time.perf_counter()
            thread.start()
            stall, last = 0.0, time.perf_counter()
            while thread.is_alive():
                time.sleep(_LOOP_S)
                now = time.perf_counter()
                stall, last = max(stall, now - last - _LOOP_S), now
            thread.join()
            worst.append((stall * 1e3, (time.perf_counter() - start) * 1e3))
        stalls = [w for w, _ in worst]
        print(
            f"{name}: {tokens} pages x {2 * shape.layers} buffers, worst loop stall "
            f"{max(stalls):.2f} ms (median {statistics.median(stalls):.2f}), "
            f"took {statistics.median(t for _, t in worst):.0f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, 1K tokens, 2 repeats")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--pools", nargs="+", default=["fresh", "fragmented"])
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["plan", "pages", "staged"],
        choices=["plan", "pages", "staged"],
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--pool-tokens", type=int, default=None, help="slots per host pool (2 x largest size)"
    )
    parser.add_argument(
        "--no-raw-entries", action="store_true", help="skip the raw same-entries write"
    )
    parser.add_argument(
        "--planning-stall",
        action="store_true",
        help="only measure how long planning holds a loop on another thread (one process)",
    )
    parser.add_argument(
        "--chunk-mib", type=int, default=None, help="TransportConfig.staging_chunk_bytes in MiB"
    )
    parser.add_argument(
        "--entry-kib", type=int, default=None, help="TransportConfig.staging_entry_bytes in KiB"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shape = QUICK if args.quick else LLAMA3_8B
    if args.planning_stall:
        for tokens in args.tokens or [4096, 16384]:
            planning_stall(tokens, shape, args.repeats or 5)
        return
    tokens_list = args.tokens or ([1024] if args.quick else [1024, 4096])
    repeats = args.repeats or (2 if args.quick else 3)
    pool_tokens = args.pool_tokens or 2 * max(tokens_list)

    load_before = os.getloadavg()
    remotes = [Remote.spawn("source", peer_main), Remote.spawn("target", peer_main)]
    rows: list[Row] = []
    try:
        for r in remotes:
            if not r.conn.poll(START_S):
                raise TimeoutError(f"{r.name} did not start")
            r.conn.recv()
        src, dst = remotes
        for layout in args.layouts:
            for page_size in args.page_sizes:
                chunk = None if args.chunk_mib is None else args.chunk_mib << 20
                entry = None if args.entry_kib is None else args.entry_kib << 10
                common = (layout, page_size, asdict(shape), pool_tokens, chunk, entry)
                src.do("setup", *common)
                peer = dst.do("setup", *common)
                for pool in args.pools:
                    for tokens in tokens_list:
                        rows += run_cell(
                            src,
                            dst,
                            peer,
                            layout,
                            page_size,
                            pool,
                            tokens,
                            args.paths,
                            repeats,
                            shape.bytes_per_token,
                            seed=tokens + page_size,
                            raw_entries_too=not args.no_raw_entries,
                        )
    finally:
        for r in remotes:
            r.stop()
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(
        f"\nshape: {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} "
        f"(bf16, {shape.bytes_per_token // 1024} KiB/token); repeats {repeats}; medians; "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after\n"
    )
    print(
        "| layout | page | pool | tokens | MiB | path (plan) | entries | migration ms | "
        f"raw contiguous ms (x{RAW_PIECES}) | raw same entries ms | migration / contiguous "
        f"(/ x{RAW_PIECES}) | same entries / contiguous | worker cores | "
        "loop stall ms (control) | bytes ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.layout} | {r.page_size} | {r.pool} | {r.tokens} | {r.mib:.0f} | "
            f"{r.path} ({r.plan}) | "
            f"{r.entries} | {r.migration_ms:.1f} | {r.raw_contiguous_ms:.1f} "
            f"({r.raw_pieces_ms:.1f}) | {r.raw_entries_ms:.1f} | {r.ratio:.2f} "
            f"({r.pieces_ratio:.2f}) | {r.raw_entries_ratio:.2f} | "
            f"{r.worker_cores:.2f} | {r.max_stall_ms:.1f} ({r.control_stall_ms:.1f}) | "
            f"{'yes' if r.ok else 'NO'} |"
        )
    if not all(r.ok for r in rows):
        sys.exit("some migrations did not deliver identical bytes")


if __name__ == "__main__":
    main()
