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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.wire import features
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

FEATURE = features.DESTINATION_DIGEST
# Distinct destinations remembered (one per target rank and KV memory generation; ~26 KB
# each for an 8B model), least recently used dropped first.
MAX_KNOWN = 64


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

    def __init__(self, limit: int = MAX_KNOWN):
        self.limit = limit
        self._by_digest: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # id() of each remembered description -> its digest: a description resolved
        # here (or deduplicated) is found again without hashing it (`digest_of`).
        self._digest_by_id: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._by_digest)

    def resolve(self, target: TransferRequestKVCacheTarget) -> None:
        """Fill in a device entry's `device_kv` from its `device_kv_digest`, or remember
        its full `device_kv` (replaced by the remembered copy when already known)."""
        if target.path != "device":
            return
        if target.device_kv_digest:
            wire = self._by_digest.get(target.device_kv_digest)
            if wire is None:
                raise UnknownDestination(target.device_kv_digest)
            self._by_digest.move_to_end(target.device_kv_digest)
            target.device_kv = wire
        elif target.device_kv:
            target.device_kv = self._remember(target.device_kv)

    def digest_of(self, descriptor: Any) -> str:
        """`grants.destination_digest(descriptor)`, without hashing a remembered one."""
        digest = self._digest_by_id.get(id(descriptor))
        if digest is not None and self._by_digest.get(digest) is descriptor:
            return digest
        return grants.destination_digest(descriptor)

    def clear(self) -> None:
        self._by_digest.clear()
        self._digest_by_id.clear()

    def _remember(self, wire: dict[str, Any]) -> dict[str, Any]:
        digest = grants.destination_digest(wire)  # BAD_REQUEST for one that is not JSON
        known = self._by_digest.get(digest)
        if known is not None:
            self._by_digest.move_to_end(digest)
            return known
        self._by_digest[digest] = wire
        self._digest_by_id[id(wire)] = digest
        while len(self._by_digest) > self.limit:
            _, dropped = self._by_digest.popitem(last=False)
            self._digest_by_id.pop(id(dropped), None)
        return wire
