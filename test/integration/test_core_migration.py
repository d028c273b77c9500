"""Migration core between two OS processes: Mooncake TCP on 127.0.0.1 plus a control pipe.

Each process (``_migration_peer.py``) holds a real HiRadixCache from the CPU harness and a
`MigrationSchedulerSide`; this test plays the HTTP layer and calls the handlers through
the pipe with the server.messages requests. The KV bytes cross only through the transfer engine.

One pair of processes serves the whole module (spawning one costs a full SGLang import);
every test rebuilds both servers' caches with the `setup` command.
"""

from __future__ import annotations

import pytest
from core_peers import LAYERS, Server, abort, allocate, commit, migrate, token_ids, transfer
from sglang_kv_migration.errors import ErrorKind

# The host path's core on every supported SGLang (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang


@pytest.fixture
def servers(migration_peers: tuple[Server, Server]) -> tuple[Server, Server]:
    """The session's pair of peer processes (conftest.py); every test calls `setup`."""
    return migration_peers


ROUNDTRIP = [
    (attention, layout, page_size)
    for attention in ("mha", "mla")
    for layout in ("layer_first", "page_first", "page_first_direct")
    for page_size in (1, 16)
]
# (pages, pages the target already holds, where the source's copy lives, where the target's)
SEQUENCES = [
    (1, 0, "device", "device"),
    (5, 2, "host", "host"),
    (260, 3, "device", "device"),
    (300, 20, "host", "device"),
]


@pytest.mark.parametrize(("attention", "layout", "page_size"), ROUNDTRIP)
def test_migrated_prefix_matches_source_bytes(servers, attention, layout, page_size):
    src, dst = servers
    sequences = [s for s in SEQUENCES if page_size == 1 or s[0] <= 260]
    total = sum(pages for pages, *_ in sequences) * page_size
    cfg = {
        "attention": attention,
        "host_layout": layout,
        "page_size": page_size,
        "device_tokens": max(1024, 2 * total),
    }
    src.setup(**cfg)
    dst.setup(**cfg)

    for i, (pages, held, src_where, dst_where) in enumerate(sequences):
        n = pages * page_size
        tokens = token_ids(n, start=100_000 * (i + 1))
        common = held * page_size
        if common:
            # Same token count and seed on both sides: the same random KV for the prefix.
            src.do("insert", tokens[:common], 10 + i, True)
            dst.do("insert", tokens[:common], 10 + i, True)
        src.do("insert", tokens, 50 + i, True)
        if src_where == "host":
            src.do("evict_device")
        if dst_where == "host":
            dst.do("evict_device")
        tail = [1, 2, 3] if page_size > 1 else []  # a partial page is never migrated
        src_before, dst_before = src.snapshot(), dst.snapshot()

        alloc, sent, committed = migrate(src, dst, tokens + tail)

        extra = n - common
        assert alloc.matched_token_size == common
        assert alloc.extra_token_size == extra
        assert len(alloc.ranks) == 1 and len(alloc.ranks[0].kv_indices) == extra
        assert sent.transferred_token_size == extra
        assert sent.transferred_bytes == extra * LAYERS * _token_bytes_per_layer(attention)
        assert committed.matched_after_commit == n
        device_len, host_len = dst.do("match", tokens)
        assert device_len + host_len == n
        assert host_len >= extra
        # Bookkeeping: the target spent exactly the migrated slots; nothing stays locked.
        dst_after, src_after = dst.snapshot(), src.snapshot()
        assert dst_after.host_available == dst_before.host_available - extra
        assert dst_after.total_lock_ref == 0 and dst_after.total_host_ref == 0
        assert src_after == src_before
        assert dst.do("pending") == 0

        src_len, src_kv = src.do("kv_digest", tokens)
        dst_len, dst_kv = dst.do("kv_digest", tokens)
        assert src_len == dst_len == n
        assert len(dst_kv) == LAYERS
        assert dst_kv == src_kv, f"{pages} pages: KV bytes differ in layers " + str(
            [j for j, (a, b) in enumerate(zip(src_kv, dst_kv, strict=True)) if a != b]
        )


def _token_bytes_per_layer(attention: str) -> int:
    # Harness defaults: MHA 2 KV heads x 16 dims for K and V, MLA 32 + 16; bfloat16.
    return 2 * 2 * 16 * 2 if attention == "mha" else (32 + 16) * 2


def test_kv_digest_negative_control(servers):
    # Different seeds give different digests: the byte comparison above can fail.
    src, dst = servers
    src.setup(attention="mha", host_layout="page_first", page_size=16)
    dst.setup(attention="mha", host_layout="page_first", page_size=16)
    tokens = token_ids(64, start=7)
    src.do("insert", tokens, 1, True)
    dst.do("insert", tokens, 2, True)
    assert src.do("kv_digest", tokens)[1] != dst.do("kv_digest", tokens)[1]


# --------------------------------------------------------------------------- watchdog


def test_watchdog_frees_an_uncommitted_allocation(servers):
    src, dst = servers
    cfg = {"attention": "mla", "host_layout": "page_first_direct", "page_size": 16}
    src.setup(**cfg)
    dst.setup(watchdog_timeout_s=0.2, **cfg)
    tokens = token_ids(8 * 16, start=3000)
    src.do("insert", tokens, 1, True)
    dst.do("insert", tokens[:32], 2, True)
    dst_before = dst.snapshot()

    alloc = allocate(src, dst, tokens, "wd")
    assert alloc.success, alloc.message
    # The bytes even arrive; only the commit is missing.
    assert transfer(src, dst, tokens, alloc).success
    during = dst.snapshot()
    assert during.host_available == dst_before.host_available - 96
    assert during.total_lock_ref > 0

    iterations = dst.do("expire_by_polling", 5000)
    assert iterations > 0, "the watchdog never freed the allocation"
    # The lock is gone; the slots stay quarantined until no granted write can land.
    expired = dst.snapshot()
    assert expired.total_lock_ref == dst_before.total_lock_ref
    assert expired.host_available == during.host_available
    assert dst.do("end_quarantine") == ["wd"]
    assert dst.snapshot() == dst_before
    refused = commit(dst, "wd")
    assert not refused.success
    assert refused.error_kind == ErrorKind.GONE.value
    assert "expired" in refused.message
    assert dst.snapshot() == dst_before
    assert dst.do("match", tokens) == (32, 0)


# --------------------------------------------------------------------------- interleaved


def test_32_interleaved_migrations_leave_pools_exact(servers):
    src, dst = servers
    ps = 16
    cfg = {"attention": "mha", "host_layout": "layer_first", "page_size": ps}
    src.setup(**cfg)
    dst.setup(**cfg)
    # 8 groups of 4 sequences; a group shares a 2-page stem, so migrations in flight
    # together race for the same pages on the target.
    seqs = []
    for g in range(8):
        stem = token_ids(2 * ps, start=10_000 * (g + 1))
        src.do("insert", stem, 100 + g, True)
        for j in range(4):
            tail = token_ids((1 + (g + j) % 3) * ps, start=10_000 * (g + 1) + 1000 * (j + 1))
            seqs.append(stem + tail)
    for k, seq in enumerate(seqs):
        src.do("insert", seq, 200 + k, True)
    src.do("evict_device")  # everything backed up: the source writes nothing more
    src_before, dst_before = src.snapshot(), dst.snapshot()

    committed_pages: set[tuple[int, ...]] = set()
    committed: list[list[int]] = []
    for batch in range(8):
        group = list(range(4 * batch, 4 * batch + 4))
        allocs = {}
        for k in group:
            allocs[k] = allocate(src, dst, seqs[k], f"il-{k}")
            assert allocs[k].success, allocs[k].message
        sent = {}
        for k in reversed(group):
            if k % 8 == 1:
                continue  # aborted before any byte moves
            sent[k] = transfer(src, dst, seqs[k], allocs[k])
            assert sent[k].success, sent[k].message
        for k in [group[2], group[0], group[3], group[1]]:
            if k % 8 in (1, 6):
                # With the source's receipt the slots are free at once; without one
                # (nothing was sent) they wait in quarantine.
                out = abort(dst, f"il-{k}", sent.get(k))
                assert out.success, out.message
                continue
            out = commit(dst, f"il-{k}", sent[k])
            assert out.success, out.message
            assert out.matched_after_commit == len(seqs[k])
            committed.append(seqs[k])
            committed_pages |= {tuple(seqs[k][: p + ps]) for p in range(0, len(seqs[k]), ps)}
        assert dst.do("pending") == 0
        assert dst.snapshot().total_lock_ref == 0

    assert len(committed) == 24
    assert src.snapshot() == src_before
    assert sorted(dst.do("end_quarantine")) == sorted(f"il-{k}" for k in range(1, 32, 8))
    dst_after = dst.snapshot()
    assert dst_after.host_available == dst_before.host_available - len(committed_pages) * ps
    assert dst_after.total_lock_ref == 0 and dst_after.total_host_ref == 0
    for seq in committed:
        assert dst.do("kv_digest", seq) == src.do("kv_digest", seq)
    for k, seq in enumerate(seqs):
        if k % 8 in (1, 6) and seq not in committed:
            # Only what a committed sibling brought (at most the stem) is there.
            device_len, host_len = dst.do("match", seq)
            assert device_len + host_len <= 2 * ps


# --------------------------------------------------------------------------- fingerprint


def test_page_size_mismatch_is_refused_before_any_byte_moves(servers):
    src, dst = servers
    src.setup(attention="mha", host_layout="page_first", page_size=16)
    dst.setup(attention="mha", host_layout="page_first", page_size=64)
    tokens = token_ids(8 * 64, start=40_000)
    src.do("insert", tokens, 1, True)
    dst_before = dst.snapshot()
    dst_bytes = dst.do("host_digest")

    # At allocate: the target compares the source's fingerprint with its own.
    refused = allocate(src, dst, tokens, "fp-1")
    assert not refused.success
    assert refused.error_kind == ErrorKind.CONFLICT.value
    assert "page_size" in refused.message
    assert dst.snapshot() == dst_before
    assert dst.do("pending") == 0

    # At transfer: the source compares the target's fingerprint with its own. Allocate
    # with a forged source fingerprint so the target hands out real slots.
    forged = dict(dst.info.ranks[0].fingerprint)
    alloc = allocate(src, dst, tokens, "fp-2", fingerprints=[forged])
    assert alloc.success, alloc.message
    src_before = src.snapshot()
    sent = transfer(src, dst, tokens, alloc)
    assert not sent.success
    assert sent.error_kind == ErrorKind.CONFLICT.value
    assert "page_size" in sent.message
    assert sent.transferred_bytes == 0
    assert dst.do("host_digest") == dst_bytes
    assert src.snapshot() == src_before
    # The request was refused before it claimed the grant: its receipt cannot say that
    # no write under the grant can land (another request could hold it), so the slots
    # wait out the write window.
    assert abort(dst, "fp-2", sent).success
    assert dst.snapshot().host_available < dst_before.host_available
    assert dst.do("end_quarantine") == ["fp-2"]
    assert dst.snapshot() == dst_before
