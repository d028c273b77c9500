"""The host KV pool in memory another process on this host can map: what the host
landing writes (`paths/shared_host/`).

SGLang allocates a host pool's one `kv_buffer` through the pool's `HostTensorAllocator`
(`memory_pool_host.get_allocator_from_storage`, called in `HostKVCache.__init__`) and
then pins it with `cudaHostRegister`. `SharedHostTensorAllocator` allocates it from an
anonymous memory file (`memfd_create`) mapped shared instead; SGLang pins it as before,
so its own write-back and load-back run at the speed they did. A source on this host
opens the file through ``/proc/<pid>/fd/<fd>`` (same user), checks that it is this
pool's file (`SharedHostRegion`), maps it and, with a GPU, registers it with CUDA too,
then writes only the host slots a grant names.

The allocator is chosen only inside `host_pool_in_shared_memory()`: the plugin enters
it around `Scheduler.init_cache_with_memory_pool` when the server offers the path, the
CPU harness around its cache; `host_tensor_allocator` is what the hook on
`get_allocator_from_storage` asks (the default allocator only: a storage backend's own
allocator stays, and the path is then not offered).
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

# The name of the pool's memory file: a source writes into a file of this name only
# (``/proc/<pid>/fd/<fd>`` reads ``/memfd:<name> (deleted)``).
MEMFD_NAME = "sglang-kv-migration-host-pool"
MEMFD_LINK = f"/memfd:{MEMFD_NAME}"

_SHARED = contextvars.ContextVar("kv_migration_host_pool_in_shared_memory", default=False)


@dataclass(frozen=True)
class SharedHostRegion:
    """Where a host pool's memory file is, as a same-host process opens it."""

    pid: int  # the process that holds the file open
    fd: int  # its descriptor there
    inode: int  # the file's inode: a reused pid or descriptor names another file
    nbytes: int  # its size: exactly the pool's kv_buffer


@contextlib.contextmanager
def host_pool_in_shared_memory(enabled: bool = True) -> Iterator[None]:
    """Host pools built inside allocate their kv_buffer from a memory file."""
    token = _SHARED.set(enabled)
    try:
        yield
    finally:
        _SHARED.reset(token)


def host_tensor_allocator(allocator_type: Any) -> Any | None:
    """The allocator for a host pool built now: a `SharedHostTensorAllocator` inside
    `host_pool_in_shared_memory()` for SGLang's default allocator, else None (SGLang's
    own choice stands)."""
    if not _SHARED.get() or allocator_type not in (None, "default"):
        return None
    return _allocator_class()()


def shared_host_region(cache: HiRadixCache) -> SharedHostRegion | None:
    """The memory file of `cache`'s host pool, None when it was not allocated in one."""
    from sglang_kv_migration.sglang_adapter.pools import host_pool

    # A host pool group (NSA) has no allocator of its own: not offered.
    allocator = getattr(host_pool(cache), "allocator", None)
    return allocator.region if isinstance(allocator, _allocator_class()) else None


def open_shared_memory(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A memory file of `nbytes` named `name`, and its shared read-write mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


@cache
def _allocator_class() -> type:
    """SGLang's `HostTensorAllocator` with its memory in a memory file (built on first
    use: SGLang's host pool module imports its kernels)."""
    import torch
    from sglang.srt.mem_cache.memory_pool_host import HostTensorAllocator

    class SharedHostTensorAllocator(HostTensorAllocator):
        """Allocates a host pool's buffers from shared memory files, kept open for the
        life of the process (sources open them by descriptor). The KV host pools of MHA
        and MLA models allocate one buffer (`region`); other pools (hybrid models' state,
        per-layer pools) allocate several, and are not offered to sources."""

        def __init__(self) -> None:
            super().__init__()
            self.regions: list[SharedHostRegion] = []
            self._mappings: list[mmap.mmap] = []

        @property
        def region(self) -> SharedHostRegion | None:
            """The pool's one buffer, None when it has several (or none yet)."""
            return self.regions[0] if len(self.regions) == 1 else None

        def allocate(self, dims: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
            self.dtype, self.dims = dtype, dims
            nbytes = int(torch.Size(dims).numel()) * torch.empty((), dtype=dtype).element_size()
            fd, mapping = open_shared_memory(MEMFD_NAME, nbytes)
            self._mappings.append(mapping)
            self.regions.append(SharedHostRegion(os.getpid(), fd, os.fstat(fd).st_ino, nbytes))
            flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
            return flat.view(dtype).view(dims)

    return SharedHostTensorAllocator
