"""SGLang's processes as the plugin meets them: the scheduler's attributes, request
dispatcher and idle and input checks, later PP stages' replies, the tokenizer manager's
reply dispatcher, the HTTP server's app, the hook registry, and the requests that load
new weights or free the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.sglang_adapter.installed import is_unified_line


@dataclass(frozen=True)
class SchedulerView:
    """What the migration side reads from SGLang's `Scheduler`, read in one place.

    With DP attention (`--enable-dp-attention`) SGLang's TP group spans every DP rank,
    and each DP rank's attention TP group holds its own tree and pools (SGLang hands the
    cache that group): `tp_rank`, `tp_size` and `tp_cpu_group` are then the attention
    TP rank, size and group. Without it each DP rank is its own TP group."""

    tree_cache: Any
    server_args: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_cpu_group: Any
    send_output: Any  # (output, request) -> None, a SenderWrapper.send_output
    world_cpu_group: Any = None  # every (tp, pp) rank; None without PP (= tp_cpu_group)
    dp_rank: int = 0  # this scheduler's data-parallel rank
    dp_size: int = 1

    @classmethod
    def of(cls, scheduler: Any) -> SchedulerView:
        ranks = scheduler_ranks(scheduler)
        dp_attention = ranks.dp_attention
        return cls(
            tree_cache=scheduler.tree_cache,
            server_args=scheduler.server_args,
            tp_rank=ranks.tp_rank,
            tp_size=ranks.tp_size,
            pp_rank=ranks.pp_rank,
            pp_size=ranks.pp_size,
            tp_cpu_group=scheduler.attn_tp_cpu_group if dp_attention else scheduler.tp_cpu_group,
            # SGLang connects only stage 0 to the tokenizer manager; later stages reply
            # through the sender `stage_reply_sender` made for them.
            send_output=(
                scheduler.kv_migration_stage_reply.send_output
                if ranks.pp_rank > 0
                else _tokenizer_sender(scheduler).send_output
            ),
            world_cpu_group=scheduler.world_group.cpu_group if ranks.pp_size > 1 else None,
            dp_rank=ranks.dp_rank,
            dp_size=ranks.dp_size,
        )


@dataclass(frozen=True)
class SchedulerRanks:
    """Where a scheduler process sits: its (attention) TP rank, PP stage and DP rank.

    0.5.12 keeps them on the `Scheduler`; 0.5.23 in the process's parallel context
    (`runtime_context.get_parallel()`), published before the scheduler is built. With DP
    attention `tp_rank` / `tp_size` are the attention TP group's (see `SchedulerView`)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    dp_attention: bool


def scheduler_stage_rank(scheduler: Any) -> tuple[int, int]:
    """(PP stage, TP rank) of the scheduler process `scheduler` runs in (read at its
    start, before it has a tree cache)."""
    if is_unified_line():
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().pp_rank, get_parallel().tp_rank
    return scheduler.pp_rank, scheduler.tp_rank


def scheduler_ranks(scheduler: Any) -> SchedulerRanks:
    """The ranks of the scheduler process `scheduler` runs in."""
    if is_unified_line():
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        dp_attention = bool(p.attn_dp_enabled)
        return SchedulerRanks(
            tp_rank=p.attn_tp_rank if dp_attention else p.tp_rank,
            tp_size=p.attn_tp_size if dp_attention else p.tp_size,
            pp_rank=p.pp_rank,
            pp_size=p.pp_size,
            dp_rank=p.dp_rank or 0,  # None without a DP controller
            dp_size=p.num_dp_ranks,
            dp_attention=dp_attention,
        )
    dp_attention = scheduler.dp_size > 1 and scheduler.server_args.enable_dp_attention
    return SchedulerRanks(
        tp_rank=scheduler.attn_tp_rank if dp_attention else scheduler.tp_rank,
        tp_size=scheduler.attn_tp_size if dp_attention else scheduler.tp_size,
        pp_rank=scheduler.pp_rank,
        pp_size=scheduler.pp_size,
        # SGLang passes None without a DP controller (--dp-size 1).
        dp_rank=scheduler.dp_rank or 0,
        dp_size=scheduler.dp_size,
        dp_attention=dp_attention,
    )


def stage_reply_sender(scheduler: Any, tokenizer_ipc_name: str) -> Any:
    """A `SenderWrapper` from a later PP stage to the tokenizer manager.

    SGLang opens the scheduler -> tokenizer socket on the first TP rank of stage 0 only
    (`Scheduler.init_ipc_channels`); the tokenizer manager binds a PULL socket on
    `port_args.tokenizer_ipc_name` that any number of PUSH sockets may connect to. The
    first TP rank of each later stage gets its own; the other ranks a no-op sender, as
    SGLang gives them.
    """
    SenderWrapper = _sender_wrapper_class()  # noqa: N806 (a class)

    pp_rank, tp_rank = scheduler_stage_rank(scheduler)
    if pp_rank == 0 or tp_rank != 0:
        return SenderWrapper(None)
    import zmq
    from sglang.srt.utils.network import get_zmq_socket

    socket = get_zmq_socket(zmq.Context(1), zmq.PUSH, tokenizer_ipc_name, False)
    return SenderWrapper(socket)


def _tokenizer_sender(scheduler: Any) -> Any:
    """The scheduler's `SenderWrapper` to the tokenizer manager (0.5.23 keeps its sockets
    in `ipc_channels`)."""
    if is_unified_line():
        return scheduler.ipc_channels.send_to_tokenizer
    return scheduler.send_to_tokenizer


def _sender_wrapper_class() -> type:
    if is_unified_line():
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    else:
        from sglang.srt.managers.scheduler import SenderWrapper
    return SenderWrapper


def forward_to_later_stages(recv_reqs: list[Any], messages: list[Any]) -> None:
    """Append `messages` to the iteration's requests on a PP stage.

    `event_loop_pp` hands the list it gave `process_input_requests` to the next stage
    after that call returns (`_pp_send_pyobj_to_next_stage(recv_reqs)`), so what the
    AFTER hook appends reaches every later stage, after this iteration's requests, in
    order. Without PP the list is dropped after the iteration: appending is harmless.
    """
    recv_reqs.extend(messages)


def give_request_dispatcher(scheduler_stand_in: Any) -> None:
    """The empty `TypeBasedDispatcher` SGLang's `Scheduler` starts with, on an object that
    stands in for one (the demo's CPU server): our hooks add their handlers to it."""
    from sglang.utils import TypeBasedDispatcher

    scheduler_stand_in._request_dispatcher = TypeBasedDispatcher([])


def dispatch_request(scheduler: Any, request: Any) -> Any:
    """A request through the scheduler's dispatcher, as its loop hands it on."""
    return scheduler._request_dispatcher(request)


def add_request_handlers(scheduler: Any, handlers: list[tuple[type, Any]]) -> None:
    """Append handlers to the scheduler's `TypeBasedDispatcher`."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(handlers)


def add_result_handlers(tokenizer_manager: Any, handlers: list[tuple[type, Any]]) -> None:
    """Append handlers to the tokenizer manager's reply `TypeBasedDispatcher`."""
    from sglang.utils import TypeBasedDispatcher

    tokenizer_manager._result_dispatcher += TypeBasedDispatcher(handlers)


def generate_requests_in_flight(tokenizer_manager: Any) -> Callable[[], bool]:
    """A test, for the tokenizer manager's process, that generate requests are in flight
    (SGLang's `rid_to_state`: sent to the scheduler and not finished), so its scheduler
    runs a batch: one loop iteration per forward step."""
    return lambda: bool(tokenizer_manager.rid_to_state)


def http_server_app() -> Any:
    """SGLang's FastAPI app (`http_server.app`), which our routes join."""
    from sglang.srt.entrypoints import http_server

    return http_server.app


def http_server_imported() -> bool:
    """Whether this process imported SGLang's HTTP server module (and so may serve its
    `app`); asking does not import it."""
    import sys

    return "sglang.srt.entrypoints.http_server" in sys.modules


# SGLang's scheduler and HTTP server modules import this at module level, unguarded
# (mem_cache/memory_pool_host.py): where the kernel package is absent (a CPU-only install)
# they cannot be imported at all, and only SGLang's argument parser runs.
_SERVER_RUNTIME_NATIVE_MODULE = "sgl_kernel.kvcacheio"


def server_runtime_missing() -> str | None:
    """The native module SGLang's server runtime needs and this environment lacks, or None.
    Looked up without importing anything: it runs in every SGLang process, at start-up."""
    import importlib.util
    import sys

    name = _SERVER_RUNTIME_NATIVE_MODULE
    package = name.partition(".")[0]
    if name in sys.modules or package in sys.modules:
        return None
    return name if importlib.util.find_spec(package) is None else None


def http_tokenizer_manager() -> Any:
    """The HTTP server's `TokenizerManager` (set when the server launches)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    return get_global_state().tokenizer_manager


def plugins_loading_started() -> bool:
    """Whether SGLang's `load_plugins()` has started in this process (it sets its flag
    first, before it loads any plugin)."""
    import sglang.srt.plugins as plugins

    return bool(plugins._plugins_loaded)


def engine_tokenizer_manager(engine: Any) -> Any:
    """An in-process `sglang.Engine`'s tokenizer manager (set once it has started)."""
    return engine.tokenizer_manager


def engine_loop(engine: Any) -> Any:
    """The asyncio loop an in-process `sglang.Engine` runs its calls on: the running loop
    it was built in, else one of its own that its blocking calls run."""
    return engine.loop


def add_api_key_middleware(app: Any, api_key: str | None, admin_api_key: str | None) -> None:
    """SGLang's API-key middleware on `app`, as its HTTP server adds it (the routes'
    auth levels decide which key each takes)."""
    from sglang.srt.utils.auth import add_api_key_middleware as add

    add(app, api_key=api_key, admin_api_key=admin_api_key)


def registered_hooks(target: str) -> list[object]:
    """The hook callables SGLang's `HookRegistry` holds for `target` (registered, maybe not
    applied yet). The registry has no public reader; this is its one private read."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [hook for _type, hook, _source in HookRegistry._hooks.get(target, [])]


def frees_kv_cache(memory_req: Any) -> bool:
    """True if a Release/ResumeMemoryOccupationReqInput covers the KV cache (its tags
    name it, or name nothing: SGLang then takes every kind of GPU memory)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    tags = getattr(memory_req, "tags", None)
    return not tags or GPU_MEMORY_TYPE_KV_CACHE in tags


def scheduler_load(scheduler: Any) -> Callable[[], int]:
    """How many requests this rank runs or has waiting (its DP rank's load, as SGLang's
    `DataParallelController` counts requests): the running batch and the waiting queue."""

    def load() -> int:
        return len(scheduler.running_batch.reqs) + len(scheduler.waiting_queue)

    return load


def scheduler_idle_check(scheduler: Any) -> Callable[[], bool]:
    """A test that SGLang has nothing to run or finish on this rank: no batch running or
    waiting, no HiCache copy in flight (`Scheduler.is_fully_idle`, read-only)."""
    return scheduler.is_fully_idle


def input_waiting_check(scheduler: Any) -> Callable[[], bool]:
    """A non-blocking test that a request for SGLang waits on this rank's input sockets
    (the tokenizer manager's and the RPC socket; only the first rank of the first stage
    has them: elsewhere it is always False)."""
    import zmq

    # 0.5.23 keeps the sockets in `ipc_channels`.
    owner = scheduler.ipc_channels if is_unified_line() else scheduler
    sockets = [
        s
        for s in (
            getattr(owner, "recv_from_tokenizer", None),
            getattr(owner, "recv_from_rpc", None),
        )
        if s is not None
    ]

    def waiting() -> bool:
        return any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in sockets)

    return waiting


def wake_from_idle_sleep_on(scheduler: Any, socket: Any) -> None:
    """With `--sleep-on-idle` SGLang's loop parks in a poll on its own sockets (up to
    1 s, `IdleSleeper.maybe_sleep`): a request on `socket` (ours) wakes it too."""
    sleeper = getattr(scheduler, "idle_sleeper", None)
    if sleeper is not None:
        import zmq

        sleeper.poller.register(socket, zmq.POLLIN)


def weight_update_types() -> tuple[type, ...]:
    """The scheduler requests that load new weights (SGLang 0.5.12's io_struct): a
    pending migration the source commits through the mailbox is dropped when one
    arrives, since no commit request carries the tokenizer's weight version then."""
    from sglang.srt.managers import io_struct

    names = (
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightsFromTensorReqInput",
        "UpdateWeightsFromIPCReqInput",
    )
    return tuple(getattr(io_struct, name) for name in names)
