"""The package's boundaries, read from its source with `ast` (see the package README):

- no import cycle between modules, function-level imports included, and the longest
  chain of imports does not grow;
- `paths/` imports nothing from `server/`, `client/` or `rollout/`;
- `client/`, `rollout/` and `integrations/` import nothing from `server/` or `paths/`,
  and stand in that order: `client/` imports neither of the other two, `rollout/` not
  `integrations/`;
- no two sibling folders import each other (`server/rank` and `server/source`, say);
  the pairs that still do are listed with their module edges each way, so they only
  shrink (`MUTUAL_FOLDERS_ALLOWED`);
- the shared modules (errors, wire, grants, cp_owners, fingerprint, targets) and
  `sglang_adapter/` import none of the four parts;
- sibling layers import one way only: the root modules stand on `wire/`, which imports
  nothing of the package outside itself;
- `mooncake` is imported only by the engine wrapper, `paths/host/mooncake_engine.py`;
- SGLang is reached only through `sglang_adapter/`: no run-time SGLang import elsewhere
  except the extension points a plugin is meant to use, and no private (`._name`)
  attribute of anything but our own objects; Starlette's `request._body` / `request._json`
  count as a framework's private names too (`PRIVATE_ALLOWED` lists what is left).
"""

from __future__ import annotations

import ast

import pytest
from package_source import MODULES, NAME, PATHS, check_allow_list, imports, relative_path
from package_source import edges as _edges
from package_source import in_part as _in

# Documented extension points, used as SGLang's plugin docs show: the hook registry, the
# ServerArgs class our flags subclass and the route auth decorator. (The request base
# class our messages derive from differs between SGLang lines: the adapter's
# `ipc_messages.py` reaches it.)
SGLANG_EXTENSION_POINTS = {
    f"{NAME}.server.plugin": {"sglang.srt.plugins.hook_registry"},
    f"{NAME}.server.server_args": {"sglang.srt"},
    f"{NAME}.server.http.routes": {"sglang.srt.utils.auth"},
    # verl's plugin entry point calls SGLang's own plugin loader (and nothing else).
    f"{NAME}.integrations.verl_plugin": {"sglang.srt.plugins"},
    # The demo's CPU server builds SGLang's own cache and pools, as a scheduler does
    # (`demo/__init__.py`); it runs in processes of its own, never in a server's.
    f"{NAME}.demo.cpu_server": {"sglang.srt.mem_cache", "sglang.srt.managers.scheduler"},
}
# torch's own CUDA IPC calls (storage export/import), not SGLang's: the device path's
# one place that shares KV buffers between processes the way torch.multiprocessing does.
TORCH_PRIVATE = {
    f"{NAME}.paths.device.cuda_ipc": {"_share_cuda_", "_lazy_init", "_new_shared_cuda"}
}
# Starlette's `Request` caches the body it read in `_body` and the parsed JSON in `_json`:
# private names of a framework like SGLang's, never ours even where we assign them.
STARLETTE_PRIVATE = {"_body", "_json"}
# Modules outside the adapter that still touch a framework's private name (path ->
# (names, reason)); the list only shrinks: an entry that is no longer needed fails.
PRIVATE_ALLOWED: dict[str, object] = {
    "server/http/routes.py": (
        frozenset({"_body", "_json"}),
        "the body-size guard fills Starlette's body and JSON caches so SGLang's own "
        "handlers read the capped body; belongs in the adapter",
    ),
}


def test_the_modules_were_found() -> None:
    assert f"{NAME}.server.plugin" in MODULES and f"{NAME}.paths.host.mooncake" in MODULES
    assert len(MODULES) > 30


def test_no_import_cycle() -> None:
    edges = _edges()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# The most modules one chain of imports passes through (function-level imports and those
# for type checking included). Lower it when the chain shrinks.
MAX_IMPORT_CHAIN = 18


def _longest_chain() -> list[str]:
    edges = _edges()
    longest: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in longest:
            longest[module] = [module]  # (no cycle: `test_no_import_cycle`)
            best = max((chain(t) for t in sorted(edges[module])), key=len, default=[])
            longest[module] = [module, *best]
        return longest[module]

    return max((chain(m) for m in sorted(edges)), key=len)


def test_the_longest_import_chain_does_not_grow() -> None:
    found = _longest_chain()
    assert len(found) <= MAX_IMPORT_CHAIN, " -> ".join(m.removeprefix(NAME + ".") for m in found)
    assert len(found) > 5  # (it was read)


@pytest.mark.parametrize(
    ("part", "forbidden"),
    [
        ("paths", ("server", "client", "rollout")),
        ("client", ("server", "paths", "rollout", "integrations")),
        ("rollout", ("server", "paths", "integrations")),
        ("integrations", ("server", "paths")),
        # The shared modules (and the adapter) stand under every part.
        ("errors", ("server", "paths", "client", "rollout")),
        ("wire", ("server", "paths", "client", "rollout")),
        ("grants", ("server", "paths", "client", "rollout")),
        ("cp_owners", ("server", "paths", "client", "rollout")),
        ("fingerprint", ("server", "paths", "client", "rollout")),
        ("targets", ("server", "paths", "client", "rollout")),
        ("sglang_adapter", ("server", "paths", "client", "rollout")),
    ],
)
def test_parts_import_only_what_they_may(part: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{module} -> {target}"
        for module, targets in _edges().items()
        if _in(module, part)
        for target in sorted(targets)
        if _in(target, *forbidden)
    ]
    assert not bad, bad


# Sibling layers, (lower, upper): the lower imports nothing of the upper. `wire/` is the
# contract every part speaks (names, encodings, versions, models); the root modules that
# hold shared logic (grants, fingerprints, typed destinations, errors) stand on it.
ROOT_MODULES = ("errors", "grants", "cp_owners", "fingerprint", "targets")
ONE_WAY_PAIRS = [(("wire",), ROOT_MODULES)]


def _edges_between(lower: tuple[str, ...], upper: tuple[str, ...]) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in _edges().items()
        if _in(module, *lower)
        for target in sorted(targets)
        if _in(target, *upper)
    ]


@pytest.mark.parametrize(("lower", "upper"), ONE_WAY_PAIRS)
def test_sibling_layers_import_one_way(lower: tuple[str, ...], upper: tuple[str, ...]) -> None:
    assert not _edges_between(lower, upper)
    assert _edges_between(upper, lower), "the upper layer was expected to use the lower"


def test_wire_imports_nothing_of_the_package_outside_itself() -> None:
    bad = [
        f"{module} -> {target}"
        for module, targets in _edges().items()
        if _in(module, "wire")
        for target in sorted(targets)
        if not _in(target, "wire")
    ]
    assert not bad, bad


def test_every_root_module_is_in_a_layer() -> None:
    """A new module at the package root joins `ROOT_MODULES` (or a folder), so the
    one-way check sees it; the entry points and import helpers stand above every part."""
    above = {"cli", "sglang_flags", "import_hooks"}
    folders = {m.split(".")[1] for m in MODULES if m.count(".") >= 2}
    files = {m.split(".")[1] for m in MODULES if m.count(".") == 1} - folders
    assert files - above == set(ROOT_MODULES)


def test_only_the_console_script_loads_the_demo() -> None:
    """The demo's CPU stand-ins (`demo/cpu_stand_ins.py`) replace SGLang's copy kernels in
    the demo's own server processes: no module of the plugin, client or integrations may
    import the demo; the console script loads its driver for `demo` only."""
    importers = {
        module
        for module, targets in _edges().items()
        if not _in(module, "demo") and any(_in(t, "demo") for t in targets)
    }
    assert importers == {f"{NAME}.cli"}, importers
    driver_imports = _edges()[f"{NAME}.demo.run"]
    assert not [t for t in driver_imports if _in(t, "server", "paths")], driver_imports


# "a <-> b" (sibling folders, as paths below the package) -> ((module edges a -> b,
# b -> a), why they still import each other). Counts may only go down, to no entry.
MUTUAL_FOLDERS_ALLOWED: dict[str, object] = {}


def _folders() -> set[str]:
    """Every package folder below the root, dotted (`sglang_kv_migration.server.rank`)."""
    return {m for m, path in PATHS.items() if path.name == "__init__.py" and m != NAME}


def _folder_edges(edges: dict[str, set[str]], folders: set[str]) -> dict[tuple[str, str], int]:
    """(folder a, folder b) -> how many module edges go from inside a to inside b, for
    each edge between two sibling folders: the child folders, under the deepest package
    both modules are in, that hold each end (none where an end sits in that package
    itself)."""

    def child_folder(module: str, parent: str) -> str | None:
        for folder in folders:
            if folder.rpartition(".")[0] == parent and (
                module == folder or module.startswith(folder + ".")
            ):
                return folder
        return None

    counts: dict[tuple[str, str], int] = {}
    for module, targets in edges.items():
        for target in targets:
            a, b = module.split("."), target.split(".")
            shared = 0
            while shared < min(len(a), len(b)) and a[shared] == b[shared]:
                shared += 1
            parent = ".".join(a[:shared])
            ends = child_folder(module, parent), child_folder(target, parent)
            if ends[0] and ends[1] and ends[0] != ends[1]:
                counts[ends] = counts.get(ends, 0) + 1
    return counts


def _mutual_folders(edges: dict[str, set[str]], folders: set[str]) -> dict[str, tuple[int, int]]:
    """Sibling folders that import each other: "a <-> b" -> (edges a -> b, b -> a)."""
    counts = _folder_edges(edges, folders)

    def path(folder: str) -> str:
        return folder.removeprefix(NAME + ".").replace(".", "/")

    return {
        f"{path(a)} <-> {path(b)}": (n, counts[(b, a)])
        for (a, b), n in counts.items()
        if (b, a) in counts and path(a) < path(b)
    }


def test_no_two_sibling_folders_import_each_other() -> None:
    check_allow_list(_mutual_folders(_edges(), _folders()), MUTUAL_FOLDERS_ALLOWED)


def test_the_server_layers_import_one_way() -> None:
    """A folder is one layer: `server/rank` is what the roles stand on, `server/scheduler`
    what stands on them, so the roles import the first and the second imports them."""
    counts = _folder_edges(_edges(), _folders())
    rank, scheduler, target = (f"{NAME}.server.{f}" for f in ("rank", "scheduler", "target"))
    assert counts[(scheduler, target)] > 0
    assert counts[(target, rank)] > 0
    assert (rank, target) not in counts
    assert (rank, scheduler) not in counts


def test_the_sibling_folder_check_can_fail() -> None:
    """Edges one way, edges between a folder and a module beside it, and edges inside a
    folder are not a pair; two folders that import each other are, counted each way."""
    folders = {f"{NAME}.a", f"{NAME}.b", f"{NAME}.c", f"{NAME}.a.x", f"{NAME}.a.y"}
    edges = {
        f"{NAME}.a.one": {f"{NAME}.b.two", f"{NAME}.c.three", f"{NAME}.shared"},
        f"{NAME}.a.x.four": {f"{NAME}.b.two", f"{NAME}.a.y.five", f"{NAME}.a.six"},
        f"{NAME}.b.two": {f"{NAME}.a.one"},
        f"{NAME}.a.y.five": {f"{NAME}.a.x.four"},
        f"{NAME}.a.six": {f"{NAME}.a.x.four"},
        f"{NAME}.shared": {f"{NAME}.c.three"},
    }
    assert _mutual_folders(edges, folders) == {"a <-> b": (2, 1), "a/x <-> a/y": (1, 1)}
    assert _folders() >= {f"{NAME}.server.rank", f"{NAME}.client", f"{NAME}.paths.host"}


def _mooncake_importers() -> set[str]:
    return {
        module
        for module, tree in MODULES.items()
        for dotted, _line in imports(tree)
        if dotted.split(".")[0] == "mooncake"
    }


def test_mooncake_is_imported_only_by_the_engine_wrapper() -> None:
    """One module reads the engine's return codes: the transport interface, the workers
    and the host path stay importable and testable without it."""
    assert _mooncake_importers() == {f"{NAME}.paths.host.mooncake_engine"}


def test_sglang_is_imported_at_run_time_only_by_the_adapter() -> None:
    bad = []
    for module, tree in MODULES.items():
        if _in(module, "sglang_adapter"):
            continue
        allowed = SGLANG_EXTENSION_POINTS.get(module, set())
        for dotted, line in imports(tree, runtime_only=True):
            if dotted.split(".")[0] != "sglang":
                continue
            if not any(dotted == a or dotted.startswith(a + ".") for a in allowed):
                bad.append(f"{module}:{line} imports {dotted}")
    assert not bad, bad


def _our_private_names() -> set[str]:
    """Every `_name` our package defines: functions, classes, fields, attributes set."""
    names: set[str] = set()
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if _in(module, "sglang_adapter") and isinstance(node, ast.Attribute):
                continue  # `scheduler._request_dispatcher += ...` writes SGLang's attribute
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.rpartition(".")[2])
    return {n for n in names if n.startswith("_")}


def test_private_sglang_attributes_are_read_only_by_the_adapter() -> None:
    ours = _our_private_names() - STARLETTE_PRIVATE
    bad = [
        f"{module}:{node.lineno} .{node.attr}"
        for module, tree in MODULES.items()
        if not _in(module, "sglang_adapter")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not (node.attr.startswith("__") and node.attr.endswith("__"))
        and node.attr not in ours
        and node.attr not in TORCH_PRIVATE.get(module, set())
        and node.attr not in PRIVATE_ALLOWED.get(relative_path(module), ((),))[0]
    ]
    assert not bad, bad


def test_framework_private_names_outside_the_adapter_are_only_the_listed_ones() -> None:
    """Starlette's `request._body` / `request._json` count as a framework's private names
    (assigning them does not make them ours); the modules that still use any are listed."""
    ours = _our_private_names() - STARLETTE_PRIVATE
    found: dict[str, frozenset[str]] = {}
    for module, tree in MODULES.items():
        if _in(module, "sglang_adapter"):
            continue
        names = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in ours
            and node.attr not in TORCH_PRIVATE.get(module, set())
        }
        if names:
            found[relative_path(module)] = frozenset(names)
    check_allow_list(found, PRIVATE_ALLOWED)


def test_the_adapter_is_where_the_private_reads_are() -> None:
    """The check above can fail: the adapter itself reads SGLang's private names."""
    ours = _our_private_names()
    adapter_private = {
        node.attr
        for module, tree in MODULES.items()
        if _in(module, "sglang_adapter")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in ours
    }
    assert {"_request_dispatcher", "_result_dispatcher", "_hooks"} <= adapter_private
