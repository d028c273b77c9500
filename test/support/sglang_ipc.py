"""What the CPU stand-ins for SGLang's processes (`mini_server.py`) do the way the
installed SGLang line does it (tests only): receive a request or reply as its sockets
carry them, the scheduler's reply sender, and where a scheduler process keeps its ranks.

- 0.5.12: pickled objects (`recv_pyobj`), `managers.scheduler.SenderWrapper`, ranks on
  the `Scheduler` object.
- 0.5.23: `io_struct.sock_recv` / `async_sock_recv` (pickle by default, msgpack with
  ``SGLANG_USE_PICKLE_IPC=0``), `scheduler_components.output_sender.SenderWrapper`, ranks
  and widths in the process's runtime context (`get_context().set_server_args` publishes
  the record, the launcher stamps the ranks).
"""

from __future__ import annotations

from typing import Any

import cpu_harness


def sender_wrapper(socket: Any) -> Any:
    """SGLang's `SenderWrapper` around `socket` (the scheduler's reply sender)."""
    if cpu_harness.is_unified_sglang():
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    else:
        from sglang.srt.managers.scheduler import SenderWrapper
    return SenderWrapper(socket)


def recv_nowait(socket: Any) -> Any:
    """One request from a scheduler's input socket, as SGLang's receive decodes it;
    raises `zmq.ZMQError` (EAGAIN) when none waits."""
    import zmq

    if cpu_harness.is_unified_sglang():
        from sglang.srt.managers.io_struct import sock_recv

        return sock_recv(socket, zmq.NOBLOCK)
    return socket.recv_pyobj(zmq.NOBLOCK)


async def recv_reply(socket: Any) -> Any:
    """One reply on the tokenizer side's socket (an asyncio zmq socket)."""
    if cpu_harness.is_unified_sglang():
        from sglang.srt.managers.io_struct import async_sock_recv

        return await async_sock_recv(socket)
    return await socket.recv_pyobj()


def publish_scheduler(server_args: Any, tp_rank: int, pp_rank: int, attn_tp_rank: int) -> None:
    """Make this process a scheduler of `server_args` at these ranks, as SGLang's launcher
    does before it builds one (nothing to do on 0.5.12: the ranks are the scheduler's
    attributes there)."""
    if not cpu_harness.is_unified_sglang():
        return
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().set_server_args(server_args)
    get_parallel().override_permanently(
        tp_rank=tp_rank, pp_rank=pp_rank, attn_tp_rank=attn_tp_rank, dp_rank=None
    )
