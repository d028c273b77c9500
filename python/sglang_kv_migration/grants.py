"""Write grants and completion receipts: what a source may write, and proof that it did.

The data plane has no authentication of its own (anyone who reaches a Mooncake port or
holds a CUDA IPC handle can write the registered memory), and the client that relays
slot lists between servers is not trusted either. So:

- at allocate, the target binds each rank's reserved slots to the migration id, the data
  path and a deadline, and hands out a **grant** for them;
- the source writes only what a grant it can verify names (same migration, rank, path,
  exactly these slots, not expired, not used before); anything else is refused with 403
  before a byte moves. One grant, one claim, per source server: each scheduler process
  refuses a replay (`UsedGrants`), and a server with DP ranks lets only one of them
  claim each grant (`server/http/grant_claims.py`; a grant may name that DP rank,
  `Grant.source_dp_rank`);
- the source answers every transfer with a **receipt** per rank (success or not, bytes,
  the slots' digest, whether no write of it can still land, and — when the grant asked
  for verification — a digest of the bytes it sent, `verify.py`); `/commit` inserts only
  with a success receipt for every rank, and `/abort_transfer` frees slots at once only
  with a receipt saying no write can land — otherwise they stay quarantined until the
  grant's deadline plus the transfer timeout has passed.

Grants and receipts are signed with HMAC-SHA256 under a key all servers share
(`--kv-migration-grant-key`, else derived from `--admin-api-key`). Never from `--api-key`:
every client of `/generate` holds that one, and a key a client holds cannot stop a client
forging a grant. Without either key they are **unsigned**: still bound to the migration,
the exact slots and the deadline — which stops a buggy or confused client — but anyone can
forge one, so a hostile client or peer is not stopped. Servers log a warning then.

Tokens are `base64url(JSON payload) "." hex(HMAC)`, plain data: nothing is unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any

import orjson
import xxhash

from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    import torch

_KEY_CONTEXT = b"sglang-kv-migration grant key\x00"
# Grants used by this source (for replay refusal), remembered until they expire.
MAX_REMEMBERED_GRANTS = 1 << 16


def derive_key(grant_key: str | None, admin_api_key: str | None) -> bytes | None:
    """The shared signing key, or None when no secret is configured (unsigned tokens).
    Only secrets no inference client holds: never the `--api-key` of `/generate`."""
    secret = grant_key or admin_api_key
    if not secret:
        return None
    return hashlib.sha256(_KEY_CONTEXT + secret.encode()).digest()


def tokens_digest(input_ids: list[int], extra_key: str | None) -> str:
    """xxh64 of a prefix's token ids (int64, little-endian) and namespace: the KV a
    grant's slots will hold. The bytes are those of older servers (numpy int64); `struct`
    packs a list of ints in about half of numpy's time (0.35 vs 0.6 ms at 32K ids), and
    every grant is hashed once on each side."""
    return _tokens_hash(struct.pack(f"<{len(input_ids)}q", *input_ids), extra_key)


def tokens_digest_u32(raw: bytes, extra_key: str | None) -> str:
    """`tokens_digest` of the ids in `raw` (little-endian uint32, `binary_ids`), without
    making a list of them first."""
    import numpy as np

    ids = np.frombuffer(raw, dtype="<u4", count=len(raw) // 4).astype("<i8")
    return _tokens_hash(ids.tobytes(), extra_key)


def _tokens_hash(int64_ids: bytes, extra_key: str | None) -> str:
    """The one definition of the tokens digest: the ids as int64 little-endian, a NUL,
    the namespace."""
    h = xxhash.xxh64(int64_ids)
    h.update(b"\x00" + (extra_key or "").encode())
    return h.hexdigest()


def request_tokens_digest(req: Any, end: int) -> str:
    """`tokens_digest` of a request's first `end` ids (`input_ids`, `extra_key`), from
    the bytes they came as when they did (`binary_ids.raw_of`)."""
    from sglang_kv_migration.wire import binary_ids

    raw = binary_ids.raw_of(req)
    if len(raw) >= end * binary_ids.ITEM_BYTES:
        return tokens_digest_u32(raw[: end * binary_ids.ITEM_BYTES], req.extra_key)
    return tokens_digest(req.input_ids[:end], req.extra_key)


def destination_digest(descriptor: Any) -> str:
    """sha256 of a data path's destination descriptor (`DataPath.destination_of`), as
    canonical JSON: what the target published and what a transfer body names hash the
    same exactly when they are the same. BAD_REQUEST for a descriptor that is not JSON."""
    try:
        canonical = orjson.dumps(descriptor, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise MigrationError(ErrorKind.BAD_REQUEST, f"bad destination description: {e}") from None
    return hashlib.sha256(canonical).hexdigest()


def grant_digest(raw: str) -> str:
    """What a receipt names of the grant its transfer claimed: sha256 of the token."""
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def slots_digest(slots: torch.Tensor) -> str:
    """xxh64 of the int64 token slots, in order."""
    import torch

    if not (slots.device.type == "cpu" and slots.dtype == torch.int64 and slots.is_contiguous()):
        slots = slots.detach().to("cpu", torch.int64).contiguous()
    # Hashed through the buffer protocol: the same bytes, without a copy.
    return xxhash.xxh64(slots.numpy()).hexdigest()


@dataclass(frozen=True)
class Grant:
    """Permission for one source rank to write `num_tokens` slots of one migration."""

    migration_id: str
    tp: int
    pp: int
    path: str
    slots_digest: str
    num_tokens: int
    expires_at: float  # unix time; the source starts no write after it
    tokens_digest: str  # the whole prefix (tokens + extra_key) the slots are for
    # Optional: the target's staging extent the source may write instead of the slots
    # (`target_staging.py`); optional, like the fields below it (see `_decode`).
    staging_addr: int = 0
    staging_length: int = 0
    # Unix time after which the source submits no more bytes (0: expires_at plus its own
    # transfer timeout). Below the target's write window, so a freed slot gets no late write.
    write_until: float = 0.0
    verify: bool = False  # the target will check a content digest: the receipt carries one
    # `destination_digest` of what the target rank published for this path: the source
    # writes only there (host: session and buffers; device: the IPC buffer description).
    # Empty in grants of servers that predate it: this version's sources refuse those.
    destination: str = ""
    # The source server the grant was issued to (its session info `instance_id`, passed
    # at allocate as `source_instance`); a source refuses a grant naming another one, or
    # none, so one grant is used by one source.
    source: str = ""
    # Where the source hands its receipts to the target after the copy (`mailbox.py`,
    # feature "source_commit"): "name/slot/nonce" of the target's mailbox; in rank 0's
    # grant only, when the allocate asked for `source_commit`.
    mailbox: str = ""
    # Owner-sharded CP (`cp_owners.py`): `cp_owners.pattern_digest` of the owners of the
    # granted pages, as the target allocated them. The source sends only if its own
    # pattern of the run digests the same, then only the pages its rank owns.
    owners: str = ""
    # Feature "source_dp_rank": the DP rank of the source server whose scheduler may
    # claim the grant (the allocate's `source_dp_rank`, from the source's size query);
    # -1 (left out of the token): any one of them, the server's claim ledger picking one.
    source_dp_rank: int = -1

    @property
    def staging(self) -> tuple[int, int] | None:
        return (self.staging_addr, self.staging_length) if self.staging_length else None


@dataclass(frozen=True)
class Receipt:
    """A source rank's account of one transfer."""

    migration_id: str
    tp: int
    pp: int
    path: str
    slots_digest: str
    success: bool
    bytes: int
    # No write under the grant can land any more: this transfer claimed it and its
    # writes are over (done, or never started). Never set by a request that did not
    # claim the grant (a replay, no grant, another source's): it cannot know.
    settled: bool
    # Optional: how the source shaped the write ("staged": into the granted staging extent,
    # which the target must scatter before commit); set only when staging was granted.
    plan: str = ""
    digest: str = ""  # verify.py's digest of the pages sent, when the grant asked for it
    source: str = ""  # the sending server's instance id: the target takes its grant's only
    # Tokens written, from the grant's first slot, when fewer than the grant names (a
    # partial transfer: the source held less); -1, left out of the token: all of them.
    tokens: int = -1
    # `grant_digest` of the grant this transfer claimed (its first and only use on this
    # source); empty when the request claimed none (refused before its grant verified).
    # Only a receipt naming the target's own grant can settle its slots.
    grant: str = ""
    # The DP rank of the source scheduler that claimed the grant, as it knows itself; set
    # only when the grant names one (`Grant.source_dp_rank`: a target that understands
    # it), and the target takes a receipt naming its grant only from that DP rank.
    dp_rank: int = -1


class Signer:
    """Encodes and checks grants and receipts under one key (or unsigned without one)."""

    def __init__(self, key: bytes | None, clock: Callable[[], float] = time.time):
        self.key = key
        self.clock = clock

    @property
    def signed(self) -> bool:
        return self.key is not None

    def encode(self, token: Grant | Receipt) -> str:
        # Every field is a scalar: a shallow dict is what `asdict` (which deep-copies
        # each value) would give, at a fraction of the cost on the scheduler thread.
        data = {f.name: getattr(token, f.name) for f in fields(token)}
        # Optional fields at their default are left out: such a token reads the same as
        # one from a server that predates them.
        for f in fields(token):
            if f.default is not MISSING and data[f.name] == f.default:
                del data[f.name]
        payload = base64.urlsafe_b64encode(orjson.dumps({"kind": type(token).__name__, **data}))
        return payload.decode() + "." + self._mac(payload)

    def decode_grant(self, raw: str) -> Grant:
        return self._decode(raw, Grant)

    def decode_receipt(self, raw: str) -> Receipt:
        return self._decode(raw, Receipt)

    def check_grant(
        self,
        raw: str,
        *,
        migration_id: str,
        tp: int,
        pp: int,
        path: str,
        num_slots: int,
        slots: str,
        tokens: str,
        staging: tuple[int, int] | None = None,
        destination: str = "",
        source: str = "",
        dp_rank: int = 0,
    ) -> Grant:
        """The grant, if it names exactly this write and has not expired; else FORBIDDEN.
        `slots` is `slots_digest` of the target slots named in the request and `tokens`
        `tokens_digest` of the prefix the source is about to send; `staging` the
        ``(addr, length)`` extent the request asks to write instead of the slots, which the
        grant must name exactly; `destination` the `destination_digest` of where the
        request asks to write, `source` this source server's instance id and `dp_rank`
        the DP rank of the scheduler that checks it."""
        grant = self.decode_grant(raw)
        if not grant.source:
            raise _forbidden(
                "grant names no source (allocate without source_instance, or a target that "
                "predates source binding): no source may use it"
            )
        if grant.source != source:
            raise _forbidden("grant was issued to another source server")
        if grant.source_dp_rank >= 0 and grant.source_dp_rank != dp_rank:
            raise _forbidden(
                f"grant is for DP rank {grant.source_dp_rank} of the source, not DP rank "
                f"{dp_rank} (send the transfer with dp_rank {grant.source_dp_rank})"
            )
        if not grant.destination:
            raise _forbidden("grant names no destination (a target that predates it)")
        if grant.destination != destination:
            raise _forbidden(
                "grant is for another destination: session_id, host buffers or device_kv "
                "differ from what the target published"
            )
        if grant.tokens_digest != tokens:
            raise _forbidden("grant is for another prefix (input_ids / extra_key differ)")
        expected = {"migration_id": migration_id, "tp": tp, "pp": pp, "path": path}
        for name, value in expected.items():
            if getattr(grant, name) != value:
                raise _forbidden(f"grant is for {name}={getattr(grant, name)!r}, not {value!r}")
        if grant.num_tokens != num_slots or grant.slots_digest != slots:
            raise _forbidden("grant does not name these target slots")
        if staging is not None and grant.staging != staging:
            raise _forbidden(f"grant does not name the staging extent {list(staging)}")
        if grant.expires_at <= self.clock():
            raise _forbidden("grant expired")
        return grant

    # ------------------------------------------------------------------ helpers

    def _mac(self, payload: bytes) -> str:
        if self.key is None:
            return ""
        return hmac.new(self.key, payload, hashlib.sha256).hexdigest()

    def _decode(self, raw: str, kind: type) -> Any:
        name = kind.__name__.lower()
        # ASCII only: `hmac.compare_digest` raises on other strings, and a token is ASCII.
        if not isinstance(raw, str) or not raw.isascii() or raw.count(".") != 1:
            raise _forbidden(f"malformed {name}")
        payload, mac = raw.split(".")
        if not hmac.compare_digest(mac, self._mac(payload.encode())):
            what = "signature does not verify" if self.signed else "signed, but no key here"
            raise _forbidden(f"{name} {what}")
        try:
            data = orjson.loads(base64.urlsafe_b64decode(payload.encode()))
        except (ValueError, orjson.JSONDecodeError) as e:  # binascii.Error is a ValueError
            raise _forbidden(f"malformed {name}: {e}") from None
        problem = _payload_problem(data, kind)
        if problem is not None:
            raise _forbidden(f"malformed {name}: {problem}")
        del data["kind"]
        return kind(**data)


# A token field's annotation -> the JSON values it accepts (bool is not an int here).
_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


def _payload_problem(data: Any, kind: type) -> str | None:
    """Why a decoded payload is not a `kind` token (None when it is): a JSON object with
    its `kind`, every required field, no unknown one, each of its declared type. Fields
    with a default were added later: a token from an older server lacks them."""
    if not isinstance(data, dict):
        return f"payload is a JSON {type(data).__name__}, not an object"
    if data.get("kind") != kind.__name__:
        return "wrong kind"
    declared = {f.name: f for f in fields(kind)}
    given = set(data) - {"kind"}
    required = {n for n, f in declared.items() if f.default is MISSING}
    if not required <= given <= set(declared):
        unknown = sorted(given - set(declared))
        return f"wrong fields (missing {sorted(required - given)}, unknown {unknown})"
    for name in given:
        if not _FIELD_CHECKS[str(declared[name].type)](data[name]):
            return f"{name} must be {declared[name].type}, got {type(data[name]).__name__}"
    return None


class UsedGrants:
    """Grants a source scheduler process already acted on, until they expire: a replay
    is refused. One process's guard: the DP ranks of a server, each with its own, agree
    through the server's HTTP layer (`server/http/grant_claims.py`)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._used: OrderedDict[tuple[str, int, int], float] = OrderedDict()
        self.clock = clock

    def claim(self, grant: Grant) -> None:
        now = self.clock()
        while self._used and (
            next(iter(self._used.values())) <= now or len(self._used) >= MAX_REMEMBERED_GRANTS
        ):
            self._used.popitem(last=False)
        key = (grant.migration_id, grant.tp, grant.pp)
        if key in self._used:
            raise _forbidden("grant was already used (replay)")
        self._used[key] = grant.expires_at


def _forbidden(message: str) -> MigrationError:
    return MigrationError(ErrorKind.FORBIDDEN, f"write refused: {message}; nothing was written")
