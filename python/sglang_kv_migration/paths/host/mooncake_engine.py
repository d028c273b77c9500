"""The Mooncake Transfer Engine, wrapped: the only module of the package that imports
`mooncake`, and it does so lazily when an engine starts, so the rest of the package imports
on machines without it. Every integer return code of the engine is read here, once: a
failed start or registration raises `TransferError`, a failed submission or batch raises
`EngineCallFailed` (which names the call and the code; the worker adds the peer and the
bytes, and decides on the retry), and a one-entry batch's status comes back as the
engine's code (1 done, 0 running, -1 failed, -2 timed out: states, not errors).

Facts about mooncake-transfer-engine 0.3.13.post1 this module relies on (checked with two
processes over TCP on 127.0.0.1):
- `initialize(hostname, "P2PHANDSHAKE", protocol, devices)` returns 0 on success; the engine
  picks its own RPC port (`get_rpc_port()`), and ignores `protocol`: it uses RDMA whenever
  an HCA is visible unless `MC_FORCE_TCP` is set.
- `batch_register_memory` returns 0, or a negative code (-7 for an overlapping region).
- `batch_transfer_async_write` returns a batch id; 0 means it failed to submit (e.g. no
  listener at the peer address). Ids are unsigned pointers, so a negative test never fires.
- `get_batch_transfer_status([id])` waits (spinning, GIL released) until the batch completes
  (0) or one entry fails or the engine's own timeout, `MC_TRANSFER_TIMEOUT` (default 30 s)
  plus 1 ns per byte, passes (-1). It frees the batch id in both cases.
- `transfer_check_status(id)` is NOT usable for batches: it looks at the first entry only
  (it reported a 9-entry 32 MiB batch done after 5 ms; the batch took 100 ms) and frees the
  batch when that entry finishes. For a one-entry batch (`transfer_submit_write`) it is
  exact and never blocks: 1 done, 0 running, -1 failed (both free the id), -2 timed out.
- So the worker (`mooncake_batches.py`) waits without spinning a core: a write of at most
  `_SINGLES_MAX` entries is submitted as one-entry batches and polled with
  `transfer_check_status` between short sleeps; a larger batch sleeps for most of the time
  its previous batch took, and only then calls the spinning `get_batch_transfer_status`.
- Over TCP one entry is in flight per lane (`MC_TCP_LANES_PER_PEER`, default 4, per peer)
  and the rest queue in the engine; -2 from `transfer_check_status` means the engine timed
  the entry out while still holding it (it may yet be sent, even from the queue on a new
  stream). So over TCP every entry goes out as a one-entry batch, at most the peer's lanes
  of them in the engine at once, each keeping its lane until the engine reports it final
  (`lanes.py`); `get_batch_transfer_status`, which frees a batch it timed out, is not used.
- The cost per entry is fixed (~20 us over TCP on a 2-core box), so `write_pages` plans at
  page granularity in the worker and gathers scattered pages into reused staging chunks
  (`staging.py`), keeping the entry count independent of how fragmented the pools are.
- A write to a peer address the peer did not register is refused by the peer (-1); no
  memory is touched. Over TCP the local source need not be registered, over RDMA it must;
  we require it for both.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from sglang_kv_migration.paths.host.transport import (
    MemoryRegion,
    TransferError,
    TransportConfig,
    logged,
)

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

# 0 is the documented failure id; the upstream source also returns -1 (seen as 2**64 - 1
# through the unsigned id type) when the handshake with the peer fails.
_FAILED_BATCH_IDS = frozenset({0, 2**64 - 1})


class EngineCallFailed(Exception):
    """An engine call refused or failed a write: `api` returned `code`."""

    def __init__(self, api: str, code: int):
        super().__init__(f"{api} returned {code}")
        self.api = api
        self.code = code


class MooncakeEngine:
    """One started transfer engine in P2P-handshake mode (no etcd); its calls with their
    return codes read. Thread-safe as the binding is; `release()` drops it."""

    def __init__(self, config: TransportConfig):
        self._engine: TransferEngine | None = _start_engine(config)
        self.rpc_port: int = self._engine.get_rpc_port()
        # What peers pass as `peer_session_id` to write into this process.
        self.session_id = f"{config.hostname}:{self.rpc_port}"

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register buffers as sources and as destinations peers may write into."""
        engine = self._live()
        rc = engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            total = sum(r.length for r in regions)
            message = (
                f"registering {len(regions)} regions ({total} bytes) on {self.session_id} "
                f"failed: batch_register_memory returned {rc}"
            )
            raise logged(TransferError(message))

    def unregister(self, addr: int) -> None:
        self._live().unregister_memory(addr)

    def submit_batch(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """Start a batch write; its id (for `wait_batch`)."""
        batch_id = self._live().batch_transfer_async_write(peer, srcs, dsts, lengths)
        if batch_id in _FAILED_BATCH_IDS:
            raise EngineCallFailed("batch_transfer_async_write", _signed(batch_id))
        return batch_id

    def wait_batch(self, batch_id: int) -> None:
        """Wait for a batch (spinning, GIL released) and free its id."""
        # Blocks this worker thread only; the binding releases the GIL.
        code = self._live().get_batch_transfer_status([batch_id])
        if code != 0:
            raise EngineCallFailed("get_batch_transfer_status", code)

    def submit_single(self, peer: str, src: int, dst: int, length: int) -> int:
        """Start a one-entry batch; its id (for `check_single`)."""
        batch_id = self._live().transfer_submit_write(peer, src, dst, length)
        if batch_id in _FAILED_BATCH_IDS:
            raise EngineCallFailed("transfer_submit_write", _signed(batch_id))
        return batch_id

    def check_single(self, batch_id: int) -> int:
        """A one-entry batch's state, never blocking: 1 done, 0 running, -1 failed (both
        free the id), -2 timed out."""
        return self._live().transfer_check_status(batch_id)

    def batch_completed(self, batch_id: int) -> bool:
        """Wait for a batch the poll gave up on (bounded by the engine's own timeout) and
        free its id: whether it did complete."""
        return self._live().get_batch_transfer_status([batch_id]) == 0

    def status_check(self) -> Callable[[int], int] | None:
        """The engine's one-entry status call (as `check_single`), or None once released:
        the lanes' reaper polls with it, and the call it holds keeps the engine alive."""
        engine = self._engine
        return None if engine is None else engine.transfer_check_status

    def probe(self, peer: str) -> int:
        """The handshake probe (no engine-wide lock, GIL released): 0 when the peer
        answers; -1 once released."""
        engine = self._engine
        return -1 if engine is None else int(engine.send_probe(peer))

    def release(self) -> None:
        """Drop the engine: the binding's destructor closes segments and stops it. Only
        once no call is in flight (its batches use registered memory)."""
        self._engine = None

    def _live(self) -> TransferEngine:
        engine = self._engine
        # The transport calls the engine only until its workers have stopped.
        assert engine is not None, "the transfer engine was released"
        return engine


class RegionIndex:
    """Answers "is [addr, addr + length) inside one region?" in O(log regions)."""

    def __init__(self, regions: Iterable[MemoryRegion]):
        self.regions: tuple[MemoryRegion, ...] = tuple(sorted(regions, key=lambda r: r.addr))
        self._starts = [r.addr for r in self.regions]
        # Largest end among regions starting at or before index i, so overlaps are handled.
        self._max_ends = list(itertools.accumulate((r.end for r in self.regions), max))

    def covers(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and self._max_ends[i] >= addr + length


class Registrations:
    """What this process registered with its engine: the sources its writes may read."""

    def __init__(self, engine: MooncakeEngine):
        self._engine = engine
        self._lock = threading.Lock()  # guards `_index`
        self._index = RegionIndex(())

    @property
    def index(self) -> RegionIndex:
        with self._lock:
            return self._index

    def add(self, regions: Sequence[MemoryRegion]) -> None:
        self._engine.register(regions)
        with self._lock:
            self._index = RegionIndex((*self._index.regions, *regions))

    def remove(self, addr: int) -> None:
        """Unregister the region starting at `addr` (no transfer may use it)."""
        self._engine.unregister(addr)
        with self._lock:
            self._index = RegionIndex(r for r in self._index.regions if r.addr != addr)


@contextlib.contextmanager
def _force_tcp(tcp: bool) -> Iterator[None]:
    """MC_FORCE_TCP set (tcp) or unset (rdma) while the engine initializes, then as it was.

    The engine ignores its protocol argument and picks RDMA whenever an HCA is visible,
    unless MC_FORCE_TCP is set; it reads the variable only while initializing, so the
    rest of the process (and another engine started later) keeps its own environment."""
    before = os.environ.get("MC_FORCE_TCP")
    if tcp:
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MC_FORCE_TCP", None)
        else:
            os.environ["MC_FORCE_TCP"] = before


def _start_engine(config: TransportConfig) -> TransferEngine:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(
            "mooncake is not installed: install sglang-kv-migration[gpu] (or [cpu])"
        ) from exc
    engine = TransferEngine()
    with _force_tcp(config.protocol == "tcp"):
        rc = engine.initialize(
            config.hostname, "P2PHANDSHAKE", config.protocol, config.rdma_devices
        )
    if rc != 0:
        message = (
            f"starting the transfer engine on {config.hostname} over {config.protocol} "
            f"(devices {config.rdma_devices or 'auto'}) failed: initialize returned {rc}"
        )
        raise logged(TransferError(message))
    return engine


def _signed(batch_id: int) -> int:
    """Batch ids are unsigned; show the binding's -1 as -1."""
    return batch_id - 2**64 if batch_id >= 2**63 else batch_id
