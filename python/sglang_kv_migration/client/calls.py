"""One HTTP call of the migration protocol, as the steps yield it and the drivers send
it: `Call` (what a step yields) and `CallReply` (what it gets back), the body's ids
(`with_ids`) and the size query callers build themselves (`size_query`), the body
encoded and the reply decoded (`encode`, `json_or_text`), and the reply checked and read
into its model (`step`, `checked`, `parsed`), with the trip's `steps_ms`."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson

from sglang_kv_migration.client.auth import auth_hint, route_of
from sglang_kv_migration.client.results import AuthFailed, MigrationFailed
from sglang_kv_migration.wire import binary_ids, bodies
from sglang_kv_migration.wire.convert import build, from_dict, to_wire
from sglang_kv_migration.wire.features import BINARY_IDS
from sglang_kv_migration.wire.messages import Reply, SessionInfoReply


@dataclass(frozen=True)
class Call:
    """One HTTP call a protocol step yields: its phase (for `MigrationFailed`), where it
    goes and its body."""

    phase: str
    url: str
    path: str
    body: Any  # a `wire.bodies` model (`to_wire`), a JSON object (`call`) or None


CallReply = tuple[int | None, Any]  # (HTTP status or None on a connection error, JSON/text)
# `error_kind` of a server's refusal of a write or commit for its grant or receipts.
FORBIDDEN_KIND = "forbidden"
# The phases whose names are also wire fields (`MigrationResult.timings` keys).
SIZE_QUERY = "extra_token_size"
ALLOCATE = "allocate"
SIZE_QUERY_ROUTE = "/get_request_extra_token_size"
TRANSFER_ROUTE = "/transfer_request_kvcache"


B = TypeVar("B", bound=bodies.IdsBody)
R = TypeVar("R", bound=Reply)


def with_ids(
    body: B,
    info: SessionInfoReply | None,
    ids: list[int],
    encoded: dict[int, str | None] | None = None,
) -> B:
    """`body` carrying `ids` to the server whose session info is `info`: as
    `input_ids_u32` when it lists "binary_ids" (cheaper to parse, check and hand to its
    scheduler than a JSON list), else as `input_ids` (also without session info).
    `encoded`: prefixes of one id list encoded so far, by length (`Plan.encoded`),
    filled in here."""
    if info is None or BINARY_IDS not in info.features:
        body.input_ids = ids
        return body
    if encoded is None:
        text = binary_ids.encode(ids)
    elif len(ids) in encoded:
        text = encoded[len(ids)]
    else:
        text = encoded[len(ids)] = binary_ids.encode(ids)
    if text is None:
        body.input_ids = ids
    else:
        body.input_ids_u32 = text
    return body


def size_query(
    info: SessionInfoReply | None,
    ids: list[int],
    extra_key: str | None = None,
    *,
    headroom: bool = False,
    running_rid: str = "",
) -> bodies.ExtraTokenSizeBody:
    """The body of `/get_request_extra_token_size` for `ids` to the server of `info`;
    `headroom`: also ask for its host headroom (planners); `running_rid` (feature
    "running_slots"): also ask how much of `ids` that running request holds."""
    body = build(bodies.ExtraTokenSizeBody, extra_key=extra_key)
    if headroom:
        body.headroom = True
    if running_rid:
        body.running_rid = running_rid
    return with_ids(body, info, ids)


def step(call: Call, reply_type: type[R]) -> Generator[Call, CallReply, R]:
    """Yield one call; return its checked JSON reply as `reply_type`."""
    status, payload = yield call
    reply = checked(call, status, payload)
    try:
        return from_dict(reply_type, reply)
    except (ValueError, TypeError) as e:
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: malformed reply: {e}") from None


def parsed(reply_type: type[R], payload: Any) -> R | None:
    """A failed call's JSON reply as `reply_type`; None when there is none, or it is not
    one."""
    if not payload:
        return None
    try:
        return from_dict(reply_type, payload)
    except (ValueError, TypeError):
        return None


def checked(call: Call, status: int | None, payload: Any) -> dict[str, Any]:
    """The JSON reply of a successful call, else `MigrationFailed` naming the phase."""
    if status is None:
        raise MigrationFailed(call.phase, f"{call.url}{call.path}: {payload}")
    common = parsed(Reply, payload)
    # A 403 of ours (a write refused for its grant, `error_kind` "forbidden") is this
    # migration's failure, rolled back like any other; SGLang's refusal of a key is not.
    if status in (401, 403) and (common is None or common.error_kind != FORBIDDEN_KIND):
        message = f"{call.url}{call.path} refused the key: {payload}; {auth_hint(call.path)}"
        raise AuthFailed(call.phase, route_of(call.path), message, status)
    if status >= 300 or common is None or not common.success:
        message = common.message if common is not None and common.message else payload
        failure = MigrationFailed(call.phase, f"{call.url}{call.path}: {message}", status)
        failure.reply = payload if isinstance(payload, dict) else None
        raise failure
    return payload


def trip_steps(reply: Reply, seconds: float) -> dict[str, float]:
    """The server's `steps_ms` of one trip plus `outside`: this trip less the route."""
    steps = dict(reply.steps_ms or {})
    if "route" in steps:
        steps["outside"] = round(max(seconds * 1e3 - steps["route"], 0.0), 3)
    return steps


JSON_HEADERS = {"Content-Type": "application/json"}


def encode(body: bodies.Body | dict[str, Any] | None) -> bytes:
    # orjson: bodies carry token lists as long as the prefix (stdlib json is ~10x slower).
    if isinstance(body, bodies.Body):
        return orjson.dumps(to_wire(body))
    return orjson.dumps(body or {})


def join_url(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path.lstrip("/")


def json_or_text(response: httpx.Response) -> Any:
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text


def json_or_bytes_text(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace")
