"""Contract tests of `sglang_adapter` against the real SGLang 0.5.12 HiRadixCache on CPU.

Every function of the adapter runs here on real pools and a real radix tree (CPU
harness), for MHA and MLA pools and page sizes 1 and 16, so an SGLang upgrade that
changes what the adapter relies on fails here first. Sizes are in tokens and always
multiples of 16, so the same numbers are whole pages at both page sizes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cpu_harness import Harness
from sglang_kv_migration import sglang_adapter as adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.host.path import HostPath
from sglang_kv_migration.server.target.pending import PendingMigrations
from sglang_kv_migration.sglang_adapter import radix_tree

CONFIGS = [("mha", 1), ("mha", 16), ("mla", 1), ("mla", 16)]
CONFIG_IDS = [f"{a}-page{p}" for a, p in CONFIGS]


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _path_tokens(h: Harness, node) -> int:
    return sum(len(n.key) for n in adapter.path_from_root(h.cache, node))


def _tree_state(h: Harness) -> list[tuple]:
    """Everything eviction could change: nodes, their keys, device and host slots."""
    return sorted(
        (
            n.id,
            tuple(n.key.token_ids),
            None if n.value is None else tuple(n.value.tolist()),
            None if n.host_value is None else tuple(n.host_value.tolist()),
        )
        for n in h.iter_nodes()
    )


def _device_slots_in_tree(h: Harness) -> set[int]:
    return {int(s) for n in h.iter_nodes() if n.value is not None for s in n.value.tolist()}


def _evict_device(h: Harness, num_tokens: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return h.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted


def _two_tier_tree(h: Harness) -> tuple[list[int], torch.Tensor]:
    """P (32 tokens) on device and backed up, then 64 more tokens of T on host only.

    Returns T and P's device slots.
    """
    tokens = _tokens(96)
    prefix_slots = h.insert_random(tokens[:32], seed=1)
    h.insert_random(tokens, seed=2)
    h.write_back_all()
    # Only the leaf (T's last 64 tokens) is an evictable device leaf.
    assert _evict_device(h, 64) == 64
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (32, 64)
    return tokens, prefix_slots


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_match_held_prefix_counts_device_and_host(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    # Less than a page (page size 16) or nothing at all: the root, length 0.
    empty = adapter.match_held_prefix(h.cache, _tokens(page_size - 1), None)
    assert (empty.length, empty.device_length) == (0, 0)
    assert empty.last_node is h.cache.root_node

    tokens, _ = _two_tier_tree(h)
    # A partial last page and tokens the tree does not hold are not counted.
    query = tokens + _tokens(32, start=50_000) + ([1, 2, 3] if page_size > 1 else [])
    held = adapter.match_held_prefix(h.cache, query, None)
    assert (held.length, held.device_length) == (96, 32)
    assert held.last_node.evicted  # the deepest node of the prefix is host-only
    assert _path_tokens(h, held.last_node) == 96

    # Ending inside a host-only node: the node is split so it ends exactly at the match.
    held = adapter.match_held_prefix(h.cache, tokens[:48] + _tokens(16, start=60_000), None)
    assert (held.length, held.device_length) == (48, 32)
    assert _path_tokens(h, held.last_node) == 48
    # Ending inside the device prefix.
    held = adapter.match_held_prefix(h.cache, tokens[:16] + _tokens(16, start=70_000), None)
    assert (held.length, held.device_length) == (16, 16)
    assert not held.last_node.evicted
    assert _path_tokens(h, held.last_node) == 16
    # Another namespace holds nothing.
    other = adapter.match_held_prefix(h.cache, tokens, "other-lora")
    assert (other.length, other.last_node) == (0, h.cache.root_node)


def _shape(h: Harness) -> list[tuple]:
    """The tree as keys and slots by path (node ids differ between two harnesses)."""

    def walk(node, path: tuple) -> list[tuple]:
        rows = []
        for child in node.children.values():
            here = path + (tuple(child.key.token_ids), child.key.extra_key)
            rows.append(
                (
                    here,
                    None if child.value is None else tuple(child.value.tolist()),
                    None if child.host_value is None else tuple(child.host_value.tolist()),
                    child.lock_ref,
                )
            )
            rows += walk(child, here)
        return rows

    return sorted(walk(h.cache.root_node, ()), key=repr)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_the_adapters_walk_finds_and_splits_what_sglangs_match_prefix_does(
    harness_factory, attention, page_size
):
    """`_match_prefix` (whole-list compares) against SGLang's own `match_prefix` on a
    twin tree: the same results, splits and tree after every lookup, over device,
    host-only and namespaced branches and lookups that end anywhere."""
    import random

    ours, theirs = (
        harness_factory(attention=attention, page_size=page_size, device_tokens=8192)
        for _ in range(2)
    )
    rng = random.Random(7)
    trunk = _tokens(300)
    sequences = [
        trunk[: rng.randrange(1, 300)] + _tokens(rng.randrange(1, 40), start=10_000 * (i + 1))
        for i in range(12)
    ]
    for h in (ours, theirs):
        for i, seq in enumerate(sequences):
            h.insert_random(seq, extra_key="ns" if i % 4 == 3 else None, seed=i)
        h.write_back_all()
        assert _evict_device(h, 150) > 0  # some branches are host-only now
    assert _shape(ours) == _shape(theirs)
    assert radix_tree._fast_walk_applies(ours.cache, adapter.make_key(ours.cache, trunk, None))
    lookups = [seq[: rng.randrange(1, len(seq) + 1)] for seq in sequences]
    lookups += [seq + [rng.randrange(1, 99)] for seq in sequences[:4]]
    # Diverging inside a node, past its first page, and at once.
    lookups += [trunk[:k] + _tokens(40, start=900_000 + k) for k in (1, 57, 150, 299)]
    lookups += [[123_456_789] * 20]
    for i, ids in enumerate(lookups):
        extra = "ns" if i % 5 == 4 else None
        mine = radix_tree._match_prefix(ours.cache, adapter.make_key(ours.cache, ids, extra))
        result = theirs.match(ids, extra)
        assert radix_tree._joined(ours.cache, mine.device_values).tolist() == (
            result.device_indices.tolist()
        )
        assert mine.host_hit_length == result.host_hit_length
        for node, other in (
            (mine.last_device_node, result.last_device_node),
            (mine.last_host_node, result.last_host_node),
        ):
            assert _path_tokens(ours, node) == _path_tokens(theirs, other)
        assert _shape(ours) == _shape(theirs), f"trees differ after lookup {i}"


def test_eagle_keys_and_other_caches_use_sglangs_own_match(harness_factory, monkeypatch):
    h = harness_factory(attention="mha", page_size=16)
    tokens, _ = _two_tier_tree(h)
    key = adapter.make_key(h.cache, tokens, None)
    assert radix_tree._fast_walk_applies(h.cache, key)
    key.is_bigram = True  # EAGLE's bigram keys: SGLang's walk
    assert not radix_tree._fast_walk_applies(h.cache, key)

    class OtherMatch(type(h.cache)):  # a subclass that matches its own way
        def _match_prefix_helper(self, node, key):
            return super()._match_prefix_helper(node, key)

    monkeypatch.setattr(h.cache, "__class__", OtherMatch)
    assert not radix_tree._fast_walk_applies(h.cache, adapter.make_key(h.cache, tokens, None))
    monkeypatch.setattr(radix_tree, "_walk", None)  # never reached
    held = adapter.match_held_prefix(h.cache, tokens, None)
    assert (held.length, held.device_length) == (96, 32)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_match_device_prefix_excludes_host_only_parts(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    tokens, prefix_slots = _two_tier_tree(h)

    dev = adapter.match_device_prefix(h.cache, tokens, None)
    assert dev.length == 32
    assert dev.indices.dtype == torch.int64
    assert dev.indices.tolist() == prefix_slots.tolist()
    assert not dev.last_node.evicted
    assert _path_tokens(h, dev.last_node) == 32
    held = dev.as_held()
    assert (held.length, held.device_length, held.last_node) == (32, 32, dev.last_node)

    # Everything evicted from device: nothing is held on device, though all is on host.
    h.evict_device_all()
    dev = adapter.match_device_prefix(h.cache, tokens, None)
    assert dev.length == 0 and len(dev.indices) == 0
    assert dev.last_node is h.cache.root_node
    assert adapter.match_held_prefix(h.cache, tokens, None).length == 96
    # Less than a page: empty int64 indices at the root.
    short = adapter.match_device_prefix(h.cache, tokens[: page_size - 1], None)
    assert short.length == 0 and short.indices.dtype == torch.int64
    assert short.last_node is h.cache.root_node


def test_make_key_is_page_aligned_and_keeps_the_namespace(harness_factory):
    h = harness_factory(page_size=16)
    key = adapter.make_key(h.cache, _tokens(40), "ns")
    assert key.token_ids == _tokens(32)
    assert key.extra_key == "ns"
    assert len(adapter.make_key(h.cache, _tokens(15), None)) == 0
    assert adapter.key_parts(key) == (_tokens(32), "ns")


def test_path_from_root(harness_factory):
    h = harness_factory(page_size=16)
    assert adapter.path_from_root(h.cache, h.cache.root_node) == []
    tokens = _tokens(64)
    h.insert_random(tokens[:16], seed=1)
    h.insert_random(tokens[:32], seed=2)
    h.insert_random(tokens, seed=3)
    leaf = adapter.match_held_prefix(h.cache, tokens, None).last_node
    path = adapter.path_from_root(h.cache, leaf)
    assert [len(n.key) for n in path] == [16, 16, 32]
    assert path[0].parent is h.cache.root_node
    assert all(child.parent is parent for parent, child in zip(path, path[1:], strict=False))
    assert path[-1] is leaf
    assert [t for n in path for t in n.key.token_ids] == tokens


# --------------------------------------------------------------------------- device slots


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_alloc_device_slots_from_the_free_list(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=256)
    h.insert_random(_tokens(64), seed=1)
    h.write_back_all()
    before, tree = h.snapshot(), _tree_state(h)
    assert adapter.device_available_size(h.cache) == before.device_available

    slots = adapter.alloc_device_slots(h.cache, 96)
    assert slots.dtype == torch.int64 and len(slots) == 96
    assert len(set(slots.tolist())) == 96
    assert not set(slots.tolist()) & _device_slots_in_tree(h)
    assert 0 not in slots.tolist()  # slot 0 is SGLang's padding slot
    for p in range(0, 96, page_size):  # whole pages, contiguous within a page
        page = slots[p : p + page_size].tolist()
        assert page[0] % page_size == 0 and page == list(range(page[0], page[0] + page_size))
    assert adapter.device_available_size(h.cache) == before.device_available - 96
    assert _tree_state(h) == tree  # nothing evicted

    adapter.free_device_slots(h.cache, torch.empty(0, dtype=torch.int64))  # no-op
    assert adapter.device_available_size(h.cache) == before.device_available - 96
    adapter.free_device_slots(h.cache, slots)
    assert h.snapshot() == before


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_alloc_device_slots_evicts_unlocked_nodes(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=256)
    unlocked, locked = _tokens(96), _tokens(96, start=20_000)
    h.insert_random(unlocked, seed=1)
    locked_slots = h.insert_random(locked, seed=2)
    h.write_back_all()
    node = adapter.match_device_prefix(h.cache, locked, None).last_node
    h.cache.inc_lock_ref(node)
    free = adapter.device_available_size(h.cache)
    evictable = h.cache.evictable_size()
    assert (free, evictable) == (64, 96)

    slots = adapter.alloc_device_slots(h.cache, 128)
    assert len(slots) == 128 and len(set(slots.tolist())) == 128
    # Eviction made room: the unlocked sequence left the device (its host copy stays),
    # the locked one kept its slots.
    assert h.cache.evictable_size() < evictable
    assert len(h.match(unlocked).device_indices) < 96
    assert adapter.match_held_prefix(h.cache, unlocked, None).length == 96
    assert h.match(locked).device_indices.tolist() == locked_slots.tolist()
    assert not set(slots.tolist()) & _device_slots_in_tree(h)
    evicted = evictable - h.cache.evictable_size()
    assert adapter.device_available_size(h.cache) == free + evicted - 128
    adapter.free_device_slots(h.cache, slots)
    h.cache.dec_lock_ref(node)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_alloc_device_slots_refusal_evicts_nothing(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=256)
    h.insert_random(_tokens(96), seed=1)
    locked = _tokens(96, start=20_000)
    h.insert_random(locked, seed=2)
    h.write_back_all()
    node = adapter.match_device_prefix(h.cache, locked, None).last_node
    h.cache.inc_lock_ref(node)
    before, tree = h.snapshot(), _tree_state(h)
    free, evictable = before.device_available, before.evictable
    assert (free, evictable) == (64, 96)

    need = free + evictable + 16
    with pytest.raises(MigrationError) as info:
        adapter.alloc_device_slots(h.cache, need)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    message = info.value.message
    assert f"{need} token slots needed" in message
    assert f"{free} free and {evictable} evictable" in message
    assert "nothing was evicted" in message
    assert h.snapshot() == before
    assert h.cache.evictable_size() == evictable
    assert _tree_state(h) == tree
    # Exactly free + evictable is still feasible.
    slots = adapter.alloc_device_slots(h.cache, free + evictable)
    assert len(slots) == free + evictable
    adapter.free_device_slots(h.cache, slots)
    h.cache.dec_lock_ref(node)


# --------------------------------------------------------------------------- device insert


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_insert_device_pages_then_matches_on_device(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    tokens = _tokens(96)
    prefix_slots = h.insert_random(tokens[:32], seed=1)
    h.write_back_all()
    anchor = adapter.match_device_prefix(h.cache, tokens, None).last_node
    h.cache.inc_lock_ref(anchor)
    slots = adapter.alloc_device_slots(h.cache, 64)
    key = adapter.make_key(h.cache, tokens, None)

    assert adapter.insert_device_pages(h.cache, key, 32, slots) == 0
    m = h.match(tokens)
    assert m.host_hit_length == 0
    assert m.device_indices.tolist() == prefix_slots.tolist() + slots.tolist()
    h.cache.dec_lock_ref(anchor)
    h.drain_writes()  # write-through locks the new nodes until its copy is acknowledged
    assert h.snapshot().total_lock_ref == 0
    # Ordinary device nodes: evictable like any other.
    assert h.cache.evictable_size() == 96

    # From the root (nothing held): the whole key gets our slots.
    other = _tokens(48, start=30_000)
    slots = adapter.alloc_device_slots(h.cache, 48)
    assert (
        adapter.insert_device_pages(h.cache, adapter.make_key(h.cache, other, None), 0, slots) == 0
    )
    assert h.match(other).device_indices.tolist() == slots.tolist()


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_insert_device_pages_race_returns_the_overlap(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    tokens = _tokens(96)
    prefix_slots = h.insert_random(tokens[:32], seed=1)
    anchor = adapter.match_device_prefix(h.cache, tokens, None).last_node
    h.cache.inc_lock_ref(anchor)
    ours = adapter.alloc_device_slots(h.cache, 64)
    # A request prefilled 48 of the same tokens first.
    racer = h.insert_random(tokens[:80], seed=2)
    assert racer[:32].tolist() == prefix_slots.tolist()

    key = adapter.make_key(h.cache, tokens, None)
    assert adapter.insert_device_pages(h.cache, key, 32, ours) == 48
    m = h.match(tokens)
    assert m.device_indices.tolist() == racer.tolist() + ours[48:].tolist()
    # Our first 48 slots are not in the tree: the caller frees them.
    assert not set(ours[:48].tolist()) & _device_slots_in_tree(h)
    h.cache.dec_lock_ref(anchor)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_insert_device_pages_adopts_host_only_nodes(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    tokens, prefix_slots = _two_tier_tree(h)
    host_only = [n for n in h.iter_nodes() if n.evicted]
    assert host_only and all(n.backuped for n in host_only)
    anchor = adapter.match_device_prefix(h.cache, tokens, None).last_node
    h.cache.inc_lock_ref(anchor)
    slots = adapter.alloc_device_slots(h.cache, 64)
    key = adapter.make_key(h.cache, tokens, None)

    # The host-only range is not "already present on device": nothing to free.
    assert adapter.insert_device_pages(h.cache, key, 32, slots) == 0
    m = h.match(tokens)
    assert m.host_hit_length == 0
    assert m.device_indices.tolist() == prefix_slots.tolist() + slots.tolist()
    # The adopting nodes keep their host copies.
    assert all(not n.evicted and n.backuped for n in h.iter_nodes())
    h.cache.dec_lock_ref(anchor)


def test_insert_device_pages_refuses_a_prefix_not_on_device(harness_factory):
    h = harness_factory(page_size=16)
    tokens, _ = _two_tier_tree(h)
    tree = _tree_state(h)
    slots = adapter.alloc_device_slots(h.cache, 16)
    key = adapter.make_key(h.cache, tokens + _tokens(16, start=40_000), None)
    with pytest.raises(MigrationError) as info:
        # Only 32 tokens are on device, not 96.
        adapter.insert_device_pages(h.cache, key, 96, slots)
    assert info.value.kind is ErrorKind.INTERNAL
    assert "32 of 96" in info.value.message
    assert _tree_state(h) == tree
    adapter.free_device_slots(h.cache, slots)


# --------------------------------------------------------------------------- host slots


def _fill_host_with_host_only_nodes(h: Harness, sequences: int = 3) -> list[list[int]]:
    seqs = [_tokens(128, start=100_000 * (i + 1)) for i in range(sequences)]
    for i, seq in enumerate(seqs):
        h.insert_random(seq, seed=10 + i)
    h.evict_device_all()
    return seqs


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_alloc_host_slots_evicts_only_when_needed(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=512)
    seqs = _fill_host_with_host_only_nodes(h)
    before, tree = h.snapshot(), _tree_state(h)
    # A free-list hit evicts nothing.
    slots = adapter.alloc_host_slots(h.cache, 64)
    assert len(slots) == 64 and len(set(slots.tolist())) == 64
    assert h.host_pool.available_size() == before.host_available - 64
    assert _tree_state(h) == tree
    adapter.free_host_slots(h.cache, torch.empty(0, dtype=torch.int64))  # no-op
    adapter.free_host_slots(h.cache, slots)
    assert h.snapshot() == before

    # Leave 32 free: 96 more need 64 evicted from the unprotected host-only pages.
    hog = h.host_pool.alloc(before.host_available - 32)
    evictable = adapter.host_evictable_size(h.cache)
    assert evictable == 3 * 128
    slots = adapter.alloc_host_slots(h.cache, 96)
    assert len(slots) == 96
    assert adapter.host_evictable_size(h.cache) < evictable
    held = sum(adapter.match_held_prefix(h.cache, s, None).length for s in seqs)
    assert 3 * 128 - held >= 64
    host_slots_in_tree = {
        int(s) for n in h.iter_nodes() if n.host_value is not None for s in n.host_value.tolist()
    }
    assert not set(slots.tolist()) & host_slots_in_tree
    h.host_pool.free(hog)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_alloc_host_slots_oversized_evicts_nothing(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=512)
    seqs = _fill_host_with_host_only_nodes(h)
    hog = h.host_pool.alloc(h.host_pool.available_size() - 32)
    before, tree = h.snapshot(), _tree_state(h)
    free, evictable = before.host_available, adapter.host_evictable_size(h.cache)
    assert (free, evictable) == (32, 3 * 128)

    need = free + evictable + 16
    with pytest.raises(MigrationError) as info:
        adapter.alloc_host_slots(h.cache, need)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert f"{need} token slots needed, {free} free and {evictable} evictable" in (
        info.value.message
    )
    assert "nothing was evicted" in info.value.message
    assert h.snapshot() == before
    assert _tree_state(h) == tree
    assert all(adapter.match_held_prefix(h.cache, s, None).length == 128 for s in seqs)
    h.host_pool.free(hog)


def _host_freed_by_evict_host(h: Harness) -> int:
    before = h.host_pool.available_size()
    h.cache.evict_host(10**9)
    return int(h.host_pool.available_size() - before)


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_host_evictable_size_matches_what_evict_host_frees(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=512)
    # Host-only: a shared 32-token node with two 64-token children (all evictable) ...
    base = _tokens(32)
    h.insert_random(base + _tokens(64, start=5000), seed=1)
    h.insert_random(base + _tokens(64, start=6000), seed=2)
    # ... a protected host-only sequence (a source is sending it) ...
    protected = _tokens(64, start=7000)
    h.insert_random(protected, seed=3)
    h.evict_device_all()
    protected_node = adapter.match_held_prefix(h.cache, protected, None).last_node
    protected_node.protect_host()
    # ... and a device node, backed up, with a host-only child (only the child counts).
    dev = _tokens(96, start=8000)
    h.insert_random(dev[:32], seed=4)
    h.insert_random(dev, seed=5)
    h.write_back_all()
    assert _evict_device(h, 64) == 64

    evictable = adapter.host_evictable_size(h.cache)
    assert evictable == 32 + 64 + 64 + 64
    assert _host_freed_by_evict_host(h) == evictable
    assert adapter.host_evictable_size(h.cache) == 0
    assert adapter.match_held_prefix(h.cache, protected, None).length == 64
    assert len(h.match(dev).device_indices) == 32
    protected_node.release_host()
    assert adapter.host_evictable_size(h.cache) == 64
    assert _host_freed_by_evict_host(h) == 64


def test_host_evictable_size_excludes_a_locked_host_only_leaf(harness_factory):
    h = harness_factory(page_size=16, device_tokens=512)
    locked = _tokens(64, start=7000)
    h.insert_random(locked, seed=1)
    h.insert_random(_tokens(64, start=9000), seed=2)
    h.evict_device_all()
    node = adapter.match_held_prefix(h.cache, locked, None).last_node
    h.cache.inc_lock_ref(node)  # what PendingMigrations.allocate does with its anchor
    try:
        evictable = adapter.host_evictable_size(h.cache)
        assert _host_freed_by_evict_host(h) == 64
        assert evictable == 64
    finally:
        h.cache.dec_lock_ref(node)


def test_host_allocation_never_evicts_its_own_locked_host_only_anchor(harness_factory):
    ps = 16
    h = harness_factory(page_size=ps, device_tokens=512)
    base = _tokens(2 * ps)
    # Host-only: the target's prefix with two children that diverge from the migration.
    h.insert_random(base + _tokens(4 * ps, start=5000), seed=1)
    h.insert_random(base + _tokens(4 * ps, start=6000), seed=2)
    h.evict_device_all()
    hog = h.host_pool.alloc(h.host_pool.available_size() - 4 * ps)
    tokens = base + _tokens(13 * ps, start=7000)
    pending = PendingMigrations(h.cache, 5.0)
    try:
        # 208 needed, 64 free: the two children (128) are evictable, the prefix is not.
        alloc = pending.allocate("m", tokens, None, path=HostPath(h.cache))
    except MigrationError as e:
        # Refusing is also correct (64 + 128 < 208): the prefix must be kept either way.
        assert e.kind is ErrorKind.UNAVAILABLE
        assert adapter.match_held_prefix(h.cache, tokens, None).length == 2 * ps
        return
    finally:
        h.host_pool.free(hog)
    assert alloc.matched_length == 2 * ps
    anchor = pending.get("m").anchor
    assert anchor.parent.children.get(anchor.key.child_key(ps)) is anchor, "anchor evicted"
    assert pending.commit("m") == len(tokens)


# --------------------------------------------------------------------------- host insert, pins


def test_insert_host_pages_hangs_host_only_nodes_below_the_anchor(harness_factory):
    ps = 16
    h = harness_factory(page_size=ps)
    tokens = _tokens(96)
    h.insert_random(tokens[:32], seed=1)
    h.write_back_all()
    anchor = adapter.match_held_prefix(h.cache, tokens, None).last_node
    h.cache.inc_lock_ref(anchor)
    key = adapter.make_key(h.cache, tokens, None)
    slots = adapter.alloc_host_slots(h.cache, 64)

    assert adapter.insert_host_pages(h.cache, anchor, key, 32, slots) == 0
    m = h.match(tokens)
    assert (len(m.device_indices), m.host_hit_length) == (32, 64)
    leaf = adapter.match_held_prefix(h.cache, tokens, None).last_node
    assert leaf.evicted and leaf.host_value.tolist() == slots.tolist()
    assert not adapter.needs_page_hashes(h.cache)  # no storage backend, no KV events
    assert leaf.hash_value == [None] * 4  # as SGLang's own inserts leave them then
    # A second insert of the same range finds it all present.
    again = adapter.alloc_host_slots(h.cache, 64)
    assert adapter.insert_host_pages(h.cache, anchor, key, 32, again) == 64
    adapter.free_host_slots(h.cache, again)
    h.cache.dec_lock_ref(anchor)


def test_insert_host_pages_chains_page_hashes_when_storage_needs_them(harness_factory):
    ps = 16
    h = harness_factory(page_size=ps)
    tokens = _tokens(96)
    h.insert_random(tokens[:32], seed=1)
    h.write_back_all()
    anchor = adapter.match_held_prefix(h.cache, tokens, None).last_node
    key = adapter.make_key(h.cache, tokens, None)
    slots = adapter.alloc_host_slots(h.cache, 64)
    h.cache.enable_storage = True  # as with --hicache-storage-backend; only read here
    try:
        assert adapter.needs_page_hashes(h.cache)
        assert adapter.insert_host_pages(h.cache, anchor, key, 32, slots) == 0
    finally:
        h.cache.enable_storage = False
    leaf = adapter.match_held_prefix(h.cache, tokens, None).last_node
    assert leaf.hash_value == adapter.page_hashes(key, ps)[2:]


def test_page_hashes_chain_like_sglang(harness_factory):
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import compute_node_hash_values

    key = RadixKey(_tokens(64), extra_key="ns")
    hashes = adapter.page_hashes(key, 16)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    root = SimpleNamespace(key=RadixKey([]), hash_value=[])
    assert hashes == compute_node_hash_values(SimpleNamespace(key=key, parent=root), 16)
    parent = SimpleNamespace(key=key[:32], hash_value=hashes[:2])
    assert hashes[2:] == compute_node_hash_values(SimpleNamespace(key=key[32:], parent=parent), 16)
    # Position-aware: the same page after another prefix hashes differently.
    moved = RadixKey(_tokens(16, start=1) + _tokens(48, start=1016), extra_key="ns")
    assert adapter.page_hashes(moved, 16)[1:] != hashes[1:]


@pytest.mark.parametrize("page_size", [1, 16])
def test_pin_host_pages_protects_and_unpin_releases(harness_factory, page_size):
    # write_back: device nodes have no host copy until something writes them back.
    h = harness_factory(page_size=page_size, write_policy="write_back")
    tokens = _tokens(96)
    h.insert_random(tokens[:32], seed=1)
    h.insert_random(tokens, seed=2)
    leaf = adapter.match_held_prefix(h.cache, tokens, None).last_node
    nodes = adapter.path_from_root(h.cache, leaf)
    assert len(nodes) == 2 and not any(n.backuped for n in nodes)
    host_before = h.host_pool.available_size()

    pinned = adapter.pin_host_pages(h.cache, tokens, None, 16, 96)
    try:
        # Each path node's copy is either waited for or already complete.
        assert pinned.copying_ids <= {n.id for n in nodes}
        in_flight = {n.id for n in nodes if n.id in h.cache.ongoing_write_through}
        assert in_flight <= pinned.copying_ids
        assert adapter.host_pages_ready(h.cache, pinned) == (not pinned.copying_ids)
        assert all(n.backuped and n.host_ref_counter == 1 for n in nodes)
        assert h.host_pool.available_size() == host_before - 96
        host_values = torch.cat([n.host_value for n in nodes])
        assert pinned.host_indices.tolist() == host_values[16:].tolist()
        assert (pinned.start, pinned.end) == (16, 96)
        h.cache.writing_check()  # what the scheduler loop runs between polls
        assert adapter.host_pages_ready(h.cache, pinned)
        # Pinned host copies survive device eviction followed by host eviction.
        assert _evict_device(h, 10**9) == 96
        h.cache.evict_host(10**9)
        assert h.match(tokens).host_hit_length == 96
    finally:
        adapter.unpin_host_pages(pinned)
    assert pinned.nodes == []
    snap = h.snapshot()
    assert (snap.total_host_ref, snap.total_lock_ref) == (0, 0)
    h.cache.evict_host(10**9)
    assert adapter.match_held_prefix(h.cache, tokens, None).length == 0
    assert h.host_pool.available_size() == host_before


def test_pin_under_write_back_policy_leaks_no_lock_when_the_scheduler_evicts(harness_factory):
    h = harness_factory(page_size=16, write_policy="write_back")
    tokens, other = _tokens(64), _tokens(64, start=5000)
    h.insert_random(tokens, seed=1)
    h.insert_random(other, seed=2)
    pinned = adapter.pin_host_pages(h.cache, tokens, None, 0, 64)
    # The scheduler makes room for a new request before its next writing_check.
    assert _evict_device(h, 64) == 64
    h.cache.writing_check()
    assert adapter.host_pages_ready(h.cache, pinned)
    adapter.unpin_host_pages(pinned)
    snap = h.snapshot()
    assert snap.total_lock_ref == 0, "the pinned prefix stays locked on device forever"
    assert _evict_device(h, 10**9) == 64


def test_pin_host_pages_refuses_bad_and_missing_ranges(harness_factory):
    h = harness_factory(page_size=16)
    tokens = _tokens(64)
    h.insert_random(tokens, seed=1)
    h.write_back_all()
    for start, end in [(8, 64), (0, 40), (32, 32), (-16, 32)]:
        with pytest.raises(MigrationError) as info:
            adapter.pin_host_pages(h.cache, tokens, None, start, end)
        assert info.value.kind is ErrorKind.BAD_REQUEST, (start, end)
    with pytest.raises(MigrationError) as info:
        adapter.pin_host_pages(h.cache, tokens + _tokens(16, start=9000), None, 0, 80)
    assert info.value.kind is ErrorKind.CONFLICT
    assert "64 tokens of the prefix, 80 needed" in info.value.message
    assert h.snapshot().total_host_ref == 0


def test_write_back_path_waits_for_host_copies(harness_factory):
    h = harness_factory(page_size=16, write_policy="write_back")
    tokens = _tokens(64)
    h.insert_random(tokens[:32], seed=1)
    h.insert_random(tokens, seed=2)
    leaf = adapter.match_held_prefix(h.cache, tokens, None).last_node
    nodes = adapter.path_from_root(h.cache, leaf)
    assert len(nodes) == 2 and not any(n.backuped for n in nodes)
    adapter.write_back_path(h.cache, nodes)
    assert all(n.backuped for n in nodes)
    assert not h.cache.ongoing_write_through
    snap = h.snapshot()
    assert (snap.total_host_ref, snap.total_lock_ref) == (0, 0)
    # Now on host too: evicting the device copies leaves the whole prefix held.
    _evict_device(h, 10**9)
    assert h.match(tokens).host_hit_length == 64


# --------------------------------------------------------------------------- pools


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_pools_and_device_kv_buffers(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size, layer_num=3)
    assert adapter.host_pool(h.cache) is h.host_pool
    assert adapter.device_pool(h.cache) is h.device_pool
    buffers = adapter.device_kv_buffers(h.cache)
    pool = h.device_pool
    if attention == "mha":
        assert len(buffers) == 2 * 3
        expected = [*pool.k_buffer, *pool.v_buffer]
    else:
        assert len(buffers) == 3
        expected = list(pool.kv_buffer)
    assert [b.data_ptr() for b in buffers] == [b.data_ptr() for b in expected]
    # One row per token slot: every slot the allocator hands out is a row.
    assert all(b.shape[0] >= h.allocator.size + page_size for b in buffers)
    slots = h.insert_random(_tokens(48), seed=7)
    kv = h.read_device_kv(slots)
    if attention == "mha":
        rows = [
            torch.stack([k[slots], v[slots]]) for k, v in zip(buffers[:3], buffers[3:], strict=True)
        ]
    else:
        rows = [b[slots] for b in buffers]
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(rows, kv, strict=True)
    )


def test_device_kv_buffers_refuses_an_unknown_pool():
    allocator = SimpleNamespace(get_kvcache=lambda: object())
    cache = SimpleNamespace(token_to_kv_pool_allocator=allocator)
    with pytest.raises(MigrationError) as info:
        adapter.device_kv_buffers(cache)
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "object" in info.value.message


def test_pending_device_write_streams_is_the_load_stream(harness_factory):
    h = harness_factory()
    assert adapter.pending_device_write_streams(h.cache) == [h.controller.load_stream]


@pytest.mark.parametrize("page_size", [1, 16])
def test_take_device_slots_after_a_reset(harness_factory, page_size):
    h = harness_factory(page_size=page_size)
    slots = adapter.alloc_device_slots(h.cache, 4 * page_size)
    h.allocator.clear()  # what a cache reset does: every slot free again
    full = h.allocator.available_size()
    adapter.take_device_slots(h.cache, slots)
    assert h.allocator.available_size() == full - len(slots)
    again = adapter.alloc_device_slots(h.cache, h.allocator.available_size())
    assert set(again.tolist()).isdisjoint(slots.tolist())


def test_take_host_slots_after_a_reset(harness_factory):
    h = harness_factory(page_size=16)
    slots = adapter.alloc_host_slots(h.cache, 64)
    h.host_pool.clear()
    adapter.take_host_slots(h.cache, slots)
    assert h.host_pool.available_size() == h.host_pool.size - 64
    assert set(h.host_pool.free_slots.tolist()).isdisjoint(slots.tolist())


def test_cache_generation_changes_on_reset(harness_factory):
    h = harness_factory()
    first = adapter.cache_generation(h.cache)
    h.insert_random(_tokens(64), seed=1)
    h.evict_device_all()
    assert adapter.cache_generation(h.cache) is first
    h.cache.reset()
    second = adapter.cache_generation(h.cache)
    assert second is not first
    assert adapter.cache_generation(h.cache) is second


def test_is_hiradix_cache(harness_factory):
    h = harness_factory()
    assert adapter.is_hiradix_cache(h.cache)
    assert not adapter.is_hiradix_cache(object())


# --------------------------------------------------------------------------- scheduler


def test_scheduler_view_of_a_stand_in():
    sent = []
    scheduler = SimpleNamespace(
        tree_cache="tree",
        server_args="args",
        tp_rank=1,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        tp_cpu_group="group",
        dp_rank=None,
        dp_size=1,
        send_to_tokenizer=SimpleNamespace(send_output=lambda out, req: sent.append((out, req))),
    )
    view = adapter.SchedulerView.of(scheduler)
    assert (view.tree_cache, view.server_args, view.tp_cpu_group) == ("tree", "args", "group")
    assert (view.tp_rank, view.tp_size, view.pp_rank, view.pp_size) == (1, 2, 0, 1)
    view.send_output("out", "req")
    assert sent == [("out", "req")]
    with pytest.raises(AttributeError):
        adapter.SchedulerView.of(SimpleNamespace(tree_cache="tree"))


@pytest.mark.parametrize("dp_attention", [False, True])
def test_scheduler_view_of_a_dp_rank(dp_attention: bool):
    """With DP attention the view's TP rank, size and group are the attention TP ones
    (SGLang's TP group spans every DP rank); without, each DP rank is its own TP group."""
    scheduler = SimpleNamespace(
        tree_cache="tree",
        server_args=SimpleNamespace(enable_dp_attention=dp_attention),
        tp_rank=3,
        tp_size=4,
        pp_rank=0,
        pp_size=1,
        tp_cpu_group="tp-group",
        attn_tp_rank=1,
        attn_tp_size=2,
        attn_tp_cpu_group="attn-group",
        dp_rank=1,
        dp_size=2,
        send_to_tokenizer=SimpleNamespace(send_output=None),
        running_batch=SimpleNamespace(reqs=["a", "b"]),
        waiting_queue=["c"],
    )
    view = adapter.SchedulerView.of(scheduler)
    expected = (1, 2, "attn-group") if dp_attention else (3, 4, "tp-group")
    assert (view.tp_rank, view.tp_size, view.tp_cpu_group) == expected
    assert (view.dp_rank, view.dp_size) == (1, 2)
    assert adapter.scheduler_load(scheduler)() == 3


def test_scheduler_has_what_the_dp_view_reads():
    """The real Scheduler sets every attribute `SchedulerView.of` and `scheduler_load`
    read for DP ranks (read from its source: building one needs a GPU model)."""
    import inspect

    from sglang.srt.managers import scheduler as scheduler_module

    source = inspect.getsource(scheduler_module)
    for name in (
        "attn_tp_rank",
        "attn_tp_size",
        "attn_tp_cpu_group",
        "dp_rank",
        "dp_size",
        "running_batch",
        "waiting_queue",
    ):
        assert f"self.{name}" in source, name
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    assert "reqs" in ScheduleBatch.__dataclass_fields__


def test_add_request_handlers_extends_the_dispatcher():
    from sglang.utils import TypeBasedDispatcher

    class Existing:
        pass

    class Added:
        pass

    scheduler = SimpleNamespace(
        _request_dispatcher=TypeBasedDispatcher([(Existing, lambda r: "old")])
    )
    adapter.add_request_handlers(scheduler, [(Added, lambda r: "new"), (Existing, lambda r: "x")])
    assert scheduler._request_dispatcher(Added()) == "new"
    assert scheduler._request_dispatcher(Existing()) == "old"  # existing handlers win


def test_scheduler_view_of_a_later_pp_stage():
    """A later stage replies through its own sender and exposes the world CPU group."""
    sent = []

    def refuse(out, req):
        raise AssertionError("stage 1 has no SGLang socket to the tokenizer")

    scheduler = SimpleNamespace(
        tree_cache="tree",
        server_args="args",
        tp_rank=0,
        tp_size=1,
        pp_rank=1,
        pp_size=2,
        tp_cpu_group="stage-group",
        dp_rank=None,
        dp_size=1,
        world_group=SimpleNamespace(cpu_group="world-group"),
        send_to_tokenizer=SimpleNamespace(send_output=refuse),
        kv_migration_stage_reply=SimpleNamespace(
            send_output=lambda out, req: sent.append((out, req))
        ),
    )
    view = adapter.SchedulerView.of(scheduler)
    assert (view.tp_cpu_group, view.world_cpu_group) == ("stage-group", "world-group")
    view.send_output("out", "req")
    assert sent == [("out", "req")]


def test_stage_reply_sender_reaches_the_tokenizer_socket():
    """The first TP rank of a later stage pushes to the socket the tokenizer manager
    binds; other ranks (and stage 0, which has SGLang's own) get a no-op sender."""
    import zmq
    from sglang_kv_migration.server.messages import AbortTransferReqInput, AbortTransferReqOutput

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        sender = adapter.stage_reply_sender(SimpleNamespace(pp_rank=1, tp_rank=0), endpoint)
        req = AbortTransferReqInput(migration_id="m", rid="r1")
        sender.send_output(AbortTransferReqOutput(success=True, rid="r1"), req)
        assert pull.poll(10_000), "no reply reached the tokenizer side"
        got = pull.recv_pyobj()
        assert isinstance(got, AbortTransferReqOutput) and got.rid == "r1"
        for pp_rank, tp_rank in ((1, 1), (0, 0)):
            quiet = adapter.stage_reply_sender(
                SimpleNamespace(pp_rank=pp_rank, tp_rank=tp_rank), endpoint
            )
            assert quiet.socket is None
            quiet.send_output(AbortTransferReqOutput(success=True), req)  # a no-op
        assert not pull.poll(200)
    finally:
        pull.close(linger=0)
        context.term()


def test_forward_to_later_stages_appends_after_the_iterations_requests():
    reqs = ["a", "b"]
    adapter.forward_to_later_stages(reqs, ["sync"])
    assert reqs == ["a", "b", "sync"]


# --------------------------------------------------------------------------- pool readings


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_host_pool_buffer_reads_the_one_kv_buffer(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    pool = h.host_pool
    buf = adapter.host_pool_buffer(pool)
    assert (buf.attention, buf.layout) == (attention, pool.layout)
    assert (buf.base_ptr, buf.nbytes) == (pool.kv_buffer.data_ptr(), pool.kv_buffer.nbytes)
    assert (buf.layer_num, buf.page_size, buf.num_slots) == (
        pool.layer_num,
        page_size,
        pool.size,
    )
    # One slot over every layer and plane: the whole buffer holds exactly `size` of them.
    assert buf.num_slots * buf.slot_bytes == buf.nbytes
    assert buf.slot_bytes == pool.layer_num * (2 if attention == "mha" else 1) * (
        pool.token_stride_size
    )


def test_host_pool_buffer_and_kv_cache_shape_refuse_other_pools():
    for read in (adapter.host_pool_buffer, adapter.kv_cache_shape):
        with pytest.raises(ValueError, match="unsupported host pool type SimpleNamespace"):
            read(SimpleNamespace())


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_kv_cache_shape_reads_host_and_device_pools(harness_factory, attention, page_size):
    h = harness_factory(attention=attention, page_size=page_size)
    shape = adapter.kv_cache_shape(h.host_pool)
    dev = h.device_pool
    assert (shape.attention, shape.page_size, shape.host_layout) == (
        attention,
        page_size,
        h.host_pool.layout,
    )
    assert shape.kv_dtype == str(dev.dtype).removeprefix("torch.")
    assert (shape.start_layer, shape.end_layer) == (dev.start_layer, dev.end_layer)
    if attention == "mha":
        assert (shape.kv_heads, shape.head_dim) == (dev.head_num, dev.head_dim)
        assert (shape.kv_lora_rank, shape.qk_rope_head_dim) == (0, 0)
    else:
        assert (shape.kv_heads, shape.head_dim) == (1, 0)
        assert (shape.kv_lora_rank, shape.qk_rope_head_dim) == (
            dev.kv_lora_rank,
            dev.qk_rope_head_dim,
        )


# --------------------------------------------------------------------------- HTTP server


def test_http_server_app_is_sglangs_fastapi_app():
    from fastapi import FastAPI

    app = adapter.http_server_app()
    assert isinstance(app, FastAPI)
    assert any(getattr(r, "path", None) == "/generate" for r in app.routes)


def test_http_tokenizer_manager_is_the_launched_servers(monkeypatch):
    from sglang.srt.entrypoints import http_server

    manager = SimpleNamespace(kv_migration_communicators=None)
    state = http_server._GlobalState(
        tokenizer_manager=manager, template_manager=None, scheduler_info={}
    )
    monkeypatch.setattr(http_server, "_global_state", state)
    assert adapter.http_tokenizer_manager() is manager


def test_generate_requests_in_flight_reads_the_tokenizer_managers_request_states():
    """SGLang's tokenizer manager keeps one `rid_to_state` entry per generate request
    from its send to the scheduler until it finished (read from its source: building one
    needs a model), and the test reads the dict as it is now."""
    import inspect

    from sglang.srt.managers import tokenizer_manager as module

    source = inspect.getsource(module.TokenizerManager)
    assert "self.rid_to_state: Dict[str, ReqState] = {}" in source
    assert "self.rid_to_state[rid] = state" in source
    assert "del self.rid_to_state[" in source
    manager = SimpleNamespace(rid_to_state={})
    busy = adapter.generate_requests_in_flight(manager)
    assert not busy()
    manager.rid_to_state["r1"] = object()
    assert busy()
    manager.rid_to_state = {}  # were it ever replaced, the test reads the new one
    assert not busy()


@pytest.mark.parametrize(("attention", "page_size"), CONFIGS, ids=CONFIG_IDS)
def test_host_headroom_is_what_a_host_allocate_can_claim(harness_factory, attention, page_size):
    """The headroom a planner reads (free plus evictable host slots) is exactly the most
    `alloc_host_slots` grants: one page more is refused, that much succeeds."""
    h = harness_factory(attention=attention, page_size=page_size, device_tokens=512)
    _fill_host_with_host_only_nodes(h)
    hog = h.host_pool.alloc(h.host_pool.available_size() - 32)
    headroom = adapter.host_headroom_tokens(h.cache)
    assert headroom == 32 + 3 * 128
    with pytest.raises(MigrationError):
        adapter.alloc_host_slots(h.cache, headroom + page_size)
    assert adapter.host_headroom_tokens(h.cache) == headroom  # a refusal evicts nothing
    slots = adapter.alloc_host_slots(h.cache, headroom)
    assert len(slots) == headroom
    assert adapter.host_headroom_tokens(h.cache) == 0
    h.host_pool.free(slots)
    h.host_pool.free(hog)


def test_cp_page_owners_is_none_on_stock_sglang_and_reads_a_forks_hook(harness_factory):
    """Stock SGLang's allocator names no owner function (its CP ranks replicate pages); a
    fork's allocator that names one and allocates by owner pattern is read by name."""
    from sglang_kv_migration.cp_owners import PageOwners

    h = harness_factory(page_size=16)
    assert adapter.cp_page_owners(h.cache, 2) is None
    stock = type(h.allocator)

    class ShardingAllocator(stock):  # what a fork's allocator adds
        kv_migration_cp_owner = "round_robin:1"

        def alloc_pages_with_owners(self, owners):
            raise NotImplementedError  # the hook reads only that it exists

    h.allocator.__class__ = ShardingAllocator
    try:
        assert adapter.cp_page_owners(h.cache, 2) == PageOwners(cp_size=2)
        ShardingAllocator.kv_migration_cp_owner = "my_own_function"
        with pytest.raises(ValueError, match="not a known owner function"):
            adapter.cp_page_owners(h.cache, 2)
        ShardingAllocator.kv_migration_cp_owner = "round_robin:1"
        del ShardingAllocator.alloc_pages_with_owners
        with pytest.raises(ValueError, match="alloc_pages_with_owners"):
            adapter.cp_page_owners(h.cache, 2)
    finally:
        h.allocator.__class__ = stock
