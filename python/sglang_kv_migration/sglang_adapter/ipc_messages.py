"""Our requests as SGLang IPC messages, on either line: how a message type is made, sent
and copied.

SGLang routes a request between its processes (HTTP layer -> tokenizer manager ->
scheduler ranks, and the reply back) by its type, and copies `rid` and
`http_worker_ipc` through `io_struct.BaseReq`. The two lines build that base differently:

- ``0.5.12``: `BaseReq` is a dataclass, and every message crosses processes pickled
  (`send_pyobj` / `recv_pyobj`). A message is a dataclass deriving from its wire model
  and `BaseReq`.
- ``0.5.23``: `BaseReq` is a `msgspec.Struct` (``tag=True, kw_only=True,
  array_like=True``), and `io_struct.sock_send` / `sock_recv` carry every message:
  pickled by default (``SGLANG_USE_PICKLE_IPC=1``), else msgpack-encoded and decoded
  into one of the struct types `io_struct` knows, a set `hook_custom_types` extends. A
  message is a struct deriving from `BaseReq` with its wire model's fields (names,
  types, defaults), registered there, so it crosses either way; its nested values (the
  wire's dataclasses) are encoded and decoded by msgspec from their annotations. The
  struct has a ``__dict__`` (``dict=True``) for the tracing stamps `server/diag/trace.py`
  sets as attributes: msgspec encodes fields only, so they never leave the process.

On both lines a message type names its wire model in ``WIRE_MODEL`` (what
`wire.messages.reply_content` lists), and `replace_message` copies one with changes.
Nothing outside `sglang_adapter/` knows which kind of class it holds.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from sglang_kv_migration.sglang_adapter.installed import is_unified_line


def ipc_message(module: str, name: str, model: type) -> type:
    """A message type `name` (defined in `module`, where pickle finds it) carrying the
    fields of `model`, a dataclass (a wire model, or one of the server's own)."""
    if not dataclasses.is_dataclass(model):
        raise TypeError(f"{model.__name__} is not a dataclass")
    # The model's class constants (UPPER_CASE, e.g. a reply's later fields: a struct
    # does not inherit them), and the model itself.
    namespace = {
        k: v for base in reversed(model.__mro__) for k, v in vars(base).items() if k.isupper()
    }
    namespace["WIRE_MODEL"] = model
    if is_unified_line():
        return _msgspec_message(module, name, model, namespace)
    return _dataclass_message(module, name, model, namespace)


def replace_message(message: Any, **changes: Any) -> Any:
    """A copy of `message` with `changes` applied (`dataclasses.replace` on 0.5.12,
    `msgspec.structs.replace` on 0.5.23); `rid` and `http_worker_ipc` are kept."""
    if dataclasses.is_dataclass(message):
        return dataclasses.replace(message, **changes)
    import msgspec

    return msgspec.structs.replace(message, **changes)


def send_to_scheduler(socket: Any, message: Any) -> None:
    """Send `message` on the tokenizer manager's socket to the scheduler the way the
    installed SGLang sends its own requests (what its scheduler's receive decodes). On
    0.5.23 that is `TokenizerManager._dispatch_to_scheduler` less its multi-tokenizer
    stamp (`--tokenizer-worker-num > 1` is refused with migration)."""
    if is_unified_line():
        from sglang.srt.managers.io_struct import sock_send

        sock_send(socket, message)
    else:
        socket.send_pyobj(message)


# --------------------------------------------------------------------------- helpers


def _dataclass_message(module: str, name: str, model: type, namespace: dict[str, Any]) -> type:
    from sglang.srt.managers.io_struct import BaseReq

    body = {**namespace, "__module__": module, "__qualname__": name}
    cls = types.new_class(name, (model, BaseReq), exec_body=lambda ns: ns.update(body))
    return dataclasses.dataclass(cls)


def _msgspec_message(module: str, name: str, model: type, namespace: dict[str, Any]) -> type:
    import msgspec
    from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

    hints = typing.get_type_hints(model)
    fields = []
    for f in dataclasses.fields(model):
        if f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], msgspec.field(default_factory=f.default_factory)))
        elif f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], f.default))
        else:
            fields.append((f.name, hints[f.name]))
    cls = msgspec.defstruct(
        name,
        fields,
        bases=(BaseReq,),
        module=module,
        namespace=namespace,
        kw_only=True,
        dict=True,
    )
    # Without it a msgpack-mode receiver cannot decode the type (SGLang's own decoder
    # knows only the struct types io_struct defined when it was imported).
    hook_custom_types(cls)
    return cls
