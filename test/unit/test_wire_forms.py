"""A request's two forms agree field by field: its body model (`wire/bodies.py`, what a
client may send, validated) and its dataclass (`wire/messages.py`, what the scheduler
ranks get, built from the body's fields by name: `bodies.body_fields`).

Both declare the same fields, because pydantic validates the one and SGLang pickles the
other; this test is what keeps them one declaration in effect: the same names, the same
types (constraints aside), the same optionality, the same defaults. What differs on
purpose is listed per pair, with the reason, so a new difference fails until someone
decides it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest
from pydantic_core import PydanticUndefined
from sglang_kv_migration.wire import bodies, messages


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED = _Required()  # a field without a default


@dataclass(frozen=True)
class Forms:
    body: type[bodies.Body]
    request: type
    # Request fields no body names: the server sets them (why).
    server_sets: dict[str, str] = field(default_factory=dict)
    # Fields whose type changes between the forms (why).
    retyped: dict[str, str] = field(default_factory=dict)
    # Fields a body must name that the request defaults (why).
    body_requires: dict[str, str] = field(default_factory=dict)


STAMPED = "stamped by this server's HTTP layer (SGLang's weight_version)"
STAGE = "set by an earlier PP stage that refused the request"
U32 = "base64 text in the body, the bytes it decodes to in the request (feature binary_ids)"
IDS = {"input_ids_u32": U32}
BUILT_INSIDE = "the server builds the request inside too (mailbox commits, tests)"

PAIRS = [
    Forms(
        bodies.ExtraTokenSizeBody,
        messages.ExtraTokenSizeRequest,
        server_sets={"weight_version": STAMPED},
        retyped=IDS,
    ),
    Forms(
        bodies.AllocateBody,
        messages.AllocateRequest,
        server_sets={
            "weight_version": STAMPED,
            "stage_refusal": STAGE,
            "migration_id": "minted by the HTTP layer, one for every rank",
        },
        retyped=IDS,
        body_requires={"source_fingerprints": BUILT_INSIDE},
    ),
    Forms(
        # The allocate a transfer forwards to its target's channel: its ids come in a
        # frame of their own.
        bodies.AllocateFields,
        messages.AllocateRequest,
        server_sets={
            "weight_version": STAMPED,
            "stage_refusal": STAGE,
            "migration_id": "minted by the target's channel",
            "input_ids": "the forwarded ids frame",
            "input_ids_u32": "the forwarded ids frame",
            "dp_rank": "a channel allocates on its own DP rank",
            "source_dp_rank": "a channel's source has one DP rank",
        },
        body_requires={"source_fingerprints": BUILT_INSIDE},
    ),
    Forms(
        bodies.TransferBody,
        messages.TransferRequest,
        server_sets={"weight_version": STAMPED, "stage_refusal": STAGE},
        retyped=IDS,
        body_requires={"target_per_rank": BUILT_INSIDE},
    ),
    Forms(
        bodies.TargetRankBody,
        messages.TransferRequestKVCacheTarget,
        body_requires={"fingerprint": BUILT_INSIDE},
    ),
    Forms(
        bodies.AllocateOnTargetBody,
        messages.AllocateOnTarget,
        server_sets={
            "ids": "the transfer's ids, as the frame the channel sends",
            "reply_ahead": "the source's HTTP layer asked the target itself",
            "error_ahead": "the source's HTTP layer asked the target itself",
        },
        retyped={"allocate": "a body object, sent on as its JSON bytes"},
    ),
    Forms(
        bodies.CommitBody,
        messages.CommitRequest,
        server_sets={
            "weight_version": STAMPED,
            "stage_refusal": STAGE,
            "from_mailbox": "made by the server from its mailbox, never received",
            "dp_rank": "read by the HTTP layer off the migration id",
        },
        body_requires={"migration_id": BUILT_INSIDE},
    ),
    Forms(
        bodies.MigrationIdBody,
        messages.AbortRequest,
        server_sets={
            "weight_version": STAMPED,
            "dp_rank": "read by the HTTP layer off the migration id",
        },
        body_requires={"migration_id": BUILT_INSIDE},
    ),
]
# Body models with no request of their own (why).
NO_REQUEST = {
    bodies.Body: "the base of every body",
    bodies.IdsBody: "the ids every body with ids shares",
    bodies.TransferBatchBody: "several transfer bodies, each sent as its own request",
}
# Request dataclasses with no body (why).
NO_BODY = {messages.SessionInfoRequest: "the route reads no body"}
# The nested forms: a body type stands for its request type inside another.
NESTED = {pair.body: pair.request for pair in PAIRS if pair.body is not bodies.AllocateFields}


# --------------------------------------------------------------------------- reading


def _normal(hint: Any) -> Any:
    """`hint` without constraints: Annotated unwrapped, unions as sets, a nested body
    as its request type, generics as (origin, args)."""
    if typing.get_origin(hint) is Annotated:
        return _normal(typing.get_args(hint)[0])
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return frozenset(_normal(a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return ("Literal", frozenset(typing.get_args(hint)))
    if origin is not None:
        return (origin, tuple(_normal(a) for a in typing.get_args(hint)))
    return NESTED.get(hint, hint)


def _body_fields(model: type[bodies.Body]) -> dict[str, tuple[Any, Any]]:
    """name -> (type, default or REQUIRED) of a body model."""
    found = {}
    for name, info in model.model_fields.items():
        hint = info.annotation
        if info.metadata:  # constraints pydantic moved off the annotation
            hint = Annotated[(hint, *info.metadata)]
        if info.default_factory is not None:
            default = info.default_factory()
        elif info.default is PydanticUndefined:
            default = REQUIRED
        else:
            default = info.default
        found[name] = (_normal(hint), default)
    return found


def _request_fields(request: type) -> dict[str, tuple[Any, Any]]:
    """name -> (type, default or REQUIRED) of a request dataclass."""
    hints = typing.get_type_hints(request, include_extras=True)
    found = {}
    for f in dataclasses.fields(request):
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        elif f.default is dataclasses.MISSING:
            default = REQUIRED
        else:
            default = f.default
        found[f.name] = (_normal(hints[f.name]), default)
    return found


def _disagreements(pair: Forms) -> list[str]:
    body, request = _body_fields(pair.body), _request_fields(pair.request)
    problems = [f"{n}: only in the body" for n in sorted(body.keys() - request.keys())]
    problems += [
        f"{n}: only in the request"
        for n in sorted(request.keys() - body.keys())
        if n not in pair.server_sets
    ]
    problems += [f"{n}: a body names it" for n in sorted(pair.server_sets.keys() & body.keys())]
    for name in sorted(body.keys() & request.keys()):
        (body_type, body_default), (request_type, request_default) = body[name], request[name]
        if body_type != request_type and name not in pair.retyped:
            problems.append(f"{name}: type {body_type} in the body, {request_type} in the request")
        if name in pair.retyped:
            continue
        if body_default is REQUIRED and request_default is not REQUIRED:
            if name not in pair.body_requires:
                problems.append(f"{name}: the body requires it, the request defaults it")
        elif body_default != request_default:
            problems.append(
                f"{name}: default {body_default!r} in the body, {request_default!r} in the request"
            )
    stale = (pair.retyped.keys() | pair.body_requires.keys()) - (body.keys() & request.keys())
    problems += [f"{n}: listed, but not a field of both" for n in sorted(stale)]
    return problems


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.body.__name__)
def test_a_body_and_its_request_agree_field_by_field(pair: Forms) -> None:
    problems = _disagreements(pair)
    assert not problems, f"{pair.body.__name__} / {pair.request.__name__}:\n" + "\n".join(problems)


def test_every_body_and_every_request_has_its_other_form() -> None:
    body_models = {
        value
        for value in vars(bodies).values()
        if isinstance(value, type) and issubclass(value, bodies.Body)
    }
    paired = {pair.body for pair in PAIRS}
    assert body_models - paired == set(NO_REQUEST), body_models - paired
    requests = {
        value
        for name, value in vars(messages).items()
        if dataclasses.is_dataclass(value)
        and (name.endswith("Request") or value in NESTED.values())
    }
    assert requests - {pair.request for pair in PAIRS} == set(NO_BODY)


def test_the_check_finds_each_kind_of_disagreement() -> None:
    class Body(bodies.Body):
        same: int = 0
        typed: str = ""
        optional: int | None = None
        defaulted: int = 1
        required: int
        extra: bool = False

    @dataclass
    class Request:
        required: int
        same: int = 0
        typed: bytes = b""
        optional: int = 0
        defaulted: int = 2
        internal: str = ""

    problems = _disagreements(Forms(Body, Request))
    assert [p.split(":")[0] for p in problems] == [
        "extra",  # only in the body
        "internal",  # only in the request, and not listed as the server's
        "defaulted",  # 1 / 2
        "optional",  # int | None / int: the type, then the default
        "optional",
        "typed",  # str / bytes
        "typed",
    ]
    listed = Forms(
        Body,
        Request,
        server_sets={"internal": "why"},
        retyped={"typed": "why", "optional": "why"},
        body_requires={"gone": "why"},
    )
    assert _disagreements(listed) == [
        "extra: only in the body",
        "defaulted: default 1 in the body, 2 in the request",
        "gone: listed, but not a field of both",
    ]
