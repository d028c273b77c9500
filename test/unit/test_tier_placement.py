"""Placing prompts in a server's host tier only (`test/gpu/tier_placement.py`), against
SGLang's own eviction on CPU: a real HiRadixCache (write-through, host pool twice the
GPU pool, as the GPU benchmark and test run it) served the way the scheduler serves
requests and asked the size query (`test/support/served_cache.py`).

The first two tests reproduce the two ways a placement fails on a real server: a size
query between flood prompts keeps the prompts on the GPU for ever (a benchmark then
stops at "host-tier prefixes still on the source's GPU"), and a flood of twice the GPU
pool into a host pool of twice the GPU pool loses the prompt from the host tier too (a
move of it then sends 0 tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from served_cache import ServedCache
from sglang_kv_migration import sglang_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import tier_placement as placement  # noqa: E402

PAGE = 16
DEVICE_TOKENS = 1024  # the harness's GPU pool; its host pool holds twice that
FLOOD = 256


@pytest.fixture
def server(harness_factory) -> ServedCache:
    return ServedCache(
        harness_factory(page_size=PAGE, device_tokens=DEVICE_TOKENS, hicache_ratio=2.0)
    )


def _prompt(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE + 1))  # a move carries `pages` pages


def test_a_size_query_between_flood_prompts_keeps_the_prompts_on_the_gpu(server: ServedCache):
    """The benchmark's loop: flood one prompt, ask where the prompts are, again."""
    prompts = [_prompt(10, 8), _prompt(5_000, 16)]
    for p in prompts:
        server.serve(p)
    for _ in range(4 * DEVICE_TOKENS // FLOOD):  # its bound: 4x the pool
        server.serve(server.fresh(FLOOD))
        held = [server.held(p) for p in prompts]
    assert [h["device_token_size"] for h in held] == [8 * PAGE, 16 * PAGE]


def test_a_flood_of_twice_the_gpu_pool_loses_the_prompt_from_the_host_tier_too(
    server: ServedCache,
):
    """The GPU test's flood: 2 x pool tokens, with the host pool 2 x pool."""
    prompt = _prompt(10, 8)
    server.serve(prompt)
    for _ in range(2 * DEVICE_TOKENS // FLOOD):
        server.serve(server.fresh(FLOOD))
    assert server.held(prompt) == {"matched_token_size": 0, "device_token_size": 0}


def test_placing_leaves_each_prompt_whole_in_the_host_tier_only(server: ServedCache):
    prompts = {"8": _prompt(10, 8), "16": _prompt(5_000, 16)}
    kept = sum(placement.whole_tokens(p, PAGE) for p in prompts.values())
    assert placement.host_room(2 * DEVICE_TOKENS, DEVICE_TOKENS, kept, FLOOD) > 0
    done = placement.place_in_host_tier(
        prompts,
        serve=server.serve,
        held=server.held,
        fresh=server.fresh,
        device_tokens=DEVICE_TOKENS,
        page_size=PAGE,
        flood_prompt_tokens=FLOOD,
    )
    assert done.all_placed and len(done.attempts) == 1, done.to_dict()
    assert server.queries == len(prompts)  # once, after the flood
    assert done.attempts[0]["held"] == {
        "8": {"whole": 128, "matched": 128, "device": 0},
        "16": {"whole": 256, "matched": 256, "device": 0},
    }
    assert done.attempts[0]["flood_tokens"] == (DEVICE_TOKENS // FLOOD + 1) * FLOOD
    # Prompts served after it evict the flood's host copies, not the placed prompts'.
    for i in range(3):
        server.serve(_prompt(20_000 + 1000 * i, 16))
    for p in prompts.values():
        assert placement.in_host_tier_only(server.held(p), placement.whole_tokens(p, PAGE))


def test_what_cannot_be_placed_is_recorded_after_the_bounded_attempts(server: ServedCache):
    """A prompt that stays on the GPU (here: locked, as a running request's prefix is)
    is reported not placed after `attempts` floods; nothing raises."""
    prompts = {"held": _prompt(10, 8), "free": _prompt(5_000, 8)}
    server.serve(prompts["held"])
    node = sglang_adapter.match_held_prefix(server.h.cache, prompts["held"][:-1], None).last_node
    lock = sglang_adapter.lock_node(server.h.cache, node)
    try:
        done = placement.place_in_host_tier(
            prompts,
            serve=server.serve,
            held=server.held,
            fresh=server.fresh,
            device_tokens=DEVICE_TOKENS,
            page_size=PAGE,
            flood_prompt_tokens=FLOOD,
            attempts=2,
        )
    finally:
        sglang_adapter.unlock_node(server.h.cache, lock)
    assert done.placed == {"held": False, "free": True} and not done.all_placed
    assert [a["held"]["held"]["device"] for a in done.attempts] == [128, 128]


def test_the_flood_and_the_host_room_arithmetic():
    assert placement.flood_prompts(81920, 16384) == 6
    assert placement.flood_prompts(16384, 4096) == 5
    # The benchmark: 8K + 32K kept, host pool 2 x 81920.
    assert placement.host_room(163840, 81920, 8176 + 32752, 16384) == 163840 - 40928 - 98304
    # The GPU test's old flood (2 x pool) did not fit beside its prompt; the planned does.
    assert 32768 - 2048 - 2 * 16384 < 0 < placement.host_room(32768, 16384, 2048, 4096)
    assert placement.whole_tokens(list(range(8193)), 16) == 8192
    assert placement.whole_tokens(list(range(8192)), 16) == 8176
