"""What every mini-server rank imports, imported once by the fork server the ranks are
forked from (`mini_server._context`): each rank then starts without its own SGLang import
(about 10 s of CPU each on a small box). Only imports: no Python threads, no sockets,
no process groups, so forking from here is safe (as DataLoader workers fork after
`import torch`); the shims go first, as they must before anything imports sglang."""

from __future__ import annotations

import cpu_harness

cpu_harness.install_cpu_shims()

import fastapi  # noqa: E402, F401
import sglang.srt.managers.scheduler  # noqa: E402, F401
import sglang.srt.mem_cache.hiradix_cache  # noqa: E402, F401
import sglang.srt.server_args  # noqa: E402, F401
import sglang.srt.utils.auth  # noqa: E402, F401
import sglang_kv_migration.server.http.communicators  # noqa: E402, F401
import sglang_kv_migration.server.http.routes  # noqa: E402, F401
import sglang_kv_migration.server.scheduler.hooks  # noqa: E402, F401
import sglang_kv_migration.server.server_args  # noqa: E402, F401
import uvicorn  # noqa: E402, F401
import zmq.asyncio  # noqa: E402, F401
