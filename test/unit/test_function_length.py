"""No function in the package is longer than 80 lines (checked with `ast`)."""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_kv_migration

PACKAGE = Path(sglang_kv_migration.__file__).parent
MAX_LINES = 80


def _long_functions() -> list[str]:
    found = []
    for module in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{module.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    return found


def test_the_package_was_read() -> None:
    assert (PACKAGE / "server" / "scheduler" / "scheduler_side.py").exists()


def test_every_function_fits_on_a_screen() -> None:
    assert _long_functions() == []
