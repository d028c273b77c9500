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

import logging

from sglang_kv_migration.import_hooks import after_import

logger = logging.getLogger(__name__)

HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"


def load_sglang_plugins() -> None:
    """SGLang's own plugin loader (the `sglang.srt.plugins` entry points, then the hooks)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def install() -> None:
    """Load SGLang's plugins now if its HTTP server is imported, else right after it is.
    Idempotent (`load_plugins` is)."""
    after_import(HTTP_SERVER_MODULE, _load_quietly)


def _load_quietly() -> None:
    # This runs inside an import statement of verl's: an error here must not break it.
    # Without the plugins, ServerArgs(enable_kv_migration=...) fails next with TypeError,
    # after this warning.
    try:
        load_sglang_plugins()
    except Exception:
        logger.warning("sglang-kv-migration: loading SGLang's plugins failed", exc_info=True)


install()
