"""The TCP lane budget: how many entries one peer may have in the engine at once."""

from __future__ import annotations

import pytest
from sglang_kv_migration.paths.host.lanes import LaneBudget, tcp_lanes_per_peer


@pytest.mark.parametrize(
    ("environ", "lanes"),
    [
        ({}, 4),  # Mooncake's default
        ({"MC_TCP_LANES_PER_PEER": "16"}, 16),
        ({"MC_TCP_LANES_PER_PEER": "2"}, 2),
        ({"MC_TCP_MAX_CONNECTIONS_PER_PEER": "8"}, 8),  # the deprecated name
        ({"MC_TCP_LANES_PER_PEER": "3", "MC_TCP_MAX_CONNECTIONS_PER_PEER": "8"}, 3),
        # Values Mooncake refuses: never more permits than it may have lanes.
        ({"MC_TCP_LANES_PER_PEER": "17"}, 4),
        ({"MC_TCP_LANES_PER_PEER": "0"}, 1),
        ({"MC_TCP_LANES_PER_PEER": "four"}, 4),
        ({"MC_TCP_LANES_PER_PEER": "-3"}, 4),
    ],
)
def test_lanes_are_read_as_mooncake_reads_them(environ, lanes):
    assert tcp_lanes_per_peer(environ) == lanes


def test_permits_are_per_peer_and_never_exceed_the_lanes():
    budget = LaneBudget(4)
    assert budget.take("a:1", 3) == 3
    assert budget.take("a:1", 3) == 1  # only one lane left to a:1
    assert budget.take("a:1", 1) == 0
    assert budget.take("b:2", 4) == 4  # another peer has its own lanes
    budget.give_back("a:1", 2)
    assert budget.taken("a:1") == 2
    assert budget.take("a:1", 5) == 2
    budget.give_back("a:1", 4)
    assert budget.taken("a:1") == 0
    with pytest.raises(RuntimeError):
        budget.give_back("a:1")  # more than were taken
    with pytest.raises(ValueError):
        LaneBudget(0)
