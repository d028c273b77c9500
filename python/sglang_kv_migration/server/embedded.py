"""The six migration routes of an in-process `sglang.Engine`, on a port of its own.

Frameworks that drive SGLang in-process (ROLL's strategy layer, AReaL's local mode) run
no SGLang HTTP server, so there is no app for the plugin to add its routes to. Their
engine still has everything else: `Engine(enable_kv_migration=True, ...)` (the plugin
replaces `Engine.server_args_class`) starts schedulers with the migration side and a
tokenizer manager with its communicators. This serves the routes for that engine:

    engine = sglang.Engine(model_path=..., enable_hierarchical_cache=True,
                           enable_kv_migration=True)        # inside the rollout's loop
    routes = await serve_engine_routes(engine, host="0.0.0.0", port=30100)
    ...                                   # peers and clients migrate to/from routes.url
    await routes.stop()

The routes are the same code as on `launch_server` (`http/routes.py`), behind SGLang's
API-key middleware with the engine's `--api-key` / `--admin-api-key`. They run on the
asyncio loop that drives the engine (where `engine.async_generate` is awaited): the
tokenizer manager reads the schedulers' replies on one loop, so the routes must be
served from it; `serve_engine_routes` refuses any other.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.server.http.routes import add_routes

START_TIMEOUT_S = 30.0


class EngineRoutesError(RuntimeError):
    """The engine cannot serve the routes (migration off, or another loop drives it)."""


@dataclass
class EngineRoutes:
    """The routes' server: `url` to hand to peers and clients; `stop()` ends it."""

    url: str
    server: Any  # uvicorn.Server
    task: asyncio.Task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_engine_routes(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> EngineRoutes:
    """Serve the six routes of `engine` on `host:port` (0: a free port) from the running
    loop, which must be the engine's; returns once they answer. `api_key` /
    `admin_api_key` default to the engine's server args."""
    import uvicorn
    from fastapi import FastAPI

    tokenizer_manager = sglang_adapter.engine_tokenizer_manager(engine)
    communicators = tokenizer_manager.kv_migration_communicators
    if communicators is None:
        raise EngineRoutesError(
            "this engine has no KV-migration side: build it with enable_kv_migration=True "
            "and enable_hierarchical_cache=True"
        )
    loop = asyncio.get_running_loop()
    if sglang_adapter.engine_loop(engine) is not loop:
        raise EngineRoutesError(
            "serve the routes from the loop that drives the engine (build the Engine inside "
            "that running loop, and await serve_engine_routes there)"
        )
    args = engine.server_args
    app = FastAPI()
    add_routes(app, lambda: communicators)
    keys = (api_key or args.api_key, admin_api_key or args.admin_api_key)
    if any(keys):
        sglang_adapter.add_api_key_middleware(app, api_key=keys[0], admin_api_key=keys[1])
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = loop.create_task(server.serve(sockets=[listening]))
    deadline = loop.time() + START_TIMEOUT_S
    while not server.started:
        if task.done() or loop.time() > deadline:
            server.should_exit = True
            failure = task.exception() if task.done() else None
            raise EngineRoutesError(
                f"the routes' server on {host}:{port} did not start: {failure!r}"
            ) from failure
        await asyncio.sleep(0.01)
    return EngineRoutes(f"http://{host}:{listening.getsockname()[1]}", server, task)
