"""Real SGLang 0.5.23 caches on a machine without a GPU (tests only): what
`cpu_harness` does for 0.5.12's ``HiRadixCache``, for 0.5.23's ``UnifiedRadixCache``.

What runs is the stock code: ``UnifiedRadixCache`` with its tree core (the Rust
extension SGLang selects by default), HiCache attached by ``init_hicache`` (the
``HostPoolGroup`` and ``HybridCacheController`` that ``hybrid_pool_assembler`` builds),
the host pools of ``mem_cache/pool_host/``, the device pools on ``device="cpu"``, the
token allocators, ``ServerArgs`` published to SGLang's runtime context as the scheduler
does. What differs from 0.5.12's shims, all installed by ``cpu_harness.install_cpu_shims``:

1. ``transfer_kv_*``: 0.5.23's host pool modules (``pool_host/mha.py``, ``mla.py``)
   import the ``sgl_kernel.kvcacheio`` kernels only where CUDA or ROCm is found, so on a
   CPU they are unbound names. The same 13 CPU stand-ins `cpu_harness` writes are bound
   into those modules right after they are first imported.
2. ``pin_memory`` defaults to False for ``MHATokenToKVPoolHost`` and
   ``MLATokenToKVPoolHost`` (the assembler never passes it), as on 0.5.12.

The torchvision schemas are the same as on 0.5.12. Only the ``write_through`` policy and
the MHA / MLA pools are built here (what the version-independent tests use).
"""

from __future__ import annotations

import atexit
import dataclasses
import types
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from cpu_harness import Harness

if TYPE_CHECKING:
    from cpu_harness import HarnessConfig, HarnessSnapshot

# The 0.5.23 modules that call the kvcacheio kernels by module-level name.
HOST_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
)
_HOST_POOL_CLASSES = {
    "sglang.srt.mem_cache.pool_host.mha": "MHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mla": "MLATokenToKVPoolHost",
}


def prepare_host_pool_module(module: types.ModuleType, kernels: dict[str, Any]) -> None:
    """Bind the CPU kernels into one 0.5.23 host pool module and unpin its pool."""
    from cpu_harness import _set_default

    for name, fn in kernels.items():
        setattr(module, name, fn)
    cls = getattr(module, _HOST_POOL_CLASSES[module.__name__])
    _set_default(cls.__init__, "pin_memory", False)


@dataclasses.dataclass
class UnifiedHarness:
    """One real UnifiedRadixCache with HiCache attached, built by `build_unified_harness`.

    The same methods as `cpu_harness.Harness` where a test of the adapter needs them;
    nodes are the tree core's node ids (no node objects: the Rust core has none)."""

    cfg: HarnessConfig
    server_args: Any
    cache: Any  # UnifiedRadixCache
    device_pool: Any
    allocator: Any
    host_pool: Any  # HostPoolGroup (KV pool at its anchor)
    controller: Any  # HybridCacheController
    tp_group: Any
    _closed: bool = False

    # -- data in and out ----------------------------------------------------

    def insert_random(
        self, token_ids: Sequence[int], extra_key: str | None = None, seed: int = 0
    ) -> torch.Tensor:
        """As `Harness.insert_random`: seeded random KV in fresh device slots, inserted
        (page-aligned part); returns the device slots the tree holds for it."""
        from cpu_harness import _ceil_to
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        n = len(token_ids)
        ps = self.cfg.page_size
        aligned = n - n % ps
        if aligned == 0:
            raise ValueError(f"need at least one full page ({ps} tokens), got {n}")
        slots = self.allocator.alloc(_ceil_to(n, ps))
        if slots is None:
            raise RuntimeError(f"device allocator has no room for {n} tokens")
        slots = slots[:n]
        self._fill_random(slots, seed)
        key = self._key(token_ids[:aligned], extra_key)
        # 0.5.23's insert frees the slots it does not keep (the already cached part's
        # duplicates) itself: only the unaligned tail is left to free here.
        self.cache.insert(InsertParams(key=key, value=slots[:aligned].clone()))
        held = self.device_prefix(token_ids[:aligned], extra_key)
        spare = slots[aligned:]
        if len(spare):
            self.allocator.free(spare)
        return held

    def read_device_kv(self, device_indices: torch.Tensor) -> list[torch.Tensor]:
        idx = device_indices.to(torch.int64)
        if self.cfg.attention == "mha":
            return [
                torch.stack([k[idx], v[idx]])
                for k, v in zip(self.device_pool.k_buffer, self.device_pool.v_buffer, strict=True)
            ]
        return [kv[idx].clone() for kv in self.device_pool.kv_buffer]

    def indexer_rows(self) -> list[torch.Tensor]:
        return []

    # -- tier movement ------------------------------------------------------

    def write_back_all(self, timeout_s: float = 10.0) -> int:
        """Submit the write-throughs the inserts queued and drain their acks."""
        pending = len(self.cache.ongoing_write_through)
        self.drain_writes(timeout_s)
        return pending

    def drain_writes(self, timeout_s: float = 10.0) -> None:
        # CPU events are done at once: the blocking drain returns after one pass.
        self.cache.flush_pending_backups()
        self.cache.writing_check(write_back=True)

    # Both lines' caches evict and match through the same public calls: 0.5.12's
    # harness's methods, which use only `cache`, `_key` and `write_back_all`.
    evict_device_all = Harness.evict_device_all
    match = Harness.match

    def host_free_list(self) -> torch.Tensor:
        """As `Harness.host_free_list` (0.5.23 keeps freed slots aside until the next
        allocation needs them: merged first, so the list is whole)."""
        pool = self.kv_host_pool
        pool._merge_release_slots()
        return pool.free_slots

    def host_slots_held(self) -> list[int]:
        """The host slots the pool counts as allocated (the tree core lists no nodes to
        read them from: this includes slots pending migrations hold)."""
        return self.kv_host_pool.slot_used.nonzero().flatten().tolist()

    def match_lengths(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> tuple[int, int]:
        """As `Harness.match_lengths`: (device prefix length, host hit length)."""
        m = self.match(token_ids, extra_key)
        return int(m.device_prefix_len), int(m.host_hit_length)

    def device_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> torch.Tensor:
        """Device slots of the prefix of `token_ids` held on device."""
        m = self.match(token_ids, extra_key)
        root = self.cache.root_node_handle(extra_key)
        slots = self.cache.tree_core.collect_full_device_indices(m.last_device_node, root)
        return slots[: m.device_prefix_len].to(torch.int64)

    def load_back(self, token_ids: Sequence[int], extra_key: str | None = None) -> torch.Tensor:
        """Device slots of the cached prefix after loading host-only parts back (SGLang's
        own `load_back`, then the load acks drained as the scheduler's event check does)."""
        m = self.match(token_ids, extra_key)
        if m.host_hit_length >= self.cache.load_back_threshold:
            self.cache.load_back(m.best_match_node)
            self.cache.ready_to_load_host_cache()
            self.cache.loading_check()
        return self.device_prefix(token_ids, extra_key)

    # -- bookkeeping --------------------------------------------------------

    def snapshot(self) -> HarnessSnapshot:
        """Counters a leak test compares (lock counts as the tree core reports them: the
        protected size; host references are not readable through the tree core)."""
        from cpu_harness import HarnessSnapshot

        return HarnessSnapshot(
            host_available=int(self.host_pool.available_size()),
            device_available=int(self.allocator.available_size()),
            evictable=int(self.cache.evictable_size()),
            protected=int(self.cache.protected_size()),
            total_lock_ref=int(self.cache.protected_size()),
            total_host_ref=0,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.cache.shutdown)
        self.cache.shutdown()
        stop = getattr(self.controller, "stop_event", None)
        if stop is not None:
            stop.set()

    @property
    def kv_host_pool(self) -> Any:
        return self.host_pool.anchor_entry.host_pool

    # -- helpers ------------------------------------------------------------

    def _key(self, token_ids: Sequence[int], extra_key: str | None) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", token_ids), extra_key=extra_key)

    def _fill_random(self, slots: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        pool = self.device_pool
        buffers = (
            list(pool.k_buffer) + list(pool.v_buffer)
            if self.cfg.attention == "mha"
            else list(pool.kv_buffer)
        )
        for buf in buffers:
            shape = (len(slots), *buf.shape[1:])
            raw = torch.randint(
                0,
                256,
                (*shape[:-1], shape[-1] * buf.element_size()),
                generator=gen,
                dtype=torch.uint8,
            )
            buf[slots] = raw.view(buf.dtype)


def build_unified_harness(cfg: HarnessConfig, tp_group: Any) -> UnifiedHarness:
    """Build the cache the way 0.5.23's `kv_cache_builder` and registry do for a model
    with full attention only: a UnifiedRadixCache of one FULL component, then
    `init_hicache` with the published server args."""
    from cpu_harness import _make_allocator, _make_device_pool, _make_server_args
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context

    if cfg.attention not in ("mha", "mla") or cfg.write_policy != "write_through":
        raise NotImplementedError(
            f"the 0.5.23 harness builds MHA/MLA write_through caches, not "
            f"{cfg.attention}/{cfg.write_policy}"
        )
    server_args = _make_server_args(cfg)
    get_context().set_server_args(server_args)
    device_pool = _make_device_pool(cfg)
    allocator = _make_allocator(cfg, device_pool)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=cfg.device_tokens, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        tp_cache_group=tp_group,
        eviction_policy=server_args.radix_eviction_policy,
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
        tree_components=(ComponentType.FULL,),
    )
    cache = UnifiedRadixCache(params)
    cache.init_hicache(server_args, params)
    if cfg.load_back_threshold is not None:
        cache.load_back_threshold = cfg.load_back_threshold
    controller = cache.cache_controller
    return UnifiedHarness(
        cfg=cfg,
        server_args=server_args,
        cache=cache,
        device_pool=device_pool,
        allocator=allocator,
        host_pool=controller.mem_pool_host,
        controller=controller,
        tp_group=tp_group,
    )
