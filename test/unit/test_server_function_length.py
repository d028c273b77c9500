"""No function in `server/` is longer than 80 lines (issue 18): split by meaning."""

from __future__ import annotations

import ast
import pathlib

import sglang_kv_migration.server as server

MAX_LINES = 80


def test_no_server_function_over_80_lines() -> None:
    root = pathlib.Path(server.__file__).parent
    too_long = []
    for module in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    too_long.append(f"{module.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not too_long
