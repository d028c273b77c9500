"""One rank's send of a tiered source (`tier_source.py`): launched once the destination
is open, done when its copy's end event has completed; the source's prefix stays pinned
until `release`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.errors import ErrorKind, MigrationError, detached
from sglang_kv_migration.paths import verify
from sglang_kv_migration.paths.base import ROUTE_LANDING, KVPoll, SendJob, SendStats
from sglang_kv_migration.paths.device.tier_copies import launch_error

if TYPE_CHECKING:
    from sglang_kv_migration.paths.device.source_prefix import TierPin

logger = logging.getLogger(__name__)


class TierSendJob(SendJob):
    """See the module docstring. `tier_routes`: the route (`paths/base.py`) each source
    tier's bytes take into this path's destination."""

    def __init__(self, pin: TierPin, tier_routes: Mapping[str, str] | None = None):
        self._pin: TierPin | None = pin
        self._tier_routes = dict(tier_routes or {})
        self._start: Any = None
        self._end: Any = None
        self._opening: Future[Any] | None = None
        self._launch: Callable[[], None] | None = None
        self.stats = SendStats()
        # verify: (per-buffer page views, pages) in prefix order, hashed once copied.
        self.digest_pieces: list[tuple[list[Any], Any]] | None = None
        self._digest: Future[str] | None = None
        self._tier_events: dict[str, tuple[Any, Any]] = {}
        self.tier_bytes: dict[str, int] = {}  # bytes read from each source tier
        self.into_landing = False  # the target is a landing arena (memory saver)
        self.first_into_mapping = False  # the first copy into a kept peer mapping
        self.cold_tiers: frozenset[str] = frozenset()  # tiers whose kernel ran first here
        # Launched with other sends (`TierSource.launching_together`): the bytes of the
        # whole launch per tier, so this send's share of its events' time is known.
        self._group_tier_bytes: dict[str, int] | None = None
        self._queued = False  # waiting for the end of a `launching_together` block
        self._launch_error: MigrationError | None = None

    def launch_when(self, opening: Future[Any], launch: Callable[[], None]) -> None:
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
        # The destination is opened on a helper thread (a peer's buffers mapped through
        # CUDA IPC, a peer's host pool mapped and registered), each step giving the GIL
        # up and waiting for it back.
        return self._end is None and self._opening is not None and not self._opening.done()

    @property
    def completion_event(self) -> Any:
        # Launched and not verified: only the copy is left (a verify digest runs on a
        # helper thread afterwards).
        if self._end is None or self.error is not None or self.digest_pieces is not None:
            return None
        return self._end

    def poll_launch(self) -> bool:
        """Launch once the destination is open; True once launched. Raises what the
        launch does."""
        if self._end is None:
            if self._launch_error is not None:
                raise self._launch_error
            if self._queued or self._opening is None or not self._opening.done():
                return False
            assert self._launch is not None
            try:
                self._launch()
            except Exception as e:  # e.g. the open failed: CUDA refused the handle
                raise launch_error(e) from e
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
                # The pages stay pinned (unchanged) until `release`; hash them off the
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
        self._account()
        return KVPoll.SUCCESS

    def _account(self) -> None:
        """The copy's time and its routes' (bytes, seconds), from its events."""
        self.stats.seconds = self._start.elapsed_time(self._end) / 1e3 * self._share()
        for tier, (start, end) in self._tier_events.items():
            self.stats.steps[f"copy_{tier}"] = start.elapsed_time(end) / 1e3 * self._share(tier)
        # A tier whose kernel ran first in this launch (`cold_tiers`) is no sample.
        self.stats.routes = {
            self._tier_routes[tier]: (nbytes, self.stats.steps.get(f"copy_{tier}", 0.0))
            for tier, nbytes in self.tier_bytes.items()
            if nbytes and tier not in self.cold_tiers and tier in self._tier_routes
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
