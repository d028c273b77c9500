"""One grant, one claim, per server: which DP rank of a `--dp-size N` server holds each
grant a transfer names.

A grant binds a target rank's slots to a source *server* and to a (tp, pp) position
(`grants.py`), not to one scheduler process. On a server with DP ranks every DP rank has
a scheduler at each position, each with its own replay guard (`grants.UsedGrants`): a
second DP rank could claim a grant the first was writing under, then write the same
slots, or sign a receipt that settles them while the first still writes. Every transfer
passes through this server's one HTTP process (SGLang's single tokenizer manager; more
HTTP workers are refused at start-up, `server_args.py`), so the DP ranks agree here:

- Before a transfer goes to its DP rank, each grant it names — its `migration_id` and a
  target entry's (tp, pp): what a grant that verifies binds — must be held by no other
  DP rank, neither claimed there nor named by a transfer in flight there. Otherwise the
  transfer is refused as a replay (403) before any scheduler sees it; its reply carries
  no receipt, so it settles nothing.
- Once that DP rank replies, each grant its ranks claimed stays with it until the grant
  expires (`TransferReply.claims`; no scheduler claims an expired grant). A grant none
  claimed (refused before it verified) is free again: a correct retry may go to any DP
  rank. A reply that does not say (a failure answered without the ranks' gather, or no
  reply) leaves the grants with that DP rank for `UNKNOWN_HOLD_S`.

Grants the target's allocate channel handed to a DP rank (feature "source_allocate")
are named by no body: the reply's claims bring them in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.grants import MAX_REMEMBERED_GRANTS

# (migration_id, tp, pp): the grant of one target rank of one migration.
GrantKey = tuple[str, int, int]

# How long grants stay with a DP rank that did not say whether it claimed them: longer
# than any grant lives (the target's TTL is at most half its watchdog timeout).
UNKNOWN_HOLD_S = 3600.0


@dataclass
class _Holder:
    dp_rank: int
    in_flight: int = 0  # transfers naming the grant, sent to `dp_rank`, not answered yet
    until: float = 0.0  # unix time the claim lapses (0: not claimed)

    def lapsed(self, now: float) -> bool:
        return self.in_flight == 0 and self.until <= now


def grant_keys(request: Any) -> list[GrantKey]:
    """The grants a transfer request names (none when the source asks the target for
    them: its entries carry none)."""
    if request.allocate_on_target is not None:
        return []
    keys = {(request.migration_id, t.tp, t.pp) for t in request.target_per_rank if t.grant}
    return sorted(keys)


class GrantClaims:
    """The server's ledger: grant -> the DP rank holding it."""

    def __init__(self, clock: Callable[[], float] = time.time, limit: int = MAX_REMEMBERED_GRANTS):
        self.clock = clock  # unix time, as grants' `expires_at`
        self.limit = limit
        self._held: OrderedDict[GrantKey, _Holder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def holder(self, key: GrantKey) -> int | None:
        """The DP rank holding `key` now (None: free)."""
        held = self._held.get(key)
        return None if held is None or held.lapsed(self.clock()) else held.dp_rank

    def take(self, keys: list[GrantKey], dp_rank: int) -> str | None:
        """Hold `keys` for a transfer going to `dp_rank`; the refusal (a replay) when
        another DP rank holds one of them, taking none. Pair with `release`."""
        self._forget_lapsed()
        for migration_id, tp, pp in keys:
            other = self.holder((migration_id, tp, pp))
            if other is not None and other != dp_rank:
                return (
                    f"write refused: grant for tp={tp} pp={pp} of migration {migration_id!r} "
                    f"was already used (replay): DP rank {other} of this server claimed it or "
                    "is sending under it, and a grant is claimed once per server; nothing "
                    "was written"
                )
        now = self.clock()
        for key in keys:
            held = self._held.get(key)
            if held is None or held.lapsed(now):
                held = self._held[key] = _Holder(dp_rank)
            held.in_flight += 1
            self._held.move_to_end(key)
        return None

    def release(self, keys: list[GrantKey], dp_rank: int, claims: list | None) -> None:
        """The transfer that took `keys` was answered by `dp_rank`; `claims` is its
        reply's (`TransferReply.claims`), None when the reply does not say."""
        now = self.clock()
        for key in keys:
            held = self._held.get(key)
            if held is not None and held.in_flight:
                held.in_flight -= 1
        if claims is None:
            for key in keys:
                self._hold(key, dp_rank, now + UNKNOWN_HOLD_S)
        else:
            for migration_id, tp, pp, until in _claimed(claims):
                self._hold((migration_id, tp, pp), dp_rank, until)
        for key in keys:
            held = self._held.get(key)
            if held is not None and held.lapsed(now):
                del self._held[key]
        self._bound()

    # ------------------------------------------------------------------ helpers

    def _hold(self, key: GrantKey, dp_rank: int, until: float) -> None:
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Holder(dp_rank)
        held.until = max(held.until, until)
        self._held.move_to_end(key)

    def _forget_lapsed(self) -> None:
        now = self.clock()
        while self._held and next(iter(self._held.values())).lapsed(now):
            self._held.popitem(last=False)

    def _bound(self) -> None:
        """At most `limit` grants: the least recently used that no transfer names go
        first (a DP rank's own guard still refuses its replays)."""
        if len(self._held) <= self.limit:
            return
        for key in [k for k, h in self._held.items() if not h.in_flight]:
            del self._held[key]
            if len(self._held) <= self.limit:
                return


def _claimed(claims: Iterable[Any]) -> Iterable[tuple[str, int, int, float]]:
    """The claims of a reply that did claim a grant."""
    for migration_id, tp, pp, until in claims:
        if until > 0:
            yield migration_id, tp, pp, until
