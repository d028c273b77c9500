"""The client's side of the wire models: a reply's JSON object read into its `messages`
model (`from_dict`), a request body built as a `bodies` model turned into the JSON object
it sends (`to_wire`). Clients and planners go through these two, so the field names are
spelled only in `wire/`.

A body is built with `build(Model, ...)` (`model_construct`: no validation, the server
validates what arrives) plus attribute assignments for the fields it sends only
sometimes; `to_wire` sends exactly the fields so set (pydantic's "exclude unset"), so a
body names what its builder chose to send and nothing an older server would refuse.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from sglang_kv_migration.wire.messages import SessionInfoReply

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Fields whose default is what this version's servers say rather than what an older
# server that leaves them out means: its session info lists no `features`.
_ABSENT: dict[tuple[type, str], Callable[[], Any]] = {(SessionInfoReply, "features"): list}

# (field name, how to read its JSON value or None for as-is, whether the JSON must name it)
_Reader = tuple[str, Callable[[Any], Any] | None, bool]


def from_dict(model: type[T], payload: Any) -> T:
    """`payload`, a reply's JSON object, as `model` (a `messages` dataclass): nested models
    (lists of them, optional ones) read too, fields the JSON leaves out at their defaults
    (an older server), keys the model does not know ignored (a newer one). Lists and dicts
    are the payload's own, not copies (`_ABSENT`: the few fields whose default is not
    what their absence means). ValueError when `payload` is not an object or
    leaves out a field without a default. A `model` instance is returned as it is."""
    if isinstance(payload, model):
        return payload
    if not isinstance(payload, Mapping):
        raise ValueError(f"{model.__name__}: expected a JSON object, got {payload!r:.200}")
    values: dict[str, Any] = {}
    for name, read, required in _readers(model):
        if name in payload:
            value = payload[name]
            values[name] = value if read is None or value is None else read(value)
        elif required:
            raise ValueError(f"{model.__name__}: the reply has no {name!r}")
        elif (model, name) in _ABSENT:
            values[name] = _ABSENT[model, name]()
    return model(**values)


def build(model: type[M], **given: Any) -> M:
    """`model.model_construct(**given)`: `given` are the fields set, the others at their
    defaults. The defaults are filled in here: `model_construct` inspects the signature
    of a default factory on every call (~0.5 ms for `list`, and a transfer target entry
    has seven)."""
    values = {name: make() for name, make in _defaults(model) if name not in given}
    values.update(given)
    return model.model_construct(_fields_set=set(given), **values)


@functools.cache
def _defaults(model: type[BaseModel]) -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(field, what makes its default) for each field of `model` that has one."""
    found = []
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            found.append((name, info.default_factory))
        elif info.default is not PydanticUndefined:
            found.append((name, functools.partial(_same, info.default)))
    return tuple(found)


def _same(value: Any) -> Any:
    return value


def to_wire(body: BaseModel) -> dict[str, Any]:
    """The JSON object of a body made by `build`: the fields it set, in the
    model's order, nested bodies as objects. Token lists and free-form dicts go as they
    are (no copy: they can be 32K ids long)."""
    chosen = body.model_fields_set
    return {
        name: _wire_value(getattr(body, name)) for name in type(body).model_fields if name in chosen
    }


def _wire_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return to_wire(value)
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [to_wire(v) for v in value]
    return value


@functools.cache
def _readers(model: type) -> tuple[_Reader, ...]:
    hints = typing.get_type_hints(model)
    return tuple(
        (
            f.name,
            _reader_for(hints[f.name]),
            f.default is MISSING and f.default_factory is MISSING,
        )
        for f in fields(model)
        if f.init
    )


def _reader_for(hint: Any) -> Callable[[Any], Any] | None:
    """How to read a JSON value into a field typed `hint`; None: as it is."""
    if is_dataclass(hint):
        return functools.partial(from_dict, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _reader_for(inner[0]) if len(inner) == 1 else None
    if origin is list and args and is_dataclass(args[0]):
        item = args[0]
        return lambda value: [from_dict(item, v) for v in value]
    return None
