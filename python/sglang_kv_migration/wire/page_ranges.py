"""Page lists as runs: `[first_page, count]` pairs instead of one id per page.

An allocation's slots travel from the target (allocate reply) through the client to the
source (transfer body). As a page list that is one JSON int per page, parsed, validated,
pickled and unpickled on every hop: 32K ids for a 32K-token prefix at page size 1. A fresh
pool hands out consecutive pages, so the same slots are usually one run: `[[0, 32768]]`.
A fragmented pool degrades to one pair per page, twice the ints of a page list, and no
worse in kind. Both sides convert in numpy, without a Python loop per page.

Invariants: runs are in prefix order (the k-th page of the allocation is the k-th page
the runs enumerate); `count >= 1`; adjacent runs are not merged across a gap, so the
expansion is exactly the allocation's page sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def to_page_ranges(slots: torch.Tensor, page_size: int) -> list[list[int]]:
    """The runs of consecutive page ids of `slots` (int64 token slots of whole pages, in
    order), as `[first_page, count]` pairs."""
    import numpy as np
    import torch

    # On the CPU (device-path slots live on the GPU: callers that copied them already
    # pass the copy), then in numpy: this runs on the scheduler thread at every allocate,
    # and torch's per-op overhead made a two-token allocation's runs cost 0.2 ms.
    pages = slots[::page_size].to("cpu", torch.int64).numpy() // page_size
    if len(pages) == 0:
        return []
    # A run starts where a page does not follow its predecessor.
    breaks = np.flatnonzero(pages[1:] != pages[:-1] + 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return np.stack([pages[starts], ends - starts], axis=1).tolist()


def pages_from_ranges(ranges: list[list[int]]) -> torch.Tensor:
    """The int64 page ids the runs enumerate, in order. Raises ValueError for a pair that
    is not `[first >= 0, count >= 1]`."""
    import numpy as np
    import torch

    if not ranges:
        return torch.empty(0, dtype=torch.int64)
    if any(len(pair) != 2 for pair in ranges):
        raise ValueError("each page range must be [first_page, count]")
    # numpy, not torch: this runs on the scheduler thread for every transfer, and each
    # torch op on a few ints costs tens of microseconds there (profiled on an H200).
    table = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    firsts, counts = table[:, 0], table[:, 1]
    if firsts.min() < 0 or counts.min() < 1:
        raise ValueError("page ranges need first_page >= 0 and count >= 1")
    if len(ranges) == 1:  # the usual case: a fresh pool hands out one run
        return torch.from_numpy(np.arange(firsts[0], firsts[0] + counts[0], dtype=np.int64))
    # Page k of run r is firsts[r] + (k - offset[r]), where offset[r] is the number of
    # pages before run r: one arange plus a per-run shift, no loop over runs.
    offsets = np.cumsum(counts) - counts
    pages = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(firsts - offsets, counts)
    return torch.from_numpy(pages)


def slots_from_pages(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The int64 token slots of whole pages `pages`, in order (`to_page_ranges` takes
    them back to runs)."""
    import numpy as np
    import torch

    if page_size == 1:
        return pages
    if pages.device.type == "cpu":  # numpy: one op instead of four (scheduler thread)
        slots = pages.numpy()[:, None] * page_size + np.arange(page_size, dtype=np.int64)
        return torch.from_numpy(slots.reshape(-1))
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)


def count_pages(ranges: list[list[int]]) -> int:
    """Pages the runs enumerate (the pairs are assumed well-formed)."""
    return sum(pair[1] for pair in ranges)
