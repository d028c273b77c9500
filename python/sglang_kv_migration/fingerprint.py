"""The layout fingerprint: everything two ranks must agree on before one writes into the
other's KV pools, compared before anything else crosses between servers.

Plain data, importable without torch or SGLang (the client compares fingerprints of two
servers before it asks either to move anything). The server builds its own from
`KVCacheShape`, which `sglang_adapter.kv_cache_shape` reads off the live pools.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.wire.version import PROTOCOL_VERSION


@dataclass(frozen=True)
class KVCacheShape:
    """What the fingerprint takes from one rank's KV pools (host pool and its device pool).
    The fields are in the order the fingerprint's wire dict lists them."""

    kv_dtype: str  # the logical dtype, e.g. "bfloat16"
    attention: str  # "mha" or "mla"
    start_layer: int
    end_layer: int
    kv_heads: int  # KV heads on this rank; 1 for MLA
    head_dim: int  # MHA; 0 for MLA
    kv_lora_rank: int  # MLA; 0 for MHA
    qk_rope_head_dim: int  # MLA; 0 for MHA
    page_size: int
    host_layout: str
    # The pools of the host pool group one page lives in ("kv", or "kv+indexer" for NSA
    # models) and the NSA indexer's key shape (0 / "" without one).
    host_pools: str = "kv"
    index_head_dim: int = 0
    index_dtype: str = ""


# How a server with attention context parallelism holds a prefix's pages on its CP ranks.
# SGLang 0.5.12 all-gathers K/V in prefill and writes the whole result into every CP
# rank's pool (layers/utils/cp_utils.py): each CP rank holds every page.
CP_REPLICATED = "replicated"

# Fields a peer that predates them lacks (and refuses as unknown keys): left out of
# `to_dict` at these values, and read as them when missing.
_LEFT_OUT_AT: dict[str, int | str] = {
    "attn_cp_size": 1,
    "attn_cp_mode": "",
    "host_pools": "kv",
    "index_head_dim": 0,
    "index_dtype": "",
}


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything two ranks must agree on before one writes into the other's host pool."""

    protocol_version: int
    model: str
    shape: KVCacheShape  # on the wire, its fields at top level after `model`
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    # SGLang's attention context parallelism (--attn-cp-size) and how its CP ranks hold
    # pages (`CP_REPLICATED`; "" without CP). Ranks pair by tp rank, which numbers CP
    # ranks too, so both sides must split their ranks the same way.
    attn_cp_size: int = 1
    attn_cp_mode: str = ""
    # SGLang's weight version, as the server's HTTP layer knows it when the request
    # arrives (RL weight updates change it): KV never crosses a weight update.
    weight_version: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, KVCacheShape):
            raise ValueError(f"fingerprint shape must be a KVCacheShape, got {self.shape!r}")
        flat = self._flat()
        for name, kind in _FIELD_TYPES.items():
            value = flat[name]
            ok = _is_int(value) if kind == "int" else isinstance(value, str)
            if not ok:
                raise ValueError(f"fingerprint field {name} must be {kind}, got {value!r}")

    @classmethod
    def from_shape(
        cls,
        shape: KVCacheShape,
        *,
        model: str,
        tp_size: int,
        tp_rank: int,
        pp_size: int,
        pp_rank: int,
        attn_cp_size: int = 1,
    ) -> LayoutFingerprint:
        """This rank's fingerprint (`sglang_adapter.kv_cache_shape` reads ``shape``)."""
        return cls(
            protocol_version=PROTOCOL_VERSION,
            model=model,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            attn_cp_size=attn_cp_size,
            attn_cp_mode=CP_REPLICATED if attn_cp_size > 1 else "",
            shape=shape,
        )

    @functools.cached_property
    def wire(self) -> dict[str, int | str]:
        """`to_dict()`, built once per fingerprint (read-only: compare, never change)."""
        return self.to_dict()

    def with_weight_version(self, weight_version: str) -> LayoutFingerprint:
        """This fingerprint with `weight_version` (the same object for the same version,
        so its `wire` is built once: a handler compares fingerprints on every request)."""
        return _with_weight_version(self, weight_version)

    def to_dict(self) -> dict[str, int | str]:
        d = self._flat()
        for name, value in _LEFT_OUT_AT.items():
            if d[name] == value:
                del d[name]
        return d

    def _flat(self) -> dict[str, Any]:
        """Every field, the shape's at top level, in wire order."""
        return {
            "protocol_version": self.protocol_version,
            "model": self.model,
            **{name: getattr(self.shape, name) for name in _SHAPE_FIELDS},
            **{name: getattr(self, name) for name in _AFTER_SHAPE},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayoutFingerprint:
        expected = list(_FIELD_TYPES)
        unknown = sorted(set(d) - set(expected))
        optional = ("weight_version", *_LEFT_OUT_AT)
        missing = [k for k in expected if k not in d and k not in optional]
        if unknown or missing:
            raise ValueError(
                f"bad layout fingerprint: unknown keys {unknown}, missing keys {missing}"
            )
        shape = {name: d[name] for name in _SHAPE_FIELDS if name in d}
        rest = {name: value for name, value in d.items() if name not in shape}
        return cls(shape=KVCacheShape(**shape), **rest)

    def first_mismatch(
        self,
        other: LayoutFingerprint,
        *,
        self_name: str = "source",
        other_name: str = "target",
    ) -> str | None:
        """``"field: source=.. target=.."`` for the first differing field, else None.

        Fields are compared in declaration order, so a protocol change is reported first.
        """
        theirs = other._flat()
        for name, mine in self._flat().items():
            if mine != theirs[name]:
                return f"{name}: {self_name}={mine} {other_name}={theirs[name]}"
        return None


_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(KVCacheShape))
_AFTER_SHAPE = tuple(
    f.name
    for f in dataclasses.fields(LayoutFingerprint)
    if f.name not in {"protocol_version", "model", "shape"}
)
# Every wire field of a fingerprint, in wire order, with its type.
_FIELD_TYPES: dict[str, str] = {
    "protocol_version": "int",
    "model": "str",
    **{f.name: f.type for f in dataclasses.fields(KVCacheShape)},
    **{f.name: f.type for f in dataclasses.fields(LayoutFingerprint) if f.name in _AFTER_SHAPE},
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.lru_cache(maxsize=64)
def _with_weight_version(fingerprint: LayoutFingerprint, version: str) -> LayoutFingerprint:
    return dataclasses.replace(fingerprint, weight_version=version)
