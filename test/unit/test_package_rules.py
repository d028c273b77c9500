"""The package's shape, read from its source with `ast` (see the package README):

- `server/` reaches the data paths only through `paths.base`, `paths.factory` and what
  `paths/__init__` exports;
- wire field names are string literals only in the wire models;
- every wire feature name is defined in one module, the feature registry, and named
  there, with no alias elsewhere; each feature reaches the modules it reaches today and
  no more;
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
import types

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
    "client/cli.py": (4, "the CLI's own JSON output (`success`, `message`, `migration_id`)"),
    "client/call_bodies.py": (
        2,
        "the session info's free-form `allocate_channel` object (`address`, `secret`)",
    ),
    "client/calls.py": (2, "phase names `extra_token_size` and `allocate` (the `timings` keys)"),
    "client/plan.py": (1, "the session info's free-form `allocate_channel` object (`address`)"),
    "fingerprint.py": (4, "names `weight_version` in the layout fingerprint"),
    "grants.py": (4, "the signed grant's payload keys repeat the wire names"),
    "paths/host/mooncake_workers.py": (1, "a dict key `plan` that shares a wire field's name"),
    "rollout/cost_model.py": (5, "metric labels `tp_rank`, `pp_rank`, `path`"),
    "integrations/rebalance_cli.py": (
        7,
        "its own JSON output (`success`) and the request file's `input_ids` / `extra_key`",
    ),
    "rollout/live_rounds.py": (
        2,
        "the `message` of a failed call's JSON reply and the field its refusal names",
    ),
    "rollout/rebalancer.py": (1, "the `path` key of a move plan's own dict"),
    "rollout/request_types.py": (2, "SGLang's /generate body (`input_ids`, `extra_key`)"),
    "rollout/server_calls.py": (2, "the `path` and `running_rid` keywords of migrate"),
    "server/diag/metrics.py": (9, "metric labels `path`, `tp_rank`, `pp_rank`, `bytes`"),
    "server/diag/trace.py": (1, "the `trace` key of a reply dict"),
    "server/http/fast_path.py": (1, "the ASGI scope's `path` (shares a wire field's name)"),
    "server/http/routes.py": (17, "turns replies into JSON bodies by hand (`steps_ms`, ...)"),
    "server/diag/profiling.py": (1, "a profile field that shares a wire field's name"),
    "server/rank/dispatch.py": (1, "the `trace` key of a reply dict"),
    "server/target/allocations.py": (1, "the `grant` step of its `steps_ms`"),
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


def _feature_aliases(modules: dict[str, ast.Module] = MODULES) -> list[str]:
    """Modules that bind a registry constant to a name of their own (`FEATURE =
    features.X`, `from ...features import X as FEATURE`): a grep for the constant would
    miss them. The package `__init__` re-exports two under public names."""
    features = _features()
    constants = {
        name
        for name, value in vars(features).items()
        if name.isupper() and isinstance(value, str) and value in features.BY_NAME
    }
    found = []
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "features"
                and node.value.attr in constants
            ):
                found.append(f"{module}:{node.lineno}")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == REGISTRY_MODULE
                and module != NAME
                and any(a.asname and a.asname != a.name for a in node.names)
            ):
                found.append(f"{module}:{node.lineno}")
    return found


def _features() -> types.ModuleType:
    from sglang_kv_migration.wire import features

    return features


def test_feature_constants_have_no_aliases() -> None:
    assert not _feature_aliases()
    source = (
        "from sglang_kv_migration.wire import features\n"
        "from sglang_kv_migration.wire.features import RUNNING_SLOTS as FEATURE\n"
        "from sglang_kv_migration.wire.features import BINARY_IDS\n"
        "MINE = features.SOURCE_COMMIT\n"
        "ALL = features.ALWAYS\n"
    )
    assert _feature_aliases({"m": ast.parse(source)}) == ["m:2", "m:4"]


def _code_names(module: str) -> set[str]:
    """What a module's code names (comments and docstrings aside): identifiers,
    attributes, keywords, parameters, definitions, the modules it imports, its own path,
    and its string literals."""
    tree = MODULES[module]
    names = set(module.split("."))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(part for a in node.names for part in a.name.split("."))
    names.update(node.value for node in string_literals(tree))
    return names


def feature_reach() -> dict[str, list[str]]:
    """Per registered feature, the modules whose code names it: its name, its registry
    constant or a wire field the registry says it adds (`Feature.fields`)."""
    names = {module: _code_names(module) for module in MODULES}
    return {
        feature.name: sorted(
            relative_path(module)
            for module, named in names.items()
            if named & {feature.name, feature.name.upper(), *feature.fields}
        )
        for feature in _features().REGISTRY
    }


# feature -> how many modules it reaches (`feature_reach`; the wire models, the registry
# and the client's plan among them; a field name another object shares counts too, e.g.
# a device target's `instance_id` or a rebalancer round's `moves`). Growth fails: put a
# feature's new check with its others instead of in one more module, or raise its number
# here on purpose. A feature that reaches fewer modules lowers its number. The client's
# split into its steps, plan and calls counts each of those modules apart; on the server
# each role says what it offers (`TargetRole.features`, the allocate channel it holds),
# `scheduler/compose.py` hands that to the session info, and the source's reply is built
# whole in `source/replies.py`.
FEATURE_REACH = {
    "page_ranges": 8,
    "bound_grants": 11,
    "partial_transfer": 12,
    "binary_ids": 10,
    "epoch_check": 6,
    "transfer_batch": 12,
    "source_commit": 9,
    "source_allocate": 20,
    "destination_digest": 13,
    "dp_ranks": 24,
    "running_slots": 18,
    "owner_pattern": 12,
    "source_dp_rank": 11,
}


def test_each_feature_reaches_no_more_modules_than_recorded() -> None:
    reach = feature_reach()
    counts = {name: len(modules) for name, modules in reach.items()}
    assert counts == FEATURE_REACH, "\n".join(
        f"{name}: {counts[name]} modules, recorded {FEATURE_REACH.get(name)}: {reach[name]}"
        for name in counts
        if counts[name] != FEATURE_REACH.get(name)
    )


def test_the_feature_fields_are_wire_fields() -> None:
    """What the registry says a feature adds is a field of the wire models (or the batch
    body's `moves`), so the reach above follows real names."""
    from sglang_kv_migration.wire import bodies

    body_fields = {
        name
        for value in vars(bodies).values()
        if isinstance(value, type) and issubclass(value, bodies.Body)
        for name in value.model_fields
    }
    fields = {f for feature in _features().REGISTRY for f in feature.fields}
    assert fields - _wire_field_names() - body_fields == set()
    assert "running_rid" in fields and "input_ids_u32" in fields


# --------------------------------------------------------------------------- sizes

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
# path (or path::Class) -> why it is still longer.
SIZE_ALLOWED: dict[str, object] = {}


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
        15,
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
        16,
        "the source role's flow reaches its records, checks and replies, the same-host "
        "channels and the diagnostics",
    ),
}


def _outside_own_package(module: str, targets: set[str]) -> set[str]:
    """A package's `__init__` that re-exports its own modules (the adapter's facade) is
    not coupled to them: only its imports from outside its package count."""
    if not relative_path(module).endswith("__init__.py"):
        return set(targets)
    return {t for t in targets if not t.startswith(module + ".")}


def test_no_module_imports_much_of_the_package() -> None:
    found: dict[str, object] = {
        relative_path(module): len(_outside_own_package(module, targets))
        for module, targets in edges().items()
        if len(_outside_own_package(module, targets)) > MAX_PACKAGE_IMPORTS
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
