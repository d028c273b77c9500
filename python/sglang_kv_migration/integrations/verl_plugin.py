"""verl's plugin entry point (group `verl.plugins`): SGLang's plugins load in verl's SGLang
server actors before verl builds `ServerArgs`.

verl 0.9.1 starts SGLang inside a Ray actor (`async_sglang_server.py`): it imports
`ServerArgs` and `app` from `sglang.srt.entrypoints.http_server`, calls
`ServerArgs(**args)` with the rollout's `engine_kwargs.sglang`, then
`Engine._launch_subprocesses` (which loads SGLang's plugins as its first step) and serves
`app` with its own uvicorn. `ServerArgs(enable_kv_migration=True)` would raise TypeError
there: the class that knows the flag replaces SGLang's only once the plugins load.

verl imports every `verl.plugins` entry point whenever `verl` is imported, in each of its
processes (`VERL_USE_EXTERNAL_PLUGINS`, default "auto"). Imported so, this module arranges
for SGLang's `load_plugins()` to run as soon as SGLang's HTTP server module has been
imported: what SGLang's own `Engine.__init__` does before it builds ServerArgs, moved to
the one import every process that serves SGLang's `app` makes. The hook registry's class
replacement rebinds `ServerArgs` in every module that imported it (verl's included), and
the plugin's hook on `Engine._launch_subprocesses` adds the routes to `app`
(`server/plugin.py`). Processes that never import SGLang's HTTP server (verl's trainer
workers, its driver, the load balancer) pay for this module's import only.

`load_plugins()` is idempotent and loads every installed SGLang plugin, as SGLang would a
moment later in the same process; with `--enable-kv-migration` off our hooks return at once.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"


def load_sglang_plugins() -> None:
    """SGLang's own plugin loader (the `sglang.srt.plugins` entry points, then the hooks)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def install() -> None:
    """Load SGLang's plugins now if its HTTP server is imported, else right after it is.
    Idempotent."""
    if HTTP_SERVER_MODULE in sys.modules:
        _load_quietly()
    elif not any(isinstance(f, AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(HTTP_SERVER_MODULE, _load_quietly))


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


def _load_quietly() -> None:
    # This runs inside an import statement of verl's: an error here must not break it.
    # Without the plugins, ServerArgs(enable_kv_migration=...) fails next with TypeError,
    # after this warning.
    try:
        load_sglang_plugins()
    except Exception:
        logger.warning("sglang-kv-migration: loading SGLang's plugins failed", exc_info=True)


install()
