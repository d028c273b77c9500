"""A harness cache (`cpu_harness`) served as SGLang's scheduler serves requests, for the
tests of what GPU jobs do to a server's tiers (`test/gpu/tier_placement.py`): a prompt's
slots are taken after evicting what they need from the tree (`HiRadixCache.evict`, LRU,
write-through copies kept in the host pool), the prompt inserted and written through;
the size query is the route's own match (`sglang_adapter.match_held_prefix`), which
refreshes access times as SGLang's does."""

from __future__ import annotations

from typing import Any

from sglang_kv_migration import sglang_adapter


class ServedCache:
    """See the module docstring. `queries` counts size queries."""

    def __init__(self, harness: Any):
        self.h = harness
        self.page_size = harness.cfg.page_size
        self.next_id = 1_000_000
        self.queries = 0

    def serve(self, ids: list[int]) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        need = -(-len(ids) // self.page_size) * self.page_size
        short = need - self.h.allocator.available_size()
        if short > 0:
            self.h.cache.evict(EvictParams(num_tokens=short))
        self.h.insert_random(ids, seed=len(ids))
        self.h.drain_writes()

    def held(self, ids: list[int]) -> dict[str, int]:
        """The size query of `ids[:-1]` (what a move of `ids` less its last token asks)."""
        self.queries += 1
        found = sglang_adapter.match_held_prefix(self.h.cache, ids[:-1], None)
        return {"matched_token_size": found.length, "device_token_size": found.device_length}

    def fresh(self, n: int) -> list[int]:
        """`n` token ids no prompt so far used."""
        self.next_id += n
        return list(range(self.next_id - n, self.next_id))
