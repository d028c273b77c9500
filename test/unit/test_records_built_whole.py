"""Every record of the package is built whole where it is owned: no module assigns an
attribute of another module's dataclass (`x.field = ...` on an instance of it, the type
read from the package's type hints: `test/support/record_writes.py`). Values are passed
to the constructor, or to a method of the record's own module, not set afterwards.

What is left is counted per module with the reason (`RECORD_WRITES_ALLOWED`): a module
that writes one more fails, and so does one that writes fewer (write the new number),
so the list only shrinks."""

from __future__ import annotations

import ast
from collections import Counter

from package_source import NAME, check_allow_list, relative_path
from record_writes import record_writes

# path -> (writes to other modules' records, why).
RECORD_WRITES_ALLOWED: dict[str, object] = {
    # The messages SGLang carries between processes are completed along their trip: the
    # same request object goes from the HTTP layer to every rank and on to later stages.
    "server/http/dp_ranks.py": (
        4,
        "the HTTP layer stamps the DP rank a request goes to (and the migration id that "
        "names it) on the request it forwards",
    ),
    "server/same_host/ask_ahead.py": (
        2,
        "the HTTP layer puts the allocate answer it asked ahead into the request the "
        "scheduler takes up",
    ),
    "server/source/known_destinations.py": (
        2,
        "a device entry named by digest gets its `device_kv` on the request",
    ),
    "server/source/transfers.py": (
        5,
        "the request is completed with the target's allocate answer (feature "
        '"source_allocate": migration id, sizes, target entry), and a refusal is marked '
        "on it for later PP stages (`stage_refusal`)",
    ),
    "server/target/allocations.py": (
        1,
        "a refused allocate is marked on the request for later PP stages",
    ),
    "server/target/commits.py": (3, "a refused commit is marked on the request for later stages"),
    # Records of the data paths and the adapter, filled in as their work goes on.
    "paths/device/send_job.py": (
        5,
        "a device send's `SendStats` fill in as its copy ends (digest, time, routes)",
    ),
    "paths/device/source_prefix.py": (1, "a matched prefix's segments moved to the host once"),
    "paths/device/source_side.py": (
        3,
        "a peer's opened buffers marked checked and used (`cuda_ipc.OpenedPeer`)",
    ),
    "paths/device/tier_source.py": (1, "the send's byte count on its job's stats"),
    "paths/shared_host/peer_pools.py": (
        3,
        "a mapped pool's copy destination keyed by the pool, and emptied when it closes",
    ),
    "sglang_adapter/unified_tree.py": (2, "unpinning host pages empties their pin"),
    "integrations/rebalance_cli.py": (
        1,
        "a request file's `rid` set on the request built from it",
    ),
    "rollout/server_calls.py": (1, "the moment a piece's body was sent, on its progress"),
    # A live move's stages, each its own module, leave what they found on the move in
    # progress (`rollout/move.py`) for the stages after them.
    "rollout/stop.py": (3, "when the stop was sent and returned, and the source's last token"),
    "rollout/live_stages.py": (1, "the migration the copies while decoding made"),
    "rollout/resume.py": (1, "the cost model's price of the rest"),
}


def test_records_are_written_only_where_they_are_owned() -> None:
    writes = record_writes()
    found = Counter(relative_path(w.module) for w in writes)
    try:
        check_allow_list(dict(found), RECORD_WRITES_ALLOWED)
    except AssertionError as e:
        raise AssertionError(f"{e}\nthe writes:\n" + "\n".join(map(str, writes))) from None


def test_the_target_and_source_records_are_built_whole() -> None:
    """The records the roles keep for a migration are written by no other module."""
    owners = {
        f"{NAME}.server.target.pending",
        f"{NAME}.server.target.quarantine",
        f"{NAME}.server.source.inflight",
        f"{NAME}.server.rank.identity",
        f"{NAME}.server.rank.settings",
    }
    bad = [str(w) for w in record_writes() if w.record[0] in owners]
    assert not bad, bad


_RECORD = """
from dataclasses import dataclass


@dataclass
class Rec:
    a: int = 0
    b: int = 0

    def bump(self) -> None:
        self.a += 1  # its own module: fine


@dataclass
class Holder:
    rec: Rec
    by_id: dict[str, Rec]


class Registry:
    def __init__(self, rec: Rec):
        self.rec = rec
        self.recs: list[Rec] = []

    def get(self, key: str) -> Rec | None:
        return None


def make() -> Rec:
    return Rec()
"""

_USER = """
from pkg.rec import Holder, Rec, Registry, make


def by_parameter(rec: Rec) -> None:
    rec.a = 1


def by_constructor() -> None:
    rec = Rec()
    rec.a, other = 2, 3


def by_function() -> None:
    made = make()
    made.b += 1


def by_attributes(holder: Holder, registry: Registry) -> None:
    holder.rec.a = 4
    registry.rec.b = 5
    registry.get("x").a = 6


def by_iteration(holder: Holder, registry: Registry) -> None:
    for rec in holder.by_id.values():
        rec.a = 7
    for _key, rec2 in holder.by_id.items():
        rec2.b = 8
    for _i, rec3 in enumerate(registry.recs):
        rec3.a = 9


class Wrapper:
    def __init__(self, rec: Rec):
        self.rec = rec

    def change(self) -> None:
        self.rec.b = 10


def untouched(anything, rec: Rec) -> None:
    anything.a = 11  # no known type: not checked
    rec.bump()  # its own method: fine
    Wrapper(rec).extra = 12  # not a record
"""


def test_the_check_reads_the_types_it_claims() -> None:
    """The check can fail: each way of reaching a record's instance is found, and the
    writes it cannot prove (an untyped name, the record's own module, a plain class)
    are not reported."""
    modules = {
        "pkg": ast.parse(""),
        "pkg.rec": ast.parse(_RECORD),
        "pkg.user": ast.parse(_USER),
    }
    found = sorted((w.module, w.line, w.record[1], w.attribute) for w in record_writes(modules))
    lines = _USER.splitlines()
    expected = sorted(
        ("pkg.user", number, record, attribute)
        for number, text in enumerate(lines, start=1)
        for record, attribute, needle in (
            ("Rec", "a", "rec.a = 1"),
            ("Rec", "a", "rec.a, other"),
            ("Rec", "b", "made.b += 1"),
            ("Rec", "a", "holder.rec.a = 4"),
            ("Rec", "b", "registry.rec.b = 5"),
            ("Rec", "a", 'get("x").a = 6'),
            ("Rec", "a", "rec.a = 7"),
            ("Rec", "b", "rec2.b = 8"),
            ("Rec", "a", "rec3.a = 9"),
            ("Rec", "b", "self.rec.b = 10"),
        )
        if needle in text
    )
    assert len(expected) == 10
    assert found == expected
