"""Run SGLang in-process as ROLL's and AReaL's rollouts do, on CPU, and serve its six
migration routes on a port of its own (test env only).

    python embedded_engine.py '<Engine kwargs as JSON>'

In a fresh interpreter, inside a running asyncio loop (the rollout's): `Engine(**kwargs)`
with `enable_kv_migration=True`, with SGLang's `ServerArgs` still SGLang's own (no
`sglang_flags` import: SGLang finds the plugin through its installed entry point, in
`Engine.__init__`), then
`serve_engine_routes(engine)`. What stands in: only the scheduler and detokenizer
process functions (`engine_standins.py`; a GPU model cannot load here), given as the
`Engine` class attributes SGLang keeps for that (`run_scheduler_process_func`,
`run_detokenizer_process_func`). The tokenizer manager, the plugin's hooks and
communicators and the routes are SGLang's and ours.

Prints one JSON line (`{"url": ..., "server_args_class": ..., "engine_args_class": ...}`)
once the routes answer, or `{"error": ...}`; exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


async def launch(kwargs: dict[str, Any]) -> dict[str, Any]:
    import engine_standins
    import sglang
    from sglang.srt import server_args
    from sglang.srt.entrypoints.engine import Engine

    if server_args.ServerArgs.__module__ != server_args.__name__:
        raise RuntimeError(f"ServerArgs was replaced before the Engine: {server_args.ServerArgs}")

    class CPUEngine(Engine):
        run_scheduler_process_func = staticmethod(engine_standins.run_scheduler_process)
        run_detokenizer_process_func = staticmethod(engine_standins.run_detokenizer_process)

    engine = CPUEngine(**kwargs)
    from sglang_kv_migration.server.embedded import serve_engine_routes

    routes = await serve_engine_routes(engine)
    return {
        "url": routes.url,
        "server_args_class": _qualified(type(engine.server_args)),
        # `sglang.Engine` is the class subclassed here; what it builds args with now.
        "engine_args_class": _qualified(sglang.Engine.server_args_class),
    }


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine_child

    engine_child.run(lambda: launch(json.loads(sys.argv[1])))
