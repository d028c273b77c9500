"""Target side: the slots of ended migrations that a granted write may still reach.

Slots of an aborted, expired, flushed or weights-changed migration go back to the free
list only when no write to them can still land: at once if the source's receipt says it
settled, else once the write window (grant deadline + the path's late write margin,
`write_window_s` after allocate) has passed — until then they sit here, and once the
window closed, until no inbound stream that was open then is left (a TCP stream can
outlive its batch's timeout: it is shut down first, and the engine closes it).

`PendingMigrations` (`pending.py`) puts an ended migration here and calls these methods
under its lock, on its clock; the watchdog's `expire()` frees what is due.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths.base import DataPath

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


class EndedAllocation(Protocol):
    """What the quarantine reads of an ended allocation (`pending.PendingMigration`)."""

    migration_id: str
    root: object  # the tree generation it was allocated under
    write_window_end: float  # a source may write the slots until then (registry clock)
    path: DataPath  # owns the slots
    slots: torch.Tensor


Ended = TypeVar("Ended", bound=EndedAllocation)


@dataclass
class QuarantinedSlots(Generic[Ended]):
    """One ended migration whose slots are not free yet."""

    # The ended allocation: its slots and path, and the grant, source and slots a
    # repeated abort's receipts are checked against.
    pending: Ended
    root: object  # the tree generation the slots belong to (a reset frees them: `retake`)
    # Once its write window closed: the inbound streams still to be closed before the
    # slots go back (`DataPath.close_write_streams`; None: not yet listed).
    streams: frozenset[int] | None = None


class Quarantine(Generic[Ended]):
    """The quarantined slots of one rank, by migration id."""

    def __init__(self, cache: HiRadixCache):
        self.cache = cache
        # Read-only outside this class (the scheduler's idle check reads it directly).
        self.by_id: dict[str, QuarantinedSlots[Ended]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, migration_id: str) -> bool:
        return migration_id in self.by_id

    def get(self, migration_id: str) -> Ended | None:
        held = self.by_id.get(migration_id)
        return held.pending if held is not None else None

    def allocations(self) -> list[Ended]:
        return [held.pending for held in self.by_id.values()]

    def hold(self, pending: Ended, now: float) -> None:
        """Keep an ended migration's slots until its write window closed (freed at once
        when it has by `now`)."""
        # IMPORTANT: a write granted for these slots may still land; handing them to
        # another prefix now could let it be overwritten.
        self.by_id[pending.migration_id] = QuarantinedSlots(pending, pending.root)
        if pending.write_window_end <= now:
            self.free_after_window(pending.migration_id)

    def due(self, now: float) -> list[str]:
        """The ids whose write window ended by `now`."""
        return [m for m, held in self.by_id.items() if held.pending.write_window_end <= now]

    def release(self, now: float) -> list[str]:
        """Free quarantined slots whose write window ended by `now`."""
        return [mid for mid in self.due(now) if self.free_after_window(mid)]

    def free_after_window(self, migration_id: str) -> bool:
        """Free a quarantined allocation whose write window closed once no stream that
        was open then is left (a TCP stream can outlive its batch's timeout: it is shut
        down here, and the engine closes it); False while one is."""
        held = self.by_id[migration_id]
        path = held.pending.path
        if held.streams is None:
            held.streams = path.open_write_streams()
        held.streams = path.close_write_streams(held.streams)
        if held.streams:
            return False
        self.free(migration_id)
        return True

    def free(self, migration_id: str) -> None:
        held = self.by_id.pop(migration_id)
        if held.root is sglang_adapter.cache_generation(self.cache):
            # (a reset already freed them otherwise)
            held.pending.path.release(held.pending.slots)

    def retake(self) -> None:
        """After a reset freed every slot: take the quarantined ones out again, under
        the new tree generation, until their write windows close."""
        generation = sglang_adapter.cache_generation(self.cache)
        for held in self.by_id.values():
            held.pending.path.retake(held.pending.slots)
            held.root = generation

    def free_unreachable(self) -> None:
        """Free at once the slots late writes cannot reach (a landing arena's), before the
        path drops what they lie in."""
        for mid, held in list(self.by_id.items()):
            if not held.pending.path.late_writes_reach_slots:
                self.free(mid)

    def free_all(self) -> None:
        for mid in list(self.by_id):
            self.free(mid)
