"""The device data path: GPU -> GPU through CUDA IPC between servers on one host.

Target: reserves **device** KV slots from SGLang's token-to-KV allocator (evicting by
the tree's own rules), holds them in the pending registry like host slots, and on commit
inserts ordinary device radix nodes, so the next request hits on device with no
load-back (write-through then backs the pages up to host as usual).

Source (push): opens the target's per-layer KV buffers once per target instance
(`cuda_ipc.PeerBuffers`), locks the prefix's device nodes, and copies page by page on a
side stream that first waits for the streams that may still write those pages. The
reply is sent once the copy's CUDA event has completed; the lock is held until then.

Any tier (`tiers.py`): pages the source holds only in its pinned host pool (evicted from
its GPU) are read in place by the source's GPU through unified addressing and written
into the same target slots, one launch per tier, in the same migration; their host
nodes are protected from host eviction until the copy's event. Advertised as
`tiers: ["device", "host"]`; without a readable host pool (not pinned, a layout the
kernel cannot address) only `["device"]`, and such ranges are refused.

Memory saver (`landing.py`): a server started with `--enable-memory-saver` holds its KV
pool in torch_memory_saver's virtual-memory mappings, which CUDA IPC cannot export and
`/release_memory_occupation` unmaps. As a target it advertises a landing arena instead
(a plain buffer laid out like the pool); each reservation takes pool slots and as many
arena rows, the source writes the rows, and commit copies them into the pool on the
target's GPU before inserting. A memory release drops the arena with the KV cache (after
every copy out of it and every send of this rank has finished), a resume builds a new
one under a new instance id. As a source nothing changes: it reads its own pool.

Refused (the client then falls back to the host path): no CUDA, another host, a GPU this
process cannot see, or host pages this server cannot read in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError, detached
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.base import (
    DEVICE,
    ROUTE_GPU_TO_GPU,
    ROUTE_HOST_TO_GPU,
    ROUTE_LANDING,
    DataPath,
    KVPoll,
    NothingWritten,
    PreparedSend,
    SendJob,
    SendRange,
    SendStats,
)
from sglang_kv_migration.paths.device import cuda_ipc, landing, page_copy, page_lists, tiers
from sglang_kv_migration.targets import DeviceTarget

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun
    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

logger = logging.getLogger(__name__)

# The route a source tier's pages take into the target's slots (`SendStats.routes`).
_TIER_ROUTES = {tiers.DEVICE_TIER: ROUTE_GPU_TO_GPU, tiers.HOST_TIER: ROUTE_HOST_TO_GPU}


def device_path_unavailable_reason(
    cache: HiRadixCache, enable_memory_saver: bool, landing_bytes: int = 0
) -> str | None:
    """Why this server cannot offer the device path, or None when it can (with the
    memory saver on, as a landing-arena target of `landing_bytes`: `landing.py`)."""
    import torch

    missing = sglang_adapter.device_path_missing()
    if missing is not None:
        return missing
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if enable_memory_saver and not landing_bytes:
        return (
            "--enable-memory-saver with --kv-migration-landing-mb 0: CUDA IPC cannot "
            "export the saver's KV pool and no landing arena was asked for"
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

    def __init__(self, cache: HiRadixCache, landing_bytes: int = 0):
        import torch

        self.cache = cache
        self.page_size = int(cache.page_size)
        self.buffers = sglang_adapter.device_kv_buffers(cache)
        self.device = self.buffers[0].device
        self.row_bytes = [b[0].numel() * b.element_size() for b in self.buffers]
        self.num_rows = [int(b.shape[0]) for b in self.buffers]
        self.bytes_per_token = sum(self.row_bytes)
        self.page_bytes = [rb * self.page_size for rb in self.row_bytes]
        # Inside `launching_together`: the launches its sends queued (None outside).
        self._together: list[_QueuedLaunch] | None = None
        self._warm_tiers: set[str] = set()  # tiers some launch of this path copied
        self.instance_id = uuid.uuid4().hex  # a restarted server is a new peer
        self._peers = cuda_ipc.PeerBuffers()
        # The target role (reserve / release / insert) needs no CUDA: CPU tests run it on
        # a CPU device pool. Only the source role and the advertisement need the GPU.
        self._stream: Any = None
        self._exported: list[dict[str, Any]] = []
        self._gpu_uuid = ""
        self._src_ptrs: Any = None
        # > 0 (--enable-memory-saver): sources write a landing arena, not the pool.
        self.landing_tokens = landing_bytes // self.bytes_per_token if landing_bytes > 0 else 0
        if self.landing_tokens and self.landing_tokens < self.page_size:
            raise ValueError(
                f"a landing arena of {landing_bytes} bytes holds no page of {self.page_size} "
                f"tokens ({self.bytes_per_token} bytes each): raise --kv-migration-landing-mb"
            )
        self._landing: landing.LandingArena | None = None
        self.landing_refusal = ""  # why a landing-mode rank has no arena now
        self._page_lists: page_lists.PageListUpload | None = None
        self._order_event: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._page_lists = page_lists.PageListUpload(self.device)
            self._order_event = torch.cuda.Event()
            self._gpu_uuid = cuda_ipc.gpu_uuid(self.device.index)
            self._src_ptrs = _pointer_table(self.buffers, self.device)
        self._open_destination()
        # One fused launch moves every buffer when all have the same row size (MHA with
        # equal K/V head dims, MLA); otherwise two torch launches per buffer.
        self._fused = len(set(self.row_bytes)) == 1 and self.row_bytes[0] % 8 == 0
        self._host, self._host_refusal = self._host_tier()
        self._host_ptrs: Any = None
        if self._host is not None and self.device.type == "cuda":
            self._host_ptrs = torch.tensor(
                self._host.addresses(), dtype=torch.int64, device=self.device
            )
        self.warm_up()

    # ------------------------------------------------------------------ both roles

    def advertise(self) -> dict[str, Any]:
        arena = self._landing
        return DeviceTarget(
            host_identity=cuda_ipc.host_identity(),
            gpu_uuid=self._gpu_uuid,
            instance_id=self.instance_id,
            row_bytes=self.row_bytes,
            num_rows=[arena.capacity] * len(self.buffers) if arena else self.num_rows,
            buffers=self._exported,
            # Tiers this source copies from (absent: a server that reads device pages only).
            tiers=[tiers.DEVICE_TIER] + ([tiers.HOST_TIER] if self._host is not None else []),
            landing_tokens=arena.capacity if arena else 0,
        ).to_wire()

    # ------------------------------------------------------------------ memory saver

    def _open_destination(self) -> None:
        """What sources write: the pool's buffers, or (memory saver) a new landing arena,
        exported through CUDA IPC when this rank has a GPU."""
        if self.landing_tokens:
            self._landing = landing.LandingArena(
                self.row_bytes, self.landing_tokens, self.page_size, self.device
            )
            exported = self._landing.buffers
        else:
            exported = self.buffers
        if self.device.type != "cuda":
            return
        try:
            self._exported = [cuda_ipc.export_tensor(b) for b in exported]
        except RuntimeError as e:
            what = "landing arena" if self.landing_tokens else "KV pool"
            raise RuntimeError(
                f"cannot export the {what} through CUDA IPC ({e}); start the server with "
                "--kv-migration-paths host to go without the device path"
            ) from e

    def quiesce(self) -> None:
        """Wait for every copy this rank launched, as a source and out of its arena:
        before SGLang unmaps the KV pool (`/release_memory_occupation`)."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._landing is not None:
            self._landing.synchronize()

    def release_memory(self) -> None:
        """The KV cache is released: drop the landing arena (every reservation was freed
        before) and give its memory back to the driver. Sources map an arena only for
        the length of a send, so none holds it now (a send in flight from another
        server keeps its pages until it ends: torch frees them then)."""
        if self._landing is not None:
            self.landing_refusal = "the KV cache memory is released (/release_memory_occupation)"
            self._landing.synchronize()
            self._landing = None
            self._exported = []
            if self.device.type == "cuda":
                import torch

                torch.cuda.ipc_collect()  # blocks whose importers have all let go
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """The KV cache is back: a new arena under a new instance id, so sources open it
        instead of their mapping of the old one."""
        if self.landing_tokens and self._landing is None:
            self.instance_id = uuid.uuid4().hex
            try:
                self._open_destination()
                self.landing_refusal = ""
            except Exception as e:  # e.g. out of memory: the server must keep running
                logger.exception("KV migration landing arena not re-created")
                self._landing, self._exported = None, []
                self.landing_refusal = f"no landing arena after the resume: {e}"

    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        # As it came: the grant binds the digest of what the target advertised.
        return target.device_kv or {}

    def close(self) -> None:
        self._peers.close()

    # ------------------------------------------------------------------ target role

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return sglang_adapter.match_device_prefix(self.cache, input_ids, extra_key).as_held()

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        """Pool slots; with a landing arena, the arena rows reserved with them (the slots
        sources write: the pool slots stay this rank's business). `owners`: pages whose
        owners are the pattern, from the sharding fork's allocator (checked there)."""
        # (While the KV memory is released the scheduler side refuses allocations first.)
        if self.landing_tokens and self._landing is None:
            raise MigrationError(ErrorKind.UNAVAILABLE, self.landing_refusal)
        if owners is not None:
            slots = sglang_adapter.alloc_pages_with_owners(
                self.cache, owners.function, list(owners.pattern)
            )
        else:
            slots = sglang_adapter.alloc_device_slots(self.cache, num_tokens)
        if self._landing is None:
            return slots
        try:
            return self._landing.take(slots)
        except BaseException:
            sglang_adapter.free_device_slots(self.cache, slots)
            raise

    def release(self, slots: torch.Tensor) -> None:
        if self._landing is None:
            sglang_adapter.free_device_slots(self.cache, slots)
            return
        sglang_adapter.free_device_slots(self.cache, self._landing.pool_slots(slots))
        self._landing.give_back(slots)

    def retake(self, slots: torch.Tensor) -> None:
        pool = self._landing.pool_slots(slots) if self._landing is not None else slots
        sglang_adapter.take_device_slots(self.cache, pool)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        arena = self._landing
        if arena is None:
            return sglang_adapter.insert_device_pages(self.cache, key, anchor_length, slots)
        pool = arena.pool_slots(slots)
        copied = arena.scatter(slots, self.buffers, pool, self._src_ptrs if self._fused else None)
        present = sglang_adapter.insert_device_pages(self.cache, key, anchor_length, pool)
        # The caller releases rows [:present] (their pool slots are surplus); the rest
        # are free once the copy out of them is done.
        arena.give_back(slots[present:], after=copied)
        return present

    def content_digest(self, slots: torch.Tensor) -> str:
        if self._landing is not None:  # what the source wrote, before the scatter
            arena = self._landing
            rows = [b.view(arena.capacity, -1) for b in arena.buffers]
            return verify.device_rows_digest(rows, slots)
        return verify.device_rows_digest(self.buffers, slots)

    @property
    def holds_device_slots(self) -> bool:
        return True

    @property
    def late_write_margin_s(self) -> float:
        # The copy is launched before the grant's deadline and runs for milliseconds.
        return 2.0

    @property
    def late_writes_reach_slots(self) -> bool:
        # Into a landing arena, a late write reaches arena rows, never the pool.
        return self._landing is None

    # ------------------------------------------------------------------ source role

    def start_send(self, send: SendRange) -> SendJob:
        if not send.target.device_kv:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, "target_per_rank has no device_kv for the device path"
            )
        try:
            peer = DeviceTarget.from_wire(send.target.device_kv)
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, f"bad device_kv description: {e}") from None
        started = time.perf_counter()
        prepared = send.prepared if isinstance(send.prepared, PreparedPrefix) else None
        if prepared is not None and (send.source_slots is not None or not prepared.serves(send)):
            prepared = None  # matched less than this send asks: match again
        tiered = prepare_tiered_send(
            self.cache, send, self.page_size, prepared.prefix if prepared else None
        )
        if tiered is None:
            return NothingWritten(send.start)
        owned = tiered.send.owned_page_positions(tiered.plan.num_pages)
        if owned is not None:  # owner-sharded CP: this rank copies only its own pages
            if not owned:
                return NothingWritten(tiered.send.end)
            tiered = dataclasses.replace(tiered, plan=tiers.owned_part(tiered.plan, owned))
        matched = time.perf_counter()
        send = tiered.send
        opening = self._open_peer(peer)
        if tiered.plan.tokens(tiers.HOST_TIER) and self._host is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"source holds {tiered.plan.tokens(tiers.HOST_TIER)} of the tokens on host "
                f"only and cannot read its host pool in place ({self._host_refusal}): use "
                "the host path",
            )
        pin = prepared.take_pin() if prepared else TierPin.take(self.cache, tiered.prefix)
        job = DeviceSendJob(pin)
        job.end = send.end
        job.stats.bytes = tiered.plan.num_pages * self.page_size * self.bytes_per_token
        plan = tiered.plan
        job.tier_bytes = {t: plan.tokens(t) * self.bytes_per_token for t in plan.tiers}
        job.into_landing = peer.landing_tokens > 0
        if send.verify:
            job.digest_pieces = self._digest_pieces(tiered.plan)

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
            job.first_into_mapping = not dst.used and not job.into_landing
            dst.used = True
            if self._together is not None:  # launched with the others at the block's end
                self._together.append(_QueuedLaunch(tiered.plan, dst, job))
                job.queue_launch()
                return
            job.cold_tiers = self._cold_tiers(tiered.plan)
            job.launched(*self._launch(tiered.plan, dst))

        job.launch_when(opening, launch)
        try:
            job.poll_launch()
        except BaseException:
            job.release()
            raise
        # The handler's own time (the reply's steps): the radix match and plan, then
        # the checks, the pin and the copy's launch (the mapping's open, if it ran here).
        job.stats.steps["match"] = matched - started
        job.stats.steps["launch"] = time.perf_counter() - matched
        if prepared is not None:  # done while the target allocated
            job.stats.steps["prepare"] = prepared.seconds
        return job

    @contextlib.contextmanager
    def launching_together(self) -> Iterator[None]:
        """Sends started inside launch their copies when the block ends: one launch per
        tier for all the sends into one target (each launch costs ~1 ms of a server's
        scheduler thread, where its torch and CUDA calls run cold), not one each."""
        if self._together is not None:
            yield  # nested: the outer block launches
            return
        self._together = []
        try:
            yield
        finally:
            queued, self._together = self._together, None
            self._launch_queued(queued)

    def prepare_send(self, input_ids: list[int], extra_key: str | None) -> PreparedPrefix:
        """The radix match of the whole of `input_ids`, pinned: what `start_send` of any
        prefix of it reads (the target's answer says from where)."""
        started = time.perf_counter()
        prefix = sglang_adapter.match_tiered_prefix(self.cache, input_ids, extra_key)
        pin = TierPin.take(self.cache, prefix)
        try:
            # The device slots' GPU sync now, not once the target answered.
            prefix.segments = tiers.segments_on_host(prefix.segments)
        except BaseException:
            pin.release()
            raise
        prepared = PreparedPrefix(input_ids, extra_key, prefix, pin)
        prepared.seconds = time.perf_counter() - started
        return prepared

    # ------------------------------------------------------------------ helpers

    def _open_peer(self, peer: DeviceTarget) -> Future[cuda_ipc.OpenedPeer]:
        """Check the target's description, then open its buffers off this thread."""
        import torch

        host, gpu, instance = peer.host_identity, peer.gpu_uuid, peer.instance_id
        row_bytes, num_rows, descs = peer.row_bytes, peer.num_rows, peer.buffers
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
        # IMPORTANT: a landing arena is mapped per send, never kept: a mapping held here
        # would keep the arena's memory allocated on the target after it released it.
        return self._peers.open_async(instance, descs, here, cached=not peer.landing_tokens)

    def _checked_peer(self, opened: cuda_ipc.OpenedPeer, peer: DeviceTarget) -> cuda_ipc.OpenedPeer:
        """The mapped buffers have the sizes `peer` describes (checked once per mapping
        and description: a kept mapping is checked on its first send only)."""
        described = (tuple(peer.num_rows), tuple(peer.row_bytes))
        if opened.checked == described:
            return opened
        for flat, rows, rb in zip(opened.buffers, peer.num_rows, peer.row_bytes, strict=True):
            if flat.numel() != rows * rb:
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    f"device buffer of {flat.numel()} bytes, expected {rows} rows of {rb}",
                )
        opened.page_limit = min(
            flat.numel() // pb for flat, pb in zip(opened.buffers, self.page_bytes, strict=True)
        )
        opened.checked = described
        return opened

    def _launch_queued(self, queued: list[_QueuedLaunch]) -> None:
        """Launch what `launching_together` queued: per target, one launch of all its
        sends' pages. Sends released meanwhile are left out (their pages are unpinned)."""
        groups: dict[int, list[_QueuedLaunch]] = {}
        for q in queued:
            if not q.job.released:
                groups.setdefault(id(q.dst), []).append(q)
        for group in groups.values():
            started = time.perf_counter()
            plans = [q.plan for q in group]
            try:
                plan = tiers.merge_plans(plans) if len(plans) > 1 else plans[0]
                cold = self._cold_tiers(plan)
                events = self._launch(plan, group[0].dst)
            except Exception as e:  # every send of the group fails; none may be copying
                if self._stream is not None:
                    self._stream.synchronize()
                for q in group:
                    q.job.launch_failed(_launch_error(e))
                continue
            seconds = time.perf_counter() - started
            tier_bytes = {t: plan.tokens(t) * self.bytes_per_token for t in plan.tiers}
            for q in group:
                q.job.cold_tiers = cold
                q.job.launched(*events, group_tier_bytes=tier_bytes if len(group) > 1 else None)
                q.job.stats.steps["launch"] = q.job.stats.steps.get("launch", 0.0) + seconds

    def _cold_tiers(self, plan: tiers.TierPlan) -> frozenset[str]:
        """The tiers `plan` copies that no earlier launch of this path copied (now warm).
        A copy kernel's first launch in a process compiles it, or loads it from Triton's
        cache, inside the copy's events: the first host-tier copy on a fresh H200 took 42
        ms for 33 MB, which as a rate sample would teach the cost model 1.6 GB/s."""
        cold = frozenset(tier for tier in plan.tiers if tier not in self._warm_tiers)
        self._warm_tiers.update(cold)
        return cold

    def _launch(
        self, plan: tiers.TierPlan, dst: cuda_ipc.OpenedPeer
    ) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
        """Enqueue one copy per tier on the side stream; returns the (start, end) CUDA
        events of the whole copy and of each tier."""
        import numpy as np
        import torch

        page_bytes = self.page_bytes
        # The page lists in numpy, and all of them in one copy to the GPU: on a server's
        # scheduler thread each small torch op or copy costs tens of microseconds.
        lists = [(p.src_pages.numpy(), p.dst_pages.numpy()) for p in plan.tiers.values()]
        highest = max((int(pages.max()) for _, pages in lists if pages.size), default=-1)
        if highest >= dst.page_limit:  # (`_checked_peer` set the limit)
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"target page {highest} lies outside its device pool of {dst.page_limit} pages",
            )
        stream = self._stream
        # IMPORTANT: order the copy after every stream that may still write these pages
        # (the scheduler's stream and HiCache's load-back), before reading them. (One
        # kept event: a wait takes the event's state when it is enqueued.)
        for other in (
            torch.cuda.current_stream(self.device),
            *sglang_adapter.pending_device_write_streams(self.cache),
        ):
            self._order_event.record(other)
            stream.wait_event(self._order_event)
        events: dict[str, tuple[Any, Any]] = {}
        with torch.cuda.stream(stream):
            # Through pinned memory: from pageable memory the driver may first wait for
            # the stream, which waits for the scheduler's stream (a forward pass in
            # flight) and would block this thread that long.
            on_device = self._page_lists.upload(np.concatenate([a for pair in lists for a in pair]))
            try:
                offset = 0
                for tier, (src_pages, dst_pages) in zip(plan.tiers, lists, strict=True):
                    middle = offset + src_pages.size
                    end = middle + dst_pages.size
                    src_idx, dst_idx = on_device[offset:middle], on_device[middle:end]
                    offset = end
                    events[tier] = (_timed_event(), _timed_event())
                    events[tier][0].record(stream)
                    if tier == tiers.HOST_TIER:
                        self._copy_host_pages(src_idx, dst, dst_idx)
                    else:
                        self._copy_device_pages(src_idx, dst, dst_idx, page_bytes)
                    events[tier][1].record(stream)
            except BaseException:
                # IMPORTANT: the kept page lists are not rewritten before whatever this
                # launch enqueued has read them, also when it failed halfway.
                failed = torch.cuda.Event()
                failed.record(stream)
                self._page_lists.used_until(failed)
                raise
        ordered = list(events.values())
        self._page_lists.used_until(ordered[-1][1])
        return ordered[0][0], ordered[-1][1], events

    def _copy_device_pages(
        self, src_idx: Any, dst: cuda_ipc.OpenedPeer, dst_idx: Any, page_bytes: list[int]
    ) -> None:
        import torch

        if self._fused:
            try:
                page_copy.copy_pages(self._src_ptrs, dst.pointers, src_idx, dst_idx, page_bytes[0])
            except Exception:  # Triton cannot build the kernel here: fall back, once
                logger.exception("fused page copy unavailable; using torch copies")
                self._fused = False
        if not self._fused:
            for src, flat, pb in zip(self.buffers, dst.buffers, page_bytes, strict=True):
                page_copy.copy_pages_torch(
                    [src.view(-1).view(torch.uint8)], [flat], src_idx, dst_idx, pb
                )

    def _copy_host_pages(self, src_idx: Any, dst: cuda_ipc.OpenedPeer, dst_idx: Any) -> None:
        """Pinned host pages -> the target's device pages, read by this GPU in place."""
        host = self._host
        assert host is not None  # start_send refused host pages without a host tier
        into = page_copy.PageGeometry.contiguous(self.page_size, self.row_bytes[0])
        if self._fused:
            try:
                page_copy.copy_pages_strided(
                    self._host_ptrs, dst.pointers, src_idx, dst_idx, host.geometry, into
                )
                return
            except Exception:  # Triton cannot build the kernel here: fall back, once
                logger.exception("fused host page copy unavailable; using torch copies")
                self._fused = False
        dst_views = tiers.TierBuffers(
            tuple(dst.buffers),
            (0,) * len(dst.buffers),
            into,
            int(dst.buffers[0].numel()) // into.page_bytes,
        ).views()
        page_copy.copy_pages_strided_torch(host.views(), dst_views, src_idx.cpu(), dst_idx)

    def _host_tier(self) -> tuple[tiers.TierBuffers | None, str]:
        """The host pool as a tier this path reads in place, or (None, why not)."""
        try:
            shape = sglang_adapter.host_pool_shape(self.cache)
            offsets, geometry = tiers.host_buffer_geometry(
                shape.attention,
                shape.layout,
                shape.layer_num,
                shape.page_num,
                shape.page_size,
                shape.row_bytes,
            )
        except (MigrationError, ValueError) as e:
            return None, str(e)
        if len(offsets) != len(self.buffers) or {shape.row_bytes} != set(self.row_bytes):
            return None, "host pool rows differ from the device pool's"
        if self.device.type == "cuda" and not shape.pinned:
            return None, "the host pool is not pinned, so the GPU cannot read it in place"
        if self.device.type == "cuda" and shape.row_bytes % 8:
            return None, f"host rows of {shape.row_bytes} bytes are not whole 8-byte words"
        return tiers.TierBuffers.of_host(shape.kv_buffer, offsets, geometry, shape.page_num), ""

    @property
    def host_tier_refusal(self) -> str:
        """Why host-only pages cannot be sent by this path ("" when they can)."""
        return self._host_refusal

    def source_tiers(self) -> dict[str, tiers.TierBuffers]:
        """The tiers this source reads pages from, as torch-addressable buffers."""
        found = {tiers.DEVICE_TIER: tiers.TierBuffers.of_device(self.buffers, self.page_size)}
        if self._host is not None:
            found[tiers.HOST_TIER] = self._host
        return found

    def _digest_pieces(self, plan: tiers.TierPlan) -> list[tuple[list[Any], Any]]:
        """(per-buffer views, pages) in prefix order, for `verify.tier_pages_digest`."""
        views = {tier: buffers.views() for tier, buffers in self.source_tiers().items()}
        return [(views[tier], pages) for tier, pages in tiers.prefix_order_pages(plan)]

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
        self._warm_up_host_tier()

    def _warm_up_host_tier(self) -> None:
        """Build the strided kernel with the argument values a host-tier copy will pass
        (Triton specializes on them): host page 0 into a scratch page per buffer."""
        if self._host_ptrs is None or not self._fused or self._host.geometry.is_contiguous:
            return
        import torch

        into = page_copy.PageGeometry.contiguous(self.page_size, self.row_bytes[0])
        scratch = [
            torch.empty(into.page_bytes, dtype=torch.uint8, device=self.device)
            for _ in self.buffers
        ]
        page = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            with torch.cuda.stream(self._stream):
                page_copy.copy_pages_strided(
                    self._host_ptrs,
                    _pointer_table(scratch, self.device),
                    page,
                    page,
                    self._host.geometry,
                    into,
                )
            self._stream.synchronize()
        except Exception:  # Triton cannot build the kernel here: torch copies instead
            logger.exception("fused host page copy unavailable; using torch copies")
            self._fused = False


class DeviceSendJob(SendJob):
    """One rank's copy: launched once the target's buffers are open, done when its CUDA
    event has completed; the source's prefix stays locked until `release`."""

    def __init__(self, pin: TierPin):
        self._pin: TierPin | None = pin
        self._start: Any = None
        self._end: Any = None
        self._opening: Future[Any] | None = None
        self._launch: Any = None
        self.stats = SendStats()
        # verify: (per-buffer page views, pages) in prefix order, hashed once copied.
        self.digest_pieces: list[tuple[list[Any], Any]] | None = None
        self._digest: Future[str] | None = None
        self._tier_events: dict[str, tuple[Any, Any]] = {}
        self.tier_bytes: dict[str, int] = {}  # bytes read from each source tier
        self.into_landing = False  # the target is a landing arena (memory saver)
        self.first_into_mapping = False  # the first copy into a kept peer mapping
        self.cold_tiers: frozenset[str] = frozenset()  # tiers whose kernel ran first here
        # Launched with other sends (`DevicePath.launching_together`): the bytes of the
        # whole launch per tier, so this send's share of its events' time is known.
        self._group_tier_bytes: dict[str, int] | None = None
        self._queued = False  # waiting for the end of a `launching_together` block
        self._launch_error: MigrationError | None = None

    def launch_when(self, opening: Future[Any], launch: Any) -> None:
        self._opening, self._launch = opening, launch

    def queue_launch(self) -> None:
        self._queued = True

    def launched(
        self,
        start: Any,
        end: Any,
        tier_events: dict[str, tuple[Any, Any]],
        group_tier_bytes: dict[str, int] | None = None,
    ) -> None:
        self._start, self._end, self._tier_events = start, end, tier_events
        self._group_tier_bytes = group_tier_bytes
        self._queued = False

    def launch_failed(self, error: MigrationError) -> None:
        self._launch_error, self._queued = error, False

    @property
    def released(self) -> bool:
        return self._pin is None

    @property
    def started_writing(self) -> bool:
        return self._end is not None

    @property
    def waits_on_helper(self) -> bool:
        # The peer's buffers are mapped on the opener thread: 64 CUDA IPC opens, each
        # giving the GIL up and waiting for it back (a landing arena: on every send).
        return self._end is None and self._opening is not None and not self._opening.done()

    @property
    def completion_event(self) -> Any:
        # Launched and not verified: only the copy is left (a verify digest runs on a
        # helper thread afterwards).
        if self._end is None or self.error is not None or self.digest_pieces is not None:
            return None
        return self._end

    def poll_launch(self) -> bool:
        """Launch once the peer is open; True once launched. Raises what the launch does."""
        if self._end is None:
            if self._launch_error is not None:
                raise self._launch_error
            if self._queued or self._opening is None or not self._opening.done():
                return False
            try:
                self._launch()
            except Exception as e:  # e.g. the open failed: CUDA refused the handle
                raise _launch_error(e) from e
        return True

    def poll(self) -> KVPoll:
        if self.error is not None:
            return KVPoll.FAILED
        try:
            if not self.poll_launch():
                return KVPoll.TRANSFERRING
        except MigrationError as e:
            self.error = detached(e)
            return KVPoll.FAILED
        if not self._end.query():
            return KVPoll.TRANSFERRING
        if self.digest_pieces is not None:
            if self._digest is None:
                # The pages stay locked (unchanged) until `release`; hash them off the
                # scheduler thread.
                pieces = self.digest_pieces
                self._digest = verify.submit(lambda: verify.tier_pages_digest(pieces))
            if not self._digest.done():
                return KVPoll.TRANSFERRING
            try:
                self.stats.digest = self._digest.result()
            except Exception as e:  # a bug; the receipt must not claim a digest
                logger.exception("digest of the sent pages failed")
                self.error = MigrationError(ErrorKind.INTERNAL, f"verify digest failed: {e!r}")
                return KVPoll.FAILED
        self.stats.seconds = self._start.elapsed_time(self._end) / 1e3 * self._share()
        for tier, (start, end) in self._tier_events.items():
            self.stats.steps[f"copy_{tier}"] = start.elapsed_time(end) / 1e3 * self._share(tier)
        # A tier whose kernel ran first in this launch (`_cold_tiers`) is no sample.
        self.stats.routes = {
            _TIER_ROUTES[tier]: (nbytes, self.stats.steps.get(f"copy_{tier}", 0.0))
            for tier, nbytes in self.tier_bytes.items()
            if nbytes and tier not in self.cold_tiers
        }
        if self.into_landing:  # one route, whichever tier: the target copies it again
            landing = {ROUTE_LANDING: (self.stats.bytes, self.stats.seconds)}
            self.stats.routes = {} if self.cold_tiers else landing
        elif self.first_into_mapping:
            # The first copy into a peer's kept mapping has taken up to 80 ms on the
            # H200 whatever its size (the first migration of a server pair; the cause
            # is not established): a one-off, so it is this send's fixed cost
            # (`/metrics`), not a sample of the routes' rates.
            self.stats.routes = {}
        return KVPoll.SUCCESS

    def _share(self, tier: str | None = None) -> float:
        """This send's part of a launch it shared (1 alone): its bytes over the
        launch's, of one tier or of all."""
        group = self._group_tier_bytes
        if not group:
            return 1.0
        mine = self.tier_bytes.get(tier, 0) if tier else sum(self.tier_bytes.values())
        total = group.get(tier, 0) if tier else sum(group.values())
        return mine / total if total else 1.0

    def release(self) -> None:
        # The copy must be over before its pages are unpinned and before the target's
        # mapping (a landing arena's is this job's only) can be closed.
        if self._end is not None and not self._end.query():
            self._end.synchronize()
        if self._pin is not None:
            self._pin.release()
            self._pin = None
        # Drop the references to the opened peer: an uncached mapping closes here.
        self._opening = self._launch = None


def _launch_error(error: Exception) -> MigrationError:
    """What a send reports when its copy could not be launched."""
    if isinstance(error, MigrationError):
        return error
    return MigrationError(ErrorKind.CONFLICT, f"device copy not started: {error}")


@dataclass
class _QueuedLaunch:
    """A send's copy, queued by `DevicePath.launching_together`."""

    plan: tiers.TierPlan
    dst: cuda_ipc.OpenedPeer
    job: DeviceSendJob


@dataclass
class TieredSend:
    prefix: sglang_adapter.TieredPrefix
    plan: tiers.TierPlan
    send: SendRange  # the send asked for, cut to what the source holds (partial_ok)


def prepare_tiered_send(
    cache: HiRadixCache,
    send: SendRange,
    page_size: int,
    prefix: sglang_adapter.TieredPrefix | None = None,
) -> TieredSend | None:
    """Where each page of the send lies on this source and where it goes (no CUDA, no
    locks): raises CONFLICT when the source no longer holds the range (a partial send
    is cut to what it holds: None when that is nothing past `start`), BAD_REQUEST for
    slots that are not whole pages. `prefix`: matched (and pinned) already."""
    if send.source_slots is not None:  # feature "running_slots": the request's own row
        prefix = sglang_adapter.running_prefix(cache, send.source_slots)
    elif prefix is None:
        prefix = sglang_adapter.match_tiered_prefix(
            cache, send.input_ids[: send.end], send.extra_key
        )
        prefix.segments = tiers.segments_on_host(prefix.segments)  # one GPU sync
    send = send.cut_to(prefix.length, "on device or host")
    if send.end == send.start:
        return None
    try:
        plan = tiers.plan_tiers(prefix.segments, send.start, send.end, send.target_slots, page_size)
    except ValueError as e:
        raise MigrationError(ErrorKind.BAD_REQUEST, f"device copy plan: {e}") from None
    return TieredSend(prefix, plan, send)


class PreparedPrefix(PreparedSend):
    """`DevicePath.prepare_send`: a request's prefix matched by tier and pinned, before
    the target said from where to send it."""

    def __init__(
        self,
        input_ids: list[int],
        extra_key: str | None,
        prefix: sglang_adapter.TieredPrefix,
        pin: TierPin,
    ):
        self.input_ids = input_ids
        self.extra_key = extra_key
        self.prefix = prefix
        self._pin: TierPin | None = pin

    def serves(self, send: SendRange) -> bool:
        """Whether this match covers `send`: the same ids and namespace, held to its end
        (a prefix that was shorter may have grown since: matched again then)."""
        return (
            self._pin is not None
            and send.input_ids is self.input_ids
            and send.extra_key == self.extra_key
            and self.prefix.length >= send.end
        )

    def take_pin(self) -> TierPin:
        """The pin, now the caller's to release (once, after `serves`)."""
        pin, self._pin = self._pin, None
        assert pin is not None, "the pin was taken or released already"
        return pin

    def release(self) -> None:
        if self._pin is not None:
            self._pin.release()
            self._pin = None


class TierPin:
    """What a send holds until its copy's event: a lock on the deepest device node
    (and so its ancestors) and host protection on the host-only nodes it reads."""

    def __init__(
        self, cache: HiRadixCache, device_lock: sglang_adapter.NodeLock, host_protection: list
    ):
        self._cache = cache
        self._device_lock: sglang_adapter.NodeLock | None = device_lock
        self._host_protection = host_protection

    @classmethod
    def take(cls, cache: HiRadixCache, prefix: sglang_adapter.TieredPrefix) -> TierPin:
        # IMPORTANT: lock only the device part: `inc_lock_ref` on an evicted node would
        # count its tokens out of the device pool's evictable size.
        device_lock = sglang_adapter.lock_node(cache, prefix.last_device_node)
        host_protection = sglang_adapter.protect_host_nodes(cache, prefix.host_nodes)
        return cls(cache, device_lock, host_protection)

    def release(self) -> None:
        """Idempotent."""
        if self._device_lock is not None:
            sglang_adapter.unlock_node(self._cache, self._device_lock)
            self._device_lock = None
        sglang_adapter.release_host_nodes(self._cache, self._host_protection)
        self._host_protection = []


def _timed_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _pointer_table(buffers: list[torch.Tensor], device: Any) -> torch.Tensor:
    import torch

    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
