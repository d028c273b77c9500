"""CUDA IPC for the device path: export this process's KV buffers, open a peer's.

A buffer is exported once, at start-up, as a JSON-safe dict (no pickle: a description
that arrives in a request body must never run code when decoded). The importer maps it
with torch's own IPC primitives (`UntypedStorage._share_cuda_` / `_new_shared_cuda`, what
`torch.multiprocessing` uses), onto the local device whose UUID the exporter advertised,
so servers started with different `CUDA_VISIBLE_DEVICES` still find each other's GPU.

`PeerBuffers` caches opened peers (one mapping per peer instance, reused by every
migration) and closes them on `close()` or when a peer instance is replaced.
"""

from __future__ import annotations

import base64
import logging
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sglang_kv_migration.errors import ErrorKind, MigrationError

logger = logging.getLogger(__name__)

# Opened peers kept at once; the least recently used is closed beyond this.
MAX_OPEN_PEERS = 32
_HANDLE_FIELDS = ("handle", "ref_counter_handle", "event_handle")


@cache
def host_identity() -> str:
    """Same value for every process of one booted machine, different across machines."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    if not any(parts):
        # No way to prove two servers share a host: a random id never matches another.
        return f"unknown-{uuid.uuid4().hex}"
    return ":".join(parts)


def gpu_uuid(device_index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


@cache  # a process's visible GPUs do not change (read per send otherwise)
def local_device_of(uuid_str: str) -> int | None:
    """Index of the visible GPU with this UUID, or None."""
    import torch

    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid_str:
            return i
    return None


def export_tensor(t: Any) -> dict[str, Any]:
    """Describe a CUDA tensor so another process on the same host can map it."""
    storage = t.untyped_storage()
    (
        _device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "handle": _b64(handle),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
        "offset_bytes": int(t.storage_offset() * t.element_size()),
        "nbytes": int(t.nbytes),
    }


def open_tensor(desc: dict[str, Any], device_index: int) -> Any:
    """Map an exported buffer as a flat uint8 tensor on local device `device_index`."""
    import torch

    try:
        raw = {k: base64.b64decode(desc[k], validate=True) for k in _HANDLE_FIELDS}
        sizes = [int(desc[k]) for k in ("storage_size", "storage_offset", "ref_counter_offset")]
        offset, nbytes = int(desc["offset_bytes"]), int(desc["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise MigrationError(ErrorKind.BAD_REQUEST, f"bad device buffer description: {e}") from None
    if offset < 0 or nbytes <= 0 or offset + nbytes > sizes[0]:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"device buffer [{offset}, {offset + nbytes}) lies outside its allocation of "
            f"{sizes[0]} bytes",
        )
    torch.cuda._lazy_init()
    with torch.cuda.device(device_index):
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index,
            raw["handle"],
            sizes[0],
            sizes[1],
            raw["ref_counter_handle"],
            sizes[2],
            raw["event_handle"],
            bool(desc.get("event_sync_required", False)),
        )
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device_index}")
        flat.set_(storage, offset, (nbytes,))
    return flat


@dataclass
class OpenedPeer:
    buffers: list[Any]  # flat uint8 tensors mapping the peer's buffers
    pointers: Any  # int64 tensor of their addresses, on the device they were mapped on
    # Set by the device path once it checked the buffers' sizes against a description:
    # (num_rows, row_bytes) checked, and how many whole pages every buffer holds.
    checked: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    page_limit: int = 0
    used: bool = False  # a copy was launched into it (set by the device path)


class PeerBuffers:
    """Peers' KV buffers opened through CUDA IPC, one mapping per peer instance.

    Opening a new peer's buffers takes 60-150 ms (one IPC mapping per layer buffer), so
    `open_async` does it on a helper thread: the scheduler thread that asks only checks a
    future. `get` opens in the calling thread (tests, probes).
    """

    def __init__(self, max_open: int = MAX_OPEN_PEERS):
        self._open: OrderedDict[str, OpenedPeer] = OrderedDict()
        self._opening: dict[str, Future[OpenedPeer]] = {}
        self._max_open = max_open
        self._lock = threading.Lock()
        self._opener: ThreadPoolExecutor | None = None

    def open_async(
        self,
        instance_key: str,
        descs: list[dict[str, Any]],
        device_index: int,
        cached: bool = True,
    ) -> Future[OpenedPeer]:
        """A future of the opened peer: done at once when it is open already.

        `cached=False` (a memory-saver target's landing arena, which must be freed with
        the target's KV cache): the mapping is not kept here; it lives as long as the
        caller holds the result (torch closes an IPC mapping with its last storage)."""
        if not cached:
            with self._lock:
                if self._opener is None:
                    self._opener = ThreadPoolExecutor(1, thread_name_prefix="kv-migration-ipc")
                return self._opener.submit(self._map, instance_key, descs, device_index)
        with self._lock:
            opened = self._open.get(instance_key)
            if opened is not None:
                self._open.move_to_end(instance_key)
                done: Future[OpenedPeer] = Future()
                done.set_result(opened)
                return done
            pending = self._opening.get(instance_key)
            if pending is not None:
                return pending
            if self._opener is None:
                self._opener = ThreadPoolExecutor(1, thread_name_prefix="kv-migration-ipc")
            future = self._opener.submit(self.get, instance_key, descs, device_index)
            self._opening[instance_key] = future
        future.add_done_callback(lambda _f: self._forget_opening(instance_key))
        return future

    def _forget_opening(self, instance_key: str) -> None:
        with self._lock:
            self._opening.pop(instance_key, None)

    def get(self, instance_key: str, descs: list[dict[str, Any]], device_index: int) -> OpenedPeer:
        with self._lock:
            opened = self._open.get(instance_key)
            if opened is not None:
                self._open.move_to_end(instance_key)
                return opened
        opened = self._map(instance_key, descs, device_index)
        with self._lock:
            self._open[instance_key] = opened
            while len(self._open) > self._max_open:
                _key, dropped = self._open.popitem(last=False)
                dropped.buffers.clear()  # the last reference closes the mapping
        logger.info(
            "Opened %d KV buffers of peer %s through CUDA IPC", len(opened.buffers), instance_key
        )
        return opened

    @staticmethod
    def _map(instance_key: str, descs: list[dict[str, Any]], device_index: int) -> OpenedPeer:
        import torch

        try:
            buffers = [open_tensor(d, device_index) for d in descs]
            pointers = torch.tensor(
                [b.data_ptr() for b in buffers], dtype=torch.int64, device=f"cuda:{device_index}"
            )
            return OpenedPeer(buffers, pointers)
        except MigrationError:
            raise
        except Exception as e:  # CUDA refused the handle (other host, other namespace)
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"cannot open the target's KV buffers through CUDA IPC ({instance_key}): "
                f"{type(e).__name__}: {e}",
            ) from None

    def close(self) -> None:
        with self._lock:
            opener, self._opener = self._opener, None
        if opener is not None:
            opener.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for opened in self._open.values():
                opened.buffers.clear()
            self._open.clear()

    def __len__(self) -> int:
        return len(self._open)


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data or b"").decode("ascii")
