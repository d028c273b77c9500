"""Target side: allocations waiting for /commit, /abort_transfer or the watchdog.

Life of a migration on the target (one `PendingMigration` per rank, same id everywhere):

    allocate ──> ALLOCATED ──commit──> COMMITTED   (pages become host-only radix nodes)
                     │──abort───> ABORTED     (slots freed, prefix unlocked)
                     └──watchdog─> EXPIRED     (same, after the timeout)

(and FLUSHED, WEIGHTS_CHANGED, RELEASED when the cache, the weights or the KV memory
change under it): the moments are `wire.moments.Moment`'s, the steps `ALLOCATION_STEPS`.

Every exit frees exactly what `allocate` took: the slots and the lock on the matched
prefix. Slots of an aborted, expired or weights-changed migration go back to the free
list only when no write to them can still land: at once if the source's receipt says it
settled (`settled=True`), else they sit in quarantine (`quarantine.py`) until the write
window has passed, released by `expire()`. Finished ids are remembered (bounded) so a
late or repeated call gets a precise answer: a second commit is harmless, a commit after
expiry is "gone".

A migration is pending only whole: `allocate` reserves the slots and locks the prefix,
asks the caller what it grants with them (`GrantTerms`), then registers it (or gives the
slots and the lock back when the grant could not be made).

Slots belong to a data path (`data_path.DataPath`): host-pool slots for the host path,
device KV slots for the device path; the state machine is the same for both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.cp_owners import OwnerRun
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import DataPath
from sglang_kv_migration.server.target.quarantine import Quarantine
from sglang_kv_migration.wire.moments import ALLOCATION_STEPS, Moment, step

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

logger = logging.getLogger(__name__)

# How many finished migration ids are remembered for precise late answers.
FINISHED_HISTORY = 4096


@dataclass
class PendingMigration:
    """One rank's in-flight allocation for a migration."""

    migration_id: str
    key: RadixKey  # page-aligned key of the whole prefix
    matched_length: int  # tokens the target already held, locked until the end
    anchor_lock: sglang_adapter.NodeLock  # on the node ending at matched_length
    root: object  # sglang_adapter.cache_generation() at allocation: a reset changes it
    path: DataPath  # owns the slots: reserve / release / insert
    slots: torch.Tensor  # int64 slots for tokens [matched_length, len(key))
    created_at: float  # on the registry's clock (time.monotonic by default)
    deadline: float  # after which the watchdog frees it
    weight_version: str = ""  # the target's weights when it allocated
    write_window_end: float = 0.0  # a source may write the slots until then (registry clock)
    verify: bool = False  # commit checks the receipt's content digest (opt-in verify)
    state: Moment = Moment.ALLOCATED

    @property
    def anchor(self) -> TreeNode:
        """The node ending at matched_length (locked until the migration ends)."""
        return self.anchor_lock.node

    staging: tuple[int, int] | None = None  # granted staging extent (target_staging.py)
    source: str = ""  # the source instance the grant names: receipts must come from it
    # `grants.grant_digest` of this rank's grant: a receipt settles or commits these slots
    # only if it names it (it comes from the request that claimed the grant). Kept in
    # quarantine with the slots and the source, so a repeated abort checks them too.
    grant: str = ""
    # Feature "source_dp_rank": the source DP rank the grant names (-1: none); a receipt
    # naming the grant counts only from that DP rank's scheduler (kept in quarantine too).
    source_dp_rank: int = -1
    # Feature "source_commit": (slot, nonce) of the mailbox slot the grant names, on the
    # mailbox's rank only (`mailbox_commits.py`).
    mailbox: tuple[int, bytes] | None = None
    # Owner-sharded CP (`cp_owners.py`): the owner of each reserved page, as the source
    # asked (None: not sharded); the grant binds it, verify digests this rank's own pages.
    owner_pattern: tuple[int, ...] | None = None
    # Token offsets (in `slots`) of the pages this rank owns and is written (None: all).
    owned_tokens: list[int] | None = None

    def written_slots(self, written: int) -> torch.Tensor:
        """The slots of the first `written` tokens that a source wrote on this rank: all
        of them, or on an owner-sharded server those of the pages this rank owns."""
        if self.owned_tokens is None:
            return self.slots[:written]
        import torch

        owned = [t for t in self.owned_tokens if t < written]
        return self.slots[torch.tensor(owned, dtype=torch.int64)]

    @property
    def extra_length(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class GrantTerms:
    """What the target grants with a migration's slots, kept with them until they go back
    (`allocations.py` makes it once the slots are reserved: `PendingMigrations.allocate`'s
    `grant`). The fields mean what `PendingMigration`'s of the same names do."""

    verify: bool = False
    staging: tuple[int, int] | None = None
    source: str = ""
    grant: str = ""
    source_dp_rank: int = -1
    mailbox: tuple[int, bytes] | None = None
    owned_tokens: list[int] | None = None


@dataclass(frozen=True)
class Allocation:
    """What `allocate` reports back."""

    migration_id: str
    matched_length: int
    extra_length: int
    slots: torch.Tensor  # int64 token slots reserved after the matched prefix
    # Owner-sharded CP: the owner of each reserved page (None: not sharded).
    owner_pattern: tuple[int, ...] | None = None

    @cached_property
    def host_slots(self) -> torch.Tensor:
        """The slots on the CPU (int64, contiguous), copied once for every use (the
        reply's index list, the grant's digest): a copy of device slots is a GPU sync."""
        import torch

        return self.slots.detach().to("cpu", torch.int64).contiguous()

    @property
    def kv_indices(self) -> list[int]:
        return self.host_slots.tolist()

    def kv_pages(self, page_size: int) -> list[int]:
        """The reserved slots as page ids (they are whole pages)."""
        return (self.host_slots[::page_size] // page_size).tolist()


@dataclass(frozen=True)
class _Finished:
    state: Moment
    matched_after_commit: int = 0


class PendingMigrations:
    """Registry of one rank's pending migrations over one `HiRadixCache`.

    Not tied to the scheduler: the caller serialises access with the tree (SGLang's
    scheduler thread does), and calls `expire()` periodically. An internal lock still
    guards the registry so a watchdog thread sharing `lock` cannot race the handlers.
    """

    def __init__(
        self,
        cache: HiRadixCache,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        lock: threading.RLock | None = None,
        release_staging: Callable[[tuple[int, int], float | None], None] | None = None,
        release_mailbox: Callable[[int, float | None], None] | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.cache = cache
        self.timeout_s = timeout_s
        self.clock = clock
        self.lock = lock or threading.RLock()
        # Read-only outside this class (the scheduler's idle check reads them directly).
        self.by_id: dict[str, PendingMigration] = {}  # allocated, not yet committed
        # Ended, slots not yet freed (`quarantine.py`).
        self.quarantine: Quarantine[PendingMigration] = Quarantine(cache)
        self._finished: OrderedDict[str, _Finished] = OrderedDict()
        # Gives a finished migration's staging extent back: (extent, not_before or None).
        self.release_staging = release_staging
        # Gives a finished migration's mailbox slot back: (slot, not_before or None).
        self.release_mailbox = release_mailbox

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        return len(self.by_id)

    def device_tokens_held(self) -> int:
        """Device slots reserved or quarantined (outside the tree and the free list)."""
        with self.lock:
            held = [*self.by_id.values(), *self.quarantine.allocations()]
            return sum(len(p.slots) for p in held if p.path.holds_device_slots)

    def release_quarantine(self, now: float | None = None) -> list[str]:
        """Free quarantined slots whose write window ended by `now` (default: the clock)."""
        with self.lock:
            return self.quarantine.release(self.clock() if now is None else now)

    def committable(self, migration_id: str, weight_version: str) -> bool:
        """True if a commit of this id would insert (not answer gone or repeat)."""
        pending = self.by_id.get(migration_id)
        return (
            pending is not None
            and pending.weight_version == weight_version
            and pending.root is sglang_adapter.cache_generation(self.cache)
        )

    def quarantined(self) -> int:
        """Migrations whose slots wait for their write window to close."""
        return len(self.quarantine)

    def get(self, migration_id: str) -> PendingMigration | None:
        return self.by_id.get(migration_id)

    def held(self, migration_id: str) -> PendingMigration | None:
        """The migration's allocation while its slots are out of the free list: pending,
        or ended and quarantined (what an abort's receipts are checked against)."""
        return self.by_id.get(migration_id) or self.quarantine.get(migration_id)

    def allocate(
        self,
        migration_id: str,
        input_ids: list[int],
        extra_key: str | None,
        expected_extra: int = 0,
        *,
        path: DataPath,
        nothing_ok: bool = False,
        weight_version: str = "",
        write_window_s: float = 0.0,
        owners: OwnerRun | None = None,
        grant: Callable[[Allocation], GrantTerms] | None = None,
    ) -> Allocation:
        """Lock the prefix this server holds (for `path`) and reserve slots for the rest.

        `expected_extra` > 0 must equal the number of tokens to allocate (else the
        target's cache changed since it was measured: CONFLICT). When the target already
        holds everything, `nothing_ok` returns an empty allocation (no id registered)
        instead of CONFLICT. The slots are `path`'s (the caller picks the path).
        `owners` (owner-sharded CP): the owner of every page of the key, checked by the
        caller; the pages reserved after the held prefix get theirs. `grant`: what the
        caller grants with the reserved slots, kept with them; when it raises, the slots
        and the lock go back and nothing is pending.
        """
        with self.lock:
            if migration_id in self.by_id or migration_id in self._finished:
                raise MigrationError(
                    ErrorKind.CONFLICT, f"migration id {migration_id!r} was already used"
                )
            key = sglang_adapter.make_key(self.cache, input_ids, extra_key)
            if len(key) == 0:
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    f"{len(input_ids)} input_ids are less than one page "
                    f"(page_size={self.cache.page_size}): only whole pages migrate",
                )
            held = path.held_prefix(input_ids, extra_key)
            extra = len(key) - held.length
            if extra <= 0 and nothing_ok:
                return Allocation(migration_id, held.length, 0, sglang_adapter.no_slots())
            if extra <= 0:
                raise MigrationError(
                    ErrorKind.CONFLICT,
                    f"target already holds all {len(key)} page-aligned tokens; nothing to migrate",
                )
            if expected_extra and expected_extra != extra:
                raise MigrationError(
                    ErrorKind.CONFLICT,
                    f"target now needs {extra} tokens after a held prefix of {held.length}, "
                    f"but {expected_extra} were expected; measure again",
                )
            # IMPORTANT: lock the matched prefix before allocating, because allocating
            # may evict host nodes to make room.
            run = self._owner_run(held.length, owners)
            anchor_lock = sglang_adapter.lock_node(self.cache, held.last_node)
            try:
                slots = path.reserve(extra) if run is None else path.reserve(extra, run)
            except BaseException:
                sglang_adapter.unlock_node(self.cache, anchor_lock)
                raise
            reserved = Allocation(
                migration_id=migration_id,
                matched_length=held.length,
                extra_length=extra,
                slots=slots,
                owner_pattern=run.pattern if run is not None else None,
            )
            try:
                terms = grant(reserved) if grant is not None else GrantTerms()
            except BaseException:
                path.release(slots)
                sglang_adapter.unlock_node(self.cache, anchor_lock)
                raise
            self.by_id[migration_id] = self._pending(
                reserved, terms, key, anchor_lock, path, weight_version, write_window_s
            )
            return reserved

    def _pending(
        self,
        reserved: Allocation,
        terms: GrantTerms,
        key: RadixKey,
        anchor_lock: sglang_adapter.NodeLock,
        path: DataPath,
        weight_version: str,
        write_window_s: float,
    ) -> PendingMigration:
        """The pending migration of a reservation and what was granted with it."""
        now = self.clock()
        return PendingMigration(
            migration_id=reserved.migration_id,
            key=key,
            matched_length=reserved.matched_length,
            anchor_lock=anchor_lock,
            root=sglang_adapter.cache_generation(self.cache),
            path=path,
            slots=reserved.slots,
            weight_version=weight_version,
            created_at=now,
            deadline=now + self.timeout_s,
            write_window_end=now + write_window_s,
            verify=terms.verify,
            staging=terms.staging,
            source=terms.source,
            grant=terms.grant,
            source_dp_rank=terms.source_dp_rank,
            mailbox=terms.mailbox,
            owner_pattern=reserved.owner_pattern,
            owned_tokens=terms.owned_tokens,
        )

    def _owner_run(self, held: int, owners: OwnerRun | None) -> OwnerRun | None:
        """The owners of the pages after the `held` tokens (None: not owner-sharded)."""
        if owners is None:
            return None
        first = held // int(self.cache.page_size)
        return OwnerRun(owners.function, owners.pattern[first:])

    def commit(
        self, migration_id: str, weight_version: str | None = None, written: int | None = None
    ) -> int:
        """Insert the written pages into the tree; returns the matchable length.

        A second commit of a committed id returns the same length and changes nothing.
        `weight_version` (the target's now) must equal the one at allocate: KV computed
        under other weights is dropped (GONE), never inserted. `written` (whole pages,
        default all): a partial transfer wrote only the first `written` slots; only they
        are inserted, the rest go back now (the source's receipts settled the grant,
        which it uses once).
        """
        with self.lock:
            pending = self.by_id.get(migration_id)
            if pending is None:
                finished = self._check_finished(migration_id, "commit")
                return finished.matched_after_commit
            self._forget_if_flushed(pending)
            if weight_version is not None and weight_version != pending.weight_version:
                self._release(pending, Moment.WEIGHTS_CHANGED)
                raise MigrationError(
                    ErrorKind.GONE,
                    f"migration {migration_id!r} was dropped: weight_version changed from "
                    f"{pending.weight_version!r} to {weight_version!r} since allocate",
                )
            key, slots = pending.key, pending.slots
            if written is not None and written < pending.extra_length:
                key, slots = key[: pending.matched_length + written], slots[:written]
            # On failure the migration stays pending, unchanged (abort or the watchdog
            # frees it; the same receipts can commit again).
            if len(slots):
                already_present = pending.path.insert(
                    pending.anchor, key, pending.matched_length, slots
                )
                if already_present:
                    # A concurrent insert covered part of the range first: its nodes stay,
                    # our copies of those tokens are surplus.
                    pending.path.release(slots[:already_present])
            if len(slots) < pending.extra_length:
                # A partial transfer's unwritten slots go back at once: no write can reach
                # them (the grant was used, and its receipts say the write is over).
                pending.path.release(pending.slots[len(slots) :])
            sglang_adapter.unlock_node(self.cache, pending.anchor_lock)
            # The whole key is in the tree now (the locked anchor, then what was just
            # inserted or found present): no second radix walk over it (at page size 1
            # SGLang's match is a Python loop over every token).
            matched_after = len(key)
            self._finish(pending, Moment.COMMITTED, matched_after)
            return matched_after

    def abort(self, migration_id: str, settled: bool = False) -> None:
        """Release the allocation now (its slots quarantined unless `settled`). Aborting an
        aborted id again is harmless (rollback paths may repeat it), and with `settled`
        frees a quarantine at once; an expired, committed or unknown id is an error."""
        with self.lock:
            pending = self.by_id.get(migration_id)
            if pending is None:
                self._check_finished(migration_id, "abort")
                if settled and migration_id in self.quarantine:
                    self.quarantine.free(migration_id)
                return
            self._forget_if_flushed(pending)
            self._release(pending, Moment.ABORTED, settled)

    def due(self, now: float | None = None) -> list[str]:
        """Pending ids past their deadline and quarantined ids past their write window."""
        with self.lock:
            now = self.clock() if now is None else now
            expired = [p.migration_id for p in self.by_id.values() if p.deadline <= now]
            return expired + self.quarantine.due(now)

    def expire(self, migration_ids: list[str] | None = None) -> list[str]:
        """Watchdog: free the given pending ids (default: those `due()`); returns them.

        Ids that are no longer pending are skipped, so ranks can expire a union of ids.
        """
        with self.lock:
            ids = self.due() if migration_ids is None else migration_ids
            for mid in ids:
                if mid in self.quarantine:  # (its window closed: `due`, or stage 0's)
                    self.quarantine.free_after_window(mid)
            expired = [self.by_id[i] for i in ids if i in self.by_id]
            now = self.clock()
            for pending in expired:
                if pending.root is not sglang_adapter.cache_generation(self.cache):
                    self._finish(pending, Moment.FLUSHED)
                    continue
                logger.warning(
                    "KV migration %s %s after %.1fs without commit; freeing %d slots",
                    pending.migration_id,
                    Moment.EXPIRED,
                    now - pending.created_at,
                    pending.extra_length,
                )
                self._release(pending, Moment.EXPIRED)
            return [p.migration_id for p in expired]

    def drop_for_new_weights(self, migration_ids: list[str]) -> list[str]:
        """The target is about to load new weights: drop these pending ids (a later
        commit answers "gone"; their slots are quarantined as for an abort without
        receipts). Unknown ids are skipped; returns those dropped."""
        with self.lock:
            dropped = [self.by_id[i] for i in migration_ids if i in self.by_id]
            for pending in dropped:
                self._end(pending, Moment.WEIGHTS_CHANGED)
            return [p.migration_id for p in dropped]

    def prepare_for_reset(self) -> list[str]:
        """Before the cache is reset: drop every pending migration (state FLUSHED) and
        keep the slots whose write window is still open in quarantine. Returns the ids."""
        with self.lock:
            self.expire(self.quarantine.due(self.clock()))
            dropped = list(self.by_id.values())
            for pending in dropped:
                self._release(pending, Moment.FLUSHED)
            return [p.migration_id for p in dropped]

    def prepare_for_release(self) -> list[str]:
        """Before the KV cache memory is released (`/release_memory_occupation`): drop
        every pending migration (state RELEASED: a later commit answers "gone"). Slots
        that late writes cannot reach (a landing arena's) are freed at once, quarantine
        included, so nothing refers to the arena the path is about to drop; the others
        wait in quarantine as for a flush. Returns the dropped ids."""
        with self.lock:
            dropped = list(self.by_id.values())
            for pending in dropped:
                settled = not pending.path.late_writes_reach_slots
                self._release(pending, Moment.RELEASED, settled=settled)
            self.quarantine.free_unreachable()
            return [p.migration_id for p in dropped]

    def after_reset(self) -> None:
        """After the reset freed every slot: take the quarantined ones out again, under
        the new tree generation, until their write windows close."""
        with self.lock:
            self.quarantine.retake()

    def abort_all(self, state: Moment = Moment.ABORTED) -> list[str]:
        """Free everything, quarantine included: at shutdown, or with FLUSHED before the
        cache is reset (the caller makes sure no write window is open)."""
        with self.lock:
            dropped = list(self.by_id.values())
            for pending in dropped:
                self._end(pending, state, settled=True)
            self.quarantine.free_all()
            return [p.migration_id for p in dropped]

    # ------------------------------------------------------------------ helpers

    def _end(self, pending: PendingMigration, state: Moment, settled: bool = False) -> None:
        """End a pending migration as `state`; one allocated before a reset only has its
        entry forgotten (FLUSHED: the reset freed its slots and unlocked its nodes)."""
        if pending.root is not sglang_adapter.cache_generation(self.cache):
            self._finish(pending, Moment.FLUSHED)
        else:
            self._release(pending, state, settled)

    def _release(self, pending: PendingMigration, state: Moment, settled: bool = False) -> None:
        sglang_adapter.unlock_node(self.cache, pending.anchor_lock)
        self._finish(pending, state, settled=settled)
        if settled:
            pending.path.release(pending.slots)
            return
        self.quarantine.hold(pending, self.clock())

    def _finish(
        self,
        pending: PendingMigration,
        state: Moment,
        matched_after: int = 0,
        settled: bool = False,
    ) -> None:
        step(ALLOCATION_STEPS, pending.state, state)  # ends once, from ALLOCATED
        # IMPORTANT: like the slots, an extent or mailbox slot a granted write may still
        # reach is reused only after the write window (a commit saw every write complete).
        late = state is not Moment.COMMITTED and not settled
        not_before = pending.write_window_end if late else None
        if pending.staging is not None and self.release_staging is not None:
            self.release_staging(pending.staging, not_before)
            pending.staging = None
        if pending.mailbox is not None and self.release_mailbox is not None:
            self.release_mailbox(pending.mailbox[0], not_before)
            pending.mailbox = None
        pending.state = state
        del self.by_id[pending.migration_id]
        self._finished[pending.migration_id] = _Finished(state, matched_after)
        while len(self._finished) > FINISHED_HISTORY:
            self._finished.popitem(last=False)

    def _forget_if_flushed(self, pending: PendingMigration) -> None:
        """A reset replaced the tree and cleared the host pool: there is nothing left to
        free or unlock, only the entry to forget."""
        if pending.root is not sglang_adapter.cache_generation(self.cache):
            self._finish(pending, Moment.FLUSHED)
            self._check_finished(pending.migration_id, "commit")

    def _check_finished(self, migration_id: str, action: str) -> _Finished:
        """Answer for an id that is not pending: harmless repeat or a precise error."""
        finished = self._finished.get(migration_id)
        return _finished_answer(finished, migration_id, action, self.timeout_s)


def _finished_answer(
    finished: _Finished | None, migration_id: str, action: str, timeout_s: float
) -> _Finished:
    """`finished` when `action` repeats how it ended (harmless), else a precise error."""
    if finished is None:
        raise MigrationError(ErrorKind.NOT_FOUND, f"unknown migration id {migration_id!r}")
    if finished.state is Moment.FLUSHED:
        raise MigrationError(
            ErrorKind.GONE,
            f"migration {migration_id!r} was dropped: the cache was flushed (for example "
            "after a weight update) before it was committed",
        )
    if finished.state is Moment.WEIGHTS_CHANGED:
        raise MigrationError(
            ErrorKind.GONE,
            f"migration {migration_id!r} was dropped: the target's weights changed "
            "before it was committed",
        )
    if finished.state is Moment.RELEASED:
        raise MigrationError(
            ErrorKind.GONE,
            f"migration {migration_id!r} was dropped: the target released its KV cache "
            "memory (/release_memory_occupation) before it was committed; migrate again "
            "after /resume_memory_occupation",
        )
    if finished.state is Moment.EXPIRED:
        raise MigrationError(
            ErrorKind.GONE,
            f"migration {migration_id!r} expired after the {timeout_s:g}s watchdog "
            "timeout; its slots were freed",
        )
    repeat_ok = {"commit": Moment.COMMITTED, "abort": Moment.ABORTED}
    if finished.state is repeat_ok[action]:
        return finished
    raise MigrationError(
        ErrorKind.CONFLICT,
        f"cannot {action} migration {migration_id!r}: it was already {finished.state.value}",
    )
