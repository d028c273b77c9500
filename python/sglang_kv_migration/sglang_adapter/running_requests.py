"""The requests SGLang's scheduler is running, as a live move reads them: a request by
its rid, the tokens whose KV its slots hold, and those slots (its `req_to_token_pool`
row); plus the copy of device slots into host slots the host path sends from.

What SGLang 0.5.12 keeps of a decoding `Req`: ``origin_input_ids + output_ids`` are its
tokens; ``req_to_token_pool.req_to_token[req.req_pool_idx]`` lists the device slot of
every position; ``kv_committed_len`` counts the positions with a slot whose KV is
written or being written by the forward in flight (``prepare_for_decode`` adds one
before the step runs), so positions below ``kv_committed_len - 1`` are written once the
device is synchronized. A request that finished or freed its committed KV
(``kv_committed_freed``) holds nothing a migration may read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


@dataclass(frozen=True)
class RunningRequest:
    """One request found in the scheduler's running batch, read at one moment."""

    rid: str
    token_ids: list[int]  # prompt + output so far (a copy)
    kv_length: int  # leading positions whose KV the slots hold (written)
    req: Any  # SGLang's Req: read its slots only while it still runs (`slots_of`)
    retractions: int = 0  # its `retraction_count`: a retraction frees its slots


class RunningRequests:
    """The scheduler's running batch and waiting queue, looked up by rid."""

    def __init__(self, scheduler: Any):
        self._scheduler = scheduler

    def find(self, rid: str) -> RunningRequest | None:
        """The running request `rid` with slots to read; None when no request of that
        rid runs here (unknown, still waiting, finished, or its KV freed)."""
        for req in _running_reqs(self._scheduler):
            if req.rid == rid:
                return _read(req)
        return None

    def waiting(self, rid: str) -> bool:
        """Whether `rid` waits in the scheduler's queue (no slots yet)."""
        return any(req.rid == rid for req in getattr(self._scheduler, "waiting_queue", []))

    def still_holds(self, running: RunningRequest, end: int) -> bool:
        """Whether `running`'s request still runs and holds the slots of its first `end`
        positions it held when read: the same `Req`, never finished nor retracted since
        (SGLang frees a running request's slots only then). Reads no device memory."""
        found = self.find(running.rid)
        return (
            found is not None
            and found.req is running.req
            and found.retractions == running.retractions
            and found.kv_length >= end
        )

    def slots_of(self, running: RunningRequest, start: int, end: int) -> torch.Tensor:
        """The device slots of positions [start, end) (int64, a copy). On a GPU the
        device is synchronized first: the forward that wrote the last of them may still
        run on SGLang's stream, and a copy on another stream must read it done."""
        import torch

        pool = self._scheduler.req_to_token_pool
        row = pool.req_to_token[running.req.req_pool_idx, start:end]
        if row.is_cuda:
            torch.cuda.synchronize(row.device)
        return row.to(torch.int64).clone()


def running_requests_of(scheduler: Any) -> RunningRequests | None:
    """The scheduler's running requests as the live move reads them, or None where the
    adapter does not read them: SGLang 0.5.23 keeps a request's slots and committed
    length in `Req.kv` (`ReqKvInfo`), not on the request, so there the feature
    "running_slots" is not offered (a live move falls back to abort, migrate, resume)."""
    from sglang_kv_migration.sglang_adapter.installed import is_unified_line

    return None if is_unified_line() else RunningRequests(scheduler)


def _running_reqs(scheduler: Any) -> list[Any]:
    batch = getattr(scheduler, "running_batch", None)
    reqs = list(getattr(batch, "reqs", None) or [])
    # With the overlap schedule the batch just launched holds requests of this step too.
    last = getattr(scheduler, "last_batch", None)
    if last is not None and last is not batch:
        reqs.extend(r for r in getattr(last, "reqs", None) or [] if r not in reqs)
    return reqs


def _read(req: Any) -> RunningRequest | None:
    if req.req_pool_idx is None or getattr(req, "kv_committed_freed", False):
        return None
    if req.finished():
        return None
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    written = max(0, min(int(req.kv_committed_len), len(tokens)) - 1)
    retractions = int(getattr(req, "retraction_count", 0) or 0)
    return RunningRequest(req.rid, tokens, written, req, retractions)


def copy_device_to_host(
    cache: HiRadixCache, device_slots: torch.Tensor, host_slots: torch.Tensor
) -> None:
    """Copy every layer's KV of `device_slots` into `host_slots` of the host pool and
    wait for it (HiCache's own backup copy, on the calling thread's stream)."""
    import torch

    host = cache.cache_controller.mem_pool_host
    device = cache.cache_controller.mem_pool_device
    io_backend = cache.cache_controller.io_backend
    device_indices = device_slots.to(device=_device_of(device), dtype=torch.int64)
    host.backup_from_device_all_layer(device, host_slots, device_indices, io_backend)
    if device_indices.is_cuda:
        torch.cuda.current_stream(device_indices.device).synchronize()


def running_prefix(cache: HiRadixCache, device_slots: torch.Tensor) -> Any:
    """A `TieredPrefix` of a running request's slots (one device segment, no tree node:
    nothing to lock), for the device path's copy plan."""
    from sglang_kv_migration.sglang_adapter.radix_tree import DEVICE_TIER, Segment, TieredPrefix

    return TieredPrefix(
        length=len(device_slots),
        segments=[Segment(DEVICE_TIER, device_slots.to("cpu"))],
        last_device_node=cache.root_node,
        host_nodes=[],
    )


def _device_of(device_pool: Any) -> Any:
    return getattr(device_pool, "device", "cpu")
