"""Real SGLang 0.5.12 HiCache objects on a machine without a GPU (tests only).

What runs is the stock code: ``HiRadixCache``, ``HiCacheController``, the host pools
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``), the device pools on
``device="cpu"``, the token allocators, ``ServerArgs`` and ``CacheInitParams``. Only
three things are replaced, by :func:`install_cpu_shims`, which must run before anything
imports ``sglang``:

1. ``torchvision::nms`` / ``torchvision::qnms`` schemas, so torchvision imports beside a
   CPU torch (its C extension is a CUDA build).
2. ``sgl_kernel.kvcacheio``: the 13 ``transfer_kv_*`` copy kernels that
   ``memory_pool_host`` imports, written with torch indexing. The ``kernel`` variants
   work on raw addresses, as the CUDA kernels do, so the pointer tables that SGLang
   builds (``k_data_ptrs`` ...) are used for real.
3. ``pin_memory`` defaults to False for the host pool classes (pinning needs CUDA).

NSA models (``attention="nsa"``: SGLang's ``NSATokenToKVPool``, whose HiRadixCache gets
a ``HostPoolGroup`` of the MLA KV host pool and ``NSAIndexerPoolHost``) need one more, at
page size 1 only: SGLang 0.5.12 builds an NSA device pool with page size 1 only on ROCm
(``memory_pool._is_hip``, legacy NSA path); CUDA asks for 64. `_make_device_pool` sets
``_is_hip`` (and "no aiter preshuffle") for that one constructor call.

Typical use (see ``test/conftest.py`` for the fixture)::

    h = build_harness(HarnessConfig(attention="mha", host_layout="page_first"))
    dev = h.insert_random(tokens, seed=1)
    before = h.read_device_kv(dev)
    h.evict_device_all()                 # write back, then drop the device copies
    after = h.read_device_kv(h.load_back(tokens))
    h.close()
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import importlib.abc
import inspect
import json
import os
import socket
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import TreeNode

# ---------------------------------------------------------------------------
# Public API: shims and process group
# ---------------------------------------------------------------------------

_SHIMS_INSTALLED = False
# Keeps the torchvision schema registration alive (a dropped Library unregisters).
_TORCHVISION_LIB: Any = None


def install_cpu_shims() -> None:
    """Install the three CPU replacements; idempotent; call before any sglang import.

    Per process: a child started with "spawn" must call it again (it finds this module
    through the inherited sys.path).
    """
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    # ServerArgs reads a model config; never let it reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _define_torchvision_ops()
    _install_kvcacheio_module()
    _default_host_pools_unpinned()
    _SHIMS_INSTALLED = True


def init_gloo(
    rank: int = 0, world_size: int = 1, port: int | None = None
) -> torch.distributed.ProcessGroup:
    """Initialise a gloo group on 127.0.0.1 (once per process); return it as the tp group.

    ``port`` may be None only for a single rank (a free port is picked); ranks of a
    multi-process test must agree on one port.
    """
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"process group already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, asked for rank {rank} of {world_size}"
            )
        return dist.group.WORLD
    if port is None:
        if world_size != 1:
            raise ValueError("a multi-rank gloo group needs an explicit port")
        port = free_port()
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    return dist.group.WORLD


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------
# Public API: harness
# ---------------------------------------------------------------------------

HostLayout = Literal["layer_first", "page_first", "page_first_direct"]
# The io backend each layout works with when none is given.
_DEFAULT_IO_BACKEND = {
    "layer_first": "direct",
    "page_first": "kernel",
    "page_first_direct": "direct",
}


@dataclasses.dataclass
class HarnessConfig:
    """Shape and HiCache settings of one harness (small defaults: tens of MB in all)."""

    # "nsa": an NSA (DeepSeek-V3.2 class) MLA pool with the indexer's key buffers.
    attention: Literal["mha", "mla", "nsa"] = "mha"
    host_layout: HostLayout = "layer_first"
    # None: the valid one for the layout (direct for layer_first/page_first_direct,
    # kernel for page_first). ServerArgs may still rewrite an invalid pair; the harness
    # uses the effective values it ends up with.
    io_backend: Literal["direct", "kernel"] | None = None
    page_size: int = 16
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = (
        "write_through"
    )
    device_tokens: int = 4096
    hicache_ratio: float = 2.0
    layer_num: int = 4
    head_num: int = 2  # KV heads on this rank (MHA)
    head_dim: int = 16  # MHA
    kv_lora_rank: int = 32  # MLA
    qk_rope_head_dim: int = 16  # MLA
    index_head_dim: int = 128  # NSA (SGLang asserts 128)
    dtype: torch.dtype = torch.bfloat16
    # A folder with a config.json; a tiny Llama one is written to a temp dir if None.
    model_dir: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    # A PP stage's pools hold layers [start_layer, start_layer + layer_num) only.
    start_layer: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    # SGLang's init_load_back ignores host hits shorter than 10 tokens. None keeps that;
    # tests with one or two tiny pages set it lower so the load-back path still runs.
    load_back_threshold: int | None = None
    # The host pool in a shared memory file, as a server offering the shared-host path
    # builds it (`sglang_adapter.shared_host_pool`).
    shared_host_pool: bool = False

    def effective_io_backend(self) -> str:
        return self.io_backend or _DEFAULT_IO_BACKEND[self.host_layout]


@dataclasses.dataclass(frozen=True)
class HarnessSnapshot:
    """Counters a leak test compares before and after an operation."""

    host_available: int
    device_available: int
    evictable: int
    protected: int
    total_lock_ref: int
    total_host_ref: int


@dataclasses.dataclass
class Harness:
    """One real HiRadixCache with its pools, built by :func:`build_harness`.

    ``server_args`` holds the effective hicache settings (ServerArgs may rewrite an
    invalid layout/io pair). All tier movement runs synchronously: CPU streams and
    events are no-ops, so every copy has finished when the call returns.
    """

    cfg: HarnessConfig
    server_args: Any  # sglang.srt.server_args.ServerArgs
    cache: HiRadixCache
    device_pool: Any  # MHATokenToKVPool | MLATokenToKVPool
    allocator: Any  # TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator
    host_pool: Any  # MHATokenToKVPoolHost | MLATokenToKVPoolHost | HostPoolGroup (NSA)
    controller: Any  # HiCacheController
    tp_group: Any  # torch.distributed.ProcessGroup
    _closed: bool = False

    # -- data in and out ----------------------------------------------------

    def insert_random(
        self, token_ids: Sequence[int], extra_key: str | None = None, seed: int = 0
    ) -> torch.Tensor:
        """Fill fresh device slots with seeded random KV and insert them into the tree.

        Only the page-aligned part of ``token_ids`` is inserted (as SGLang does); slots
        for the unaligned tail, and for a prefix the tree already held on device, are
        freed again. Returns the device indices the tree holds for the aligned prefix,
        whose already-cached part keeps its old KV. Write-through acks are not drained
        here: call :meth:`write_back_all` (or ``cache.writing_check()``).
        """
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
        result = self.cache.insert(InsertParams(key=key, value=slots[:aligned].clone()))
        # IMPORTANT: free duplicates only after insert, which may adopt slots of
        # evicted nodes inside the matched prefix.
        held = self._device_prefix(key)
        owned = set(held.tolist())
        dup = [int(s) for s in slots[: result.prefix_len].tolist() if int(s) not in owned]
        spare = slots[aligned:]
        if dup:
            self.allocator.free(torch.tensor(dup, dtype=torch.int64))
        if len(spare):
            # The unaligned tail sits alone on its page: the paged allocator frees it whole.
            self.allocator.free(spare)
        return held

    def read_device_kv(self, device_indices: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer copies of the KV at ``device_indices``.

        MHA: ``torch.stack([K, V])`` of shape ``(2, n, head_num, head_dim)``.
        MLA: the latent cache of shape ``(n, 1, kv_lora_rank + qk_rope_head_dim)``.
        NSA: the MLA latent per layer, then per layer the indexer's page blocks of these
        slots (whole pages: ``page_size`` rows of one block each).
        Reads the buffers directly (not ``get_key_buffer``, which would wait on the
        layer-done counter of a forward pass that never runs here).
        """
        idx = device_indices.to(torch.int64)
        if self.cfg.attention == "mha":
            return [
                torch.stack([k[idx], v[idx]])
                for k, v in zip(self.device_pool.k_buffer, self.device_pool.v_buffer, strict=True)
            ]
        return [kv[idx].clone() for kv in [*self.device_pool.kv_buffer, *self.indexer_rows()]]

    # -- tier movement ------------------------------------------------------

    def write_back_all(self, timeout_s: float = 10.0) -> int:
        """Back up every device node on host and drain the write acks; return tokens written.

        Parents go before children, which write-through's contiguous-prefix rule needs.
        """
        write_back = self.controller.write_policy == "write_back"
        written = 0
        for node in self.iter_nodes():
            if node.value is not None and not node.backuped:
                # write_back policy never locks nodes for a write; the others do until the ack.
                got = self.cache.write_backup(node, write_back=write_back)
                if got == 0:
                    raise RuntimeError(f"host pool has no room to back up node {node.id}")
                written += got
        self.drain_writes(timeout_s)
        return written

    def drain_writes(self, timeout_s: float = 10.0) -> None:
        """Run ``writing_check`` until no write-through is in flight."""
        write_back = self.controller.write_policy == "write_back"
        deadline = time.monotonic() + timeout_s
        while self.cache.ongoing_write_through:
            self.cache.writing_check(write_back=write_back)
            if time.monotonic() > deadline:
                raise TimeoutError("write-through acks did not drain")
            if self.cache.ongoing_write_through:
                time.sleep(0.001)

    def evict_device_all(self) -> int:
        """Back everything up, then evict every unlocked device node; return tokens evicted."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.write_back_all()
        total = 0
        while self.cache.evictable_size() > 0:
            got = self.cache.evict(
                EvictParams(num_tokens=self.cache.evictable_size())
            ).num_tokens_evicted
            if got == 0:
                break
            total += got
        return total

    def match(self, token_ids: Sequence[int], extra_key: str | None = None) -> Any:
        """``cache.match_prefix`` for these tokens (a ``MatchResult``)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self._key(token_ids, extra_key)))

    def device_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> torch.Tensor:
        """Device slots of the prefix of `token_ids` held on device."""
        return self._device_prefix(self._key(token_ids, extra_key))

    def host_free_list(self) -> torch.Tensor:
        """The KV host pool's free slots, in the order it hands them out (assign its
        `free_slots` to reorder them)."""
        return self.kv_host_pool.free_slots

    def host_slots_held(self) -> list[int]:
        """Host slots the tree's nodes hold (each listed once per node holding it)."""
        return [int(s) for n in self.iter_nodes() if n.host_value is not None for s in n.host_value]

    def match_lengths(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> tuple[int, int]:
        """(device prefix length, host hit length) of `token_ids`, as `match` finds them."""
        m = self.match(token_ids, extra_key)
        return len(m.device_indices), int(m.host_hit_length)

    def load_back(self, token_ids: Sequence[int], extra_key: str | None = None) -> torch.Tensor:
        """Device indices of the cached prefix after loading host-only parts back.

        Follows the scheduler: ``match_prefix``; lock the device prefix while
        ``init_load_back`` runs (as ``PrefillAdder`` does); ``ready_to_load_host_cache``
        starts the copy (synchronous on CPU); ``loading_check`` releases the load lock.
        Host hits below ``cache.load_back_threshold`` stay on host (see HarnessConfig).
        """
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        m = self.match(token_ids, extra_key)
        if m.host_hit_length == 0:
            return m.device_indices
        self.cache.inc_lock_ref(m.last_device_node)
        try:
            loaded, _ = self.cache.init_load_back(
                InitLoadBackParams(
                    best_match_node=m.best_match_node, host_hit_length=m.host_hit_length
                )
            )
        finally:
            self.cache.dec_lock_ref(m.last_device_node)
        self.cache.ready_to_load_host_cache()
        self.cache.loading_check()
        return torch.cat([m.device_indices, loaded.to(m.device_indices.device)])

    # -- bookkeeping --------------------------------------------------------

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop(0)
            yield node
            stack.extend(node.children.values())

    def snapshot(self) -> HarnessSnapshot:
        nodes = list(self.iter_nodes())
        return HarnessSnapshot(
            host_available=int(self.host_pool.available_size()),
            device_available=int(self.allocator.available_size()),
            evictable=int(self.cache.evictable_size()),
            protected=int(self.cache.protected_size()),
            total_lock_ref=sum(n.lock_ref for n in nodes),
            total_host_ref=sum(n.host_ref_counter for n in nodes),
        )

    def close(self) -> None:
        """Release what the cache holds so the next harness starts clean; idempotent."""
        if self._closed:
            return
        self._closed = True
        # HiRadixCache registers shutdown with atexit, which would pin it (and its pools)
        # in memory until the process exits.
        atexit.unregister(self.cache.shutdown)
        self.cache.shutdown()
        self.controller.stop_event.set()
        self.controller.storage_stop_event.set()

    # -- helpers ------------------------------------------------------------

    def _key(self, token_ids: Sequence[int], extra_key: str | None) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(token_ids=list(token_ids), extra_key=extra_key)

    @property
    def kv_host_pool(self) -> Any:
        """The KV host pool (an NSA group's anchor; else `host_pool` itself)."""
        entry = getattr(self.host_pool, "anchor_entry", None)
        return self.host_pool if entry is None else entry.host_pool

    def indexer_rows(self) -> list[torch.Tensor]:
        """NSA: the indexer's per-layer page blocks viewed as one row per token slot."""
        if self.cfg.attention != "nsa":
            return []
        ps = self.cfg.page_size
        return [b.view(-1, b.shape[1] // ps) for b in self.device_pool.index_k_with_scale_buffer]

    def _device_prefix(self, key: Any) -> torch.Tensor:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=key)).device_indices

    def _fill_random(self, slots: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        pool = self.device_pool
        buffers = (
            list(pool.k_buffer) + list(pool.v_buffer)
            if self.cfg.attention == "mha"
            else [*pool.kv_buffer, *self.indexer_rows()]
        )
        for buf in buffers:
            shape = (len(slots), *buf.shape[1:])
            # Random bytes, not random floats: every bit pattern must survive the copies.
            raw = torch.randint(
                0,
                256,
                (*shape[:-1], shape[-1] * buf.element_size()),
                generator=gen,
                dtype=torch.uint8,
            )
            buf[slots] = raw.view(buf.dtype)


def build_harness(
    cfg: HarnessConfig,
    tp_group: Any = None,
    attn_cp_group: Any = None,
    attn_tp_group: Any = None,
) -> Harness:
    """Build the real SGLang objects the way ``Scheduler.init_cache_with_memory_pool`` does.

    ``tp_group``: the cache's TP group (default: the whole gloo world); a PP stage passes
    its own stage's group. ``attn_cp_group`` / ``attn_tp_group``: attention context
    parallelism's groups, as the scheduler passes them (HiCache agrees over them).
    """
    install_cpu_shims()
    if cfg.tp_size != 1 and not torch.distributed.is_initialized():
        raise RuntimeError("call init_gloo(rank, world_size, port) before a tp_size > 1 harness")
    if not torch.distributed.is_initialized():
        init_gloo()  # single rank, on demand; multi-rank callers did it already
    if tp_group is None:
        tp_group = torch.distributed.group.WORLD
    if is_unified_sglang():
        import cpu_harness_unified

        return cpu_harness_unified.build_unified_harness(cfg, tp_group)  # type: ignore[return-value]

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    server_args = _make_server_args(cfg)
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
        attn_cp_cache_group=attn_cp_group,
        attn_tp_cache_group=attn_tp_group,
        eviction_policy=server_args.radix_eviction_policy,
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
    )
    from sglang_kv_migration.sglang_adapter import host_pool_in_shared_memory

    with _plugin_allocator_hook(), host_pool_in_shared_memory(cfg.shared_host_pool):
        cache = HiRadixCache(params=params, server_args=server_args)
    if cfg.load_back_threshold is not None:
        cache.load_back_threshold = cfg.load_back_threshold
    controller = cache.cache_controller
    return Harness(
        cfg=cfg,
        server_args=server_args,
        cache=cache,
        device_pool=device_pool,
        allocator=allocator,
        host_pool=controller.mem_pool_host,
        controller=controller,
        tp_group=tp_group,
    )


def is_unified_sglang() -> bool:
    """Whether the installed SGLang is the 0.5.23 line (`cpu_harness_unified` builds its
    caches); asked without importing SGLang."""
    from sglang_kv_migration.sglang_adapter.installed import is_unified_line

    return is_unified_line()


@contextlib.contextmanager
def _plugin_allocator_hook() -> Iterator[None]:
    """The plugin's AROUND hook on the host pool's allocator (`server/scheduler/hooks.py`),
    as `load_plugins()` installs it in a server: the harness builds its cache without
    the plugin loaded."""
    import functools

    import sglang.srt.mem_cache.memory_pool_host as mph
    from sglang_kv_migration.server.scheduler.hooks import around_get_allocator_from_storage

    original = mph.get_allocator_from_storage
    mph.get_allocator_from_storage = functools.partial(around_get_allocator_from_storage, original)
    try:
        yield
    finally:
        mph.get_allocator_from_storage = original


# Temp-dir entries the suite creates carry this run's tag (the pytest process's pid, which
# its children inherit), so the session's finish check (test/conftest.py) finds exactly
# this run's leftovers while other runs share the temp dir.
SESSION_TAG_ENV = "KVM_TEST_SESSION"


def resolved_server_args(args: Any) -> Any:
    """SGLang's `ServerArgs` as a launch resolves them, read by attribute: 0.5.12 resolved
    them at construction; 0.5.23 resolves them when the launcher asks (`resolve_once`)."""
    from sglang_kv_migration import sglang_adapter

    if is_unified_sglang():
        args.resolve_once()
    return sglang_adapter.effective_server_args(args)


def session_tag() -> str:
    return os.environ.setdefault(SESSION_TAG_ENV, str(os.getpid()))


def temp_entry_prefixes() -> tuple[str, ...]:
    """Name prefixes of this run's temp-dir entries (model folders, IPC sockets)."""
    tag = session_tag()
    return (f"kvm-tiny-llama-{tag}-", f"kvm-tokenizer-{tag}-")


def remove_own_model_dir() -> None:
    """Remove this process's model folder now (before an `os._exit`, or before the
    session's finish check, which runs before the exit-time removal)."""
    global _TINY_MODEL_DIR
    if _TINY_MODEL_DIR is not None:
        import shutil

        shutil.rmtree(_TINY_MODEL_DIR, ignore_errors=True)
        _TINY_MODEL_DIR = None


def leftover_temp_entries() -> list[str]:
    """This run's entries still in the temp dir, after removing this process's own model
    folder (its removal at exit comes after pytest's session finish)."""
    remove_own_model_dir()
    prefixes = temp_entry_prefixes()
    return sorted(e for e in os.listdir(tempfile.gettempdir()) if e.startswith(prefixes))


def write_tiny_model_dir(path: str | None = None) -> str:
    """A folder with the smallest Llama ``config.json`` that ServerArgs accepts.

    Without `path`: one folder per process, made on first use and removed when the
    process exits (also a multiprocessing child that returns from its target; a child
    that leaves by ``os._exit`` must be handed its parent's folder instead)."""
    global _TINY_MODEL_DIR
    if path is None:
        if _TINY_MODEL_DIR is not None and os.path.isdir(_TINY_MODEL_DIR):
            return _TINY_MODEL_DIR
        path = tempfile.mkdtemp(prefix=temp_entry_prefixes()[0])
        _TINY_MODEL_DIR = path
        import multiprocessing.util
        import shutil

        # Runs at interpreter exit and at a multiprocessing child's exit, in the process
        # that made the folder only (a forked child inherits the entry but not the folder).
        multiprocessing.util.Finalize(
            None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, exitpriority=0
        )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    # Present only to spare a "no generation_config.json" message per ServerArgs.
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({}, f)
    return path


# ---------------------------------------------------------------------------
# Construction helpers
# ---------------------------------------------------------------------------

_TINY_MODEL_DIR: str | None = None


def _make_server_args(cfg: HarnessConfig) -> Any:
    from sglang.srt.server_args import ServerArgs

    model_dir = cfg.model_dir or write_tiny_model_dir()
    return ServerArgs(
        model_path=model_dir,
        skip_tokenizer_init=True,
        device="cpu",
        page_size=cfg.page_size,
        tp_size=cfg.tp_size,
        enable_hierarchical_cache=True,
        hicache_ratio=cfg.hicache_ratio,
        hicache_size=0,
        hicache_mem_layout=cfg.host_layout,
        hicache_io_backend=cfg.effective_io_backend(),
        hicache_write_policy=cfg.write_policy,
    )


def _make_device_pool(cfg: HarnessConfig) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if cfg.attention == "nsa":
        return _make_nsa_device_pool(cfg)
    if cfg.attention == "mha":
        return MHATokenToKVPool(
            size=cfg.device_tokens,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
            head_num=cfg.head_num,
            head_dim=cfg.head_dim,
            layer_num=cfg.layer_num,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
            **_layer_range(cfg),
        )
    return MLATokenToKVPool(
        size=cfg.device_tokens,
        page_size=cfg.page_size,
        dtype=cfg.dtype,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        layer_num=cfg.layer_num,
        device="cpu",
        enable_memory_saver=False,
        **_layer_range(cfg),
    )


def _make_nsa_device_pool(cfg: HarnessConfig) -> Any:
    """SGLang's NSA pool; at page size 1 built as on ROCm (see the module docstring)."""
    from sglang.srt.mem_cache import memory_pool

    def build() -> Any:
        return memory_pool.NSATokenToKVPool(
            size=cfg.device_tokens,
            page_size=cfg.page_size,
            kv_lora_rank=cfg.kv_lora_rank,
            dtype=cfg.dtype,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            layer_num=cfg.layer_num,
            device="cpu",
            index_head_dim=cfg.index_head_dim,
            enable_memory_saver=False,
            kv_cache_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            **_layer_range(cfg),
        )

    if cfg.page_size != 1:
        return build()
    saved = memory_pool._is_hip, memory_pool.aiter_can_use_preshuffle_paged_mqa
    memory_pool._is_hip, memory_pool.aiter_can_use_preshuffle_paged_mqa = True, lambda: False
    try:
        return build()
    finally:
        memory_pool._is_hip, memory_pool.aiter_can_use_preshuffle_paged_mqa = saved


def _layer_range(cfg: HarnessConfig) -> dict[str, int]:
    """A PP stage's layers, as ModelRunner passes them (end exclusive); without PP the
    pools keep their own defaults, as the other tests expect."""
    if cfg.pp_size == 1:
        return {}
    return {"start_layer": cfg.start_layer, "end_layer": cfg.start_layer + cfg.layer_num}


def _make_allocator(cfg: HarnessConfig, device_pool: Any) -> Any:
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )

    # As ModelRunner: the plain allocator for page size 1, the paged one otherwise;
    # need_sort is only set for PD disaggregation.
    if cfg.page_size == 1:
        return TokenToKVPoolAllocator(
            cfg.device_tokens, dtype=cfg.dtype, device="cpu", kvcache=device_pool, need_sort=False
        )
    return PagedTokenToKVPoolAllocator(
        cfg.device_tokens,
        page_size=cfg.page_size,
        dtype=cfg.dtype,
        device="cpu",
        kvcache=device_pool,
        need_sort=False,
    )


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------
# Shim 1: torchvision operator schemas
# ---------------------------------------------------------------------------


def _define_torchvision_ops() -> None:
    global _TORCHVISION_LIB
    # Already there when torchvision's own extension loaded, or the .pth fix ran. With a
    # CUDA build of torch (a GPU machine running the CPU benchmarks) torchvision's own
    # extension loads and defines them: defining them first would abort its import.
    if _TORCHVISION_LIB is not None or hasattr(torch.ops.torchvision, "nms"):
        return
    if torch.version.cuda is not None:
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_LIB = lib


# ---------------------------------------------------------------------------
# Shim 2: sgl_kernel.kvcacheio
# ---------------------------------------------------------------------------

_KVCACHEIO_NAMES = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def _install_kvcacheio_module() -> None:
    host_mod = sys.modules.get("sglang.srt.mem_cache.memory_pool_host")
    if host_mod is not None and getattr(host_mod, "transfer_kv_direct", None) is not (
        transfer_kv_direct
    ):
        raise RuntimeError("install_cpu_shims() must run before sglang is imported")
    mod = types.ModuleType(
        "sgl_kernel.kvcacheio", "CPU stand-in for sgl_kernel.kvcacheio (tests only)."
    )
    for name in _KVCACHEIO_NAMES:
        setattr(mod, name, globals()[name])
    # Only the submodule is registered: `from sgl_kernel.kvcacheio import ...` resolves
    # it from sys.modules, while `import sgl_kernel` keeps failing, so code that probes
    # for the real package still sees it as absent.
    sys.modules["sgl_kernel.kvcacheio"] = mod


# Byte offset of item(s) ``idx`` in ``layer`` (and ``head`` for page_head), from a base.
_Offset = Callable[[torch.Tensor, int, int], torch.Tensor]
# Base address of ``layer``.
_Base = Callable[[int], int]


def _tensor_base(t: torch.Tensor) -> _Base:
    return lambda _layer: t.data_ptr()


def _table_base(table: torch.Tensor) -> _Base:
    return lambda layer: int(table[layer].item())


def _off_lf(item: int) -> _Offset:
    # One tensor (or table entry) per layer: items are contiguous.
    return lambda idx, _layer, _head: idx * item


def _off_pf(item: int, page_dim: int) -> _Offset:
    # [token, layer, item]: a token's layers are adjacent.
    return lambda idx, layer, _head: idx * page_dim + layer * item


def _off_lf_head(item: int, head_num: int) -> _Offset:
    return lambda idx, _layer, head: idx * item + (item // head_num) * head


def _off_ph(item: int, page_dim: int, page_size: int, head_num: int) -> _Offset:
    # [page, head, token_in_page, layer, head_dim]
    head_dim_bytes = page_dim // head_num

    def off(idx: torch.Tensor, layer: int, head: int) -> torch.Tensor:
        return (
            (idx // page_size) * page_size * page_dim
            + head_dim_bytes * head * page_size
            + (idx % page_size) * head_dim_bytes
            + layer * (item // head_num)
        )

    return off


def _raw_bytes(addr: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over ``nbytes`` of process memory at ``addr`` (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def _check_kernel_args(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int
) -> None:
    # The same checks the CUDA launcher makes (less the device check).
    if src_indices.dtype != torch.int64 or dst_indices.dtype != torch.int64:
        raise TypeError("source and destination indices must be int64")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("source and destination indices must have the same length")
    if item_size % 8 != 0:
        raise ValueError("item byte size must be divisible by 8")


def _kernel_copy(
    streams: Sequence[tuple[_Base, _Offset, _Base, _Offset]],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layers: range,
    nbytes: int,
    heads: int = 1,
) -> None:
    """Copy ``nbytes`` per item for each (src, dst) stream, layer and head.

    Pairs with a negative index on either side are skipped, as in the CUDA kernel.
    """
    src_idx = src_indices.cpu()
    dst_idx = dst_indices.cpu()
    keep = (src_idx >= 0) & (dst_idx >= 0)
    src_idx, dst_idx = src_idx[keep], dst_idx[keep]
    if src_idx.numel() == 0 or nbytes == 0:
        return
    cols = torch.arange(nbytes, dtype=torch.int64)
    for layer in layers:
        for head in range(heads):
            for src_base, src_off, dst_base, dst_off in streams:
                s = src_off(src_idx, layer, head)
                d = dst_off(dst_idx, layer, head)
                src = _raw_bytes(src_base(layer), int(s.max()) + nbytes)
                dst = _raw_bytes(dst_base(layer), int(d.max()) + nbytes)
                # Gather first, then scatter: overlapping src/dst stay well defined.
                dst[(d[:, None] + cols).reshape(-1)] = src[(s[:, None] + cols).reshape(-1)]


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    lf = _off_lf(item_size)
    streams = [
        (_tensor_base(src_k), lf, _tensor_base(dst_k), lf),
        (_tensor_base(src_v), lf, _tensor_base(dst_v), lf),
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(1), item_size)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    pf, lf = _off_pf(item_size, src_layout_dim), _off_lf(item_size)
    streams = [
        (_tensor_base(src_k), pf, _tensor_base(dst_k), lf),
        (_tensor_base(src_v), pf, _tensor_base(dst_v), lf),
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(layer_id, layer_id + 1), item_size)


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    ph = _off_ph(item_size, src_layout_dim, page_size, head_num)
    lf = _off_lf_head(item_size, head_num)
    streams = [
        (_tensor_base(src_k), ph, _tensor_base(dst_k), lf),
        (_tensor_base(src_v), ph, _tensor_base(dst_v), lf),
    ]
    _kernel_copy(
        streams,
        src_indices,
        dst_indices,
        range(layer_id, layer_id + 1),
        item_size // head_num,
        heads=head_num,
    )


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    if num_layers != src_k_layers.size(0):
        raise ValueError("number of layers in source k table does not match num_layers")
    lf = _off_lf(item_size)
    streams = [
        (_table_base(src_k_layers), lf, _table_base(dst_k_layers), lf),
        (_table_base(src_v_layers), lf, _table_base(dst_v_layers), lf),
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(num_layers), item_size)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    if num_layers != src_k_layers.size(0):
        raise ValueError("number of layers in source k table does not match num_layers")
    lf, pf = _off_lf(item_size), _off_pf(item_size, dst_layout_dim)
    streams = [
        (_table_base(src_k_layers), lf, _tensor_base(dst_k), pf),
        (_table_base(src_v_layers), lf, _tensor_base(dst_v), pf),
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(num_layers), item_size)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    if num_layers != src_k_layers.size(0):
        raise ValueError("number of layers in source k table does not match num_layers")
    lf = _off_lf_head(item_size, head_num)
    ph = _off_ph(item_size, dst_layout_dim, page_size, head_num)
    streams = [
        (_table_base(src_k_layers), lf, _tensor_base(dst_k), ph),
        (_table_base(src_v_layers), lf, _tensor_base(dst_v), ph),
    ]
    _kernel_copy(
        streams, src_indices, dst_indices, range(num_layers), item_size // head_num, heads=head_num
    )


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    lf = _off_lf(item_size)
    streams = [(_tensor_base(src), lf, _tensor_base(dst), lf)]
    _kernel_copy(streams, src_indices, dst_indices, range(1), item_size)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    streams = [
        (
            _tensor_base(src),
            _off_pf(item_size, src_layout_dim),
            _tensor_base(dst),
            _off_lf(item_size),
        )
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(layer_id, layer_id + 1), item_size)


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    if num_layers != src_layers.size(0):
        raise ValueError("number of layers in source table does not match num_layers")
    lf = _off_lf(item_size)
    streams = [(_table_base(src_layers), lf, _table_base(dst_layers), lf)]
    _kernel_copy(streams, src_indices, dst_indices, range(num_layers), item_size)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    _check_kernel_args(src_indices, dst_indices, item_size)
    if num_layers != src_layers.size(0):
        raise ValueError("number of layers in source table does not match num_layers")
    streams = [
        (
            _table_base(src_layers),
            _off_lf(item_size),
            _tensor_base(dst),
            _off_pf(item_size, dst_layout_dim),
        )
    ]
    _kernel_copy(streams, src_indices, dst_indices, range(num_layers), item_size)


def _check_direct_args(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int
) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("source and destination indices must have the same length")
    if page_size <= 0:
        raise ValueError("page size must be positive")
    if src_indices.numel() % page_size != 0:
        raise ValueError("source indices size must be divisible by page size")


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Token rows ``src_layers[j][src_indices] -> dst_layers[j][dst_indices]`` for every j."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("source and destination must have the same number of layers")
    _check_direct_args(src_indices, dst_indices, page_size)
    src_idx = src_indices.cpu().to(torch.int64)
    dst_idx = dst_indices.cpu().to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_idx.to(dst.device)] = src[src_idx.to(src.device)].to(dst.device)


def _direct_page_first(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    start_layer: int,
    page_size: int,
    lf_to_pf: bool,
) -> None:
    """Whole pages between per-layer token buffers and ``[page, layer, page_size, ...]``.

    Only the first index of each page is read, and the page's tokens are taken as
    consecutive, as upstream does. MLA passes one page-first buffer, MHA two (K, V).
    """
    _check_direct_args(src_indices, dst_indices, page_size)
    src_first = src_indices.cpu().to(torch.int64)[::page_size]
    dst_first = dst_indices.cpu().to(torch.int64)[::page_size]
    in_page = torch.arange(page_size, dtype=torch.int64)
    if lf_to_pf:
        is_mla = len(dst_ptrs) == 1
        num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
        pages = dst_first // page_size
        tokens = src_first[:, None] + in_page
        for j in range(num_layers):
            dst_ptrs[0][pages, start_layer + j] = src_ptrs[j][tokens]
            if not is_mla:
                dst_ptrs[1][pages, start_layer + j] = src_ptrs[j + num_layers][tokens]
    else:
        is_mla = len(src_ptrs) == 1
        num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
        pages = src_first // page_size
        tokens = dst_first[:, None] + in_page
        for j in range(num_layers):
            dst_ptrs[j][tokens] = src_ptrs[0][pages, start_layer + j]
            if not is_mla:
                dst_ptrs[j + num_layers][tokens] = src_ptrs[1][pages, start_layer + j]


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    _direct_page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, False)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    _direct_page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, 0, page_size, True)


# ---------------------------------------------------------------------------
# Shim 3: unpinned host pools
# ---------------------------------------------------------------------------


_HOST_POOL_MODULE = "sglang.srt.mem_cache.memory_pool_host"


def _default_host_pools_unpinned() -> None:
    # Applied when the host pool modules are first imported, not now: importing SGLang
    # takes many seconds, which tests that never build a cache should not pay.
    if is_unified_sglang():
        # 0.5.23: the kernels are bound into each host pool module too (see
        # cpu_harness_unified's docstring).
        import cpu_harness_unified

        kernels = {name: globals()[name] for name in _KVCACHEIO_NAMES}
        for name in cpu_harness_unified.HOST_POOL_MODULES:
            _after_import(name, lambda m: cpu_harness_unified.prepare_host_pool_module(m, kernels))
        return
    _after_import(_HOST_POOL_MODULE, _unpin_host_pools)


def _after_import(name: str, action: Callable[[types.ModuleType], None]) -> None:
    if name in sys.modules:
        action(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, action))


def _unpin_host_pools(mph: types.ModuleType) -> None:
    # Pinning calls cudaHostRegister (and torch's pin_memory needs CUDA); HiRadixCache
    # never passes pin_memory, so flipping the default is the whole change.
    for cls in (mph.MHATokenToKVPoolHost, mph.MLATokenToKVPoolHost, mph.NSAIndexerPoolHost):
        _set_default(cls.__init__, "pin_memory", False)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``action(module)`` right after the module ``name`` is first executed."""

    def __init__(self, name: str, action: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self._action = action
        self._done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if self._done or fullname != self.name:
            return None
        # Stays in sys.meta_path (inert): removing it while the import system iterates
        # over that list would make it skip the next finder.
        self._done = True
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _LoaderThen(spec.loader, self._action)
                return spec
        return None


class _LoaderThen(importlib.abc.Loader):
    def __init__(self, inner: Any, action: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._action = action

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._action(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ... for tracebacks and inspect.
        return getattr(self._inner, name)


def _set_default(fn: Any, name: str, value: Any) -> None:
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    defaults = list(fn.__defaults__ or ())
    first_default = len(params) - len(defaults)
    pos = [p.name for p in params].index(name) - first_default
    if pos < 0:
        raise ValueError(f"{fn.__qualname__} has no default for {name}")
    defaults[pos] = value
    fn.__defaults__ = tuple(defaults)
