"""The device data path: GPU -> GPU through CUDA IPC between servers on one host.

Target: reserves **device** KV slots from SGLang's token-to-KV allocator (evicting by
the tree's own rules), holds them in the pending registry like host slots, and on commit
inserts ordinary device radix nodes, so the next request hits on device with no
load-back (write-through then backs the pages up to host as usual).

Source (push): opens the target's per-layer KV buffers once per target instance
(`cuda_ipc.PeerBuffers`), locks the prefix's device nodes, and copies page by page on a
side stream that first waits for the streams that may still write those pages. The
reply is sent once the copy's CUDA event has completed; the lock is held until then.

Refused (the client then falls back to the host path): no CUDA, `--enable-memory-saver`
(its KV pools are virtual-memory mappings released and resumed around training steps, so
an IPC mapping would not survive a release), another host, a GPU this process cannot
see, or a source range that is only partly on the source's GPU.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from sglang_kv_migration import cuda_ipc, page_copy, sglang_adapter, verify
from sglang_kv_migration.data_path import DEVICE, DataPath, KVPoll, SendJob, SendRange, SendStats
from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.io_types import TransferRequestKVCacheTarget

logger = logging.getLogger(__name__)


def device_path_unavailable_reason(cache: HiRadixCache, enable_memory_saver: bool) -> str | None:
    """Why this server cannot offer the device path, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if enable_memory_saver:
        return (
            "--enable-memory-saver is on: KV pools are released and resumed around "
            "training steps, so CUDA IPC mappings of them cannot be kept"
        )
    try:
        buffers = sglang_adapter.device_kv_buffers(cache)
    except MigrationError as e:
        return e.message
    if not all(b.is_cuda and b.is_contiguous() for b in buffers):
        return "device KV buffers are not contiguous CUDA tensors"
    return None


class DevicePath(DataPath):
    name: ClassVar[str] = DEVICE

    def __init__(self, cache: HiRadixCache):
        import torch

        self.cache = cache
        self.page_size = int(cache.page_size)
        self.buffers = sglang_adapter.device_kv_buffers(cache)
        self.device = self.buffers[0].device
        self.row_bytes = [b[0].numel() * b.element_size() for b in self.buffers]
        self.num_rows = [int(b.shape[0]) for b in self.buffers]
        self.bytes_per_token = sum(self.row_bytes)
        self.instance_id = uuid.uuid4().hex  # a restarted server is a new peer
        self._peers = cuda_ipc.PeerBuffers()
        # The target role (reserve / release / insert) needs no CUDA: CPU tests run it on
        # a CPU device pool. Only the source role and the advertisement need the GPU.
        self._stream: Any = None
        self._exported: list[dict[str, Any]] = []
        self._gpu_uuid = ""
        self._src_ptrs: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._exported = [cuda_ipc.export_tensor(b) for b in self.buffers]
            self._gpu_uuid = cuda_ipc.gpu_uuid(self.device.index)
            self._src_ptrs = _pointer_table(self.buffers, self.device)
        # One fused launch moves every buffer when all have the same row size (MHA with
        # equal K/V head dims, MLA); otherwise two torch launches per buffer.
        self._fused = len(set(self.row_bytes)) == 1 and self.row_bytes[0] % 8 == 0
        self.warm_up()

    # ------------------------------------------------------------------ both roles

    def advertise(self) -> dict[str, Any]:
        return {
            "host_identity": cuda_ipc.host_identity(),
            "gpu_uuid": self._gpu_uuid,
            "instance_id": self.instance_id,
            "row_bytes": self.row_bytes,
            "num_rows": self.num_rows,
            "buffers": self._exported,
        }

    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        return target.device_kv or {}

    def close(self) -> None:
        self._peers.close()

    # ------------------------------------------------------------------ target role

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return sglang_adapter.match_device_prefix(self.cache, input_ids, extra_key).as_held()

    def reserve(self, num_tokens: int) -> torch.Tensor:
        return sglang_adapter.alloc_device_slots(self.cache, num_tokens)

    def release(self, slots: torch.Tensor) -> None:
        sglang_adapter.free_device_slots(self.cache, slots)

    def retake(self, slots: torch.Tensor) -> None:
        sglang_adapter.take_device_slots(self.cache, slots)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        return sglang_adapter.insert_device_pages(self.cache, key, anchor_length, slots)

    def content_digest(self, slots: torch.Tensor) -> str:
        return verify.device_rows_digest(self.buffers, slots)

    @property
    def holds_device_slots(self) -> bool:
        return True

    @property
    def late_write_margin_s(self) -> float:
        # The copy is launched before the grant's deadline and runs for milliseconds.
        return 2.0

    # ------------------------------------------------------------------ source role

    def start_send(self, send: SendRange) -> SendJob:

        peer = send.target.device_kv
        if not peer:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, "target_per_rank has no device_kv for the device path"
            )
        opening = self._open_peer(peer)
        held = sglang_adapter.match_device_prefix(
            self.cache, send.input_ids[: send.end], send.extra_key
        )
        if held.length < send.end:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"source holds only {held.length} of {send.end} tokens on its GPU (the rest "
                "is on host only or evicted); the device path needs them on device: use "
                "the host path",
            )
        src_pages = _pages_of(held.indices[send.start : send.end], self.page_size, "source")
        dst_pages = _pages_of(send.target_slots, self.page_size, "target")
        self.cache.inc_lock_ref(held.last_node)
        job = DeviceSendJob(self.cache, held.last_node)
        job.stats.bytes = (send.end - send.start) * self.bytes_per_token
        if send.verify:
            job.digest_rows = (self.buffers, held.indices[send.start : send.end])

        def launch() -> None:
            # On the scheduler thread, once the peer's buffers are open (at once when they
            # were already): checks the mapping, then only enqueues the copy.
            if time.time() > send.start_by:
                raise MigrationError(
                    ErrorKind.FORBIDDEN,
                    "copy refused: the grant expired while the target's buffers were being "
                    "opened; nothing was written",
                )
            dst = self._checked_peer(opening.result(), peer)
            job.launched(*self._launch(src_pages, dst, dst_pages))

        job.launch_when(opening, launch)
        try:
            job.poll_launch()
        except BaseException:
            job.release()
            raise
        return job

    # ------------------------------------------------------------------ helpers

    def _open_peer(self, peer: dict[str, Any]) -> Future[cuda_ipc.OpenedPeer]:
        """Check the target's description, then open its buffers off this thread."""
        import torch

        try:
            host, gpu = str(peer["host_identity"]), str(peer["gpu_uuid"])
            instance = str(peer["instance_id"])
            row_bytes = [int(x) for x in peer["row_bytes"]]
            num_rows = [int(x) for x in peer["num_rows"]]
            descs = list(peer["buffers"])
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, f"bad device_kv description: {e}") from None
        if len(num_rows) != len(row_bytes):
            raise MigrationError(
                ErrorKind.BAD_REQUEST, "bad device_kv description: num_rows and row_bytes differ"
            )
        if host != cuda_ipc.host_identity():
            raise MigrationError(
                ErrorKind.CONFLICT, "target is on another host: the device path needs one host"
            )
        if row_bytes != self.row_bytes or len(descs) != len(self.buffers):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"device KV rows differ: source {len(self.buffers)} buffers of "
                f"{self.row_bytes[:2]}... bytes, target {len(descs)} of {row_bytes[:2]}...",
            )
        target_index = cuda_ipc.local_device_of(gpu)
        if target_index is None:
            raise MigrationError(
                ErrorKind.CONFLICT, f"target GPU {gpu} is not visible to the source process"
            )
        here = self.device.index
        if target_index != here and not torch.cuda.can_device_access_peer(here, target_index):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"this GPU ({here}) cannot access the target's GPU ({target_index}) as a peer",
            )
        # Mapped into *this* device's address space (CUDA enables peer access for a
        # mapping of a peer GPU's memory), so the copy kernel runs here and writes the
        # target's pages directly, over NVLink when the target is another GPU.
        return self._peers.open_async(instance, descs, here)

    def _checked_peer(
        self, opened: cuda_ipc.OpenedPeer, peer: dict[str, Any]
    ) -> cuda_ipc.OpenedPeer:
        row_bytes = [int(x) for x in peer["row_bytes"]]
        num_rows = [int(x) for x in peer["num_rows"]]
        for flat, rows, rb in zip(opened.buffers, num_rows, row_bytes, strict=True):
            if flat.numel() != rows * rb:
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    f"device buffer of {flat.numel()} bytes, expected {rows} rows of {rb}",
                )
        return opened

    def _launch(
        self,
        src_pages: torch.Tensor,
        dst: cuda_ipc.OpenedPeer,
        dst_pages: torch.Tensor,
    ) -> tuple[Any, Any]:
        """Enqueue the copy on the side stream; returns its (start, end) CUDA events."""
        import torch

        page_bytes = [rb * self.page_size for rb in self.row_bytes]
        for flat, pb in zip(dst.buffers, page_bytes, strict=True):
            limit = flat.numel() // pb
            if len(dst_pages) and int(dst_pages.max()) >= limit:
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    f"target page {int(dst_pages.max())} lies outside its device pool of "
                    f"{limit} pages",
                )
        stream = self._stream
        # IMPORTANT: order the copy after every stream that may still write these pages
        # (the scheduler's stream and HiCache's load-back), before reading them.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for other in sglang_adapter.pending_device_write_streams(self.cache):
            stream.wait_stream(other)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            src_idx = src_pages.to(self.device, non_blocking=True)
            dst_idx = dst_pages.to(self.device, non_blocking=True)
            start.record(stream)
            if self._fused:
                try:
                    page_copy.copy_pages(
                        self._src_ptrs, dst.pointers, src_idx, dst_idx, page_bytes[0]
                    )
                except Exception:  # Triton cannot build the kernel here: fall back, once
                    logger.exception("fused page copy unavailable; using torch copies")
                    self._fused = False
            if not self._fused:
                for src, flat, pb in zip(self.buffers, dst.buffers, page_bytes, strict=True):
                    page_copy.copy_pages_torch(
                        [src.view(-1).view(torch.uint8)], [flat], src_idx, dst_idx, pb
                    )
            end.record(stream)
        return start, end

    def warm_up(self) -> None:
        """Build the copy kernel now, not in the first migration's scheduler iteration:
        copy this pool's page 0 onto itself (nothing is cached yet: no reader to race)."""
        if self._stream is None or not self._fused:
            return
        import torch

        page = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            with torch.cuda.stream(self._stream):
                page_copy.copy_pages(
                    self._src_ptrs, self._src_ptrs, page, page, self.row_bytes[0] * self.page_size
                )
            self._stream.synchronize()
        except Exception:  # Triton cannot build the kernel here: torch copies instead
            logger.exception("fused page copy unavailable; using torch copies")
            self._fused = False


class DeviceSendJob(SendJob):
    """One rank's copy: launched once the target's buffers are open, done when its CUDA
    event has completed; the source's prefix stays locked until `release`."""

    def __init__(self, cache: HiRadixCache, locked: TreeNode):
        self._cache = cache
        self._locked: TreeNode | None = locked
        self._start: Any = None
        self._end: Any = None
        self._opening: Future[Any] | None = None
        self._launch: Any = None
        self.stats = SendStats()
        # verify: (source buffers, source slots) to hash once the copy completed.
        self.digest_rows: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._digest: Future[str] | None = None

    def launch_when(self, opening: Future[Any], launch: Any) -> None:
        self._opening, self._launch = opening, launch

    def launched(self, start: Any, end: Any) -> None:
        self._start, self._end = start, end

    @property
    def started_writing(self) -> bool:
        return self._end is not None

    def poll_launch(self) -> bool:
        """Launch once the peer is open; True once launched. Raises what the launch does."""
        if self._end is None:
            if self._opening is None or not self._opening.done():
                return False
            try:
                self._launch()
            except MigrationError:
                raise
            except Exception as e:  # the open failed: CUDA refused the handle
                raise MigrationError(ErrorKind.CONFLICT, f"device copy not started: {e}") from e
        return True

    def poll(self) -> KVPoll:
        if self.error is not None:
            return KVPoll.FAILED
        try:
            if not self.poll_launch():
                return KVPoll.TRANSFERRING
        except MigrationError as e:
            self.error = e
            return KVPoll.FAILED
        if not self._end.query():
            return KVPoll.TRANSFERRING
        if self.digest_rows is not None:
            if self._digest is None:
                # The pages stay locked (unchanged) until `release`; hash them off the
                # scheduler thread.
                buffers, slots = self.digest_rows
                self._digest = verify.submit(lambda: verify.device_rows_digest(buffers, slots))
            if not self._digest.done():
                return KVPoll.TRANSFERRING
            try:
                self.stats.digest = self._digest.result()
            except Exception as e:  # a bug; the receipt must not claim a digest
                logger.exception("digest of the sent pages failed")
                self.error = MigrationError(ErrorKind.INTERNAL, f"verify digest failed: {e!r}")
                return KVPoll.FAILED
        self.stats.seconds = self._start.elapsed_time(self._end) / 1e3
        return KVPoll.SUCCESS

    def release(self) -> None:
        if self._locked is not None:
            self._cache.dec_lock_ref(self._locked)
            self._locked = None


def _pages_of(slots: torch.Tensor, page_size: int, side: str) -> torch.Tensor:
    """Page ids of whole-page token slots; raises BAD_REQUEST naming the side."""
    import torch

    from sglang_kv_migration.layout import page_runs

    slots = slots.to("cpu", torch.int64)
    try:
        page_runs(slots, page_size)  # validates: whole pages, page-aligned
    except ValueError as e:
        raise MigrationError(ErrorKind.BAD_REQUEST, f"{side} slots: {e}") from None
    return slots[::page_size] // page_size


def _pointer_table(buffers: list[torch.Tensor], device: Any) -> torch.Tensor:
    import torch

    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
