"""The multiprocessing context the test servers' processes start from (test env only).

Ranks are forked from one fork server that has imported SGLang once (`_server_preload`),
not spawned: a spawned rank spends ~10 s of CPU importing it, and the suite starts ~50
ranks on a 2-core CI box. Each one is still its own fresh process running its own main;
only the imported modules come from the fork server. Its environment is the one of when
it started: a child that needs today's (e.g. MC_* variables a test sets) is sent it.
"""

from __future__ import annotations

import os
from typing import Any

_CONTEXT: Any = None


def context() -> Any:
    """The "forkserver" context, its server started (once) with SGLang imported."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["_server_preload"])
        # Python 3.11's fork server ignores the parent's sys.path: it finds the preload
        # module (and this package) through PYTHONPATH, set only while it starts.
        here = os.path.dirname(os.path.abspath(__file__))
        package = os.path.dirname(_package_dir())
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, package, old) if p)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old
        _CONTEXT = ctx
    return _CONTEXT


def _package_dir() -> str:
    import sglang_kv_migration

    return os.path.dirname(os.path.abspath(sglang_kv_migration.__file__))
