"""The page lists a copy launch reads on the GPU, uploaded through buffers kept between
launches.

A launch needs its source and destination page ids on the device. Made afresh for every
launch (a pinned host tensor, then `.to(device)`), they went through torch's host and
device caching allocators each time, and after SGLang's cache flush (which empties
torch's device cache) the device tensor was a fresh `cudaMalloc`, which synchronizes the
device: the upload was ~0.3 ms of a one-page move's launch on an H200 (cProfile of a
scheduler rank). `PageListUpload` keeps one pinned host buffer and one device
buffer and reuses them once the last launch that read them is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

# The smallest kept buffers (int64 entries): two lists of 4K pages.
MIN_ENTRIES = 8192


class PageListUpload:
    """One device's kept upload buffers; used on one stream (the device path's)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        # The end event of the last launch that may read the kept buffers.
        self._busy_until: Any = None
        self.kept_uses = 0  # uploads through the kept buffers (tests, diagnostics)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """`values` (int64) on the device, copied on the current stream, which must be
        the stream of every launch that reads an upload. Call `used_until` with the
        launch's end event afterwards."""
        import torch

        n = int(values.size)
        busy = self._busy_until is not None and not self._busy_until.query()
        if busy:
            # The last launch may still read the kept buffers: a fresh pair for this one.
            staged = torch.empty(n, dtype=torch.int64, pin_memory=True)
            staged.numpy()[:] = values
            return staged.to(self.device, non_blocking=True)
        if self._host is None or self._host.numel() < n:
            size = max(MIN_ENTRIES, 1 << (n - 1).bit_length())
            # (The old pair, if any, is free: no launch in flight reads it.)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._device = torch.empty(size, dtype=torch.int64, device=self.device)
        assert self._device is not None
        self._host.numpy()[:n] = values
        on_device = self._device[:n]
        on_device.copy_(self._host[:n], non_blocking=True)
        self.kept_uses += 1
        return on_device

    def used_until(self, end_event: Any) -> None:
        """The launch that read the last upload ends with `end_event` (recorded on the
        same stream, so it also covers every earlier launch)."""
        self._busy_until = end_event
