"""What a tiered send reads on its source: the prefix matched by tier, the plan of its
pages, and the pin that keeps them until the copy's event.

Shared by every source that copies pages from where they lie on this server (its GPU
or its pinned host pool): the device path (into the target's GPU) and the same-host
host landing (into the target's host pool). No CUDA here: planning and pins are tree
and torch-on-CPU work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import PreparedSend, SendRange
from sglang_kv_migration.paths.device import tiers

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


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
        raise MigrationError(ErrorKind.BAD_REQUEST, f"tiered copy plan: {e}") from None
    return TieredSend(prefix, plan, send)


class PreparedPrefix(PreparedSend):
    """`prepare_send` of a tiered source: a request's prefix matched by tier and pinned,
    before the target said from where to send it."""

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
        # IMPORTANT: lock only the device part: a lock on an evicted node would count
        # its tokens out of the device pool's evictable size.
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
