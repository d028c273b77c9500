"""A same-host target's host pool mapped into this process: where the shared-host path's
source writes.

The target keeps its host pool in a memory file (`sglang_adapter.shared_host_pool`) and
publishes where it is (`targets.SharedHostTarget`, bound by the grant). The source opens
it through ``/proc/<pid>/fd/<fd>`` (the same user may), and before it maps anything
checks that what it opened is that file: a memory file of the pool's name, of the
published inode and size, whose size is exactly the published layout's. It maps the
whole file shared and, with a GPU, registers it with CUDA, so its copy kernel writes
the target's host pages by address (`tier_copies.py`), as it reads its own pinned host
pool. Registering tens of GB takes seconds: once per target instance, on a helper
thread; the mapping is then kept.

A mapping is dropped at `close()`, or once its target is gone (its file no longer
where it was published: a restarted target's pool would otherwise stay allocated, and
pinned, for as long as this source maps it); only between launches, after the copies in
flight, and a send that meets a dropped mapping fails before it writes.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.device import tiers
from sglang_kv_migration.paths.device.tier_copies import CopyDestination, pointer_table
from sglang_kv_migration.targets import SharedHostTarget

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


@dataclass
class MappedPool:
    """One target's host pool mapped here (see the module docstring)."""

    peer: SharedHostTarget
    flat: Any  # uint8 tensor over the whole file (keeps the mapping alive)
    destination: CopyDestination
    registered: bool = False  # registered with CUDA (unregistered when dropped)
    closed: bool = False
    used: bool = False  # a copy was launched into it

    def resolve(self) -> CopyDestination:
        """What a launch writes, on the scheduler thread; CONFLICT once dropped."""
        if self.closed:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"the target's host pool mapping ({self.peer.instance}) was dropped: the "
                "target is gone; nothing was written",
            )
        first, self.used = not self.used, True
        return dataclasses.replace(self.destination, first_use=True) if first else self.destination

    def still_there(self) -> bool:
        """The published file is still where it was (the target lives)."""
        try:
            return os.stat(_fd_path(self.peer)).st_ino == self.peer.inode
        except OSError:
            return False


def expected_nbytes(peer: SharedHostTarget) -> int:
    """The size of a host pool of `peer`'s layout (`tiers.host_buffer_geometry`)."""
    planes = {"mha": 2, "mla": 1}.get(peer.attention)
    if planes is None:
        raise ValueError(f"unknown attention kind {peer.attention!r}")
    return planes * peer.layer_num * peer.page_num * peer.page_tokens * peer.row_bytes


def map_pool(peer: SharedHostTarget, device: Any) -> MappedPool:
    """Open, check, map and (with a GPU) register `peer`'s host pool; raises
    MigrationError naming what does not match (see the module docstring)."""
    offsets, geometry = _layout(peer)
    flat = _mapped_file(peer)
    registered = device.type == "cuda"
    if registered:
        _register(flat, peer.nbytes, device)
    base = flat.data_ptr()
    try:
        pointers = pointer_table([base + o for o in offsets], device) if registered else None
    except BaseException:
        # IMPORTANT: unregistered before the mapping goes with `flat`: a range left
        # registered would make CUDA refuse a later mapping at the same address.
        _unregister(flat, device)
        raise
    destination = CopyDestination(
        flats=[flat] * len(offsets),
        pointers=pointers,
        page_limit=peer.page_num,
        geometry=geometry,
        offsets=tuple(offsets),
    )
    pool = MappedPool(peer, flat, destination, registered=registered)
    destination.key = id(pool)
    return pool


def _register(flat: Any, nbytes: int, device: Any) -> None:
    """Pin the mapping for this process's GPUs: on this (helper) thread, in `device`'s
    context; portable: pinned for every context of the process, whichever GPU the copy
    launches on."""
    import torch

    with torch.cuda.device(device):
        code = int(
            torch.cuda.cudart().cudaHostRegister(
                flat.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE
            )
        )
    if code != 0:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"cannot register the target's host pool with CUDA (error {code})",
        )


def _unregister(flat: Any, device: Any) -> None:
    """Unpin what `_register` pinned (a failure is logged: the mapping goes anyway)."""
    import torch

    with torch.cuda.device(device):
        code = int(torch.cuda.cudart().cudaHostUnregister(flat.data_ptr()))
    if code != 0:
        logger.warning("cudaHostUnregister of a peer's host pool failed (error %d)", code)


class PeerPools:
    """Targets' host pools mapped here, one mapping per target instance; `open_async`
    maps a new one on a helper thread (registering it takes seconds)."""

    def __init__(self, device: Any):
        self.device = device
        self._open: dict[tuple[str, int, int, int], MappedPool] = {}
        self._opening: dict[tuple[str, int, int, int], Future[MappedPool]] = {}
        self._lock = threading.Lock()
        self._opener: ThreadPoolExecutor | None = None

    def holds(self, peer: SharedHostTarget) -> bool:
        """`peer`'s pool is mapped already."""
        return _key(peer) in self._open

    def open_async(self, peer: SharedHostTarget) -> Future[MappedPool]:
        key = _key(peer)
        with self._lock:
            opened = self._open.get(key)
            if opened is not None:
                done: Future[MappedPool] = Future()
                done.set_result(opened)
                return done
            pending = self._opening.get(key)
            if pending is not None:
                return pending
            if self._opener is None:
                self._opener = ThreadPoolExecutor(1, thread_name_prefix="kv-migration-shm")
            future = self._opener.submit(self._map, key, peer)
            self._opening[key] = future
        return future

    def _map(self, key: tuple[str, int, int, int], peer: SharedHostTarget) -> MappedPool:
        try:
            pool = map_pool(peer, self.device)
        except BaseException:
            with self._lock:
                self._opening.pop(key, None)
            raise
        with self._lock:
            # IMPORTANT: kept before it stops being "opening", so no send maps (and
            # registers) the same file a second time in between.
            self._open[key] = pool
            self._opening.pop(key, None)
        logger.info("Mapped the host pool of peer %s (%d bytes)", peer.instance, peer.nbytes)
        return pool

    def drop_gone(self, wait_for_copies: Callable[[], None]) -> int:
        """Drop the mappings of targets that are gone, after `wait_for_copies()` (the
        copies in flight); call between launches, on the scheduler thread."""
        with self._lock:
            gone = [k for k, pool in self._open.items() if not pool.still_there()]
        if not gone:
            return 0
        wait_for_copies()
        for key in gone:
            with self._lock:
                pool = self._open.pop(key, None)
            if pool is not None:
                _drop(pool, self.device)
        return len(gone)

    def close(self, wait_for_copies: Callable[[], None]) -> None:
        with self._lock:
            opener, self._opener = self._opener, None
        if opener is not None:
            opener.shutdown(wait=True, cancel_futures=True)
        wait_for_copies()
        with self._lock:
            pools, self._open = list(self._open.values()), {}
        for pool in pools:
            _drop(pool, self.device)

    def __len__(self) -> int:
        return len(self._open)


def _drop(pool: MappedPool, device: Any) -> None:
    """Unregister (the GPU writes it no more) and let the mapping go with its tensors."""
    pool.closed = True
    if pool.registered:
        _unregister(pool.flat, device)
        pool.registered = False
    pool.destination.flats, pool.destination.pointers = [], None
    pool.flat = None


def _layout(peer: SharedHostTarget) -> tuple[list[int], Any]:
    try:
        offsets, geometry = tiers.host_buffer_geometry(
            peer.attention,
            peer.layout,
            peer.layer_num,
            peer.page_num,
            peer.page_tokens,
            peer.row_bytes,
        )
        expected = expected_nbytes(peer)
    except ValueError as e:
        raise MigrationError(ErrorKind.BAD_REQUEST, f"bad shared_host_kv layout: {e}") from None
    if peer.nbytes != expected:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"bad shared_host_kv: {peer.nbytes} bytes for a pool of {expected}",
        )
    return offsets, geometry


def _mapped_file(peer: SharedHostTarget) -> Any:
    """The published file mapped shared, as a uint8 tensor; CONFLICT when what the path
    opens is not the pool's memory file of the published inode and size."""
    import torch

    try:
        fd = os.open(_fd_path(peer), os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"cannot open the target's host pool ({_fd_path(peer)}: {e.strerror}): the "
            "shared-host path needs both servers on one host, run by one user",
        ) from None
    try:
        info = os.fstat(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if not (
            stat.S_ISREG(info.st_mode)
            and name.startswith(sglang_adapter.SHARED_POOL_MEMFD_LINK)
            and info.st_ino == peer.inode
            and info.st_size == peer.nbytes
        ):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"{_fd_path(peer)} is not the target's host pool (a memory file of "
                f"{peer.nbytes} bytes, inode {peer.inode}): the target restarted?",
            )
        mapping = mmap.mmap(fd, peer.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # The tensor keeps the mapping alive; it is unmapped once both are gone.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=peer.nbytes)


def _key(peer: SharedHostTarget) -> tuple[str, int, int, int]:
    return (peer.instance, peer.pid, peer.fd, peer.inode)


def _fd_path(peer: SharedHostTarget) -> str:
    return f"/proc/{int(peer.pid)}/fd/{int(peer.fd)}"
