"""The package's source, parsed once with `ast`, for the tests that check its shape
(`test_package_boundaries.py`, `test_package_rules.py`)."""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sglang_kv_migration"
NAME = "sglang_kv_migration"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES: dict[str, str] = {
    module_name(p): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))
}
PATHS: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES: dict[str, ast.Module] = {
    module: ast.parse(text, str(PATHS[module])) for module, text in SOURCES.items()
}


def in_part(module: str, *parts: str) -> bool:
    """Whether `module` is one of `parts` (dotted, below the package) or inside one."""
    return any(module == f"{NAME}.{p}" or module.startswith(f"{NAME}.{p}.") for p in parts)


def relative_path(module: str) -> str:
    """`sglang_kv_migration.server.plugin` -> `server/plugin.py` (the allow-lists' keys)."""
    return PATHS[module].relative_to(PACKAGE).as_posix()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, *, runtime_only: bool = False) -> Iterator[tuple[str, int]]:
    """(imported module or `module.name`, line) for every import anywhere in `tree`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and runtime_only and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno
        stack.extend(ast.iter_child_nodes(node))


def package_target(dotted: str) -> str | None:
    """The module of ours an import names (`pkg.mod.Name` -> `pkg.mod`), else None."""
    if not (dotted == NAME or dotted.startswith(NAME + ".")):
        return None
    while dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def edges() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it, TYPE_CHECKING too)."""
    found: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, tree in MODULES.items():
        for dotted, _line in imports(tree):
            target = package_target(dotted)
            if target is not None and target != module:
                found[module].add(target)
    return found


def docstring_nodes(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                found.add(id(body[0].value))
    return found


def string_literals(tree: ast.Module) -> Iterator[ast.Constant]:
    """Every `str` constant in `tree` that is not a docstring (f-string parts included)."""
    docstrings = docstring_nodes(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a module's source."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    tree = ast.parse(source)
    docstrings = docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) in docstrings:
            for offset, line in enumerate(node.value.splitlines()):
                yield node.lineno + offset, line


def check_allow_list(found: dict[str, object], allowed: dict[str, object]) -> None:
    """`found` (path -> what breaks the rule there) must be exactly what `allowed` lists.

    An entry of `allowed` is `path: reason` (the path may break the rule) or
    `path: (value, reason)` (it may break it by exactly `value`: a count, a set). A new
    or grown offender fails, and so does an entry that no longer matches, so each list
    only shrinks as the code is fixed; the message says what to write instead."""
    problems = [f"new: {p} ({found[p]!r})" for p in sorted(found.keys() - allowed.keys())]
    problems += [f"stale, remove it: {p}" for p in sorted(allowed.keys() - found.keys())]
    for path in sorted(found.keys() & allowed.keys()):
        entry = allowed[path]
        if isinstance(entry, tuple) and found[path] != entry[0]:
            problems.append(f"{path}: now {found[path]!r}, listed {entry[0]!r}")
    assert not problems, "\n".join(problems)
