"""Token ids as bytes on the wire (feature "binary_ids").

A JSON list of 32K token ids costs each trip that carries it a parse, a per-element type
and range check, and a pickle of 32K Python ints to the scheduler and back
(`benchmark/bench_control_plane.py`). Bodies of servers listing the feature may carry
`input_ids_u32` instead of `input_ids`: the ids as little-endian uint32, base64
(standard alphabet, padded). Every id of every vocabulary fits; a client sends the list
form for ids of 2**32 and above. The HTTP layer decodes the base64 and hands the bytes to
the scheduler, which makes the list once, when it takes the request up
(`unpack_request`). No dependency on SGLang: the client imports this module.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Any

FIELD = "input_ids_u32"
ITEM_BYTES = 4
_LIMIT = 1 << 32


def encode(ids: list[int]) -> str | None:
    """`ids` as the wire's base64 text; None when one cannot be sent this way (an id
    outside [0, 2**32)) or there is none: send the list then."""
    raw = to_bytes(ids)
    return base64.b64encode(raw).decode("ascii") if raw else None


def to_bytes(ids: list[int]) -> bytes:
    """`ids` as the little-endian uint32 bytes `encode` base64-encodes; b"" when one
    cannot be sent so (an id outside [0, 2**32)) or there is none."""
    import numpy as np

    if not ids:
        return b""
    try:
        array = np.array(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return b""
    if int(array.min()) < 0 or int(array.max()) >= _LIMIT:
        return b""
    return array.astype("<u4").tobytes()


def decode(text: str, max_ids: int) -> bytes:
    """The ids' bytes of a body's `input_ids_u32`; ValueError naming what is wrong.
    The text's length bounds the ids before anything is decoded."""
    if len(text) > 4 * -(-max_ids * ITEM_BYTES // 3):
        raise ValueError(f"more than {max_ids} ids")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"not base64: {e}") from None
    return check_bytes(raw, max_ids)


def check_bytes(raw: bytes, max_ids: int) -> bytes:
    """`raw` if it holds 1 to `max_ids` whole ids (decoded text, or a frame of bytes
    that came so); ValueError naming what is wrong."""
    if not raw:
        raise ValueError("no ids")
    if len(raw) % ITEM_BYTES:
        raise ValueError(f"{len(raw)} bytes are not whole {ITEM_BYTES}-byte ids")
    if len(raw) > max_ids * ITEM_BYTES:
        raise ValueError(f"more than {max_ids} ids")
    return raw


def count(raw: bytes) -> int:
    return len(raw) // ITEM_BYTES


def to_list(raw: bytes) -> list[int]:
    """The ids of `raw` (`decode` checked it; a trailing partial id is ignored, so this
    never raises on the scheduler thread)."""
    import numpy as np

    return np.frombuffer(raw, dtype="<u4", count=count(raw)).tolist()


def request_ids(req: Any, start: int, end: int) -> list[int]:
    """Ids `[start, end)` of a request, from its list or, before `unpack_request`, from
    the bytes it carries (only those ids are decoded); fewer when it has fewer."""
    if req.input_ids:
        return req.input_ids[start:end]
    raw = getattr(req, FIELD, b"") or raw_of(req)
    first, last = max(start, 0), min(max(end, 0), count(raw))
    if first >= last:
        return []
    return list(struct.unpack_from(f"<{last - first}I", raw, first * ITEM_BYTES))


_RAW = "_kvmig_ids_u32"  # in-process only: the bytes `unpack_request` made the list of


def unpack_request(req: Any) -> None:
    """Give a request that carries its ids as bytes its `input_ids` list (once: the wire
    field is emptied), on the scheduler thread before any handler reads it. The bytes
    stay on the request for `raw_of` (hashing them is cheaper than the list)."""
    raw = getattr(req, FIELD, b"")
    if raw:
        req.input_ids = to_list(raw)
        setattr(req, FIELD, b"")
        setattr(req, _RAW, raw)


def raw_of(req: Any) -> bytes:
    """The bytes a request's `input_ids` were made of (`unpack_request`), or b"" when
    they came as a list."""
    return getattr(req, _RAW, b"")
