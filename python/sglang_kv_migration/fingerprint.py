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
    # SGLang's attention context parallelism (--attn-cp-size): > 1 spreads a sequence's
    # KV pages over CP ranks. Left out of `to_dict` at 1, so older peers (which lack
    # the field and refuse unknown keys) read the same fingerprint; missing means 1.
    attn_cp_size: int = 1
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
        if d["attn_cp_size"] == 1:
            del d["attn_cp_size"]
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
        optional = ("weight_version", "attn_cp_size")
        missing = [k for k in expected if k not in d and k not in optional]
        if unknown or missing:
            raise ValueError(
                f"bad layout fingerprint: unknown keys {unknown}, missing keys {missing}"
            )
        shape = {name: d[name] for name in _SHAPE_FIELDS}
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
