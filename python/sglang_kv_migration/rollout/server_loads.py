"""One server's load as the rebalancer reads it: SGLang's `/v1/loads?include=core`
(0.5.12), or its legacy `/get_load`, summed over the server's DP ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerLoad:
    url: str
    num_running: int = 0
    num_waiting: int = 0
    used_tokens: int = 0
    demand_tokens: int = 0  # used + prompts waiting for prefill
    capacity_tokens: int = 0  # 0: unknown (`/get_load` does not say)
    ok: bool = True  # False: the server did not answer
    max_running: int = 0  # running-request slots; 0: unknown
    # Host slots a host-path allocate could claim (free + evictable); None: unknown.
    host_headroom_tokens: int | None = None

    @property
    def demand_ratio(self) -> float:
        if self.capacity_tokens <= 0:
            return 0.0
        return self.demand_tokens / self.capacity_tokens

    @property
    def free_tokens(self) -> int | None:
        """GPU KV slots an allocation can claim now: capacity minus what running requests
        hold (SGLang's `num_used_tokens` counts neither free nor evictable slots, and a
        migration's allocate evicts); None when the capacity is unknown."""
        if self.capacity_tokens <= 0:
            return None
        return max(0, self.capacity_tokens - self.used_tokens)


def from_v1_loads(url: str, loads: list[dict[str, Any]]) -> ServerLoad:
    return ServerLoad(
        url,
        num_running=sum(d["num_running_reqs"] for d in loads),
        num_waiting=sum(d["num_waiting_reqs"] for d in loads),
        used_tokens=sum(d["num_used_tokens"] for d in loads),
        demand_tokens=sum(d["num_total_tokens"] for d in loads),
        capacity_tokens=sum(d.get("max_total_num_tokens", 0) for d in loads),
        max_running=sum(d.get("max_running_requests", 0) for d in loads),
    )


def from_get_load(url: str, loads: list[dict[str, Any]]) -> ServerLoad:
    return ServerLoad(
        url,
        num_running=sum(d["num_reqs"] - d["num_waiting_reqs"] for d in loads),
        num_waiting=sum(d["num_waiting_reqs"] for d in loads),
        used_tokens=sum(d["num_tokens"] - d["num_pending_tokens"] for d in loads),
        demand_tokens=sum(d["num_tokens"] for d in loads),
    )
