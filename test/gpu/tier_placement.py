"""Prompts held only in a server's host tier, for the GPU benchmarks and tests that move
a prefix from there (`bench_host_landing.py`, `test_gpu_host_landing.py`).

Each prompt is served once (HiCache writes it through to the host pool), then distinct
prompts flood the GPU pool until LRU eviction has pushed the prompts out of it; the
size query's `device_token_size` (0) and `matched_token_size` (the whole prompt) say
where they are. Two ways this goes wrong on a real server, both reproduced on CPU
against SGLang's own eviction (`test/unit/test_tier_placement.py`):

- A size query between flood prompts keeps the prompts on the GPU for ever: its radix
  match refreshes their access time as a request's would, so they are always the
  newest nodes there and each flood prompt evicts the one before it. The prompts are
  queried only after a whole flood.
- A flood larger than the host pool's room loses them from the host tier as well: HiCache
  writes every flood prompt through too and, once its host pool is full, evicts the
  least recently used host-only nodes, which the prompts are by then. The flood is
  sized to the GPU pool (one prompt more than fills it); `host_room` says whether it
  fits beside what the host tier keeps.

The query after a flood makes the prompts the newest nodes again, so a next flood (an
attempt after one that left a prompt on the GPU) or later prompts evict the flood's
host copies before theirs. Attempts are bounded; what could not be placed is recorded
(`Placement`), never raised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ATTEMPTS = 3

Held = dict[str, Any]  # the size query's reply (`/get_request_extra_token_size`)


def flood_prompts(device_tokens: int, prompt_tokens: int) -> int:
    """Distinct prompts of `prompt_tokens` that push every older unlocked prefix out of a
    GPU pool of `device_tokens`: as many as fill it, and one more."""
    return -(-device_tokens // prompt_tokens) + 1


def host_room(host_tokens: int, device_tokens: int, kept_tokens: int, prompt_tokens: int) -> int:
    """Host pool tokens left once `kept_tokens` and one flood are written through;
    negative: the flood would evict the oldest host-only nodes, the kept prompts first."""
    return host_tokens - kept_tokens - flood_prompts(device_tokens, prompt_tokens) * prompt_tokens


def whole_tokens(prompt: list[int], page_size: int) -> int:
    """What a move of `prompt` less its last token carries: its whole pages."""
    return (len(prompt) - 1) // page_size * page_size


def in_host_tier_only(held: Held, whole: int) -> bool:
    return held["device_token_size"] == 0 and held["matched_token_size"] >= whole


def on_gpu_whole(held: Held, whole: int) -> bool:
    return held["device_token_size"] >= whole


@dataclass
class Placement:
    """What `place_in_host_tier` did: per attempt, the flood and where each prompt was
    after it; `placed`: the prompts left only in the host tier, whole."""

    attempts: list[dict[str, Any]] = field(default_factory=list)
    placed: dict[str, bool] = field(default_factory=dict)

    @property
    def all_placed(self) -> bool:
        return all(self.placed.values())

    def to_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "placed": dict(self.placed)}


def place_in_host_tier(
    prompts: Mapping[str, list[int]],
    *,
    serve: Callable[[list[int]], Any],
    held: Callable[[list[int]], Held],
    fresh: Callable[[int], list[int]],
    device_tokens: int,
    page_size: int,
    flood_prompt_tokens: int,
    attempts: int = ATTEMPTS,
) -> Placement:
    """Serve `prompts` (name -> ids), then flood the GPU pool with `fresh(n)` prompts
    until each is only in the host tier, whole (see the module docstring). `serve(ids)`
    has the server cache `ids`; `held(ids)` is its size query of `ids[:-1]`. A prompt
    lost from both tiers is served again before the next attempt."""
    placement = Placement()
    for prompt in prompts.values():
        serve(prompt)
    wholes = {name: whole_tokens(p, page_size) for name, p in prompts.items()}
    floods = flood_prompts(device_tokens, flood_prompt_tokens)
    for attempt in range(attempts):
        for _ in range(floods):
            serve(fresh(flood_prompt_tokens))
        # IMPORTANT: queried only now, after the whole flood (see the module docstring).
        state = {name: held(p) for name, p in prompts.items()}
        placement.placed = {n: in_host_tier_only(state[n], wholes[n]) for n in prompts}
        placement.attempts.append(
            {
                "attempt": attempt,
                "flood_prompts": floods,
                "flood_tokens": floods * flood_prompt_tokens,
                "held": {n: _where(state[n], wholes[n]) for n in prompts},
            }
        )
        if placement.all_placed:
            break
        for name, prompt in prompts.items():
            if state[name]["matched_token_size"] < wholes[name]:
                serve(prompt)  # lost from both tiers: cached again, flooded out next
    return placement


def _where(held: Held, whole: int) -> dict[str, int]:
    return {
        "whole": whole,
        "matched": int(held["matched_token_size"]),
        "device": int(held["device_token_size"]),
    }
