"""Run a callback right after a module of another package has been imported: how this
package's flags reach SGLang's `ServerArgs` in processes that build it before SGLang
loads its plugins (the package's `__init__`), and how verl's server actors load SGLang's
plugins in time (`integrations/verl_plugin.py`).

Pure Python: importing this module imports nothing, and a callback is never run while
its module is still executing.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run `callback` now if module `name` is imported, else once, right after it is
    (after it executed; not when it raised). The callback runs inside the statement that
    imported the module: it must not raise."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, AfterImport(name, callback))


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback` once, after module `name` has executed; finds nothing itself (the
    finders behind it find the module, and its loader is wrapped)."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self._done)
                return spec
        return None

    def _done(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback()


class _ThenLoader(importlib.abc.Loader):
    """`loader`, calling `then()` after the module executed (not when it raised)."""

    def __init__(self, loader: Any, then: Callable[[], None]):
        self.loader = loader
        self.then = then

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the loader's
        return getattr(self.loader, name)
