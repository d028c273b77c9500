"""CPU stand-ins for the two processes SGLang's `Engine._launch_subprocesses` starts
(test env only): `run_scheduler_process` and `run_detokenizer_process`, with SGLang's
signatures, to pass as `run_scheduler_process_func` / `run_detokenizer_process_func`.

What is real around them: `Engine._launch_subprocesses` itself (the plugin hooks, port
allocation, the ready handshake on the pipe), SGLang's `TokenizerManager` with our
communicators on SGLang's ipc sockets, and, in the scheduler stand-in, our scheduler hooks
over a real `HiRadixCache` (`mini_server._MiniScheduler`'s loop). What stands in: the
model (none: no forward pass runs, so no request but ours is served) and the detokenizer
(idle: nothing is generated).
"""

from __future__ import annotations

import os
import time
from typing import Any

# Tokens every stand-in scheduler inserts (random KV) before it reports ready, unless
# started with KVM_STANDIN_PRELOAD=0 (a migration target).
PRELOAD_IDS = list(range(1, 1 + 64))


def run_scheduler_process(
    server_args: Any,
    port_args: Any,
    gpu_id: int,
    tp_rank: int,
    attn_cp_rank: int,
    moe_dp_rank: int,
    moe_ep_rank: int,
    pp_rank: int,
    dp_rank: Any,
    pipe_writer: Any,
) -> None:
    import cpu_harness

    cpu_harness.install_cpu_shims()
    import mini_server
    import zmq
    from sglang.srt.plugins import load_plugins
    from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks

    load_plugins()  # as SGLang's scheduler process does first
    # The engine's own model folder: this process is killed, so a folder of its own
    # would stay behind in the temp dir.
    cfg = cpu_harness.HarnessConfig(
        page_size=server_args.page_size, model_dir=server_args.model_path
    )
    harness = cpu_harness.build_harness(cfg)
    if os.environ.get("KVM_STANDIN_PRELOAD", "1") != "0":
        harness.insert_random(PRELOAD_IDS, seed=11)
    harness.write_back_all()
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    receiver.connect(port_args.scheduler_input_ipc_name)  # the tokenizer side binds, as in SGLang
    sender = context.socket(zmq.PUSH)
    sender.connect(port_args.tokenizer_ipc_name)
    scheduler = mini_server._MiniScheduler(mini_server.ServerSpec(harness=cfg), 0, harness, sender)
    scheduler.server_args = server_args  # what the engine was launched with
    scheduler.recv_from_tokenizer = receiver
    scheduler_hooks.after_init_ipc_channels(None, scheduler, port_args)
    scheduler_hooks.after_init_request_dispatcher(None, scheduler)
    pipe_writer.send(
        {"status": "ready", "max_total_num_tokens": cfg.device_tokens, "max_req_input_len": 4000}
    )
    import multiprocessing

    control, _never_written = multiprocessing.Pipe(duplex=False)
    scheduler.run(receiver, control, harness)  # until the parent kills this process


def run_detokenizer_process(server_args: Any, port_args: Any) -> None:
    """Idle: nothing is generated. Bounded; the parent kills it first."""
    time.sleep(3600)
