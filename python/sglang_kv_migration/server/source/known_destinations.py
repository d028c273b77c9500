"""Feature "destination_digest": device-path destinations a source was sent, by digest.

A target rank's `device_kv` (its KV buffers exported through CUDA IPC: ~26 KB of JSON
for an 8B model's 64 buffers) stays the same for every migration to it until it
restarts or releases its KV memory, yet every transfer body carried it: the client
encoded it, the source's HTTP layer parsed and pickled it, its scheduler unpickled,
parsed and hashed it. A client that sent it once names it afterwards by the digest that
grants already bind (`grants.destination_digest`).

IMPORTANT: the source resolves a digest only among descriptions it was sent in full and
hashed itself, so a body can name no destination the source was not given; whether it
may write there is still decided by the grant, which binds the destination's digest.
A description is remembered only once a grant that names it verified (`remember`),
never from a body the source refused, and what is remembered is bounded in number
and in bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import orjson

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

if TYPE_CHECKING:
    from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput

# Distinct destinations remembered (one per target rank and KV memory generation; ~26 KB
# of JSON each for an 8B model's 64 buffers), least recently used dropped first ...
MAX_KNOWN = 64
# ... and their JSON bytes together (Python holds a parsed description in a few times
# that; a body's description is at most `wire.bodies.MAX_DEVICE_KV_BYTES`).
MAX_KNOWN_BYTES = 8 << 20


class UnknownDestination(MigrationError):
    """A digest this source does not hold the description of: the client sends it."""

    def __init__(self, digest: str):
        super().__init__(
            ErrorKind.CONFLICT,
            f"device_kv_digest {digest[:16]}... names no destination this source was sent: "
            "send device_kv in full",
        )


class KnownDestinations:
    """Device destinations by the digest this source computed over each."""

    def __init__(self, limit: int = MAX_KNOWN, max_bytes: int = MAX_KNOWN_BYTES):
        self.limit = limit
        self.max_bytes = max_bytes
        self.bytes = 0  # JSON bytes of the descriptions remembered
        # digest -> (description, its JSON bytes)
        self._by_digest: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        # id() of each remembered description -> its digest: a description resolved
        # here (or deduplicated) is found again without hashing it (`digest_of`).
        self._digest_by_id: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._by_digest)

    def resolve(self, target: TransferRequestKVCacheTarget) -> None:
        """Fill in a device entry's `device_kv` from its `device_kv_digest`. A full
        `device_kv` is left as it came (`remember` keeps it once a grant named it)."""
        if target.path != "device" or not target.device_kv_digest:
            return
        known = self._by_digest.get(target.device_kv_digest)
        if known is None:
            raise UnknownDestination(target.device_kv_digest)
        self._by_digest.move_to_end(target.device_kv_digest)
        target.device_kv = known[0]

    def remember(self, target: TransferRequestKVCacheTarget, digest: str) -> None:
        """Keep a device entry's `device_kv`, whose digest is `digest`, after a verified
        grant named that digest (the entry then holds the copy remembered before, if
        any). One over `max_bytes` by itself is not kept."""
        wire = target.device_kv
        if target.path != "device" or not wire:
            return
        known = self._by_digest.get(digest)
        if known is not None:
            self._by_digest.move_to_end(digest)
            target.device_kv = known[0]
            return
        size = len(orjson.dumps(wire))
        if size > self.max_bytes:
            return
        self._by_digest[digest] = (wire, size)
        self._digest_by_id[id(wire)] = digest
        self.bytes += size
        while len(self._by_digest) > self.limit or self.bytes > self.max_bytes:
            _, (dropped, dropped_size) = self._by_digest.popitem(last=False)
            self._digest_by_id.pop(id(dropped), None)
            self.bytes -= dropped_size

    def digest_of(self, descriptor: Any) -> str:
        """`grants.destination_digest(descriptor)`, without hashing a remembered one."""
        digest = self._digest_by_id.get(id(descriptor))
        if digest is not None:
            known = self._by_digest.get(digest)
            if known is not None and known[0] is descriptor:
                return digest
        return grants.destination_digest(descriptor)

    def clear(self) -> None:
        self._by_digest.clear()
        self._digest_by_id.clear()
        self.bytes = 0


def resolve_destinations(
    destinations: KnownDestinations | None, req: TransferRequestKVCacheReqInput
) -> None:
    """Feature "destination_digest": a device entry named by digest gets the
    description this source remembers (a full one is remembered by
    `TransferChecks.validate`, once its grant verified); `destinations` None: a source
    that does not offer the feature (a multi-rank one) refuses a digest."""
    if destinations is None:
        if any(t.device_kv_digest for t in req.target_per_rank):
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "device_kv_digest needs a single-rank source (TP 1, PP 1); send device_kv",
            )
        return
    for target in req.target_per_rank:
        destinations.resolve(target)
