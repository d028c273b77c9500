"""NSA models (DeepSeek-V3.2 class) migrate between two OS processes over Mooncake TCP.

Each peer (`_migration_peer.py`) holds a real HiRadixCache over SGLang's NSA device pool
(`NSATokenToKVPool`), which gives it a `HostPoolGroup` host pool (the MLA KV pool plus
`NSAIndexerPoolHost`) and a `HybridCacheController`. A migration moves every pool of the
group at the target's slots; the target then loads the prefix back through SGLang's own
load-back (which reads both pools), and the MLA latent and the indexer's keys and scales
of every layer must equal the source's byte for byte. Page sizes 1 (SGLang's ROCm NSA
path, see `cpu_harness`) and 64 (CUDA's).
"""

from __future__ import annotations

import pytest
from core_peers import LAYERS, Server, allocate, migrate, token_ids

# Not ("page_first", 1): SGLang 0.5.12 cannot back such a pool up at all (the indexer's
# 132-byte page is not a whole number of the kernel's 8-byte words, and page_first pairs
# with io backend "kernel" only: "Unsupported IO backend: kernel").
CASES = [
    (layout, page_size)
    for layout in ("layer_first", "page_first", "page_first_direct")
    for page_size in (1, 64)
    if (layout, page_size) != ("page_first", 1)
]
# (pages, pages the target already holds, where the source's copy lives)
SEQUENCES = [(3, 0, "device"), (5, 2, "host")]
# Per token and layer: the MLA latent (32 + 16 bfloat16), the indexer's 128 fp8 keys and
# one fp32 scale.
TOKEN_LAYER_BYTES = (32 + 16) * 2 + 128 + 4


@pytest.fixture
def servers(migration_peers: tuple[Server, Server]) -> tuple[Server, Server]:
    return migration_peers


@pytest.mark.parametrize(("layout", "page_size"), CASES)
def test_nsa_prefix_matches_source_bytes(servers, layout, page_size):
    src, dst = servers
    cfg = {"attention": "nsa", "host_layout": layout, "page_size": page_size}
    src.setup(**cfg)
    dst.setup(**cfg)
    assert src.info.ranks[0].fingerprint["host_pools"] == "kv+indexer"

    for i, (pages, held, src_where) in enumerate(SEQUENCES):
        n = pages * page_size
        tokens = token_ids(n, start=100_000 * (i + 1))
        common = held * page_size
        if common:
            src.do("insert", tokens[:common], 10 + i, True)
            dst.do("insert", tokens[:common], 10 + i, True)
        src.do("insert", tokens, 50 + i, True)
        if src_where == "host":
            src.do("evict_device")
        dst_before = dst.snapshot()

        alloc, sent, committed = migrate(src, dst, tokens)

        extra = n - common
        assert (alloc.matched_token_size, alloc.extra_token_size) == (common, extra)
        assert sent.transferred_token_size == extra
        assert sent.transferred_bytes == extra * LAYERS * TOKEN_LAYER_BYTES
        assert committed.matched_after_commit == n
        assert dst.snapshot().host_available == dst_before.host_available - extra
        assert dst.do("pending") == 0

        src_len, src_kv = src.do("kv_digest", tokens)
        dst_len, dst_kv = dst.do("kv_digest", tokens)
        assert src_len == dst_len == n
        assert len(dst_kv) == 2 * LAYERS  # latent per layer, then indexer per layer
        assert dst_kv == src_kv, f"{pages} pages: bytes differ in buffers " + str(
            [j for j, (a, b) in enumerate(zip(src_kv, dst_kv, strict=True)) if a != b]
        )


def test_nsa_digest_sees_the_indexer(servers):
    """Negative control: the same latent with different indexer bytes differs."""
    src, dst = servers
    cfg = {"attention": "nsa", "host_layout": "page_first", "page_size": 64}
    src.setup(**cfg)
    dst.setup(**cfg)
    tokens = token_ids(128, start=7)
    src.do("insert", tokens, 1, True)
    dst.do("insert", tokens, 1, True)
    assert src.do("kv_digest", tokens)[1] == dst.do("kv_digest", tokens)[1]
    dst.do("scramble_indexer", tokens)
    src_kv, dst_kv = src.do("kv_digest", tokens)[1], dst.do("kv_digest", tokens)[1]
    assert src_kv[:LAYERS] == dst_kv[:LAYERS] and src_kv[LAYERS:] != dst_kv[LAYERS:]


@pytest.mark.parametrize(
    ("source", "target", "field"),
    [
        ("nsa", "mla", "host_pools: source=kv+indexer target=kv"),
        ("mla", "nsa", "host_pools: source=kv target=kv+indexer"),
    ],
)
def test_nsa_and_plain_mla_are_refused_naming_the_field(servers, source, target, field):
    src, dst = servers
    src.setup(attention=source, host_layout="page_first", page_size=64)
    dst.setup(attention=target, host_layout="page_first", page_size=64)
    tokens = token_ids(128, start=900)
    src.do("insert", tokens, 1, True)
    before = dst.snapshot()
    refused = allocate(src, dst, tokens, f"nsa-{source}")
    assert not refused.success
    assert field in refused.message
    assert dst.snapshot() == before
