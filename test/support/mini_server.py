"""A CPU stand-in for one SGLang server, for the HTTP/client tests (test env only).

What is real: our plugin's scheduler hooks (`after_init_request_dispatcher`,
`after_process_input_requests`) on every rank, SGLang's `HiRadixCache` from the harness,
SGLang's `TypeBasedDispatcher`, `FanOutCommunicator` and `broadcast_pyobj`, zmq between
the "tokenizer" and "scheduler" sides, our FastAPI routes served by uvicorn with SGLang's
own API-key middleware, and Mooncake TCP between servers.

What stands in for SGLang: the loop of each rank (receive on rank 0, broadcast to the
other ranks over gloo, dispatch, then the per-iteration hook — what
`Scheduler.event_loop_normal` does) and the FastAPI app (SGLang's app needs a model).
With ``pp_size > 1`` the loop is `event_loop_pp`'s request path: stage 0's first rank reads
the tokenizer side; each stage dispatches, runs the hook, then hands the same request
list to the next stage with SGLang's `point_to_point_pyobj` over the gloo world group,
whose first rank receives it (blocking) and broadcasts it over its stage's TP group. Only
stage 0's first rank holds SGLang's socket to the tokenizer side; later stages get theirs
from our `after_init_ipc_channels` hook. Each stage's caches hold only its own layers.

With ``dp_size > 1`` (no PP) there are ``dp_size`` groups of ``tp_size`` ranks (global
rank ``dp_rank * tp_size + tp_rank``), each with its own tree, pools and TP group; a
stand-in for SGLang's `DataParallelController` in rank 0's process hands every request
on as `send_control_message` does: without DP attention to every DP rank's first rank,
each of which broadcasts it over its DP rank's group; with ``dp_attention`` to DP rank
0's first rank, which broadcasts it over the whole world (SGLang's TP group then spans
every DP rank, and each DP rank's attention TP group is the cache's). The first rank of
every DP rank replies to the tokenizer side.

`start_server(ServerSpec(...))` spawns one process per (tp, pp) rank (global rank
``pp_rank * tp_size + tp_rank``, as SGLang numbers them) and returns a handle with the URL
once every rank is serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import cpu_harness
import fork_context
import sglang_ipc
from ports import listen_port

STOP = "__stop__"
# A grant TTL for servers whose tests wait for no expiry: on a loaded machine seconds may
# pass between an allocate and the write under its grant.
LONG_GRANT_S = 30.0
# How long the HTTP server keeps an idle connection open (longer than any test).
KEEP_ALIVE_S = 3600


@dataclasses.dataclass
class ServerSpec:
    harness: cpu_harness.HarnessConfig = dataclasses.field(
        default_factory=cpu_harness.HarnessConfig
    )
    tp_size: int = 1
    # Pipeline stages; the harness's `layer_num` layers are split evenly between them.
    pp_size: int = 1
    # Attention context parallelism (--attn-cp-size; pp_size 1): SGLang numbers a TP
    # rank's CP rank and attention TP rank as tp_rank = cp_rank * attn_tp + attn_tp_rank,
    # and every CP rank holds the whole prefix (the same KV for one attn_tp_rank).
    attn_cp_size: int = 1
    # With attention CP: the owner function of a fork whose CP ranks own disjoint pages
    # (e.g. "round_robin:1", `cp_sharded.py`); None: every CP rank holds every page.
    cp_owner: str | None = None
    watchdog_timeout_s: float = 60.0
    # Short grants and transfer timeout, so quarantined slots come back within seconds.
    # A test that writes under a grant it took steps before using asks for `LONG_GRANT_S`.
    grant_ttl_s: float = 1.0
    transfer_timeout_s: float = 2.0
    api_key: str | None = None
    admin_api_key: str | None = None
    enable_kv_migration: bool = True
    # Token sequences to insert with random KV at start-up: (token_ids, seed).
    preload: list[tuple[list[int], int]] = dataclasses.field(default_factory=list)
    # Global rank (pp_rank * tp_size + tp_rank) whose transport refuses every write.
    broken_transport_rank: int | None = None
    # Global rank whose host pool is this many token slots smaller (one stage cannot
    # allocate what the others can).
    small_host_pool_rank: int | None = None
    # Address the HTTP server binds and the transfer engine advertises, and the network
    # namespace (created by the test under /var/run/netns) the server's processes join.
    host: str = "127.0.0.1"
    netns: str | None = None
    # Optional test-only engine on rank 0 (e.g. `generate_standin.standin_factory`): a
    # picklable callable taking the harness and returning an object with
    # `add_routes(app)` (called on the HTTP app) and `tick()` (called every loop
    # iteration, on the scheduler thread).
    extension: Any = None
    # Staging arena per rank (--kv-migration-staging-mb); small: tests move little.
    staging_mb: int = 4
    # Data-parallel ranks (--dp-size; not with pp_size > 1), each of `tp_size` ranks, and
    # --enable-dp-attention. `preload` goes to every DP rank, or to `preload_dp_rank`'s only.
    dp_size: int = 1
    dp_attention: bool = False
    preload_dp_rank: int | None = None
    # --served-model-name (None: SGLang's default, the model path).
    served_model_name: str | None = "tiny-llama"

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    def dp_leaders(self) -> list[int]:
        """The global rank of each DP rank's first rank (they read requests and reply)."""
        return [d * self.tp_size for d in range(self.dp_size)]


@dataclasses.dataclass(frozen=True)
class ServerPair:
    """A source and a target server, as the tests of one migration direction use them."""

    source: ServerHandle
    target: ServerHandle


@dataclasses.dataclass
class ServerHandle:
    url: str
    processes: list[Any]
    control: list[Any]  # one command pipe per rank
    # The tokenizer IPC socket's file: its ranks leave by os._exit, without closing it.
    ipc_file: str = ""
    readers: tuple[int, ...] = (0,)  # ranks that read requests (each hands on the stop)

    def ask(self, rank: int, command: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run a test-only command on one rank (snapshot, read_kv, ...); `rank` is global."""
        conn = self.control[rank]
        conn.send((command, args))
        if not conn.poll(timeout):
            raise TimeoutError(f"rank {rank} did not answer {command!r} in {timeout}s")
        ok, value = conn.recv()
        if not ok:
            raise RuntimeError(f"rank {rank} failed {command!r}: {value}")
        return value

    def ask_all(self, command: str, *args: Any) -> list[Any]:
        for conn in self.control:
            conn.send((command, args))
        results = []
        for rank, conn in enumerate(self.control):
            if not conn.poll(60):
                raise TimeoutError(f"rank {rank} did not answer {command!r}")
            ok, value = conn.recv()
            if not ok:
                raise RuntimeError(f"rank {rank} failed {command!r}: {value}")
            results.append(value)
        return results

    def stop(self) -> None:
        # The reading ranks broadcast (and hand on) the stop: every rank leaves in the
        # same iteration.
        for rank in self.readers:
            try:
                self.control[rank].send((STOP, ()))
            except (BrokenPipeError, OSError):
                pass
        for p in self.processes:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.ipc_file:
            # The DP leaders' sockets sit beside the tokenizer's, named after it.
            for path in [self.ipc_file, *glob.glob(f"{glob.escape(self.ipc_file)}-dp*")]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def start_server(spec: ServerSpec, timeout_s: float = 240.0) -> ServerHandle:
    return start_servers([spec], timeout_s)[0]


def start_servers(specs: list[ServerSpec], timeout_s: float = 240.0) -> list[ServerHandle]:
    """Start several servers at once (their start-ups overlap); all ready or none."""
    launched = [_launch(spec) for spec in specs]
    handles = [handle for handle, _ready, _n in launched]
    try:
        for handle, ready, n in launched:
            _wait_ready(handle, ready, n, timeout_s)
    except BaseException:
        for handle in handles:
            handle.stop()
        raise
    return handles


@contextlib.contextmanager
def serving(specs: list[ServerSpec]) -> Iterator[list[ServerHandle]]:
    """`start_servers`, stopped on exit (a module fixture's body)."""
    handles = start_servers(specs)
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def _launch(spec: ServerSpec) -> tuple[ServerHandle, Any, int]:
    ctx = fork_context.context()
    # The ranks leave by os._exit, which skips the removal of a model folder of their own:
    # they get this process's (removed when it exits).
    model_dir = spec.harness.model_dir or cpu_harness.write_tiny_model_dir()
    spec = dataclasses.replace(spec, harness=dataclasses.replace(spec.harness, model_dir=model_dir))
    gloo_port = listen_port()  # bound seconds later, by rank 0's process
    endpoint = os.path.join(
        tempfile.gettempdir(), f"{cpu_harness.temp_entry_prefixes()[1]}{uuid.uuid4().hex}"
    )
    leaders = tuple(f"ipc://{endpoint}-dp{d}" for d in range(spec.dp_size))
    ports = _Ports(gloo_port, f"ipc://{endpoint}", leaders, uuid.uuid4().hex)
    ready = ctx.Queue()
    processes, control = [], []
    world = spec.world
    for rank in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_rank_main,
            # The fork server's environment is from when it started: send today's.
            args=(spec, rank, ports, child, ready, dict(os.environ)),
            daemon=True,
        )
        p.start()
        processes.append(p)
        control.append(parent)
    readers = (0,) if spec.dp_attention else tuple(spec.dp_leaders())
    # The URL once rank 0 has bound its HTTP socket (`_wait_ready`).
    handle = ServerHandle("", processes, control, readers=readers, ipc_file=endpoint)
    return handle, ready, world


@dataclasses.dataclass(frozen=True)
class _Ports:
    gloo: int
    # The "tokenizer manager" binds a PULL here and scheduler ranks push to it. An ipc://
    # path like SGLang's own: unique, so no other process can take it before the bind.
    tokenizer: str
    # With DP ranks: where each DP rank's first rank reads requests (the controller
    # stand-in pushes there), and the launch id every rank's server args carry.
    dp_inputs: tuple[str, ...] = ()
    launch_id: str = ""


def _wait_ready(handle: ServerHandle, ready: Any, num_ranks: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(range(num_ranks))
    while pending:
        try:
            rank, status = ready.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"{handle.url}: ranks {sorted(pending)} not ready in {timeout_s}s"
            ) from None
        if status.startswith(_LISTENING):  # rank 0 bound its HTTP socket: the URL
            handle.url = status[len(_LISTENING) :]
            continue
        if status != "ready":
            raise RuntimeError(f"{handle.url}: rank {rank} failed to start: {status}")
        pending.discard(rank)


# Rank 0's report of the address its HTTP socket is bound to (before "ready").
_LISTENING = "listening "


def _bind_http(host: str) -> Any:
    """A listening socket on a port the kernel picks: bound before anything else, so no
    other process can take the port between its choice and the bind (a port chosen in
    the parent and bound here later could be taken, and the tests would then talk to
    whatever holds it)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    return sock


# --------------------------------------------------------------------------- child side


class _MiniScheduler:
    """The attributes of `Scheduler` that our hooks read, plus a minimal loop."""

    def __init__(self, spec: ServerSpec, rank: int, harness: Any, sender: Any, launch_id: str = ""):
        from types import SimpleNamespace

        import torch.distributed as dist
        from sglang.utils import TypeBasedDispatcher

        self.spec = spec
        self.server_args = _server_args(spec, launch_id)
        self.tree_cache = harness.cache
        self.rank = rank
        local_rank, group = rank % spec.tp_size, harness.tp_group if spec.tp_size > 1 else None
        self.pp_rank = 0 if spec.dp_size > 1 else rank // spec.tp_size
        self.pp_size = spec.pp_size
        # SGLang passes no DP rank without a DP controller.
        self.dp_rank = rank // spec.tp_size if spec.dp_size > 1 else None
        self.dp_size = spec.dp_size
        # The cache's group: the stage's (PP) or the DP rank's TP ranks.
        self.attn_tp_rank, self.attn_tp_size, self.attn_tp_cpu_group = (
            local_rank,
            spec.tp_size,
            group,
        )
        if spec.dp_attention:  # SGLang's TP group spans every DP rank then
            self.tp_rank, self.tp_size, self.tp_cpu_group = rank, spec.world, dist.group.WORLD
        else:
            self.tp_rank, self.tp_size, self.tp_cpu_group = local_rank, spec.tp_size, group
        self.world_group = SimpleNamespace(cpu_group=dist.group.WORLD if spec.pp_size > 1 else None)
        self.send_to_tokenizer = sglang_ipc.sender_wrapper(sender)
        # 0.5.23 keeps the scheduler's sockets here (what the adapter reads there).
        self.ipc_channels = SimpleNamespace(send_to_tokenizer=self.send_to_tokenizer)
        self._request_dispatcher = TypeBasedDispatcher([])
        # What `sglang_adapter.scheduler_load` counts: no requests run here.
        self.running_batch = SimpleNamespace(reqs=[])
        self.waiting_queue: list[Any] = []
        # SGLang's pool of request rows (what a running request's slots are read from).
        self.req_to_token_pool = harness.cache.req_to_token_pool
        self.held_device_slots: Any = None  # the "hold_device_pool" command's

    @property
    def reads_requests(self) -> bool:
        """Reads the tokenizer side's (or the controller stand-in's) requests."""
        if self.spec.dp_attention:
            return self.rank == 0
        return self.attn_tp_rank == 0 and self.pp_rank == 0

    def _broadcast(self, reqs: list[Any]) -> list[Any]:
        """Like Scheduler.recv_requests: the reading rank's requests reach every rank of
        its stage or DP rank, or with DP attention every rank."""
        from sglang.srt.utils.common import broadcast_pyobj

        if self.spec.dp_attention:
            return broadcast_pyobj(reqs, self.rank, self.tp_cpu_group, src=0)
        if self.tp_size == 1:
            return reqs
        first = self.rank - self.tp_rank  # global rank of this stage's (DP rank's) tp 0
        return broadcast_pyobj(reqs, self.rank, self.tp_cpu_group, src=first)

    def is_fully_idle(self) -> bool:
        return True  # no requests run here: SGLang flushes only an idle scheduler

    def run(self, receiver: Any, control: Any, harness: Any, extension: Any = None) -> None:
        import zmq
        from sglang.srt.utils.common import point_to_point_pyobj
        from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks

        last_stage = self.pp_rank == self.pp_size - 1
        idle_wait = _IdleWait(receiver, getattr(self, "kv_migration", None))
        while True:
            reqs: list[Any] = []
            if self.reads_requests:
                while True:
                    try:
                        reqs.append(sglang_ipc.recv_nowait(receiver))
                    except zmq.ZMQError:
                        break
            elif self.tp_rank == 0 and self.pp_rank > 0:
                # Like Scheduler.recv_requests on a later stage: block for the previous
                # stage's list.
                reqs = point_to_point_pyobj(
                    [], self.rank, self.world_group.cpu_group, self.rank - self.tp_size, self.rank
                )
            # Introspection commands touch only this rank's tree, between iterations:
            # answered after the mailbox's commits (which run before the iteration's
            # requests, as in SGLang), so they see what a request would.
            stop = False
            command = None
            if control.poll():
                command = control.recv()
                if command[0] == STOP:
                    stop, command = True, None
            if self.reads_requests and stop:
                reqs.append(STOP)
            reqs = self._broadcast(reqs)
            if STOP not in reqs:
                scheduler_hooks.before_process_input_requests(self, reqs)
                if command is not None:
                    _answer(control, command, harness, self)
                for req in reqs:
                    output = self._request_dispatcher(req)
                    if output is not None:
                        self.send_to_tokenizer.send_output(output, req)
                scheduler_hooks.after_process_input_requests(None, self, reqs)
            if self.tp_rank == 0 and not last_stage:
                # Like event_loop_pp: the same list, after the hook, to the next stage.
                point_to_point_pyobj(
                    reqs,
                    self.rank,
                    self.world_group.cpu_group,
                    self.rank,
                    self.rank + self.tp_size,
                )
            if STOP in reqs:
                return
            if extension is not None:
                extension.tick()
            if not reqs and self.pp_rank == 0:
                idle_wait.wait()


class _IdleWait:
    """SGLang's loop spins; here an idle iteration waits up to 1 ms, but wakes as soon as
    a request arrives on the tokenizer's socket or on the allocate channel (a plain sleep
    put 0.5 ms on average, and a GIL hand-off, into every trip: `bench_control_plane.py`).
    While the source waits for a target's channel reply it spins, as SGLang's loop does."""

    def __init__(self, receiver: Any, migration: Any) -> None:
        import zmq

        self.migration = migration
        self.poller = zmq.Poller() if receiver is not None else None
        if self.poller is not None:
            self.poller.register(receiver, zmq.POLLIN)
            channel = migration.target.channel if migration is not None else None
            if channel is not None:
                self.poller.register(channel.channel.socket, zmq.POLLIN)

    def wait(self) -> None:
        asks = self.migration.transfers.asks if self.migration is not None else None
        if asks is not None and asks.waiting:
            return
        if self.poller is not None:
            self.poller.poll(1)
        else:
            time.sleep(0.001)


def _rank_main(
    spec: ServerSpec, rank: int, ports: _Ports, control: Any, ready: Any, env: dict[str, str]
) -> None:
    try:
        os.environ.clear()
        os.environ.update(env)
        if spec.netns is not None:
            _join_netns(spec.netns)  # before any socket is created
        http_socket = _bind_http(spec.host) if rank == 0 else None
        if http_socket is not None:
            ready.put((rank, f"{_LISTENING}http://{spec.host}:{http_socket.getsockname()[1]}"))
        cpu_harness.install_cpu_shims()
        from types import SimpleNamespace

        import zmq
        from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks

        world = spec.world
        tp_rank = rank % spec.tp_size
        pp_rank = 0 if spec.dp_size > 1 else rank // spec.tp_size
        dp_rank = rank // spec.tp_size if spec.dp_size > 1 else 0
        if world > 1:
            cpu_harness.init_gloo(rank, world, ports.gloo)
        cfg = _stage_harness_config(spec, tp_rank, pp_rank, rank)
        attn_cp_group, attn_tp_group = _attn_cp_groups(spec, tp_rank)
        harness = cpu_harness.build_harness(
            cfg,
            tp_group=_tp_group(spec, rank),
            attn_cp_group=attn_cp_group,
            attn_tp_group=attn_tp_group,
        )
        owners = None
        if spec.cp_owner is not None:  # before the preload allocates any page
            import cp_sharded

            owners = cp_sharded.make_owner_sharded(harness, spec.cp_owner, spec.attn_cp_size)
        # CP ranks of one attention TP rank hold the same KV (SGLang all-gathers it).
        replica = rank - tp_rank + tp_rank % (spec.tp_size // spec.attn_cp_size)
        if spec.preload_dp_rank in (None, dp_rank):
            for token_ids, seed in spec.preload:
                harness.insert_random(token_ids, seed=seed * 1000 + replica)
        harness.write_back_all()
        if owners is not None:  # each CP rank keeps only the pages it owns
            cp_rank = tp_rank // (spec.tp_size // spec.attn_cp_size)
            for token_ids, _seed in spec.preload:
                cp_sharded.keep_owned_pages(harness, owners, cp_rank, token_ids)
        extension = spec.extension(harness) if spec.extension is not None and rank == 0 else None

        context = zmq.Context()
        sched_in = None
        sender = None
        leader = tp_rank == 0 and pp_rank == 0  # replies to the tokenizer side
        if leader:
            sender = context.socket(zmq.PUSH)
            sender.connect(ports.tokenizer)
        scheduler = _MiniScheduler(spec, rank, harness, sender, ports.launch_id)
        sglang_ipc.publish_scheduler(scheduler.server_args, tp_rank, pp_rank, tp_rank)
        if extension is not None and hasattr(extension, "attach"):
            extension.attach(scheduler)  # a stand-in whose requests run in its batch
        if scheduler.reads_requests:
            sched_in = context.socket(zmq.PULL)
            if spec.dp_size > 1:
                sched_in.bind(ports.dp_inputs[dp_rank])
            else:
                sched_in_port = sched_in.bind_to_random_port("tcp://127.0.0.1")
        if rank == 0 and spec.dp_size > 1:
            sched_in_port = _start_dp_controller(spec, ports.dp_inputs)
        scheduler.recv_from_tokenizer = sched_in  # (what `input_waiting_check` reads)
        scheduler.ipc_channels.recv_from_tokenizer = sched_in
        port_args = SimpleNamespace(tokenizer_ipc_name=ports.tokenizer)
        scheduler_hooks.after_init_ipc_channels(None, scheduler, port_args)
        scheduler_hooks.after_init_request_dispatcher(None, scheduler)
        if spec.broken_transport_rank == rank and scheduler.kv_migration is not None:
            _break_transport(scheduler.kv_migration.paths["host"].transport)
        if rank == 0:
            serving = threading.Event()
            threading.Thread(
                target=_serve_http,
                args=(spec, http_socket, sched_in_port, ports.tokenizer, extension, serving),
                daemon=True,
            ).start()
            if not serving.wait(60):
                raise TimeoutError(f"the HTTP server on {spec.host} did not start in 60 s")
        ready.put((rank, "ready"))
        scheduler.run(sched_in, control, harness, extension)
        if scheduler.kv_migration is not None:
            scheduler.kv_migration.close()
        harness.close()
    except BaseException as e:  # report start-up failures to the parent
        import traceback

        ready.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        os._exit(0)


def _stage_harness_config(
    spec: ServerSpec, tp_rank: int, pp_rank: int, rank: int
) -> cpu_harness.HarnessConfig:
    """This rank's harness: its TP rank, and its PP stage's slice of the layers."""
    layers = spec.harness.layer_num // spec.pp_size
    cfg = dataclasses.replace(
        spec.harness,
        tp_rank=tp_rank,
        tp_size=spec.tp_size,
        layer_num=layers,
        start_layer=pp_rank * layers,
        pp_rank=pp_rank,
        pp_size=spec.pp_size,
    )
    if spec.small_host_pool_rank == rank:
        # Just above the device pool (HiCache needs more), far below the others.
        cfg = dataclasses.replace(cfg, hicache_ratio=1.1)
    return cfg


def _tp_group(spec: ServerSpec, rank: int) -> Any:
    """This rank's stage's (PP) or DP rank's TP group: the cache's (every rank creates
    every group, in order)."""
    if spec.pp_size == 1 and spec.dp_size == 1:
        return None  # the harness default: the whole world
    import torch.distributed as dist

    groups = [
        dist.new_group(list(range(g * spec.tp_size, (g + 1) * spec.tp_size)))
        for g in range(spec.world // spec.tp_size)
    ]
    return groups[rank // spec.tp_size]


def _start_dp_controller(spec: ServerSpec, dp_inputs: tuple[str, ...]) -> int:
    """A stand-in for SGLang's `DataParallelController` (in rank 0's process): what the
    tokenizer side sends goes on as `send_control_message` sends our requests, to every
    DP rank's first rank, or with DP attention to DP rank 0's only. Returns the port the
    tokenizer side pushes to."""
    import zmq

    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    outboxes = []
    for address in dp_inputs[:1] if spec.dp_attention else dp_inputs:
        out = context.socket(zmq.PUSH)
        out.connect(address)
        outboxes.append(out)

    def forward() -> None:
        while True:
            frame = inbox.recv()
            for out in outboxes:
                out.send(frame)

    threading.Thread(target=forward, daemon=True).start()
    return port


def _attn_cp_groups(spec: ServerSpec, tp_rank: int) -> tuple[Any, Any]:
    """This rank's attention CP and attention TP groups, as SGLang's parallel state builds
    them (every rank creates every group, in order); (None, None) without CP."""
    if spec.attn_cp_size == 1:
        return None, None
    if spec.pp_size != 1 or spec.dp_size != 1:
        raise ValueError("the mini server runs attention CP with pp_size and dp_size 1 only")
    import torch.distributed as dist

    attn_tp = spec.tp_size // spec.attn_cp_size
    cp_groups = [
        dist.new_group([cp * attn_tp + t for cp in range(spec.attn_cp_size)])
        for t in range(attn_tp)
    ]
    tp_groups = [
        dist.new_group([cp * attn_tp + t for t in range(attn_tp)])
        for cp in range(spec.attn_cp_size)
    ]
    return cp_groups[tp_rank % attn_tp], tp_groups[tp_rank // attn_tp]


def _answer(control: Any, command: tuple[str, tuple], harness: Any, scheduler: Any = None) -> None:
    """Test-only introspection commands."""
    name, args = command
    try:
        if name == "snapshot":
            value: Any = harness.snapshot()
        elif name == "held":
            value = harness.match_lengths(args[0], args[1] if len(args) > 1 else None)
        elif name == "kv":
            value = [t.clone() for t in harness.read_device_kv(harness.load_back(args[0]))]
        elif name == "corrupt_kv":
            # Invert the bytes of layer 0's KV at position args[1] of the prefix args[0]
            # (a negative control for byte-for-byte checks).
            import torch

            slot = int(harness.load_back(args[0])[args[1]])
            pool = harness.device_pool
            first = pool.k_buffer[0] if harness.cfg.attention == "mha" else pool.kv_buffer[0]
            raw = first[slot].view(torch.uint8)
            raw.copy_(torch.bitwise_not(raw))
            value = slot
        elif name == "host_slots":
            # Every host slot is free or held by one tree node, exactly once (no leak).
            in_tree = harness.host_slots_held()
            free = harness.host_free_list().tolist()
            value = {
                "size": int(harness.kv_host_pool.size),
                "in_tree": len(in_tree),
                "in_tree_unique": len(set(in_tree)),
                "free": len(free),
                "free_unique": len(set(free)),
                "overlap": len(set(in_tree) & set(free)),
            }
        elif name == "fragment_host":
            # Shuffle the host pool's free pages: later allocations are one run per page.
            import torch

            pool = harness.kv_host_pool
            ps = pool.page_size
            gen = torch.Generator().manual_seed(args[0])
            pages = harness.host_free_list().reshape(-1, ps)
            pool.free_slots = pages[torch.randperm(len(pages), generator=gen)].reshape(-1)
            value = len(pages)
        elif name == "pending":
            # Allocations this rank holds (neither committed, aborted nor expired).
            migration = getattr(scheduler, "kv_migration", None)
            value = len(migration.target.pending) if migration is not None else 0
        elif name == "advance_clock":
            # This rank's migration clock (write windows, watchdog deadlines) args[0] s
            # ahead, for good: a test of a window or an expiry waits for no clock.
            pending = scheduler.kv_migration.target.pending
            clock = pending.clock
            pending.clock = lambda: clock() + args[0]
            value = None
        elif name == "slot_digest":
            # verify.py's digest of the host pages holding these token slots.
            from sglang_kv_migration.paths import verify
            from sglang_kv_migration.paths.host.layout import HostPoolLayout

            layout = HostPoolLayout.from_host_pool(harness.host_pool)
            value = verify.host_pages_digest(layout, args[0])
        elif name == "pool_digest":
            # sha256 of every byte of this rank's host pool and device KV buffers.
            import hashlib

            import torch

            h = hashlib.sha256(harness.kv_host_pool.kv_buffer.reshape(-1).view(torch.uint8).numpy())
            dev = harness.device_pool
            mha = harness.cfg.attention == "mha"
            buffers = [*dev.k_buffer, *dev.v_buffer] if mha else list(dev.kv_buffer)
            for b in buffers:
                h.update(b.reshape(-1).view(torch.uint8).numpy())
            value = h.hexdigest()
        elif name == "free_overlap":
            # How many of these host slots are in the free list (could be handed out).
            value = len(set(args[0]) & set(harness.host_free_list().tolist()))
        elif name == "flush":
            # What SGLang's /flush_cache does to the cache, behind our AROUND hook.
            from sglang_kv_migration.server.scheduler.hooks import around_flush_cache

            def reset(s: Any) -> bool:
                s.tree_cache.reset()
                harness.allocator.clear()
                return True

            value = around_flush_cache(reset, scheduler)
        elif name == "new_weights":
            # What our BEFORE hook sees when SGLang receives a weight update (the request
            # itself is not run here: this harness has no model).
            from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
            from sglang_kv_migration.server.scheduler.hooks import before_process_input_requests

            migration = scheduler.kv_migration
            before = len(migration.target.pending)
            before_process_input_requests(
                scheduler, [UpdateWeightFromDiskReqInput(model_path="new")]
            )
            value = before - len(migration.target.pending)
        elif name == "memory_cycle":
            # What our hooks do around SGLang's /release_memory_occupation and
            # /resume_memory_occupation (the KV pool itself stays: no memory saver here).
            migration = scheduler.kv_migration
            migration.prepare_for_memory_release()
            migration.after_memory_release()
            migration.after_memory_resume()
            value = migration.identity.memory_generation
        elif name == "evict_device":
            value = harness.evict_device_all()
        elif name == "insert":
            harness.insert_random(args[0], seed=args[1])
            harness.write_back_all()
            value = True
        elif name.startswith("cp_"):  # the owner-sharded stand-in's (`cp_sharded.py`)
            import cp_sharded

            value = cp_sharded.COMMANDS[name](harness, *args)
        elif name in _MEMORY_COMMANDS:
            value = _MEMORY_COMMANDS[name](scheduler)
        elif name.endswith("_writes"):  # the write gate's (`write_gate.py`)
            import write_gate

            value = write_gate.COMMANDS[name](scheduler)
        else:
            raise ValueError(f"unknown command {name}")
        control.send((True, value))
    except Exception as e:
        control.send((False, f"{type(e).__name__}: {e}"))


def _rss_bytes(_scheduler: Any = None) -> int:
    """This process's resident memory now (VmRSS): the HTTP thread and the scheduler."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _gc_off(_scheduler: Any) -> int:
    """Stop the cyclic garbage collector (after one full collection): what a request
    leaves in a reference cycle stays until `gc_garbage_types`. Returns VmRSS."""
    import gc

    gc.collect()
    gc.disable()
    return _rss_bytes()


def _gc_garbage_types(_scheduler: Any) -> list[str]:
    """The type names of what only the cyclic collector could free (collected now, the
    collector on again), most frequent first."""
    import collections
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        counts = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    return [name for name, _ in counts.most_common()]


def _gc_rss(_scheduler: Any) -> int:
    """VmRSS after a full collection."""
    import gc

    gc.collect()
    return _rss_bytes()


def _known_destinations(scheduler: Any) -> int:
    """Device destinations the source remembers (feature "destination_digest")."""
    known = scheduler.kv_migration.transfers.destinations
    return len(known) if known is not None else 0


def _hold_device_pool(scheduler: Any) -> int:
    """Take every free device KV slot, as running requests hold theirs (nothing of it
    evictable): the GPU pool is full. Returns how many were taken."""
    allocator = scheduler.tree_cache.token_to_kv_pool_allocator
    held = allocator.alloc(allocator.available_size())
    scheduler.held_device_slots = held
    return 0 if held is None else len(held)


def _release_device_pool(scheduler: Any) -> int:
    """Give back what `_hold_device_pool` took; returns the pool's free slots."""
    allocator = scheduler.tree_cache.token_to_kv_pool_allocator
    held = scheduler.held_device_slots
    if held is not None and len(held):
        allocator.free(held)
    scheduler.held_device_slots = None
    return int(allocator.available_size())


# Test-only commands about what requests leave behind in the rank's process, and the
# device pool held full (as by running requests).
_MEMORY_COMMANDS = {
    "rss": _rss_bytes,
    "gc_off": _gc_off,
    "gc_garbage_types": _gc_garbage_types,
    "gc_rss": _gc_rss,
    "known_destinations": _known_destinations,
    "hold_device_pool": _hold_device_pool,
    "release_device_pool": _release_device_pool,
}


def _serve_http(
    spec: ServerSpec,
    http_socket: Any,
    sched_in_port: int,
    tokenizer_endpoint: str,
    extension: Any = None,
    serving: threading.Event | None = None,
) -> None:
    """Serve the app on `http_socket`; `serving` is set once it answers requests."""
    import asyncio

    import uvicorn
    import zmq
    import zmq.asyncio
    from fastapi import FastAPI
    from sglang.srt.utils.auth import add_api_key_middleware
    from sglang_kv_migration.server.http.communicators import KVMigrationCommunicators
    from sglang_kv_migration.server.http.routes import add_routes

    context = zmq.asyncio.Context()
    to_scheduler = context.socket(zmq.PUSH)
    to_scheduler.connect(f"tcp://127.0.0.1:{sched_in_port}")
    # Bound here, like the tokenizer manager's socket: every stage's first rank pushes to it.
    from_scheduler = context.socket(zmq.PULL)
    from_scheduler.bind(tokenizer_endpoint)

    # SGLang's tokenizer manager stamps every request with its server args' weight version
    # ("default" until a weight update names one).
    weight_version = _server_args(spec).weight_version
    comms = (
        KVMigrationCommunicators(
            to_scheduler,
            weight_version=lambda: weight_version,
            pp_size=spec.pp_size,
            dp_size=spec.dp_size,
            ask_ahead=_ask_ahead(spec, extension),
        )
        if spec.enable_kv_migration
        else None
    )
    app = FastAPI()
    add_routes(app, lambda: comms)
    if extension is not None:
        extension.add_routes(app)
    if spec.api_key or spec.admin_api_key:
        add_api_key_middleware(app, api_key=spec.api_key, admin_api_key=spec.admin_api_key)

    @app.on_event("startup")
    async def _start_result_loop() -> None:
        from sglang.utils import TypeBasedDispatcher

        dispatcher = TypeBasedDispatcher(comms.result_handlers if comms else [])

        async def loop() -> None:
            while True:
                dispatcher(await sglang_ipc.recv_reply(from_scheduler))

        asyncio.get_running_loop().create_task(loop())
        if serving is not None:
            serving.set()  # startup handlers run once the socket is being served

    # Idle connections stay open: a client reusing one just as the server closed it (5 s
    # idle, uvicorn's default) would read "Server disconnected", more often the busier
    # the machine.
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    uvicorn.Server(config).run(sockets=[http_socket])


def _ask_ahead(spec: ServerSpec, extension: Any) -> Any:
    """What SGLang's tokenizer manager gets on a single-rank server
    (`communicators.after_init_communicators`): its scheduler counts as busy while an
    extension says so (`slowed_loop.py`), never otherwise (no generate runs here)."""
    from sglang_kv_migration.server.same_host.ask_ahead import AskAhead

    if not spec.tp_size == spec.pp_size == spec.dp_size == 1:
        return None
    busy = getattr(extension, "busy", None)
    return AskAhead(busy if busy is not None else lambda: False)


def _join_netns(name: str) -> None:
    """Move this process into network namespace `name` (Python 3.11 has no os.setns)."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def _server_args(spec: ServerSpec, launch_id: str = "") -> Any:
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    cfg = spec.harness
    args = KVMigrationServerArgs(
        model_path=cfg.model_dir or cpu_harness.write_tiny_model_dir(),
        served_model_name=spec.served_model_name,
        skip_tokenizer_init=True,
        device="cpu",
        page_size=cfg.page_size,
        # With DP attention SGLang's TP group spans every DP rank.
        tp_size=spec.tp_size * spec.dp_size if spec.dp_attention else spec.tp_size,
        pp_size=spec.pp_size,
        attn_cp_size=spec.attn_cp_size,
        dp_size=spec.dp_size,
        enable_dp_attention=spec.dp_attention,
        enable_hierarchical_cache=True,
        hicache_mem_layout=cfg.host_layout,
        hicache_io_backend=cfg.effective_io_backend(),
        enable_kv_migration=spec.enable_kv_migration,
        kv_migration_watchdog_timeout=spec.watchdog_timeout_s,
        kv_migration_grant_ttl=min(spec.grant_ttl_s, spec.watchdog_timeout_s / 2),
        kv_migration_transfer_timeout=spec.transfer_timeout_s,
        kv_migration_hostname=spec.host,
        kv_migration_staging_mb=spec.staging_mb,
        host=spec.host,
        # The grant signing key derives from the admin key, never the API key (as on a
        # real server).
        api_key=spec.api_key,
        admin_api_key=spec.admin_api_key,
    )
    if launch_id:  # one per server, as SGLang pickles one ServerArgs into every rank
        args.kv_migration_launch_id = launch_id
    return args


def _break_transport(transport: Any) -> None:
    """Make every write of this rank fail as an unreachable peer would."""
    from sglang_kv_migration.paths.host.mooncake import TransferError

    def refuse(peer_session_id: str, *args: Any, **kwargs: Any) -> Any:
        raise TransferError(f"injected failure: peer {peer_session_id} unreachable")

    transport.write = refuse
    transport.write_pages = refuse
