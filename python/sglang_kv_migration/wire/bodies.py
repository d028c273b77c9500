"""What a request body may say, checked in one place: the routes (`server/http/routes.py`),
the allocate channel (`server/target/channel_allocations.py`) and the source's forwarded
allocate all validate with these models.

Strict pydantic models (no bools for ints, no strings for numbers, unknown fields
refused); a bad body is a ValueError / 400 naming the field (`describe_errors`).
Importable without SGLang. Each model's fields are those of its request in `messages.py`
(the same names, types, optionality and defaults; `test/unit/test_wire_forms.py`), with
the constraints a body's hostile input needs.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sglang_kv_migration.wire import binary_ids, page_ranges
from sglang_kv_migration.wire.host_fields import buffer_count_problem
from sglang_kv_migration.wire.messages import (
    AllocateOnTarget,
    IndexFormat,
    PathName,
    TransferRequestKVCacheTarget,
)

MAX_TOKENS = 1 << 21  # input_ids / kv_indices / kv_pages per request
MAX_ID_CHARS = 128  # migration_id
MAX_DP_RANK = 4095  # dp_rank (SGLang's --dp-size is far smaller)
MAX_EPOCH_CHARS = 1024  # server_epoch: instance, KV memory generation, weight_version
MAX_KEY_CHARS = 4096  # extra_key
MAX_TOKEN_CHARS = 4096  # a grant or receipt
MAX_BATCH_MOVES = 64  # transfers in one call (feature "transfer_batch")
# Free-form JSON fields, in bytes of their JSON: a target's `device_kv` (~26 KB for an 8B
# model's 64 buffers, ~400 bytes a buffer) and a layout fingerprint (~0.5 KB).
MAX_DEVICE_KV_BYTES = 1 << 20
MAX_FINGERPRINT_BYTES = 64 << 10
MAX_RANKS = 1024  # target ranks, source fingerprints and receipts in one body

MAX_ID = (1 << 63) - 1  # token ids and slots are int64 on the scheduler side


def _ids_in_range(values: list[int], info: ValidationInfo) -> list[int]:
    """Every element in [0, MAX_ID]. Two C-level passes (min, max) instead of pydantic's
    per-element constraint, which costs three times the strict int check itself on
    32K-token lists; the slow search for the culprit runs only on bad input."""
    if values and (min(values) < 0 or max(values) > MAX_ID):
        index, bad = next((i, v) for i, v in enumerate(values) if not 0 <= v <= MAX_ID)
        raise PydanticCustomError(
            "id_range",
            "{field}.{index} = {value}: must be an integer in [0, 2**63)",
            {"field": info.field_name, "index": index, "value": bad},
        )
    return values


def _json_within(limit: int) -> BeforeValidator:
    """A field of free-form JSON of at most `limit` bytes and 254 levels (orjson's own
    limit; pickling deeper values to the scheduler would recurse too deep), checked
    before pydantic copies it: such a value goes on to the scheduler as it came."""

    def check(value: Any, info: ValidationInfo) -> Any:
        try:
            size = len(orjson.dumps(value))
        except orjson.JSONEncodeError as e:
            raise PydanticCustomError(
                "json_bounds",
                "{field} is not JSON of at most 254 levels: {problem}",
                {"field": info.field_name, "problem": str(e)},
            ) from None
        if size > limit:
            raise PydanticCustomError(
                "json_size",
                "{field} holds {size} bytes of JSON, over the {limit}-byte limit",
                {"field": info.field_name, "size": size, "limit": limit},
            )
        return value

    return BeforeValidator(check)


def _at_most(count: int) -> BeforeValidator:
    """A list of at most `count` items, counted before any item is validated (pydantic's
    `max_length` validates every item first)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and len(value) > count:
            raise PydanticCustomError(
                "too_long",
                "{field} has {size} items, over the {limit}-item limit",
                {"field": info.field_name, "size": len(value), "limit": count},
            )
        return value

    return BeforeValidator(check)


# Lists of ids: strict ints (the models are strict: no bools, no strings), range checked
# as a whole by `_ids_in_range`.
IdList = Annotated[
    list[int], _at_most(MAX_TOKENS), Field(max_length=MAX_TOKENS), AfterValidator(_ids_in_range)
]
# [first_page, count] runs of page ids (`page_ranges.py`); each pair checked in the model.
PageRanges = Annotated[
    list[Annotated[list[int], Field(min_length=2, max_length=2)]],
    _at_most(MAX_TOKENS),
    Field(max_length=MAX_TOKENS),
]
# Feature "owner_pattern": one CP rank per page (a page is at least one token).
PageOwnerList = Annotated[
    list[Annotated[int, Field(ge=0)]], _at_most(MAX_TOKENS), Field(max_length=MAX_TOKENS)
]
ExtraKey = Annotated[str, Field(max_length=MAX_KEY_CHARS)]
NonNegative = Annotated[int, Field(ge=0)]
Fingerprint = Annotated[dict[str, Any], _json_within(MAX_FINGERPRINT_BYTES)]
Address = Annotated[int, Field(ge=0)]
# Feature "dp_ranks": a data-parallel rank of the server (checked against its --dp-size
# by `server/http/dp_ranks.py`); None lets the server choose.
DpRank = Annotated[int | None, Field(default=None, ge=0, le=MAX_DP_RANK)]
# Feature "running_slots": a request id as SGLang's /generate takes one (the source
# compares it with its running requests' rids, nothing more).
RunningRid = Annotated[str, Field(default="", max_length=MAX_ID_CHARS)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class IdsBody(Body):
    """A body with the request's token ids: `input_ids` (a JSON list), or `input_ids_u32`
    (feature "binary_ids": little-endian uint32, base64; `binary_ids.py`), exactly one."""

    input_ids: IdList = Field(default_factory=list)
    input_ids_u32: str = ""
    _ids_raw: bytes = PrivateAttr(default=b"")

    @model_validator(mode="after")
    def _one_form_of_ids(self) -> IdsBody:
        if bool(self.input_ids) == bool(self.input_ids_u32):
            raise ValueError("give exactly one of input_ids (non-empty) and input_ids_u32")
        if self.input_ids_u32:
            try:
                self._ids_raw = binary_ids.decode(self.input_ids_u32, MAX_TOKENS)
            except ValueError as e:
                raise ValueError(f"input_ids_u32: {e}") from None
        return self

    @property
    def token_count(self) -> int:
        return len(self.input_ids) or binary_ids.count(self._ids_raw)


class ExtraTokenSizeBody(IdsBody):
    extra_key: ExtraKey | None = None
    headroom: bool = False  # also report the host pool's headroom (planners)
    dp_rank: DpRank = None  # feature "dp_ranks": ask this DP rank only
    running_rid: RunningRid = ""  # feature "running_slots": the running request to measure


class AllocateFields(Body):
    """An allocate's fields but its ids (the allocate a transfer forwards to its target
    through the allocate channel, feature "source_allocate", takes the transfer's ids)."""

    extra_key: ExtraKey | None = None
    extra_token_size: NonNegative = 0
    source_fingerprints: Annotated[list[Fingerprint], _at_most(MAX_RANKS)] = Field(min_length=1)
    path: PathName = "host"
    index_format: IndexFormat = "tokens"
    nothing_ok: bool = False
    staging: bool = False  # the source writes staging extents (its `stage_writer`)
    verify: bool = False
    # The source's session info `instance_id` (feature "bound_grants").
    source_instance: str = Field(default="", max_length=MAX_ID_CHARS)
    # Feature "source_commit": the source commits through this server's mailbox.
    source_commit: bool = False
    # Feature "epoch_check": the session info `server_epoch` the caller planned with.
    expect_epoch: str = Field(default="", max_length=MAX_EPOCH_CHARS)
    # Feature "owner_pattern": the source's owner CP rank of every page of the request,
    # strict ints (their range is the target's CP size, checked there).
    page_owners: PageOwnerList | None = None


class AllocateBody(IdsBody, AllocateFields):
    dp_rank: DpRank = None  # feature "dp_ranks": allocate on this DP rank
    # Feature "source_dp_rank": the source's DP rank holding the prefix (its size query's
    # `dp_rank`); the grants bind it.
    source_dp_rank: DpRank = None


class AllocateOnTargetBody(Body):
    """Feature "source_allocate": the source asks the target (on its host) for the slots
    itself, through the channel the target's session info names (`allocate_channel`)."""

    address: str = Field(max_length=256)
    secret: str = Field(pattern=r"^[0-9a-f]{32}$")
    allocate: AllocateFields


class TargetRankBody(Body):
    tp: NonNegative
    pp: NonNegative
    path: PathName = "host"
    # Host path: the target rank's transfer session and host buffers.
    session_id: str = Field(default="", pattern=r"^(.+:\d+)?$")
    host_kv_data_ptrs: list[Address] = Field(default_factory=list)
    host_kv_data_lens: list[Address] = Field(default_factory=list)
    host_kv_item_lens: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    # Device path: the target rank's `paths["device"]` from its session info.
    device_kv: Annotated[dict[str, Any] | None, _json_within(MAX_DEVICE_KV_BYTES)] = None
    # Feature "destination_digest": `device_kv` named by its digest (a source that was
    # sent it in full before; `server/source/known_destinations.py`).
    device_kv_digest: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # Shared-host path: the target rank's `paths["shared_host"]` from its session info.
    shared_host_kv: Annotated[dict[str, Any] | None, _json_within(MAX_DEVICE_KV_BYTES)] = None
    # The allocated slots: token slots, or whole pages (protocol 2), or runs of whole
    # pages (feature "page_ranges").
    kv_indices: IdList = Field(default_factory=list)
    kv_pages: IdList = Field(default_factory=list)
    kv_page_ranges: PageRanges = Field(default_factory=list)
    fingerprint: Fingerprint
    grant: str = Field(default="", max_length=MAX_TOKEN_CHARS)
    # Host path: the staging extent [addr, length] the allocate reply granted this rank.
    staging: list[Address] = Field(default_factory=list, max_length=2)

    @property
    def names_slots(self) -> bool:
        return bool(self.kv_indices or self.kv_pages or self.kv_page_ranges)

    @model_validator(mode="after")
    def _consistent(self) -> TargetRankBody:
        # Exactly one for a transfer into granted slots, none when the source asks the
        # target for them (`TransferBody._consistent_sizes` says which).
        if sum(map(bool, (self.kv_indices, self.kv_pages, self.kv_page_ranges))) > 1:
            raise ValueError(SLOT_FIELDS_MESSAGE)
        if self.kv_page_ranges:
            _check_page_ranges(self.kv_page_ranges)
        if self.staging and (
            self.path != "host" or len(self.staging) != 2 or min(self.staging) == 0
        ):
            raise ValueError("staging must be [addr, length], both > 0, on the host path")
        if self.path == "device":
            if bool(self.device_kv) == bool(self.device_kv_digest):
                raise ValueError(
                    "give exactly one of device_kv and device_kv_digest for path 'device'"
                )
            return self
        if self.device_kv_digest:
            raise ValueError("device_kv_digest is for path 'device'")
        if self.path == "shared_host":
            if not self.shared_host_kv:
                raise ValueError("shared_host_kv is required for path 'shared_host'")
            return self
        if not self.session_id or not self.host_kv_data_ptrs:
            raise ValueError("session_id and host_kv_data_ptrs are required for path 'host'")
        problem = buffer_count_problem(
            self.host_kv_data_ptrs, self.host_kv_data_lens, self.host_kv_item_lens
        )
        if problem is not None:
            raise ValueError(problem)
        return self


SLOT_FIELDS_MESSAGE = "give exactly one of kv_indices, kv_pages and kv_page_ranges"


class TransferBody(IdsBody):
    extra_key: ExtraKey | None = None
    # Both 0 with `allocate_on_target` (the target's allocate reply says them), else the
    # allocate reply's; extra_token_size > 0.
    matched_token_size: NonNegative = 0
    extra_token_size: NonNegative = 0
    target_per_rank: Annotated[list[TargetRankBody], _at_most(MAX_RANKS)] = Field(min_length=1)
    migration_id: str = Field(default="", max_length=MAX_ID_CHARS)
    # Feature "partial_transfer": send what this source holds of the range.
    partial_ok: bool = False
    # Feature "source_allocate": no slots, grant or migration id in the body; the source
    # allocates on the target itself (single-rank servers on one host).
    allocate_on_target: AllocateOnTargetBody | None = None
    dp_rank: DpRank = None  # feature "dp_ranks": the DP rank holding the prefix
    # Feature "running_slots": read the range from this running request's own slots.
    running_rid: RunningRid = ""

    @model_validator(mode="after")
    def _consistent_sizes(self) -> TransferBody:
        if self.allocate_on_target is not None:
            return self._consistent_for_source_allocate()
        if self.extra_token_size <= 0:
            raise ValueError("extra_token_size must be greater than 0")
        # `_one_form_of_ids` has decoded input_ids_u32: pydantic runs a base class's
        # validators before a subclass's.
        end = self.matched_token_size + self.extra_token_size
        if end > self.token_count:
            raise ValueError(
                f"matched_token_size + extra_token_size = {end} exceeds len(input_ids) = "
                f"{self.token_count}"
            )
        for target in self.target_per_rank:
            if not target.names_slots:
                raise ValueError(f"target tp={target.tp} pp={target.pp}: {SLOT_FIELDS_MESSAGE}")
            if target.kv_indices and len(target.kv_indices) != self.extra_token_size:
                raise ValueError(
                    f"target tp={target.tp} pp={target.pp}: {len(target.kv_indices)} "
                    f"kv_indices for extra_token_size={self.extra_token_size}"
                )
            pages = len(target.kv_pages) or page_ranges.count_pages(target.kv_page_ranges)
            if pages and self.extra_token_size % pages:
                raise ValueError(
                    f"target tp={target.tp} pp={target.pp}: {pages} pages (kv_pages or "
                    f"kv_page_ranges) do not divide extra_token_size={self.extra_token_size} "
                    "into pages"
                )
        if len({t.path for t in self.target_per_rank}) != 1:
            raise ValueError("every target rank must use the same path")
        ranks = [(t.tp, t.pp) for t in self.target_per_rank]
        if len(set(ranks)) != len(ranks):
            raise ValueError("target_per_rank lists a (tp, pp) rank twice")
        return self

    def _consistent_for_source_allocate(self) -> TransferBody:
        """With `allocate_on_target` the target's reply gives sizes, slots, grant and id:
        the body names none of them, and one target rank (single-rank servers)."""
        if self.matched_token_size or self.extra_token_size or self.migration_id:
            raise ValueError(
                "with allocate_on_target, matched_token_size, extra_token_size and "
                "migration_id come from the target: leave them out"
            )
        if len(self.target_per_rank) != 1:
            raise ValueError("allocate_on_target takes one target rank (TP 1, PP 1)")
        target = self.target_per_rank[0]
        if target.names_slots or target.grant:
            raise ValueError(
                "with allocate_on_target the target rank names no slots and no grant "
                "(the target's allocate reply gives them)"
            )
        if target.staging:
            raise ValueError("with allocate_on_target the target rank names no staging")
        return self

    def request_fields(self) -> dict[str, Any]:
        """The fields of this transfer's request (`messages.TransferRequest`): the target
        entries as `TransferRequestKVCacheTarget`s, `allocate_on_target` as the
        `AllocateOnTarget` the source forwards (built here, off the scheduler thread)."""
        fields = body_fields(self, exclude=_NESTED_IN_TRANSFER)
        fields["target_per_rank"] = [
            TransferRequestKVCacheTarget(**body_fields(t)) for t in self.target_per_rank
        ]
        on_target = self.allocate_on_target
        if on_target is not None:
            on_target = AllocateOnTarget(
                on_target.address, on_target.secret, *self.forwarded_allocate()
            )
        fields["allocate_on_target"] = on_target
        return fields

    def forwarded_allocate(self) -> tuple[bytes, bytes]:
        """What the source sends to the target's allocate channel: the JSON object of
        `allocate_on_target.allocate`, and this transfer's ids as little-endian uint32
        bytes (a zmq frame of their own: no base64 to decode on the target's scheduler
        thread). Ids of 2**32 and above go in the JSON as a list instead (bytes empty)."""
        assert self.allocate_on_target is not None
        fields = self.allocate_on_target.allocate.model_dump(exclude_defaults=True)
        raw = self._ids_raw or binary_ids.to_bytes(self.input_ids)
        if not raw:
            fields["input_ids"] = self.input_ids
        return orjson.dumps(fields), raw


_NESTED_IN_TRANSFER = frozenset({"target_per_rank", "allocate_on_target"})


class TransferBatchBody(Body):
    """Feature "transfer_batch": several transfers in one call, each a whole transfer
    body. They reach the scheduler together and run as if sent at once; the reply lists
    each one's reply, in order, with the status it would have had alone."""

    moves: Annotated[list[TransferBody], _at_most(MAX_BATCH_MOVES)] = Field(min_length=1)


def _check_page_ranges(ranges: list[list[int]]) -> None:
    """Each run is [first_page >= 0, count >= 1], and all of them name at most
    MAX_TOKENS pages (the source expands them)."""
    total = 0
    for i, (first, count) in enumerate(ranges):
        if first < 0 or count < 1 or first > MAX_ID - count:
            raise ValueError(
                f"kv_page_ranges.{i} = [{first}, {count}]: must be [first_page >= 0, count >= 1]"
            )
        total += count
    if total > MAX_TOKENS:
        raise ValueError(f"kv_page_ranges name {total} pages, over the {MAX_TOKENS} limit")


class MigrationIdBody(Body):
    migration_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    receipts: Annotated[
        list[Annotated[str, Field(max_length=MAX_TOKEN_CHARS)]], _at_most(MAX_RANKS)
    ] = Field(default_factory=list)


class CommitBody(MigrationIdBody):
    verify: bool = False


def body_fields(body: BaseModel, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The body's fields as they are: `model_dump()` would copy every int of the token
    lists, and the validated body is not used again. Ids sent as base64 go on as the
    bytes they decode to."""
    fields = {name: getattr(body, name) for name in type(body).model_fields if name not in exclude}
    if isinstance(body, IdsBody):
        fields[binary_ids.FIELD] = body._ids_raw
    return fields


def validated(model: type[Body], payload: Any) -> Body:
    """`payload` as `model`; ValueError naming what is wrong."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise ValueError(describe_errors(e.errors())) from None


def describe_errors(errors: Any) -> str:
    parts = []
    for item in list(errors)[:5]:
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
