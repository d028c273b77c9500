"""Which data-parallel rank of a server a resumed request goes to.

A `--dp-size N` server keeps a prefix's KV on one DP rank; SGLang's DP controller sends
a `/generate` whose body names `routed_dp_rank` to that rank and otherwise picks one by
its load-balance method, which would re-run the prefill wherever it lands. A migration
reports the target's DP rank that holds the KV (`MigrationResult.target_dp_rank`), and
the continuation names it. A piece that goes to another server without a migration
drops the original request's routing (it named the source's DP rank; SGLang refuses a
rank past the server's --dp-size).
"""

from __future__ import annotations

from typing import Any

# SGLang 0.5.12's GenerateReqInput: `routed_dp_rank`, and its deprecated name.
ROUTING_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def routed_body(extra_body: dict[str, Any], dp_rank: int | None) -> dict[str, Any]:
    """A `/generate` body's extra fields `extra_body`, routed to DP rank `dp_rank` (None:
    the server chooses)."""
    routed = {k: v for k, v in extra_body.items() if k not in ROUTING_FIELDS}
    if dp_rank is not None:
        routed["routed_dp_rank"] = dp_rank
    return routed
