"""Scatter a staged write into the reserved slots while it is still arriving.

A source writing a granted staging extent writes, after each chunk has landed, how many
bytes of the extent are complete (a little-endian int64 in the extent's last 8 bytes,
`staging.MARKER_BYTES` reserved for it). One daemon thread per rank watches the extents
of pending staged migrations and copies every completed page into its slot as soon as the
marker covers it, so at commit only the last chunk (or, from a source that writes no
markers, everything) is left to copy: the scatter overlaps the wire instead of following
it.

Rules:
- Nothing here runs on the scheduler thread except `track`, `finish` and `cancel`, which
  are O(1) (`cancel` waits for at most one step of `step_bytes` of copying).
- The thread sleeps `POLL_S` between looks while something is tracked and blocks
  otherwise: no core spins while waiting for the wire.
- A marker is untrusted input: it is clamped to the extent, and only whole pages below it
  are copied, into this migration's own reserved slots (which a commit inserts only with
  the source's success receipt). After `cancel` returns, no copy into those slots runs.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_kv_migration.paths.host.staging import page_ids, scatter_range, staged_size

if TYPE_CHECKING:
    import torch

    from sglang_kv_migration.paths.host.layout import HostPoolLayout

logger = logging.getLogger(__name__)

POLL_S = 0.001
DEFAULT_STEP_BYTES = 16 << 20  # copied per step: bounds how long `cancel` may wait


@dataclass
class _Track:
    extent: tuple[int, int]
    slots: Any  # int64 token slots; validated into `pages` on the thread
    pages: torch.Tensor | None = None
    total: int = 0
    done: int = 0  # staging bytes already copied (always a page boundary)
    finish: Future[None] | None = None  # set by `finish`: copy the rest, then resolve
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def marker_word(extent: tuple[int, int]) -> ctypes.c_int64:
    """The extent's progress marker (its last 8 bytes)."""
    addr, length = extent
    return ctypes.c_int64.from_address(addr + length - 8)


class ProgressiveScatterer:
    """Copies staged pages into their slots as the source's markers say they landed."""

    def __init__(self, layout: HostPoolLayout, step_bytes: int = DEFAULT_STEP_BYTES):
        self.layout = layout
        page_bytes = max(layout.page_size * b.item_len for b in layout.buffers)
        self._step = max(step_bytes, page_bytes)
        self._tracks: dict[int, _Track] = {}  # by extent address
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.early_bytes = 0  # copied before the commit asked (tests, benchmarks)
        self._thread = threading.Thread(
            target=self._run, name="kv-migration-staging-watcher", daemon=True
        )
        self._thread.start()

    def track(self, extent: tuple[int, int], slots: Any) -> None:
        """Start watching a freshly granted extent (its marker must read 0)."""
        with self._lock:
            self._tracks[extent[0]] = _Track(extent, slots)
        self._wake.set()

    def finish(self, extent: tuple[int, int], slots: Any) -> Future[None]:
        """Copy whatever is not copied yet (the source said everything landed); the
        Future resolves once every page is in its slot."""
        future: Future[None] = Future()
        with self._lock:
            track = self._tracks.get(extent[0])
            if track is None:  # not tracked (e.g. granted before a restart of tracking)
                track = self._tracks[extent[0]] = _Track(extent, slots)
            track.finish = future
        self._wake.set()
        return future

    def cancel(self, extent: tuple[int, int]) -> None:
        """Stop copying into this extent's slots; returns once no copy of it runs."""
        with self._lock:
            track = self._tracks.pop(extent[0], None)
        if track is None:
            return
        with track.lock:  # waits for a step in progress (at most `step_bytes`)
            track.cancelled = True
            if track.finish is not None and not track.finish.done():
                track.finish.set_exception(RuntimeError("staged scatter cancelled"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tracks, self._tracks = list(self._tracks.values()), {}
        self._wake.set()
        for track in tracks:
            with track.lock:
                track.cancelled = True
        self._thread.join(5.0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        import torch

        torch.set_num_threads(1)  # per thread under OpenMP: the scheduler's keep theirs
        while True:
            with self._lock:
                if self._closed:
                    return
                tracks = list(self._tracks.values())
            progressed = False
            for track in tracks:
                progressed |= self._step_once(track)
            if not progressed:
                self._wake.wait(POLL_S if tracks else None)
                self._wake.clear()

    def _step_once(self, track: _Track) -> bool:
        """Copy up to one step of newly landed pages; resolve a finished track."""
        with track.lock:
            if track.cancelled:
                return False
            try:
                if track.pages is None:
                    track.pages = page_ids(self.layout, track.slots, "target")
                    track.total = staged_size(self.layout, track.pages)
                    if track.total > track.extent[1] - 8:
                        raise ValueError(
                            f"staging extent of {track.extent[1]} bytes cannot hold "
                            f"{track.total} bytes and its marker"
                        )
                if track.finish is not None:
                    target = track.total
                else:
                    target = min(max(marker_word(track.extent).value, 0), track.total)
                progressed = False
                if target > track.done:
                    hi = min(target, track.done + self._step)
                    covered = scatter_range(
                        self.layout, track.extent[0], track.pages, track.done, hi
                    )
                    if track.finish is None:
                        self.early_bytes += covered - track.done
                    progressed = covered > track.done
                    track.done = covered
                if track.finish is not None and track.done >= track.total:
                    track.finish.set_result(None)
                    self._forget(track)
                return progressed
            except Exception as e:  # a bug or bad indices: fail the commit, keep the thread
                logger.exception("staged scatter into %d slots failed", len(track.slots))
                if track.finish is not None:
                    track.finish.set_exception(e)
                # Forgotten: a later `finish` starts over and reports the error then.
                track.cancelled = True
                self._forget(track)
                return False

    def _forget(self, track: _Track) -> None:
        with self._lock:
            if self._tracks.get(track.extent[0]) is track:
                del self._tracks[track.extent[0]]
