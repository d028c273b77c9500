"""The package's shape, read from its source with `ast` (see the package README):

- `server/` reaches the data paths only through `paths.base`, `paths.factory` and what
  `paths/__init__` exports;
- wire field names are string literals only in the wire models;
- every wire feature name is defined in one module, the feature registry;
- modules are at most 600 lines, classes at most 400;
- no module imports more than 12 of the package's modules (the exceptions by their number);
- the environment is read only where the server args and diagnostics live;
- comments and docstrings say why the code is as it is, with no history: no dates, no
  "call N" / "issue N" / "session N" / "round N", no commit hashes.

Today's offenders are listed per rule with the reason each is still there; an entry that
is no longer needed fails too (`check_allow_list`), so the lists only shrink.
"""

from __future__ import annotations

import ast
import re

import pytest
from package_source import (
    MODULES,
    NAME,
    PACKAGE,
    SOURCES,
    check_allow_list,
    edges,
    in_part,
    prose,
    relative_path,
    string_literals,
)

# --------------------------------------------------------------------------- server -> paths

SERVER_MAY_IMPORT_FROM_PATHS = {f"{NAME}.paths", f"{NAME}.paths.base", f"{NAME}.paths.factory"}
# path -> (the data-path modules it still imports, why).
SERVER_PATHS_ALLOWED: dict[str, object] = {}


def test_server_reaches_the_paths_through_their_interface() -> None:
    found: dict[str, object] = {}
    for module, targets in edges().items():
        if not in_part(module, "server"):
            continue
        inner = {
            t.removeprefix(NAME + ".")
            for t in targets
            if in_part(t, "paths") and t not in SERVER_MAY_IMPORT_FROM_PATHS
        }
        if inner:
            found[relative_path(module)] = frozenset(inner)
    check_allow_list(found, SERVER_PATHS_ALLOWED)


# --------------------------------------------------------------------------- wire fields


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if getattr(target, "id", getattr(target, "attr", None)) == "dataclass":
            return True
    return False


def _wire_modules() -> list[str]:
    """The wire package's modules; `io_types` while the package does not exist."""
    return [m for m in MODULES if in_part(m, "wire")] or [f"{NAME}.io_types"]


def _wire_field_names() -> set[str]:
    return {
        statement.target.id
        for module in _wire_modules()
        for node in ast.walk(MODULES[module])
        if isinstance(node, ast.ClassDef) and _is_dataclass(node)
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
    }


# path -> (string literals equal to a wire field name, why). Counts may only go down: a
# module that spells a field as a literal should take it from the wire models.
WIRE_LITERALS_ALLOWED: dict[str, object] = {
    "binary_ids.py": (1, "reads `input_ids_u32` from a body dict"),
    "client/cli.py": (4, "the CLI's own JSON output (`success`, `message`, `migration_id`)"),
    "client/migration.py": (
        5,
        "phase names `extra_token_size` and `allocate` (the `timings` keys); the session "
        "info's free-form `allocate_channel` object (`address`, `secret`)",
    ),
    "fingerprint.py": (4, "names `weight_version` in the layout fingerprint"),
    "grants.py": (4, "the signed grant's payload keys repeat the wire names"),
    "paths/host/mooncake_workers.py": (1, "a dict key `plan` that shares a wire field's name"),
    "rollout/cost_model.py": (7, 'metric labels `phase="allocate"`, `tp_rank`, `pp_rank`, `path`'),
    "rollout/rebalance_cli.py": (
        7,
        "its own JSON output (`success`) and the request file's `input_ids` / `extra_key`",
    ),
    "rollout/live_rounds.py": (
        2,
        "the `message` of a failed call's JSON reply and the field its refusal names",
    ),
    "rollout/rebalancer.py": (1, "the `path` key of a move plan's own dict"),
    "rollout/request_migration.py": (
        4,
        "SGLang's /generate body (`input_ids`, `extra_key`) and the `path` and "
        "`running_rid` keywords of migrate",
    ),
    "server/diag/metrics.py": (9, "metric labels `path`, `tp_rank`, `pp_rank`, `bytes`"),
    "server/diag/trace.py": (1, "the `trace` key of a reply dict"),
    "server/http/fast_path.py": (1, "the ASGI scope's `path` (shares a wire field's name)"),
    "server/http/routes.py": (19, "turns replies into JSON bodies by hand (`steps_ms`, ...)"),
    "server/diag/profiling.py": (1, "a profile field that shares a wire field's name"),
    "server/rank/dispatch.py": (1, "the `trace` key of a reply dict"),
    "server/target/allocations.py": (2, "reads mailbox and channel payloads as dicts"),
    "server/same_host/allocate_channel.py": (5, "the channel's own message dicts"),
    "server/source/replies.py": (2, "trace step names `allocate` and the target's `grant`"),
    "server/source/validation.py": (5, "names the slot fields (`kv_pages`, ...) it refuses"),
    "server/target/channel_allocations.py": (1, "the `trace` key of a channel reply"),
    "sglang_adapter/__init__.py": (1, "names `host_headroom_tokens` in a reply dict"),
    "targets.py": (2, "reads `instance_id` from the session-info dict"),
}


def test_wire_field_names_are_literals_only_in_the_wire_models() -> None:
    fields = _wire_field_names()
    exempt = {*_wire_modules(), f"{NAME}.io_types"}
    found: dict[str, object] = {}
    for module, tree in MODULES.items():
        if module in exempt:
            continue
        count = sum(1 for node in string_literals(tree) if node.value in fields)
        if count:
            found[relative_path(module)] = count
    check_allow_list(found, WIRE_LITERALS_ALLOWED)


def test_the_wire_field_names_were_read() -> None:
    assert {"input_ids", "matched_token_size", "kv_indices", "success"} <= _wire_field_names()


# --------------------------------------------------------------------------- features


def _registered_features() -> set[str]:
    from sglang_kv_migration.wire import features

    return {f.name for f in features.REGISTRY}


def _feature_assignments() -> dict[str, str]:
    """Feature-named constants (`FEATURE = "..."`, `X_FEATURE = "..."`) assigned a string
    literal: module -> the names. The registry (`wire/features.py`) spells each name
    once; every other module takes its constant from there."""
    found: dict[str, str] = {}
    for module, tree in MODULES.items():
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("FEATURE")
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found[module] = node.value.value
    return found


REGISTRY_MODULE = f"{NAME}.wire.features"


def test_feature_names_are_defined_in_one_registry() -> None:
    assert {"binary_ids", "source_commit", "source_allocate", "destination_digest"} <= (
        _registered_features()
    )
    elsewhere = sorted(relative_path(m) for m in _feature_assignments() if m != REGISTRY_MODULE)
    assert not elsewhere, f"feature names spelled outside the registry: {elsewhere}"


def test_feature_names_are_literals_only_where_they_are_defined() -> None:
    """A feature name is spelled once; everyone else uses the constant. A literal that is
    also a wire field's name (the allocate body's `source_commit`) is the wire rule's."""
    names = _registered_features() - _wire_field_names()
    assert {"binary_ids", "source_allocate", "destination_digest"} <= names
    bad = [
        f"{relative_path(module)}:{node.lineno} {node.value!r}"
        for module, tree in MODULES.items()
        if module != REGISTRY_MODULE
        for node in string_literals(tree)
        if node.value in names
    ]
    assert not bad, bad


# --------------------------------------------------------------------------- sizes

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
# path (or path::Class) -> why it is still longer.
SIZE_ALLOWED: dict[str, object] = {
    "client/migration.py": "the sync and async clients and the protocol steps they share; "
    "to split into steps, plan and the two drivers",
    "rollout/request_migration.py": "the sync and async request migrators and the "
    "generate-call plumbing in one module; the live stages (tree stages, the stop, the "
    "delta) are to join the running-slot rounds in their own module",
    "rollout/request_migration.py::AsyncRequestMigrator": "submit, move and resume of a "
    "live request in one class",
}


def test_modules_and_classes_fit() -> None:
    found: dict[str, object] = {}
    for module, tree in MODULES.items():
        path = relative_path(module)
        if len(SOURCES[module].splitlines()) > MAX_MODULE_LINES:
            found[path] = True
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
            ):
                found[f"{path}::{node.name}"] = True
    check_allow_list(found, SIZE_ALLOWED)


# --------------------------------------------------------------------------- fan-out

MAX_PACKAGE_IMPORTS = 12
# path -> (how many of the package's modules it imports, why more than the cap). The
# number is exact: an entry that grows fails, and so does one that shrank (write the new
# number), so each one only goes down.
FAN_OUT_ALLOWED: dict[str, object] = {
    "server/scheduler/compose.py": (
        15,
        "the one composition step: it names every role, path and diagnostic a rank is built from",
    ),
    "server/target/allocations.py": (
        14,
        "allocate reaches the pending table, grants, both paths' slots, staging and the "
        "diagnostics",
    ),
    "server/target/build.py": (
        15,
        "builds the target role from its parts (pending, commits, allocations, channel, "
        "mailbox), and is the target's one importer of the paths' factory (the staging "
        "arena, the host the allocate channel names)",
    ),
    "server/source/transfers.py": (
        14,
        "the source role's flow reaches its records, checks and replies, the same-host "
        "channels and the diagnostics",
    ),
}


def test_no_module_imports_much_of_the_package() -> None:
    found: dict[str, object] = {
        relative_path(module): len(targets)
        for module, targets in edges().items()
        if len(targets) > MAX_PACKAGE_IMPORTS
    }
    check_allow_list(found, FAN_OUT_ALLOWED)


# --------------------------------------------------------------------------- environment

ENVIRONMENT_READERS = ("server.server_args", "server.diag")
# path -> why it reads the environment elsewhere.
ENVIRONMENT_ALLOWED: dict[str, object] = {
    "paths/host/mooncake_engine.py": "sets MC_FORCE_TCP while the engine starts and puts back "
    "what was there: Mooncake reads the protocol only from the environment",
    "paths/host/lanes.py": "reads MC_TCP_LANES_PER_PEER as Mooncake's TCP transport does "
    "(the engine takes its lanes per peer only from the environment): the transport never "
    "hands it more entries for a peer than that",
}


def _reads_environment(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in {"environ", "environb", "getenv", "getenvb"}
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "environb", "getenv", "getenvb"}:
                return True
    return False


def test_the_environment_is_read_where_the_server_args_are() -> None:
    found: dict[str, object] = {
        relative_path(module): True
        for module, tree in MODULES.items()
        if not in_part(module, *ENVIRONMENT_READERS) and _reads_environment(tree)
    }
    check_allow_list(found, ENVIRONMENT_ALLOWED)


def test_the_environment_readers_were_found() -> None:
    readers = {relative_path(m) for m, tree in MODULES.items() if _reads_environment(tree)}
    assert "server/diag/profiling.py" in readers


# --------------------------------------------------------------------------- history

_MONTH = (
    "January|February|March|April|May|June|July|August|September|October|November|"
    "December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
HISTORY = [
    re.compile(r"\b(?:19|20)\d\d-[01]\d(?:-[0-3]\d)?\b"),  # 2026-12-03, 2026-12
    re.compile(rf"\b(?:{_MONTH})\.? (?:[0-3]?\d(?:st|nd|rd|th)?,? )?(?:19|20)\d\d\b"),
    re.compile(r"\b(?:calls?|issues?|sessions?|rounds?)\s+#?\d+", re.IGNORECASE),
    re.compile(
        r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
        r" session\b",
        re.IGNORECASE,
    ),
    re.compile(r"\bcommit [0-9a-f]{7,40}\b"),
]


def _history(source: str) -> list[tuple[int, str]]:
    return [
        (line, text.strip())
        for line, text in prose(source)
        if any(pattern.search(text) for pattern in HISTORY)
    ]


def test_comments_and_docstrings_carry_no_history() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {text}"
        for path in sorted(PACKAGE.parent.rglob("*.py"))
        for line, text in _history(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "\n".join(bad)


def test_the_history_check_can_fail() -> None:
    source = (
        '"""Measured on 2026-12-03."""\n'
        "x = 1  # faster since call 21\n"
        "# issue 19: queued\n"
        "# the fifth session of the day\n"
        "y = 'issue 19 is data, not prose'\n"
    )
    assert sorted(line for line, _ in _history(source)) == [1, 2, 3, 4]
    assert not _history("# a session info `features` list; round trips of 2 calls\n")


def test_an_allow_list_fails_on_new_grown_and_stale_entries() -> None:
    listed: dict[str, object] = {"a.py": (3, "why"), "b.py": "why"}
    check_allow_list({"a.py": 3, "b.py": True}, listed)
    for found in (
        {"a.py": 4, "b.py": True},
        {"a.py": 2, "b.py": True},
        {"a.py": 3},
        {"a.py": 3, "b.py": True, "c.py": True},
    ):
        with pytest.raises(AssertionError):
            check_allow_list(found, listed)
