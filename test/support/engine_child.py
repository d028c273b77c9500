"""The one way a test's engine child process runs (test env only): `embedded_engine.py`
and `verl_order_server.py` start SGLang in a fresh interpreter, print one JSON line, and
live until the test closes their stdin.

    if __name__ == "__main__":
        engine_child.run(lambda: launch(...))
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import cpu_harness


async def _report_then_wait(start: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Print what `start` returns, or the error it raised; then wait for stdin to close."""
    try:
        started = await start()
    except BaseException as e:
        error = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        # flushed: the process leaves through os._exit, which drops unflushed output
        print(json.dumps(error), flush=True)
        return
    print(json.dumps(started), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def run(start: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """With the CPU shims installed, run `start` in a new asyncio loop and report it; then
    kill the engine's processes and leave without the interpreter's exit (its hooks would
    wait on SGLang's children and threads)."""
    cpu_harness.install_cpu_shims()
    try:
        asyncio.run(_report_then_wait(start))
    finally:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
        cpu_harness.remove_own_model_dir()  # os._exit skips the exit-time removal
        os._exit(0)
