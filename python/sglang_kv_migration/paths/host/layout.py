"""Host KV pool layout math: which bytes move when pages migrate between two host pools.

Every supported HiCache host pool is one contiguous tensor (``pool.kv_buffer``) that we
describe as a list of *buffers*. Each buffer is a contiguous byte region with an
``item_len`` (bytes per token slot in that buffer) such that the bytes of a whole page that
starts at page-aligned slot ``t`` are exactly ``[t * item_len, (t + page_size) * item_len)``
inside that buffer. Shapes below are those of ``init_kv_buffer`` in SGLang 0.5.12
(``L`` layers on this rank, ``H`` KV heads, ``D`` head dim, ``C`` MLA cache dim,
``s`` dtype itemsize, ``size = page_num * page_size`` slots):

=======  ==================  ===============================  =========  ============
attn     host layout         kv_buffer dims                   buffers    item_len
=======  ==================  ===============================  =========  ============
MHA      layer_first         (2, L, size, H, D)               2L (K0..,  H*D*s
                                                              then V0..)
MHA      page_first          (2, size, L, H, D)               2 (K, V)   L*H*D*s
MHA      page_first_direct   (2, page_num, L, page_size, H,   2 (K, V)   L*H*D*s
                             D)
MHA      page_head           (2, page_num, H, page_size, L,   2 (K, V)   L*H*D*s
                             D)
MLA      layer_first         (L, size, 1, C)                  L          C*s
MLA      page_first          (size, L, 1, C)                  1          L*C*s
MLA      page_first_direct   (page_num, L, page_size, 1, C)   1          L*C*s
=======  ==================  ===============================  =========  ============

In ``page_first_direct`` and ``page_head`` a whole page is contiguous but single tokens are
not, so the formula only holds for whole pages. The protocol only ever moves whole pages,
and `page_runs` enforces that for every layout. Any other layout (e.g. Ascend's
``page_first_kv_split``) is refused with an error naming it. An NSA model's host pool
group adds the indexer's buffers after these (`layout_nsa.py`).

Everything here is pure integer math on published buffer info (no engine, no
torch.distributed), so both servers compute identical plans and tests use literal addresses.
SGLang's pool objects are read by `sglang_adapter.host_pool_buffer` only;
`HostPoolLayout.from_host_pool` is the shorthand that calls it.
The layout fingerprint peers compare first lives in `fingerprint.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths.host.layout_nsa import indexer_host_buffers

if TYPE_CHECKING:
    import torch

    HostIndices = Sequence[int] | torch.Tensor
else:
    HostIndices = Any

# Supported host layouts per attention kind -> whether each layer is its own buffer
# (layer_first) or all layers of a slot sit together (the page_first family).
_PER_LAYER_BUFFERS = {
    "mha": {
        "layer_first": True,
        "page_first": False,
        "page_first_direct": False,
        "page_head": False,
    },
    "mla": {"layer_first": True, "page_first": False, "page_first_direct": False},
}
# Separate planes in kv_buffer's first dim: K and V for MHA, one latent cache for MLA.
_KV_PLANES = {"mha": 2, "mla": 1}


# --------------------------------------------------------------------------------------
# Buffers of one host pool
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostBuffer:
    """One contiguous byte region of a host pool; slot ``t`` starts at ``ptr + t * item_len``."""

    ptr: int
    length: int
    item_len: int

    def __post_init__(self) -> None:
        for name in ("ptr", "length", "item_len"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"HostBuffer.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Write:
    """One contiguous copy from a source address to a peer address (the transport's
    ``WriteOp``)."""

    src_addr: int
    dst_addr: int
    length: int


@dataclass(frozen=True)
class HostPoolLayout:
    """A host pool as buffers of ``num_slots`` token slots each (see the module docstring)."""

    buffers: tuple[HostBuffer, ...]
    page_size: int
    num_slots: int

    def __post_init__(self) -> None:
        if not self.buffers:
            raise ValueError("a host pool layout needs at least one buffer")
        if not _is_int(self.page_size) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not _is_int(self.num_slots) or self.num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {self.num_slots!r}")
        if self.num_slots % self.page_size:
            raise ValueError(
                f"num_slots={self.num_slots} is not a multiple of page_size={self.page_size}"
            )
        for i, buf in enumerate(self.buffers):
            if buf.length % buf.item_len:
                raise ValueError(
                    f"buffer {i}: item_len={buf.item_len} does not divide length={buf.length}"
                )
            # Every buffer holds one item per slot; anything else means the published info
            # does not describe the pool we think it does.
            if buf.length != self.num_slots * buf.item_len:
                raise ValueError(
                    f"buffer {i}: length={buf.length} != num_slots={self.num_slots} * "
                    f"item_len={buf.item_len}"
                )

    # What /get_transfer_session_info publishes per rank.
    @property
    def data_ptrs(self) -> list[int]:
        return [b.ptr for b in self.buffers]

    @property
    def data_lens(self) -> list[int]:
        return [b.length for b in self.buffers]

    @property
    def item_lens(self) -> list[int]:
        return [b.item_len for b in self.buffers]

    @classmethod
    def from_published(
        cls,
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: Sequence[int],
        page_size: int,
        num_slots: int | None = None,
    ) -> HostPoolLayout:
        """Rebuild a peer's layout from its session info; raises ValueError if inconsistent.

        ``num_slots`` defaults to what the first buffer holds; every buffer must then hold
        the same number of slots (checked on construction).
        """
        if not len(data_ptrs) == len(data_lens) == len(item_lens):
            raise ValueError(
                f"published buffer lists differ in length: data_ptrs={len(data_ptrs)} "
                f"data_lens={len(data_lens)} item_lens={len(item_lens)}"
            )
        buffers = tuple(
            HostBuffer(ptr=p, length=n, item_len=i)
            for p, n, i in zip(data_ptrs, data_lens, item_lens, strict=True)
        )
        if num_slots is None and buffers:
            num_slots = buffers[0].length // buffers[0].item_len
        return cls(buffers=buffers, page_size=page_size, num_slots=num_slots)

    @classmethod
    def from_contiguous_buffer(
        cls,
        *,
        attention: str,
        host_layout: str,
        base_ptr: int,
        nbytes: int,
        layer_num: int,
        page_size: int,
        num_slots: int,
    ) -> HostPoolLayout:
        """Split one contiguous kv_buffer of ``nbytes`` at ``base_ptr`` per the table above."""
        layouts = _PER_LAYER_BUFFERS.get(attention)
        if layouts is None:
            raise ValueError(f"unknown attention kind {attention!r} (expected 'mha' or 'mla')")
        per_layer = layouts.get(host_layout)
        if per_layer is None:
            raise ValueError(
                f"host layout {host_layout!r} is not supported for {attention.upper()} KV "
                f"migration (supported: {', '.join(sorted(layouts))})"
            )
        num_buffers = _KV_PLANES[attention] * (layer_num if per_layer else 1)
        if nbytes % (num_buffers * num_slots):
            raise ValueError(
                f"{attention}/{host_layout}: kv_buffer of {nbytes} bytes does not split into "
                f"{num_buffers} buffers of {num_slots} slots"
            )
        buf_len = nbytes // num_buffers
        item_len = buf_len // num_slots
        buffers = tuple(
            HostBuffer(ptr=base_ptr + i * buf_len, length=buf_len, item_len=item_len)
            for i in range(num_buffers)
        )
        return cls(buffers=buffers, page_size=page_size, num_slots=num_slots)

    @classmethod
    def from_pool_buffer(cls, pool: sglang_adapter.HostPoolBuffer) -> HostPoolLayout:
        """Describe a host pool from what `sglang_adapter.host_pool_buffer` read of it."""
        layout = cls.from_contiguous_buffer(
            attention=pool.attention,
            host_layout=pool.layout,
            base_ptr=pool.base_ptr,
            nbytes=pool.nbytes,
            layer_num=pool.layer_num,
            page_size=pool.page_size,
            num_slots=pool.num_slots,
        )
        # Cross-check the byte split against the pool's own dimensions.
        if pool.nbytes != pool.num_slots * pool.slot_bytes:
            raise ValueError(
                f"{pool.attention}/{pool.layout}: kv_buffer has {pool.nbytes} bytes, expected "
                f"{pool.num_slots} slots * {pool.slot_bytes} bytes"
            )
        return layout

    @classmethod
    def from_host_pool(cls, pool: Any) -> HostPoolLayout:
        """Describe a live ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, or an NSA
        model's ``HostPoolGroup``: the KV pool's buffers, then the indexer's
        (`layout_nsa.py`), all at the same slots."""
        layout = cls.from_pool_buffer(sglang_adapter.host_pool_buffer(pool))
        indexer = sglang_adapter.indexer_host_pool(pool)
        if indexer is None:
            return layout
        extra = indexer_host_buffers(sglang_adapter.indexer_pool_buffer(indexer))
        return cls(
            buffers=layout.buffers + tuple(HostBuffer(p, n, i) for p, n, i in extra),
            page_size=layout.page_size,
            num_slots=layout.num_slots,
        )


# --------------------------------------------------------------------------------------
# Slot indices -> runs -> byte ranges -> writes
# --------------------------------------------------------------------------------------


def page_runs(host_indices: HostIndices, page_size: int) -> list[tuple[int, int]]:
    """Check that ``host_indices`` are whole pages and coalesce them into runs.

    Each page must be ``page_size`` consecutive slots starting at a multiple of
    ``page_size``. Returns ``(first_slot, num_slots)`` per run of consecutive pages, in the
    order given. Raises ValueError naming the first bad position.
    """
    if not _is_int(page_size) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    torch = sys.modules.get("torch")
    # Without torch loaded there can be no tensor, so plain sequences never need torch.
    if torch is not None and isinstance(host_indices, torch.Tensor):
        return _page_runs_tensor(host_indices, page_size)
    return _page_runs_list([int(x) for x in host_indices], page_size)


def buffer_byte_ranges(
    layout: HostPoolLayout, host_indices: HostIndices
) -> list[tuple[int, int, int]]:
    """``(buffer_index, byte_offset, byte_length)`` for every buffer x run, buffer-major."""
    runs = page_runs(host_indices, layout.page_size)
    for first, count in runs:
        _check_slots_in_pool(layout, first, count, "host_indices")
    return [
        (b, first * buf.item_len, count * buf.item_len)
        for b, buf in enumerate(layout.buffers)
        for first, count in runs
    ]


def plan_writes(
    src: HostPoolLayout,
    src_indices: HostIndices,
    dst: HostPoolLayout,
    dst_indices: HostIndices,
) -> list[Write]:
    """Absolute writes copying src slot ``i`` to dst slot ``i`` for every buffer.

    Runs are split wherever either side stops being contiguous, so each write is one
    contiguous range on both sides. Raises ValueError if the layouts are incompatible, the
    counts differ, or a slot lies outside its pool.
    """
    _check_compatible(src, dst)
    src_runs = page_runs(src_indices, src.page_size)
    dst_runs = page_runs(dst_indices, dst.page_size)
    src_total = sum(n for _, n in src_runs)
    dst_total = sum(n for _, n in dst_runs)
    if src_total != dst_total:
        raise ValueError(f"slot counts differ: source={src_total} target={dst_total}")
    pieces = _zip_runs(src_runs, dst_runs)
    for s, d, n in pieces:
        _check_slots_in_pool(src, s, n, "source")
        _check_slots_in_pool(dst, d, n, "target")
    return [
        Write(
            src_addr=sb.ptr + s * sb.item_len,
            dst_addr=db.ptr + d * db.item_len,
            length=n * sb.item_len,
        )
        for sb, db in zip(src.buffers, dst.buffers, strict=True)
        for s, d, n in pieces
    ]


# --------------------------------------------------------------------------------------
# Private helpers
# --------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_page_message(pos: int, slot: int, page_pos: int, page_slot: int, page_size: int) -> str:
    if pos == page_pos:
        return (
            f"host_indices[{pos}]={slot} does not start a page "
            f"(page_size={page_size}); only whole pages can migrate"
        )
    return (
        f"host_indices[{pos}]={slot}, expected {page_slot + pos - page_pos}: the page starting "
        f"at host_indices[{page_pos}]={page_slot} must be {page_size} consecutive slots"
    )


def _check_length(n: int, page_size: int) -> None:
    if n % page_size:
        raise ValueError(
            f"{n} host indices is not a multiple of page_size={page_size}; "
            "only whole pages can migrate"
        )


def _page_runs_list(idx: list[int], page_size: int) -> list[tuple[int, int]]:
    _check_length(len(idx), page_size)
    runs: list[list[int]] = []
    for p in range(0, len(idx), page_size):
        t = idx[p]
        if t < 0 or t % page_size:
            raise ValueError(_bad_page_message(p, t, p, t, page_size))
        # Slice comparison keeps the per-slot check in C; locate the culprit only on failure.
        if idx[p : p + page_size] != list(range(t, t + page_size)):
            j = next(j for j in range(p, p + page_size) if idx[j] != t + j - p)
            raise ValueError(_bad_page_message(j, idx[j], p, t, page_size))
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1][1] += page_size
        else:
            runs.append([t, page_size])
    return [(first, count) for first, count in runs]


def _page_runs_tensor(indices: torch.Tensor, page_size: int) -> list[tuple[int, int]]:
    import torch

    x = indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    n = x.numel()
    _check_length(n, page_size)
    if n == 0:
        return []
    starts = x[::page_size]
    expected = starts.repeat_interleave(page_size) + torch.arange(n) % page_size
    bad = x != expected
    bad[::page_size] |= (starts < 0) | (starts % page_size != 0)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        p = j - j % page_size
        raise ValueError(_bad_page_message(j, int(x[j]), p, int(x[p]), page_size))
    # A new run begins at page 0 and wherever a page does not follow its predecessor.
    new_run = torch.ones(starts.numel(), dtype=torch.bool)
    new_run[1:] = starts[1:] != starts[:-1] + page_size
    run_pages = new_run.nonzero().reshape(-1)
    lengths = torch.diff(run_pages, append=torch.tensor([starts.numel()])) * page_size
    return list(zip(starts[run_pages].tolist(), lengths.tolist(), strict=True))


def _zip_runs(
    src_runs: list[tuple[int, int]], dst_runs: list[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """Pair two equally long run lists into ``(src_slot, dst_slot, count)`` pieces.

    Both inputs are maximal runs, so every piece boundary breaks contiguity on at least one
    side and the pieces need no further coalescing.
    """
    pieces: list[tuple[int, int, int]] = []
    si = di = 0
    s_first, s_left = src_runs[0] if src_runs else (0, 0)
    d_first, d_left = dst_runs[0] if dst_runs else (0, 0)
    while si < len(src_runs) and di < len(dst_runs):
        n = min(s_left, d_left)
        pieces.append((s_first, d_first, n))
        s_first, s_left = s_first + n, s_left - n
        d_first, d_left = d_first + n, d_left - n
        if s_left == 0:
            si += 1
            if si < len(src_runs):
                s_first, s_left = src_runs[si]
        if d_left == 0:
            di += 1
            if di < len(dst_runs):
                d_first, d_left = dst_runs[di]
    return pieces


def _check_compatible(src: HostPoolLayout, dst: HostPoolLayout) -> None:
    if src.page_size != dst.page_size:
        raise ValueError(f"page_size: source={src.page_size} target={dst.page_size}")
    if len(src.buffers) != len(dst.buffers):
        raise ValueError(f"number of buffers: source={len(src.buffers)} target={len(dst.buffers)}")
    for i, (s, d) in enumerate(zip(src.buffers, dst.buffers, strict=True)):
        if s.item_len != d.item_len:
            raise ValueError(f"item_len of buffer {i}: source={s.item_len} target={d.item_len}")


def _check_slots_in_pool(layout: HostPoolLayout, first: int, count: int, side: str) -> None:
    # Buffers hold exactly num_slots items (checked at construction), so this bounds every
    # byte range of every buffer too.
    if first + count > layout.num_slots:
        raise ValueError(
            f"{side} slots [{first}, {first + count}) lie outside the host pool of "
            f"{layout.num_slots} slots"
        )
