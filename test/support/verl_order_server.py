"""Start SGLang the way verl 0.9.1's SGLang server actor does, on CPU (test env only).

    python verl_order_server.py '<engine_kwargs as JSON>' [model_dir]

In a fresh interpreter, the calls of `SGLangHttpServer.launch_server`
(verl/workers/rollout/sglang_rollout/async_sglang_server.py), in its order: import verl's
module (which imports `verl`, and with it the `verl.plugins` entry points), build the
argument dict verl builds with the rollout's `engine_kwargs.sglang` merged last, install
verl's `_set_envs_and_config`, `ServerArgs(**args)` with the `ServerArgs` verl imported,
`Engine._launch_subprocesses(...)`, the global state and `app` attributes verl sets, then
verl's own `run_uvicorn(app, ...)`. Only the scheduler and detokenizer process functions
are CPU stand-ins (`engine_standins.py`): a GPU model cannot load here.

Prints one JSON line (`{"url": ..., "server_args_class": ...}`) once serving, or
`{"error": ...}` if a step failed; exits (killing its children) when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def verl_args(model_path: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keys `launch_server` passes to ServerArgs for a 1-GPU replica, engine_kwargs last
    (verl pops `attention_backend` from them and passes it on by name)."""
    engine_kwargs = dict(engine_kwargs)
    attention_backend = engine_kwargs.pop("attention_backend", "flashinfer")
    return {
        "model_path": model_path,
        "dtype": "bfloat16",
        "mem_fraction_static": 0.5,
        "disable_cuda_graph": True,
        "enable_memory_saver": True,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "tp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "node_rank": 0,
        "load_format": "dummy",
        "nnodes": 1,
        "trust_remote_code": False,
        "max_running_requests": None,
        "log_level": "error",
        "mm_attention_backend": None,
        "attention_backend": attention_backend,
        "skip_tokenizer_init": True,
        "skip_server_warmup": True,
        "quantization": None,
        "json_model_override_args": json.dumps({}),
        "custom_weight_loader": None,
        **engine_kwargs,
        "enable_weights_cpu_backup": True,
    }


async def launch(engine_kwargs: dict[str, Any], model_dir: str | None) -> dict[str, Any]:
    import cpu_harness
    import engine_standins
    import sglang.srt.entrypoints.engine
    from sglang.srt.entrypoints.http_server import Engine
    from verl.workers.rollout.sglang_rollout import async_sglang_server as verl_server
    from verl.workers.rollout.sglang_rollout.sglang_rollout import _set_envs_and_config
    from verl.workers.rollout.utils import run_uvicorn

    args = verl_args(model_dir or cpu_harness.write_tiny_model_dir(), engine_kwargs)
    sglang.srt.entrypoints.engine._set_envs_and_config = _set_envs_and_config
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
    server_args = verl_server.ServerArgs(**args)
    tokenizer_manager, template_manager, scheduler_info, *_ = (
        Engine._launch_subprocesses(  # imported inside verl's function
            server_args=server_args,
            init_tokenizer_manager_func=sglang.srt.entrypoints.engine.init_tokenizer_manager,
            run_scheduler_process_func=engine_standins.run_scheduler_process,
            run_detokenizer_process_func=engine_standins.run_detokenizer_process,
        )
    )
    verl_server.set_global_state(
        verl_server._GlobalState(
            tokenizer_manager=tokenizer_manager,
            template_manager=template_manager,
            scheduler_info=scheduler_info,
        )
    )
    app = verl_server.app
    app.is_single_tokenizer_mode = True
    app.server_args = server_args
    app.warmup_thread_kwargs = {"server_args": server_args}
    app.warmup_thread_args = (server_args, None, None)
    port, _task = await run_uvicorn(app, server_args, "127.0.0.1")
    return {
        "url": f"http://127.0.0.1:{port}",
        "server_args_class": f"{type(server_args).__module__}.{type(server_args).__name__}",
    }


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine_child

    engine_child.run(lambda: launch(json.loads(sys.argv[1]), (sys.argv[2:] or [None])[0]))
