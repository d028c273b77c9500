"""At most as many entries in flight to a peer as Mooncake has TCP lanes (streams) to it.

Mooncake (0.3.13) over TCP runs one entry per lane, `MC_TCP_LANES_PER_PEER` lanes per
peer (default 4), and queues the entries beyond them; a queued entry leaves later on
whichever lane frees up, reconnected if need be. An entry whose write timed out stays in
that queue: when a cut link comes back it leaves on a stream opened after the target shut
down the streams it knew of, and lands in slots the target may have handed out again
(docs/reliability.md, late writes). So the transport never hands the engine more entries
for one peer than the peer has lanes: each entry takes a permit when it is submitted and
gives it back only once the engine reports it final (done or failed). An entry a write
gave up on (timed out) keeps its permit in the `Reaper` until the engine is done with it,
so an entry submitted later never queues behind it either. Then every entry in flight is
on a lane's stream, which the target's shut-down covers.

Only TCP: RDMA has no lanes (`MooncakeTransport` passes no budget there).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

# Mooncake's TCP transport: lanes per peer by default, and the most it accepts.
MOONCAKE_DEFAULT_LANES = 4
MOONCAKE_MAX_LANES = 16
# How often the reaper asks the engine about the entries it holds.
_REAP_INTERVAL_S = 0.01


def tcp_lanes_per_peer(environ: Mapping[str, str] = os.environ) -> int:
    """The lanes per peer Mooncake's TCP transport starts with under `environ`.

    Read as Mooncake reads it (the newer variable first, then the deprecated one). A
    value it would refuse is taken as the smaller of what Mooncake might do instead
    (fall back to its default, or clamp): too few permits only slow writes down, too
    many would let entries queue."""
    raw = environ.get("MC_TCP_LANES_PER_PEER")
    if raw is None:
        raw = environ.get("MC_TCP_MAX_CONNECTIONS_PER_PEER")
    if raw is None:
        return MOONCAKE_DEFAULT_LANES
    text = raw.strip()
    if not text.isdigit():
        return MOONCAKE_DEFAULT_LANES
    value = int(text)
    if value < 1:
        return 1
    if value > MOONCAKE_MAX_LANES:
        return MOONCAKE_DEFAULT_LANES
    return value


class LaneBudget:
    """Per-peer permits, one per lane, shared by every worker writing to that peer."""

    def __init__(self, lanes: int):
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.lanes = lanes
        self._changed = threading.Condition()
        self._taken: dict[str, int] = {}

    def take(self, peer: str, wanted: int) -> int:
        """Take up to `wanted` free permits for `peer` without waiting; returns how many."""
        with self._changed:
            taken = self._taken.get(peer, 0)
            granted = max(0, min(wanted, self.lanes - taken))
            self._taken[peer] = taken + granted
            return granted

    def give_back(self, peer: str, count: int = 1) -> None:
        with self._changed:
            left = self._taken.get(peer, 0) - count
            if left < 0:
                raise RuntimeError(f"more permits given back for {peer} than taken")
            if left:
                self._taken[peer] = left
            else:
                self._taken.pop(peer, None)
            self._changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        """Sleep until a permit comes back or `timeout` seconds pass."""
        with self._changed:
            self._changed.wait(max(0.0, timeout))

    def taken(self, peer: str) -> int:
        with self._changed:
            return self._taken.get(peer, 0)


class Reaper:
    """Holds the permits of entries a write gave up on until the engine reports them final.

    `check_status` is the engine's `transfer_check_status` for a one-entry batch (1 done,
    -1 failed: both final, and they free the batch; anything else: still in the engine),
    or None once the engine is gone. One daemon thread, alive while it holds entries."""

    def __init__(self, budget: LaneBudget, check_status: Callable[[], Callable[[int], int] | None]):
        self._budget = budget
        self._check_status = check_status
        self._lock = threading.Lock()
        self._held: list[tuple[str, int]] = []  # (peer, batch id)
        self._thread: threading.Thread | None = None

    def adopt(self, peer: str, batch_ids: list[int]) -> None:
        if not batch_ids:
            return
        with self._lock:
            self._held.extend((peer, batch_id) for batch_id in batch_ids)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kv-migration-lane-reaper", daemon=True
                )
                self._thread.start()

    def held(self, peer: str) -> int:
        with self._lock:
            return sum(1 for p, _ in self._held if p == peer)

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._held)
                if not held:
                    self._thread = None
                    return
            check = self._check_status()
            if check is None:  # the engine is gone, and every stream of it with it
                with self._lock:
                    self._held = []
                    self._thread = None
                return
            final = [(peer, batch_id) for peer, batch_id in held if check(batch_id) in (1, -1)]
            if final:
                with self._lock:
                    self._held = [entry for entry in self._held if entry not in final]
                for peer, _batch_id in final:
                    self._budget.give_back(peer)
                logger.info("%d timed-out entries settled in the engine", len(final))
            time.sleep(_REAP_INTERVAL_S)
