"""The landing arena: where sources write for a target started with --enable-memory-saver.

torch_memory_saver maps the KV pools of such a server with the driver's virtual memory
API, and CUDA IPC cannot export those mappings (`cudaIpcGetMemHandle` answers "invalid
argument"); the mappings are also unmapped by `/release_memory_occupation`. So the target
allocates one plain buffer on its GPU, outside the saver's regions, laid out like its
device pool (per KV buffer, `capacity` rows of the pool's row size), and exports that.
A migration reserves pool slots *and* as many arena rows; the source writes the arena
rows with its usual kernels (it cannot tell the arena from a pool), and at commit the
target copies them into its pool slots on its own GPU, then inserts.

Rows go back to the free list only once that copy's CUDA event has completed, so a later
source's write cannot overtake it. The arena never survives a memory release: the device
path drops it with the KV cache and builds a new one (a new instance id, so sources open
the new buffer) on resume.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.wire.page_ranges import slots_from_pages

logger = logging.getLogger(__name__)


class LandingArena:
    """`capacity` token rows per KV buffer in one allocation, handed out page by page."""

    def __init__(self, row_bytes: Sequence[int], capacity: int, page_size: int, device: Any):
        import torch

        if capacity < page_size:
            raise ValueError(f"a landing arena of {capacity} tokens holds no page of {page_size}")
        self.page_size = page_size
        self.capacity = capacity - capacity % page_size
        self.row_bytes = list(row_bytes)
        self.device = device
        sizes = [self.capacity * rb for rb in self.row_bytes]
        # IMPORTANT: a plain allocation (the saver's regions are entered only by SGLang's
        # own pool constructors), so CUDA IPC can export it.
        self._flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self.buffers: list[Any] = []
        offset = 0
        for size in sizes:
            self.buffers.append(self._flat[offset : offset + size])
            offset += size
        num_pages = self.capacity // page_size
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() -> page 0 first
        # Rows copied out whose copy may still run: (event or None, pages), oldest first.
        self._draining: list[tuple[Any, list[int]]] = []
        # Pool slot of each arena row while it is reserved (-1: free).
        self.pool_slot_of = torch.full((self.capacity,), -1, dtype=torch.int64)
        # Where the allocator keeps its slot tensors (the GPU on a GPU server): pool
        # slots go back to the allocator and the tree there.
        self._slot_device: Any = torch.device("cpu")
        self.nbytes = int(self._flat.numel())
        self._ptrs: Any = None  # the arena buffers' pointer table, built at first use

    # ------------------------------------------------------------------ rows

    @property
    def free_tokens(self) -> int:
        self._reclaim()
        return len(self._free_pages) * self.page_size

    def take(self, pool_slots: Any) -> Any:
        """Arena rows for `pool_slots` (whole pages, in order); UNAVAILABLE when full."""
        import torch

        n = len(pool_slots)
        pages_needed = n // self.page_size
        self._reclaim()
        if pages_needed > len(self._free_pages):
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                f"the landing arena has {len(self._free_pages) * self.page_size} free tokens "
                f"of {self.capacity}; this migration needs {n} (--kv-migration-landing-mb)",
            )
        pages = [self._free_pages.pop() for _ in range(pages_needed)]
        rows = slots_from_pages(torch.tensor(pages, dtype=torch.int64), self.page_size)
        self.pool_slot_of[rows] = pool_slots.to("cpu", torch.int64)
        self._slot_device = pool_slots.device
        return rows

    def pool_slots(self, rows: Any) -> Any:
        """The pool slots reserved with these arena rows."""
        slots = self.pool_slot_of[rows.to("cpu")]
        if bool((slots < 0).any()):
            raise MigrationError(ErrorKind.INTERNAL, "landing rows without a reserved pool slot")
        return slots.to(self._slot_device)

    def give_back(self, rows: Any, after: Any = None) -> None:
        """Free `rows` once `after` (a CUDA event, or None: at once) has completed."""
        rows = rows.to("cpu")
        self.pool_slot_of[rows] = -1
        pages = sorted({int(r) // self.page_size for r in rows[:: self.page_size].tolist()})
        self._draining.append((after, pages))
        self._reclaim()

    def _reclaim(self) -> None:
        while self._draining and (self._draining[0][0] is None or self._draining[0][0].query()):
            _event, pages = self._draining.pop(0)
            self._free_pages.extend(reversed(pages))

    # ------------------------------------------------------------------ copies

    def scatter(
        self, rows: Any, pool_buffers: Sequence[Any], pool_slots: Any, pool_ptrs: Any = None
    ) -> Any:
        """Copy arena `rows` into `pool_buffers` at `pool_slots` (the target's own GPU);
        returns the CUDA event after the copy (None on CPU, where it is done). With
        `pool_ptrs` (the pool's pointer table; every row the same size) one fused launch
        moves every buffer."""
        import torch

        from sglang_kv_migration.paths.device import page_copy
        from sglang_kv_migration.paths.device.tiers import pages_of

        src_pages = pages_of(rows, self.page_size).to(self.device)
        dst_pages = pages_of(pool_slots, self.page_size).to(self.device)
        flat_pool = [b.view(-1).view(torch.uint8) for b in pool_buffers]
        if self.device.type != "cuda":
            self._scatter_torch(flat_pool, src_pages, dst_pages)
            return None
        stream = torch.cuda.current_stream(self.device)
        # On the scheduler's stream: the forward passes that will read these slots run
        # after it, and nothing that wrote the slots before they were freed can overlap.
        with torch.cuda.stream(stream):
            if pool_ptrs is not None:
                if self._ptrs is None:
                    self._ptrs = torch.tensor(
                        [b.data_ptr() for b in self.buffers], dtype=torch.int64, device=self.device
                    )
                page_copy.copy_pages(
                    self._ptrs, pool_ptrs, src_pages, dst_pages, self.row_bytes[0] * self.page_size
                )
            else:
                self._scatter_torch(flat_pool, src_pages, dst_pages)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _scatter_torch(self, flat_pool: Sequence[Any], src_pages: Any, dst_pages: Any) -> None:
        from sglang_kv_migration.paths.device import page_copy

        for src, dst, rb in zip(self.buffers, flat_pool, self.row_bytes, strict=True):
            page_copy.copy_pages_torch([src], [dst], src_pages, dst_pages, rb * self.page_size)

    def synchronize(self) -> None:
        """Wait for every copy out of the arena (before the pool is released)."""
        for event, _pages in self._draining:
            if event is not None:
                event.synchronize()
        self._reclaim()
