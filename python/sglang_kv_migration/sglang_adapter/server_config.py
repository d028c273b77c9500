"""SGLang's server configuration as the plugin meets it: the kind of class `ServerArgs`
is, the value a field of it has in effect, and the weight version in effect.

- ``0.5.12``: `ServerArgs` is a dataclass whose `__post_init__` resolves it in place
  (defaults filled in from the model, incompatible options switched off); a weight
  update rewrites `tokenizer_manager.server_args.weight_version`.
- ``0.5.23``: `ServerArgs` is a `msgspec.Struct` that keeps the operator's input as
  given; `resolve_once` records what resolution decides beside it (read back with
  `arg_groups.overrides.resolution_result`), and the process's runtime context holds the
  values in effect: a weight update changes its serving config's `weight_version`,
  never the record.

So a subclass with our flags is made per line (`server_args_class`), SGLang's own
fields are read through `effective_server_args` (what resolution decided, where it
did), and the weight version a request is stamped with through `current_weight_version`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_kv_migration.sglang_adapter.installed import is_unified_line


def server_args_class(cls: type) -> type:
    """Decorator for a subclass of SGLang's `ServerArgs` that adds fields: a dataclass on
    0.5.12; on 0.5.23 the class is already a struct through its base (its annotated
    class attributes are its new fields) and is returned as it is."""
    if is_unified_line():
        return cls
    return dataclasses.dataclass(cls)


def effective_server_args(server_args: Any) -> Any:
    """SGLang's server arguments as they are in effect, read by attribute: on 0.5.23 a
    live view of what resolution decided over the input (`resolving_view`); on 0.5.12
    the record itself, which its own post-init resolved in place."""
    if is_unified_line():
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    return server_args


def current_weight_version(tokenizer_manager: Any) -> str:
    """The weight version the tokenizer manager serves now (changed by weight updates:
    on 0.5.23 in the process's serving config, not in the record)."""
    if is_unified_line():
        from sglang.srt.runtime_context import get_serving

        return get_serving().weight_version
    return tokenizer_manager.server_args.weight_version
