"""The layout fingerprint: everything two ranks must agree on before one writes into the
other's KV pools, compared before anything else crosses between servers.

Plain data, importable without torch or SGLang (the client compares fingerprints of two
servers before it asks either to move anything). The server builds its own from
`KVCacheShape`, which `sglang_adapter.kv_cache_shape` reads off the live pools.

The model's part is what makes one server's KV valid on another, not where the weights
lie: `model` is `model_identity` of the model's own `config.json` (its architecture and
every field that shapes or fills the KV, the server's `--json-model-override-args` merged
in), so replicas of one checkpoint at different paths, or behind different SGLang
versions, agree; `weight_version` is SGLang's (RL weight updates change it). A name is
compared only where one was given: `model_name` is `--served-model-name` when set
(left out otherwise), so servers named apart are refused. `explain` says, in a refusal,
which flag or file sets the field that differs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.cp_owners import PageOwners
from sglang_kv_migration.wire.version import PROTOCOL_VERSION

# A field's metadata key: what sets it, for a refusal's message (`explain`).
_SET_BY = "set_by"


def _set_by(what: str, **default: Any) -> Any:
    """A dataclass field whose value `what` sets (`default=` passes the default on)."""
    return dataclasses.field(metadata={_SET_BY: what}, **default)


@dataclass(frozen=True)
class KVCacheShape:
    """What the fingerprint takes from one rank's KV pools (host pool and its device pool).
    The fields are in the order the fingerprint's wire dict lists them."""

    kv_dtype: str = _set_by("--kv-cache-dtype")  # the logical dtype, e.g. "bfloat16"
    attention: str  # "mha" or "mla"
    start_layer: int
    end_layer: int
    kv_heads: int  # KV heads on this rank; 1 for MLA
    head_dim: int  # MHA; 0 for MLA
    kv_lora_rank: int  # MLA; 0 for MHA
    qk_rope_head_dim: int  # MLA; 0 for MHA
    page_size: int = _set_by("--page-size")
    host_layout: str = _set_by("--hicache-mem-layout")
    # The pools of the host pool group one page lives in ("kv", or "kv+indexer" for NSA
    # models) and the NSA indexer's key shape (0 / "" without one).
    host_pools: str = "kv"
    index_head_dim: int = 0
    index_dtype: str = ""


# How a server with attention context parallelism holds a prefix's pages on its CP ranks.
# SGLang 0.5.12 all-gathers K/V in prefill and writes the whole result into every CP
# rank's pool (layers/utils/cp_utils.py): each CP rank holds every page.
CP_REPLICATED = "replicated"
# A fork's layout where each page lives on one CP rank only, its owner, chosen by the
# named owner function the fingerprint's `cp_owner` carries (`cp_owners.PageOwners`).
CP_SHARDED = "sharded"

# Fields a peer that predates them lacks (and refuses as unknown keys): left out of
# `to_dict` at these values, and read as them when missing.
_LEFT_OUT_AT: dict[str, int | str] = {
    "model_name": "",
    "attn_cp_size": 1,
    "attn_cp_mode": "",
    "cp_owner": "",
    "host_pools": "kv",
    "index_head_dim": 0,
    "index_dtype": "",
}


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything two ranks must agree on before one writes into the other's host pool."""

    protocol_version: int = _set_by("the sglang-kv-migration version each server runs")
    # `model_identity` of the model's config.json.
    model: str = _set_by(
        "the model's config.json (architecture and KV-shaping fields) with "
        "--json-model-override-args; the model path does not count"
    )
    shape: KVCacheShape  # on the wire, its fields at top level after `model`
    tp_size: int = _set_by("--tp-size")
    tp_rank: int
    pp_size: int = _set_by("--pp-size")
    pp_rank: int
    # SGLang's attention context parallelism (--attn-cp-size) and how its CP ranks hold
    # pages (`CP_REPLICATED`; "" without CP). Ranks pair by tp rank, which numbers CP
    # ranks too, so both sides must split their ranks the same way.
    attn_cp_size: int = _set_by("--attn-cp-size", default=1)
    attn_cp_mode: str = ""
    # With `CP_SHARDED`, the owner function's name (`cp_owners.PageOwners.describe`);
    # "" otherwise. Servers whose functions differ are refused naming this field.
    cp_owner: str = ""
    # SGLang's weight version, as the server's HTTP layer knows it when the request
    # arrives (RL weight updates change it): KV never crosses a weight update.
    weight_version: str = _set_by("--weight-version, and every weight update", default="")
    # --served-model-name where it was set, else "" (and left out of the wire form).
    model_name: str = _set_by(
        "--served-model-name, compared only where it is set: set it alike on both, or on neither",
        default="",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.shape, KVCacheShape):
            raise ValueError(f"fingerprint shape must be a KVCacheShape, got {self.shape!r}")
        flat = self._flat()
        for name, kind in _FIELD_TYPES.items():
            value = flat[name]
            ok = _is_int(value) if kind == "int" else isinstance(value, str)
            if not ok:
                raise ValueError(f"fingerprint field {name} must be {kind}, got {value!r}")
        self._check_cp_owner()

    def _check_cp_owner(self) -> None:
        """A sharded mode names a known owner function over its CP ranks; no other mode
        names one (a peer's fingerprint is hostile input)."""
        if self.attn_cp_mode == CP_SHARDED:
            PageOwners.parse(self.cp_owner, self.attn_cp_size)
        elif self.cp_owner:
            raise ValueError(
                f"fingerprint field cp_owner is only for attn_cp_mode={CP_SHARDED}, "
                f"got cp_owner={self.cp_owner!r} with attn_cp_mode={self.attn_cp_mode!r}"
            )

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
        cp_owners: PageOwners | None = None,
        model_name: str = "",
    ) -> LayoutFingerprint:
        """This rank's fingerprint (`sglang_adapter.kv_cache_shape` reads ``shape``;
        `model` is `model_identity`'s); `cp_owners` for a server whose CP ranks own
        disjoint pages (None: replicated); `model_name` the served name where one was set."""
        if cp_owners is not None and cp_owners.cp_size != attn_cp_size:
            raise ValueError(
                f"owner function over {cp_owners.cp_size} CP ranks on a server with "
                f"attn_cp_size={attn_cp_size}"
            )
        mode = "" if attn_cp_size <= 1 else CP_REPLICATED if cp_owners is None else CP_SHARDED
        return cls(
            protocol_version=PROTOCOL_VERSION,
            model=model,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            attn_cp_size=attn_cp_size,
            attn_cp_mode=mode,
            cp_owner="" if cp_owners is None else cp_owners.describe(),
            shape=shape,
            model_name=model_name,
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


# What sets each field a refusal can name (`explain`): the fields' own metadata.
SET_BY: Mapping[str, str] = {
    f.name: f.metadata[_SET_BY]
    for cls in (LayoutFingerprint, KVCacheShape)
    for f in dataclasses.fields(cls)
    if _SET_BY in f.metadata
}

# config.json fields that neither shape nor fill the KV of a prefix: file metadata,
# generation and tokenizer settings, runtime switches. Everything else counts, nested
# configs (a VLM's text_config) included: a field added by a later model family counts
# until it is known not to.
NOT_KV_FIELDS = frozenset(
    {
        "_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
        "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
        "auto_map", "custom_pipelines", "torch_dtype", "dtype", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "torchscript",
        "use_return_dict", "tie_word_embeddings", "architectures",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
        "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
        "suppress_tokens", "begin_suppress_tokens", "tokenizer_class", "prefix",
        "id2label", "label2id", "finetuning_task", "problem_type", "task_specific_params",
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
        "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "exponential_decay_length_penalty",
        "remove_invalid_values", "chunk_size_feed_forward", "pruned_heads",
    }
)  # fmt: skip


def model_identity(config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> str:
    """``"<architecture>:<digest>"`` of an HF `config.json` (as the file says it, with
    `overrides` merged over its top level as SGLang merges --json-model-override-args):
    the digest covers every field but `NOT_KV_FIELDS`, at every depth. Depends on the
    file's fields only, not on SGLang or transformers: one checkpoint gives one identity
    wherever it is copied."""
    merged = {**config, **(overrides or {})}
    architectures = merged.get("architectures") or [merged.get("model_type") or "unknown"]
    canonical = json.dumps(_kv_fields(merged), sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return f"{'+'.join(str(a) for a in architectures)}:{digest}"


def _kv_fields(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _kv_fields(v) for k, v in value.items() if k not in NOT_KV_FIELDS}
    if isinstance(value, list | tuple):
        return [_kv_fields(v) for v in value]
    return value


def explain(mismatch: str) -> str:
    """A `first_mismatch` line with what sets its field, for a refusal's message."""
    field = mismatch.partition(":")[0]
    where = SET_BY.get(field)
    return f"{mismatch} (set by {where})" if where else mismatch


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.lru_cache(maxsize=64)
def _with_weight_version(fingerprint: LayoutFingerprint, version: str) -> LayoutFingerprint:
    return dataclasses.replace(fingerprint, weight_version=version)
