"""The request and reply models of the six routes, written once.

One `...Request` / `...Reply` dataclass pair per operation. Every reply derives from
`Reply`: `success`, `message`, `error_kind` (an `errors.ErrorKind` value, so the HTTP
layer can pick the status code), `steps_ms` and `trace`. `server/messages.py` makes each
of them an SGLang request (`BaseReq`) for the trip HTTP layer -> scheduler ranks; the
JSON a route answers is `reply_content` of the reply, and `bodies.py` validates what a
body may say.

Field names follow the public contract of the design note (`input_ids`, `extra_key`,
`matched_token_size`, `extra_token_size`, `kv_indices`, `target_per_rank`,
`matched_after_commit`, ...). Per-rank data is a list with one entry per (tp, pp) rank,
gathered on the replying rank. Plain-data fields only: the server pickles them between
processes, and the client reads them without SGLang.

Input validation happens once, in `bodies.py`, wherever a body arrives (the routes, the
allocate channel); the scheduler handlers trust these objects. A request is built from
its body's fields by name (`bodies.body_fields`), so the two forms declare the same
fields with the same types, optionality and defaults, and differ only where a pair says
why (the server's own fields, the ids' bytes): `test/unit/test_wire_forms.py` checks
them field by field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal

from sglang_kv_migration.wire import features
from sglang_kv_migration.wire.host_fields import HostFields

# Optional wire features every server of this version lists (`features.py`).
WIRE_FEATURES = features.ALWAYS

# The data paths a body may name (protocol 2), and how an allocate reply lists its slots.
PathName = Literal["host", "device", "shared_host"]
IndexFormat = Literal["tokens", "pages", "ranges"]


@dataclass
class Reply:
    """What every reply says. On the wire (`reply_content`): `success`, the reply's own
    fields, these four, then the fields later features added (`ADDED_LATER`)."""

    success: bool
    message: str = ""
    error_kind: str = ""
    # Where the trip spent its time, ms (`server/diag/trace.py`); informational.
    steps_ms: dict = field(default_factory=dict)
    trace: dict = field(default_factory=dict)  # raw stamps; never leaves the server

    ADDED_LATER: ClassVar[tuple[str, ...]] = ()


# --------------------------------------------------------------------------- PP stages


@dataclass
class StageRefusal:
    """Set on a request by a PP stage that refused it. SGLang hands the very request
    objects a stage processed on to the next stage, so later stages see it and refuse
    too, without touching their trees: all stages stay identical (`pp_stages.py`)."""

    message: str
    error_kind: str


# --------------------------------------------------------------------------- session info


@dataclass
class RankSessionInfo(HostFields):
    """One rank's endpoints: the host path's fields (`HostFields`; empty without the host
    path) at top level (protocol 1), and every data path's advertisement under `paths`,
    in this server's order of preference."""

    tp_rank: int
    pp_rank: int
    page_size: int
    fingerprint: dict  # fingerprint.LayoutFingerprint.to_dict()
    # Protocol 2: path name -> DataPath.advertise(); e.g. {"device": {...}, "host": {...}}.
    paths: dict = field(default_factory=dict)
    server_epoch: str = ""  # changes when the server restarts: cached session info is stale
    # Staging (optional; target_staging.py): this rank writes granted staging extents as a
    # source, and the [addr, length] of its own staging arena as a target (empty: none).
    stage_writer: bool = False
    staging_region: list[int] = field(default_factory=list)
    # Feature "dp_ranks": the data-parallel rank this scheduler rank belongs to (each DP
    # rank has its own tree and pools; `server/http/dp_ranks.py`).
    dp_rank: int = 0


@dataclass
class SessionInfoRequest:
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    dp_rank: int | None = None  # set by the HTTP layer: the DP rank asked (None: every one)


@dataclass
class SessionInfoReply(Reply):
    ranks: list[RankSessionInfo] = field(default_factory=list)
    protocol_version: int = 0
    server_epoch: str = ""
    ADDED_LATER = ("features", "instance_id", "allocate_channel", "dp_size")
    # Optional wire features this server understands beyond its protocol version; a
    # client uses one only when both servers list it (older servers list none).
    features: list[str] = field(default_factory=lambda: list(WIRE_FEATURES))
    # This server's identity as a source: pass it to the target's allocate as
    # `source_instance`, and only this server may write under the grant (changes on
    # a restart, like server_epoch).
    instance_id: str = ""
    # Feature "source_allocate": a source on this host may allocate here directly
    # (`server/same_host/allocate_channel.py`: address, secret, host); empty when it may not.
    allocate_channel: dict = field(default_factory=dict)
    # Feature "dp_ranks": how many DP ranks `ranks[]` spans (`--dp-size`).
    dp_size: int = 1


# --------------------------------------------------------------------------- extra size


@dataclass
class ExtraTokenSizeRequest:
    # Empty when the body sent `input_ids_u32` (the scheduler fills it in).
    input_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    # The ids as little-endian uint32 (feature "binary_ids"): the scheduler turns them
    # into `input_ids` when it takes the request up (`binary_ids.unpack_request`).
    input_ids_u32: bytes = b""
    # Also report `host_headroom_tokens` (a walk of the tree: asked for only by planners).
    headroom: bool = False
    # Feature "dp_ranks": the DP rank to ask (None: every one; the reply names the one
    # holding the longest prefix).
    dp_rank: int | None = None
    # Feature "running_slots": also say how much of `input_ids` the running request of
    # this rid holds in its own slots (`running_token_size`).
    running_rid: str = ""


@dataclass
class ExtraTokenSizeReply(Reply):
    matched_token_size: int = 0  # page-aligned prefix this server holds (device or host)
    extra_token_size: int = 0  # page-aligned tokens of input_ids it does not hold
    total_token_size: int = 0  # page-aligned length of input_ids
    device_token_size: int = 0  # the part of matched_token_size held on device
    # With `headroom`: host slots a host-path allocate could claim now (free plus
    # evictable host-only pages); -1 when not asked.
    host_headroom_tokens: int = -1
    server_epoch: str = ""
    # Feature "dp_ranks": the DP rank that holds `matched_token_size` (None on a server
    # with one DP rank), and how many requests run or wait there (its load).
    dp_rank: int | None = None
    dp_load: int = 0
    # Feature "running_slots", with `running_rid`: the page-aligned prefix of `input_ids`
    # that request holds in its own slots (-1: it does not run here).
    running_token_size: int = -1
    ADDED_LATER = ("page_owners",)
    # Feature "owner_pattern", from an owner-sharded CP server only: the CP rank owning
    # each page of the part of the prefix it holds on device, in prefix order (None
    # otherwise); what the caller passes on to the target's allocate.
    page_owners: list[int] | None = None


# --------------------------------------------------------------------------- allocate


@dataclass
class AllocateRequest:
    # Empty when the body sent `input_ids_u32` (the scheduler fills it in).
    input_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    # What the caller expects to move; the target refuses (conflict) if its own match
    # changed since /get_request_extra_token_size. 0: take whatever is missing.
    extra_token_size: int = 0
    migration_id: str = ""  # minted once by the HTTP layer, shared by every rank
    # The source's fingerprints, one per rank; each target rank checks its counterpart.
    source_fingerprints: list[dict[str, Any]] = field(default_factory=list)
    path: PathName = "host"  # data path whose slots to reserve (protocol 2)
    # "tokens": kv_indices in the reply; "pages": kv_pages; "ranges": kv_page_ranges
    index_format: IndexFormat = "tokens"
    nothing_ok: bool = False  # target holds everything: success with nothing allocated
    verify: bool = False  # grant asks the source for a content digest; commit checks it
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    # The source can write a staging extent (its session info says `stage_writer`): grant
    # one where the reserved slots are fragmented (host path; `target_staging.py`).
    staging: bool = False
    # The source server's session info `instance_id`: the grant binds it (feature
    # "bound_grants"). Without it the grant names no source, and no source uses it.
    source_instance: str = ""
    stage_refusal: StageRefusal | None = None  # set by an earlier PP stage
    input_ids_u32: bytes = b""  # feature "binary_ids", as for the size query
    # Feature "source_commit": the source hands its receipts to this server's mailbox
    # and this server commits by itself, with no /commit trip (`server/same_host/mailbox.py`).
    source_commit: bool = False
    # Feature "epoch_check": the `server_epoch` of the caller's session info. A caller
    # whose info is stale (restart, weight update, KV memory resume) gets a conflict
    # before anything is reserved: slots granted to it would sit out a write window.
    expect_epoch: str = ""
    # Feature "dp_ranks": the DP rank to allocate on (None: the HTTP layer picks the least
    # loaded one that fits).
    dp_rank: int | None = None
    # Feature "owner_pattern": the source's owner CP rank of every page of the request's
    # page-aligned ids, in prefix order (its size query's `page_owners`). An owner-sharded
    # target allocates the pages it lacks so that each lands on its owner's twin; any
    # other target refuses it. None: not sent.
    page_owners: list[int] | None = None
    # Feature "source_dp_rank": the source's DP rank that holds the prefix (its size
    # query's `dp_rank`); the grants bind it, and only that DP rank's scheduler claims
    # them. None: any DP rank of the source (its HTTP layer lets one claim each grant).
    source_dp_rank: int | None = None


@dataclass
class AllocatedRank:
    tp_rank: int
    pp_rank: int
    kv_indices: list[int]  # token slots on this rank, in prefix order ("tokens" format)
    kv_pages: list[int] = field(default_factory=list)  # page ids instead ("pages" format)
    grant: str = ""  # grants.Grant for these slots: what the source may write
    staging: list[int] = field(default_factory=list)  # [addr, length] granted, or empty
    # [first_page, count] runs instead ("ranges" format; `page_ranges.py`).
    kv_page_ranges: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Any, where: str = "ranks.0") -> AllocatedRank:
        """A rank of an allocate reply as another server sent it; ValueError naming the
        field (`where`: the rank's place in the reply) for a wrong type or shape."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} is not an object")
        slot_lists = {}
        for name in ("kv_indices", "kv_pages", "staging"):
            value = d.get(name, [])
            if not isinstance(value, list):
                raise ValueError(f"{where}.{name} is not a list")
            if not all(map(_is_count, value)):
                raise ValueError(f"{where}.{name} are not slot ids")
            slot_lists[name] = value
        ranges = d.get("kv_page_ranges", [])
        if not isinstance(ranges, list):
            raise ValueError(f"{where}.kv_page_ranges is not a list")
        if not all(
            isinstance(pair, list) and len(pair) == 2 and all(map(_is_count, pair))
            for pair in ranges
        ):
            raise ValueError(f"{where}.kv_page_ranges: each page range must be [first, count]")
        if sum(map(bool, (slot_lists["kv_indices"], slot_lists["kv_pages"], ranges))) > 1:
            raise ValueError(f"{where} names more than one of kv_indices, kv_pages and ranges")
        staging = slot_lists["staging"]
        if staging and (len(staging) != 2 or min(staging) == 0):
            raise ValueError(f"{where}.staging must be [addr, length], both > 0")
        return cls(
            tp_rank=_field(d, "tp_rank", _is_count, f"{where}."),
            pp_rank=_field(d, "pp_rank", _is_count, f"{where}."),
            kv_page_ranges=ranges,
            grant=_field(d, "grant", _is_str, f"{where}.", ""),
            **slot_lists,
        )


@dataclass
class AllocateReply(Reply):
    migration_id: str = ""
    matched_token_size: int = 0  # the target prefix that was locked and kept
    extra_token_size: int = 0  # tokens allocated after it
    ranks: list[AllocatedRank] = field(default_factory=list)
    path: str = ""
    page_size: int = 0
    server_epoch: str = ""
    ADDED_LATER = ("source_commit", "dp_rank")
    # The allocation asked for `source_commit` and got a mailbox slot: a transfer reply
    # that says `delivered` means this server commits by itself.
    source_commit: bool = False
    # Feature "dp_ranks": the DP rank holding the slots (None on a server with one): the
    # continuation goes there (`routed_dp_rank`).
    dp_rank: int | None = None

    @classmethod
    def from_dict(cls, d: Any) -> AllocateReply:
        """An allocate reply as another server sent it (the JSON object of
        `reply_content`), checked for the fields a reader acts on; ValueError naming the
        field. Fields it does not know are left out (a newer server may add some)."""
        if not isinstance(d, dict):
            raise ValueError("the reply is not an object")
        success = _field(d, "success", _is_bool)
        common = {
            "message": _field(d, "message", _is_str, default=""),
            "error_kind": _field(d, "error_kind", _is_str, default=""),
            "steps_ms": _field(d, "steps_ms", _is_dict, default={}),
        }
        if not success:
            return cls(success=False, **common)
        ranks = _field(d, "ranks", _is_list)
        return cls(
            success=True,
            migration_id=_field(d, "migration_id", _is_str),
            matched_token_size=_field(d, "matched_token_size", _is_count),
            extra_token_size=_field(d, "extra_token_size", _is_count),
            ranks=[AllocatedRank.from_dict(r, f"ranks.{i}") for i, r in enumerate(ranks)],
            path=_field(d, "path", _is_str, default=""),
            page_size=_field(d, "page_size", _is_count, default=0),
            server_epoch=_field(d, "server_epoch", _is_str, default=""),
            source_commit=_field(d, "source_commit", _is_bool, default=False),
            dp_rank=_field(d, "dp_rank", lambda v: v is None or _is_count(v), default=None),
            **common,
        )


_REQUIRED = object()


def _field(d: dict, name: str, valid: Any, prefix: str = "", default: Any = _REQUIRED) -> Any:
    """`d[name]` when `valid` says it is; `default` when missing (if there is one)."""
    if name not in d:
        if default is _REQUIRED:
            raise ValueError(f"{prefix}{name} is missing")
        return default
    value = d[name]
    if not valid(value):
        raise ValueError(f"{prefix}{name} has the wrong type or is negative")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


# --------------------------------------------------------------------------- transfer


@dataclass
class TransferRequestKVCacheTarget(HostFields):
    """One target rank: where the source rank with the same (tp, pp) writes (host path:
    the `HostFields`; device path: `device_kv`, a `DeviceTarget` on the wire;
    shared-host path: `shared_host_kv`, a `SharedHostTarget`)."""

    tp: int
    pp: int
    kv_indices: list[int] = field(default_factory=list)  # token slots, or kv_pages
    fingerprint: dict[str, Any] = field(default_factory=dict)
    path: PathName = "host"  # protocol 2
    kv_pages: list[int] = field(default_factory=list)  # page ids instead of kv_indices
    device_kv: dict[str, Any] | None = None  # device path: the target rank's paths["device"]
    grant: str = ""  # the allocate reply's grant for this rank
    staging: list[int] = field(default_factory=list)  # the allocate reply's extent, if any
    # [first_page, count] runs instead of kv_pages (feature "page_ranges").
    kv_page_ranges: list[list[int]] = field(default_factory=list)
    # Feature "destination_digest": `device_kv` named by its digest, for a source that
    # was sent it in full before (`server/source/known_destinations.py`); the source fills
    # `device_kv` in from what it hashed itself.
    device_kv_digest: str = ""
    # Shared-host path: the target rank's paths["shared_host"] (`SharedHostTarget`).
    shared_host_kv: dict[str, Any] | None = None


@dataclass
class AllocateOnTarget:
    """Feature "source_allocate": where the source asks the target for the slots (its
    session info's `allocate_channel`), the allocate's JSON object and the transfer's
    ids as little-endian uint32 bytes (empty: the JSON lists them). Built by the source's
    HTTP layer; the target validates both again."""

    address: str
    secret: str
    allocate: bytes
    ids: bytes = b""
    # Set by the source's HTTP layer when it asked the target itself, before the
    # transfer reached a busy scheduler (`server/same_host/ask_ahead.py`; never from a
    # body): the target's allocate reply as it answered, or why it did not answer.
    reply_ahead: bytes = b""
    error_ahead: str = ""


@dataclass
class TransferRequest:
    # Empty when the body sent `input_ids_u32` (the scheduler fills it in).
    input_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    matched_token_size: int = 0
    extra_token_size: int = 0
    target_per_rank: list[TransferRequestKVCacheTarget] = field(default_factory=list)
    migration_id: str = ""  # for logs only: the source keeps no state for it
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    stage_refusal: StageRefusal | None = None  # set by an earlier PP stage
    # Feature "partial_transfer": send the whole pages of the range this source holds,
    # from matched_token_size on (the reply's transferred_token_size says how many;
    # the receipts carry it), instead of refusing when it holds less.
    partial_ok: bool = False
    input_ids_u32: bytes = b""  # feature "binary_ids", as for the size query
    # Feature "source_allocate": allocate on the target first (the sizes, migration id
    # and the target rank's slots and grant come from its reply).
    allocate_on_target: AllocateOnTarget | None = None
    # Feature "dp_ranks": the DP rank holding the prefix (None: the HTTP layer finds the
    # one with the longest match).
    dp_rank: int | None = None
    # Feature "running_slots": read the range from the slots of the running request of
    # this rid (whose tokens must begin with `input_ids`), not from the radix tree.
    running_rid: str = ""


@dataclass
class RankTransferResult:
    tp_rank: int
    pp_rank: int
    success: bool
    bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    receipt: str = ""  # grants.Receipt: what /commit (or /abort_transfer) presents
    plan: str = ""  # host path: "direct", "gather" or "staged" (staging.py)
    entries: int = 0  # host path: transfer-engine write entries the plan needed
    # Where this rank's time went, ms (host path: host_copies, queued, probe, plan, wire,
    # first_batch, max_batch); informational, for logs and benchmarks.
    steps_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class TransferReply(Reply):
    transferred_token_size: int = 0
    transferred_bytes: int = 0  # summed over ranks
    ranks: list[RankTransferResult] = field(default_factory=list)
    path: str = ""
    server_epoch: str = ""
    ADDED_LATER = (
        "delivered",
        "allocation",
        "channel_error",
        "destination_unknown",
        "dp_rank",
    )
    # Feature "source_commit": every rank's receipts are in the target's mailbox, put
    # there before this reply; the target commits before it handles anything sent after.
    delivered: bool = False
    # Feature "source_allocate": the target's allocate reply as it answered the source
    # (empty when it was not asked, or did not answer): its migration id is what the
    # client commits or aborts.
    allocation: dict = field(default_factory=dict)
    # Feature "source_allocate": why the source could not ask the target's channel (not
    # on this host, not a channel, the target gone or silent); the client allocates then.
    channel_error: str = ""
    # Feature "destination_digest": the body named its device destination by a digest
    # this source does not know (forgotten, or never sent in full): nothing was done;
    # send `device_kv` in full.
    destination_unknown: bool = False
    # Feature "dp_ranks": the DP rank that sent (None on a server with one).
    dp_rank: int | None = None
    # Internal (never on the wire): the grants this reply's ranks account for, one
    # [migration_id, tp, pp, claimed_until] each (claimed_until: the unix time the grant
    # this request claimed expires; 0 when it claimed none). The HTTP layer of a server
    # with DP ranks keeps them (`server/http/grant_claims.py`); None: not known.
    claims: list | None = None


# --------------------------------------------------------------------------- commit/abort


@dataclass
class CommitRequest:
    migration_id: str = ""
    receipts: list[str] = field(default_factory=list)  # the source's, one per rank
    verify: bool = False  # check the receipts' content digests against what landed
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    stage_refusal: StageRefusal | None = None  # set by an earlier PP stage
    # Made by this server from its mailbox (`server/target/mailbox_commits.py`), not received:
    # nobody waits for its reply. Never set from a body (`bodies.CommitBody`).
    from_mailbox: bool = False
    dp_rank: int | None = None  # set by the HTTP layer from the migration id (`dp_ranks.py`)


@dataclass
class CommitReply(Reply):
    matched_after_commit: int = 0


@dataclass
class AbortRequest:
    migration_id: str = ""
    # Optional: settled receipts let the slots go back at once instead of quarantine.
    receipts: list[str] = field(default_factory=list)
    weight_version: str = ""  # stamped by this server's HTTP layer (SGLang's weight_version)
    dp_rank: int | None = None  # set by the HTTP layer from the migration id (`dp_ranks.py`)


@dataclass
class AbortReply(Reply):
    pass


# BaseReq bookkeeping, the scheduler's raw stamps (`trace.py`) and the grants a transfer
# claimed (`TransferReply.claims`): never leave the server.
INTERNAL_FIELDS = frozenset({"rid", "http_worker_ipc", "trace", "claims"})


def reply_content(reply: Reply) -> dict[str, Any]:
    """A reply as the JSON object a route answers with (without the internal fields).

    `reply` is a wire model or a server message built from one: a message type names its
    model in `WIRE_MODEL` (`sglang_adapter.ipc_message`; on some SGLang lines it is no
    dataclass), and its fields are the model's."""
    model = getattr(type(reply), "WIRE_MODEL", type(reply))
    return {name: _plain(getattr(reply, name)) for name in wire_order(model)}


@functools.cache
def wire_order(reply_type: type[Reply]) -> tuple[str, ...]:
    """The reply's fields in the order its JSON lists them (`Reply`), internal ones out."""
    own = [f.name for f in fields(reply_type) if f.name not in _COMMON]
    later = reply_type.ADDED_LATER
    order = ["success", *(n for n in own if n not in later), *_COMMON[1:], *later]
    return tuple(n for n in order if n not in INTERNAL_FIELDS)


_COMMON = tuple(f.name for f in fields(Reply))


def _plain(value: Any) -> Any:
    """Dataclasses (and lists of them) as dicts; everything else as it is."""
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list) and value and is_dataclass(value[0]):
        return [_plain(v) for v in value]
    return value
