"""A migration's moments are named once (`wire/moments.py`): the records' states, the
state machines' steps, the metrics' outcome and phase labels and the log lines use the
same members, and nothing else spells them."""

from __future__ import annotations

import ast

import pytest
from package_source import MODULES, NAME, check_allow_list, relative_path, string_literals
from sglang_kv_migration.wire.moments import (
    ALLOCATION_STEPS,
    TRANSFER_STEPS,
    Moment,
    Phase,
    step,
)

MOMENTS_MODULE = f"{NAME}.wire.moments"


def test_the_names_users_scrape_do_not_change() -> None:
    """`sglang:kv_migration_total{outcome}` and `..._phase_seconds{phase}` label values."""
    target = {
        "allocated",
        "allocate_failed",
        "committed",
        "commit_failed",
        "verify_failed",
        "aborted",
        "expired",
        "weights_changed",
    }
    assert target | {"sent", "send_failed"} <= {m.value for m in Moment}
    assert {p.value for p in Phase} == {"allocate", "transfer", "commit", "pending"}


@pytest.mark.parametrize("steps", [ALLOCATION_STEPS, TRANSFER_STEPS], ids=["target", "source"])
def test_each_state_machine_ends(steps: dict[Moment, frozenset[Moment]]) -> None:
    """Every step leads to a moment of the same machine, and every moment reaches one
    with no step after it."""
    assert all(to in steps for nexts in steps.values() for to in nexts)
    ends = {m for m, nexts in steps.items() if not nexts}
    reach = set(ends)
    for _ in steps:
        reach |= {m for m, nexts in steps.items() if nexts & reach}
    assert reach == set(steps) and ends


def test_the_records_moments_are_moments_of_one_machine_each() -> None:
    assert not set(ALLOCATION_STEPS) & set(TRANSFER_STEPS)
    outcomes_only = {Moment.ALLOCATE_FAILED, Moment.COMMIT_FAILED, Moment.VERIFY_FAILED}
    assert set(ALLOCATION_STEPS) | set(TRANSFER_STEPS) | outcomes_only == set(Moment)


def test_a_step_outside_the_machine_is_refused() -> None:
    assert step(TRANSFER_STEPS, Moment.CHECKING, Moment.SENDING) is Moment.SENDING
    with pytest.raises(RuntimeError, match="from SENT to SENDING"):
        step(TRANSFER_STEPS, Moment.SENT, Moment.SENDING)
    with pytest.raises(RuntimeError, match="from COMMITTED to ABORTED"):
        step(ALLOCATION_STEPS, Moment.COMMITTED, Moment.ABORTED)


# --------------------------------------------------------------------------- the package


def _calls(method: str) -> list[tuple[str, ast.Call]]:
    return [
        (relative_path(module), node)
        for module, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
    ]


def _member_of(node: ast.expr, enum: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == enum
    )


def test_metrics_take_their_labels_from_the_enums() -> None:
    outcomes = [(p, c) for p, c in _calls("outcome") if len(c.args) == 2]
    phases = [(p, c) for p, c in _calls("phase") if len(c.args) == 2]
    assert len(outcomes) >= 10 and len(phases) >= 4
    bad = [f"{p}:{c.lineno}" for p, c in outcomes if not _member_of(c.args[1], "Moment")]
    bad += [f"{p}:{c.lineno}" for p, c in phases if not _member_of(c.args[0], "Phase")]
    assert not bad, bad


# path -> (string literals equal to a moment's name, why). The list only shrinks.
MOMENT_LITERALS_ALLOWED: dict[str, object] = {
    "server/diag/request_moments.py": (
        1,
        "`released`: a request's own event (SGLang put its KV into the tree), not a migration's",
    ),
}


def test_moments_are_spelled_only_where_they_are_defined() -> None:
    names = {m.value for m in Moment}
    found: dict[str, object] = {}
    for module, tree in MODULES.items():
        if module == MOMENTS_MODULE:
            continue
        count = sum(1 for node in string_literals(tree) if node.value in names)
        if count:
            found[relative_path(module)] = count
    check_allow_list(found, MOMENT_LITERALS_ALLOWED)


def _enum_values(tree: ast.Module) -> set[str]:
    """String values of the members of every Enum class in `tree`."""
    values = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
        if not bases & {"Enum", "StrEnum"}:
            continue
        for statement in node.body:
            if (
                isinstance(statement, ast.Assign)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                values.add(statement.value.value)
    return values


def test_no_other_enum_names_a_moment() -> None:
    """The records' states are `Moment`s: no second enum of them (as the source's and
    the target's records once had)."""
    names = {m.value for m in Moment}
    assert names <= _enum_values(MODULES[MOMENTS_MODULE])
    bad = {
        relative_path(module): sorted(_enum_values(tree) & names)
        for module, tree in MODULES.items()
        if module != MOMENTS_MODULE and _enum_values(tree) & names
    }
    assert not bad, bad
