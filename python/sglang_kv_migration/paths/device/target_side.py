"""The device path's target role: device KV slots from SGLang's token-to-KV allocator
(evicting by the tree's own rules), held by the pending registry like host slots, and
on commit inserted as ordinary device radix nodes, so the next request hits on device
with no load-back (write-through then backs the pages up to host as usual).

What sources write is exported through CUDA IPC when this rank has a GPU: the pool's
buffers, or with the memory saver a landing arena (`landing.py`): each reservation then
takes pool slots and as many arena rows, the source writes the rows, and commit copies
them into the pool on this GPU before inserting. A memory release drops the arena with
the KV cache (after every copy out of it), a resume builds a new one under a new
instance id. No CUDA is needed for the reservations themselves: CPU tests run them on a
CPU device pool.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.device import cuda_ipc, landing

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun

logger = logging.getLogger(__name__)


class DeviceTargetSide:
    """See the module docstring. `pool_ptrs()`: the pool's pointer table on its GPU for
    the fused copy out of a landing arena, None while that kernel cannot run (torch
    copies then)."""

    def __init__(
        self,
        cache: HiRadixCache,
        buffers: list[torch.Tensor],
        page_size: int,
        landing_bytes: int = 0,
        pool_ptrs: Callable[[], Any] = lambda: None,
    ):
        self.cache = cache
        self.buffers = buffers
        self.page_size = page_size
        self.device = buffers[0].device
        self.row_bytes = [b[0].numel() * b.element_size() for b in buffers]
        self.num_rows = [int(b.shape[0]) for b in buffers]
        bytes_per_token = sum(self.row_bytes)
        self.pool_ptrs = pool_ptrs
        self.instance_id = uuid.uuid4().hex  # a restarted server is a new peer
        self.exported: list[dict[str, Any]] = []
        # > 0 (--enable-memory-saver): sources write a landing arena, not the pool.
        self.landing_tokens = landing_bytes // bytes_per_token if landing_bytes > 0 else 0
        if self.landing_tokens and self.landing_tokens < page_size:
            raise ValueError(
                f"a landing arena of {landing_bytes} bytes holds no page of {page_size} "
                f"tokens ({bytes_per_token} bytes each): raise --kv-migration-landing-mb"
            )
        self.landing: landing.LandingArena | None = None
        self.landing_refusal = ""  # why a landing-mode rank has no arena now
        self.open_destination()

    # ------------------------------------------------------------------ destination

    def open_destination(self) -> None:
        """What sources write: the pool's buffers, or (memory saver) a new landing arena,
        exported through CUDA IPC when this rank has a GPU."""
        if self.landing_tokens:
            self.landing = landing.LandingArena(
                self.row_bytes, self.landing_tokens, self.page_size, self.device
            )
            exported = self.landing.buffers
        else:
            exported = self.buffers
        if self.device.type != "cuda":
            return
        try:
            self.exported = [cuda_ipc.export_tensor(b) for b in exported]
        except RuntimeError as e:
            what = "landing arena" if self.landing_tokens else "KV pool"
            raise RuntimeError(
                f"cannot export the {what} through CUDA IPC ({e}); start the server with "
                "--kv-migration-paths host to go without the device path"
            ) from e

    def advertised_rows(self) -> list[int]:
        """Rows of each buffer sources may write (an arena's, with the memory saver)."""
        arena = self.landing
        return [arena.capacity] * len(self.buffers) if arena else self.num_rows

    @property
    def advertised_landing_tokens(self) -> int:
        return self.landing.capacity if self.landing else 0

    # ------------------------------------------------------------------ memory saver

    def quiesce(self) -> None:
        """Wait for every copy out of the arena (before SGLang unmaps the KV pool)."""
        if self.landing is not None:
            self.landing.synchronize()

    def release_memory(self) -> None:
        """The KV cache is released: drop the landing arena (every reservation was freed
        before) and give its memory back to the driver. Sources map an arena only for
        the length of a send, so none holds it now (a send in flight from another
        server keeps its pages until it ends: torch frees them then)."""
        if self.landing is None:
            return
        self.landing_refusal = "the KV cache memory is released (/release_memory_occupation)"
        self.landing.synchronize()
        self.landing = None
        self.exported = []
        if self.device.type == "cuda":
            import torch

            torch.cuda.ipc_collect()  # blocks whose importers have all let go
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """The KV cache is back: a new arena under a new instance id, so sources open it
        instead of their mapping of the old one."""
        if self.landing_tokens and self.landing is None:
            self.instance_id = uuid.uuid4().hex
            try:
                self.open_destination()
                self.landing_refusal = ""
            except Exception as e:  # e.g. out of memory: the server must keep running
                logger.exception("KV migration landing arena not re-created")
                self.landing, self.exported = None, []
                self.landing_refusal = f"no landing arena after the resume: {e}"

    # ------------------------------------------------------------------ slots

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return sglang_adapter.match_device_prefix(self.cache, input_ids, extra_key).as_held()

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        """Pool slots; with a landing arena, the arena rows reserved with them (the slots
        sources write: the pool slots stay this rank's business). `owners`: pages whose
        owners are the pattern, from the sharding fork's allocator (checked there)."""
        # (While the KV memory is released the scheduler side refuses allocations first.)
        if self.landing_tokens and self.landing is None:
            raise MigrationError(ErrorKind.UNAVAILABLE, self.landing_refusal)
        if owners is not None:
            slots = sglang_adapter.alloc_pages_with_owners(
                self.cache, owners.function, list(owners.pattern)
            )
        else:
            slots = sglang_adapter.alloc_device_slots(self.cache, num_tokens)
        if self.landing is None:
            return slots
        try:
            return self.landing.take(slots)
        except BaseException:
            sglang_adapter.free_device_slots(self.cache, slots)
            raise

    def release(self, slots: torch.Tensor) -> None:
        if self.landing is None:
            sglang_adapter.free_device_slots(self.cache, slots)
            return
        sglang_adapter.free_device_slots(self.cache, self.landing.pool_slots(slots))
        self.landing.give_back(slots)

    def retake(self, slots: torch.Tensor) -> None:
        pool = self.landing.pool_slots(slots) if self.landing is not None else slots
        sglang_adapter.take_device_slots(self.cache, pool)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        arena = self.landing
        if arena is None:
            return sglang_adapter.insert_device_pages(self.cache, key, anchor_length, slots)
        pool = arena.pool_slots(slots)
        copied = arena.scatter(slots, self.buffers, pool, self.pool_ptrs())
        present = sglang_adapter.insert_device_pages(self.cache, key, anchor_length, pool)
        # The caller releases rows [:present] (their pool slots are surplus); the rest
        # are free once the copy out of them is done.
        arena.give_back(slots[present:], after=copied)
        return present

    def content_digest(self, slots: torch.Tensor) -> str:
        if self.landing is not None:  # what the source wrote, before the scatter
            arena = self.landing
            rows = [b.view(arena.capacity, -1) for b in arena.buffers]
            return verify.device_rows_digest(rows, slots)
        return verify.device_rows_digest(self.buffers, slots)
