"""The package's boundaries, read from its source with `ast` (see the package README):

- no import cycle between modules, function-level imports included;
- no two sibling folders import each other (a folder is one layer), and the longest
  chain of imports does not grow;
- `paths/` imports nothing from `server/`, `client/` or `rollout/`;
- `client/`, `rollout/` and `integrations/` import nothing from `server/` or `paths/`;
- the shared modules (errors, wire, grants, page_ranges, cp_owners, fingerprint, targets)
  and `sglang_adapter/` import none of the four parts;
- `mooncake` is imported only by the engine wrapper, `paths/host/mooncake_engine.py`;
- SGLang is reached only through `sglang_adapter/`: no run-time SGLang import elsewhere
  except the extension points a plugin is meant to use, and no private (`._name`)
  attribute of anything but our own objects; Starlette's `request._body` / `request._json`
  count as a framework's private names too (`PRIVATE_ALLOWED` lists what is left).
"""

from __future__ import annotations

import ast

import pytest
from package_source import MODULES, NAME, PACKAGE, PATHS, check_allow_list, imports, relative_path
from package_source import edges as _edges
from package_source import in_part as _in

# Documented extension points, used as SGLang's plugin docs show: the hook registry, the
# ServerArgs class our flags subclass, the request base class our wire types derive
# from (SGLang's communicators route by it), and the route auth decorator.
SGLANG_EXTENSION_POINTS = {
    f"{NAME}.server.plugin": {"sglang.srt.plugins.hook_registry"},
    f"{NAME}.server.server_args": {"sglang.srt"},
    f"{NAME}.server.messages": {"sglang.srt.managers.io_struct"},
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


# "a <-> b" -> ((a's module edges to b, b's to a), why they still import each other).
SIBLINGS_ALLOWED: dict[str, object] = {
    "integrations <-> rollout": (
        (3, 1),
        "the gateway and verl's balancer use the rollout's request migrator and cost model, "
        "and the rebalance CLI the gateway",
    ),
}


def _folder_pairs() -> dict[tuple[str, str], int]:
    """(folder, sibling folder) -> how many module edges run from the first into the
    second (a module counts in every folder above it)."""
    pairs: dict[tuple[str, str], int] = {}
    for module, targets in _edges().items():
        here = PATHS[module].relative_to(PACKAGE).parts[:-1]
        for target in targets:
            there = PATHS[target].relative_to(PACKAGE).parts[:-1]
            shared = zip(here, there, strict=False)  # (a folder's module: never its sibling's)
            depth = next((i for i, (a, b) in enumerate(shared) if a != b), None)
            if depth is not None:
                key = ("/".join(here[: depth + 1]), "/".join(there[: depth + 1]))
                pairs[key] = pairs.get(key, 0) + 1
    return pairs


def test_no_two_sibling_folders_import_each_other() -> None:
    """A folder is one layer: what it stands on is in other folders, which do not stand
    on it in turn (`server/rank` is what the roles stand on, `server/scheduler` what
    stands on them)."""
    pairs = _folder_pairs()
    found = {
        f"{a} <-> {b}": (n, pairs[(b, a)])
        for (a, b), n in pairs.items()
        if a < b and (b, a) in pairs
    }
    check_allow_list(found, SIBLINGS_ALLOWED)


def test_the_sibling_check_reads_folders() -> None:
    pairs = _folder_pairs()
    assert pairs[("server/scheduler", "server/target")] > 0
    assert pairs[("server/target", "server/rank")] > 0
    assert ("server/rank", "server/target") not in pairs


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
        ("client", ("server", "paths")),
        ("rollout", ("server", "paths")),
        ("integrations", ("server", "paths")),
        # The shared modules (and the adapter) stand under every part.
        ("errors", ("server", "paths", "client", "rollout")),
        ("wire", ("server", "paths", "client", "rollout")),
        ("grants", ("server", "paths", "client", "rollout")),
        ("page_ranges", ("server", "paths", "client", "rollout")),
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
