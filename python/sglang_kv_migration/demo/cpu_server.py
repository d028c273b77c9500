"""One demo server on CPU (`demo/__init__.py`): SGLang's real `HiRadixCache` with its
device pool, allocator and host pool, a one-rank scheduler loop that runs this plugin's
real hooks, and the plugin's six routes on uvicorn, with Mooncake TCP between servers.

    python -m sglang_kv_migration.demo.cpu_server [--host 127.0.0.1]

Prints one JSON line, ``{"url": ...}``, once it serves, and stops when its stdin closes.
Besides the six routes it answers two of its own, done on the scheduler thread as
SGLang does its cache work:

- ``POST /demo/prefill {"tokens": [...], "seed": n}``: what a prefill leaves behind,
  without a model: the page-aligned prompt's KV (seeded random bytes) inserted into the
  tree and backed up to the host pool;
- ``POST /demo/serve {"tokens": [...]}``: what the next request would find: the
  prefix held on the GPU pool (here: the CPU device pool) and in the host pool, the
  host part loaded back as HiCache does, and a digest of the prefix's KV bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

# Module level: FastAPI reads the routes' annotations from this module's names.
from fastapi import FastAPI, Request

PAGE_SIZE = 16
DEVICE_TOKENS = 8192
# The smallest Llama config SGLang's ServerArgs accepts; its KV: 4 layers x 2 KV heads x
# head dim 16 (hidden 64 / 4 heads), bfloat16, 512 bytes a token.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    from sglang_kv_migration.demo import cpu_stand_ins

    cpu_stand_ins.install()
    with tempfile.TemporaryDirectory(prefix="kvmig-demo-") as folder:
        server = DemoServer(args.host, folder)
        print(json.dumps({"url": server.url}), flush=True)
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        server.run(stop)
    return 0


class DemoServer:
    """The cache, the scheduler stand-in and the HTTP server of one demo server."""

    def __init__(self, host: str, folder: str):
        import torch.distributed as dist
        import zmq

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.cache, self.device_pool, self.allocator, server_args = _build_cache(host, folder)
        context = zmq.Context()
        self.receiver = context.socket(zmq.PULL)
        scheduler_port = self.receiver.bind_to_random_port("tcp://127.0.0.1")
        tokenizer = f"ipc://{folder}/tokenizer"
        sender = context.socket(zmq.PUSH)
        sender.connect(tokenizer)
        self.scheduler = _scheduler_stand_in(server_args, self.cache, sender, self.receiver)
        self.work: queue.Queue[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = (
            queue.Queue()
        )
        self.listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listening.bind((host, 0))
        self.url = f"http://{host}:{self.listening.getsockname()[1]}"
        serving = threading.Event()
        args = (server_args, scheduler_port, tokenizer, serving)
        threading.Thread(target=self._serve_http, args=args, daemon=True).start()
        if not serving.wait(60):
            raise TimeoutError("the demo server's HTTP side did not start in 60 s")

    def run(self, stop: threading.Event) -> None:
        """SGLang's loop, one rank: the iteration's requests through the dispatcher
        between the plugin's two per-iteration hooks, then the demo's own cache work."""
        import zmq

        from sglang_kv_migration import sglang_adapter
        from sglang_kv_migration.server.scheduler import hooks

        poller = zmq.Poller()
        poller.register(self.receiver, zmq.POLLIN)
        while not stop.is_set():
            requests: list[Any] = []
            while True:
                try:
                    requests.append(self.receiver.recv_pyobj(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
            hooks.before_process_input_requests(self.scheduler, requests)
            for request in requests:
                output = sglang_adapter.dispatch_request(self.scheduler, request)
                if output is not None:
                    self.scheduler.send_to_tokenizer.send_output(output, request)
            hooks.after_process_input_requests(None, self.scheduler, requests)
            self._do_work()
            if not requests:
                poller.poll(1)
        if self.scheduler.kv_migration is not None:
            self.scheduler.kv_migration.close()

    # ------------------------------------------------------------------ demo routes

    def prefill(self, ids: list[int], seed: int) -> dict[str, Any]:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        aligned = len(ids) - len(ids) % PAGE_SIZE
        if aligned == 0:
            raise ValueError(f"a prefill leaves whole pages: give at least {PAGE_SIZE} ids")
        slots = self.allocator.alloc(aligned)
        if slots is None:
            raise RuntimeError(f"no room for {aligned} tokens in the device pool")
        generator = torch.Generator().manual_seed(seed)
        for buffer in [*self.device_pool.k_buffer, *self.device_pool.v_buffer]:
            shape = (aligned, *buffer.shape[1:-1], buffer.shape[-1] * buffer.element_size())
            random = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
            buffer[slots] = random.view(buffer.dtype)
        key = RadixKey(token_ids=list(ids[:aligned]))
        result = self.cache.insert(InsertParams(key=key, value=slots.clone()))
        # IMPORTANT: free the slots of a prefix the tree held already only after the
        # insert, which may adopt slots of evicted nodes inside it.
        owned = set(self._match(ids[:aligned]).device_indices.tolist())
        spare = [int(s) for s in slots[: result.prefix_len].tolist() if int(s) not in owned]
        if spare:
            self.allocator.free(torch.tensor(spare, dtype=torch.int64))
        self._write_back()
        return {"inserted_tokens": aligned, "held": self.held(ids)}

    def serve(self, ids: list[int]) -> dict[str, Any]:
        """What the next request with `ids` finds here, and its KV bytes' digest (the
        host part loaded back first, as SGLang's scheduler does before a prefill)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        match = self._match(ids)
        device, host = len(match.device_indices), match.host_hit_length
        started = time.perf_counter()
        slots = match.device_indices
        if host:
            self.cache.inc_lock_ref(match.last_device_node)
            try:
                params = InitLoadBackParams(
                    best_match_node=match.best_match_node, host_hit_length=host
                )
                loaded, _ = self.cache.init_load_back(params)
            finally:
                self.cache.dec_lock_ref(match.last_device_node)
            self.cache.ready_to_load_host_cache()
            self.cache.loading_check()
            slots = _cat(slots, loaded)
        load_back_ms = (time.perf_counter() - started) * 1e3
        return {
            "cached_tokens": device + host,
            "device_tokens": device,
            "host_tokens": host,
            "load_back_ms": round(load_back_ms, 3),
            "kv_digest": self._digest(slots),
        }

    def held(self, ids: list[int]) -> dict[str, int]:
        match = self._match(ids)
        return {"device": len(match.device_indices), "host": match.host_hit_length}

    # ------------------------------------------------------------------ helpers

    def _match(self, ids: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=list(ids))))

    def _write_back(self) -> None:
        stack = list(self.cache.root_node.children.values())
        while stack:  # parents before children, as write-through needs
            node = stack.pop(0)
            if node.value is not None and not node.backuped:
                self.cache.write_backup(node, write_back=False)
            stack.extend(node.children.values())
        deadline = time.monotonic() + 10
        while self.cache.ongoing_write_through and time.monotonic() < deadline:
            self.cache.writing_check(write_back=False)

    def _digest(self, slots: Any) -> str:
        import torch

        index = slots.to(torch.int64)
        digest = hashlib.blake2b(digest_size=16)
        for buffer in [*self.device_pool.k_buffer, *self.device_pool.v_buffer]:
            digest.update(buffer[index].contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _do_work(self) -> None:
        while True:
            try:
                fn, args, future = self.work.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn(*args))
            except Exception as e:  # answered to the route: the loop goes on
                future.set_exception(e)

    async def _on_scheduler(self, fn: Callable[..., Any], *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.work.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def _serve_http(
        self, server_args: Any, scheduler_port: int, tokenizer: str, serving: threading.Event
    ) -> None:
        import uvicorn
        import zmq
        import zmq.asyncio

        from sglang_kv_migration.server.http.communicators import KVMigrationCommunicators
        from sglang_kv_migration.server.http.routes import add_routes

        context = zmq.asyncio.Context()
        to_scheduler = context.socket(zmq.PUSH)
        to_scheduler.connect(f"tcp://127.0.0.1:{scheduler_port}")
        from_scheduler = context.socket(zmq.PULL)
        from_scheduler.bind(tokenizer)
        communicators = KVMigrationCommunicators(
            to_scheduler, weight_version=lambda: server_args.weight_version
        )
        receivers = dict(communicators.result_handlers)
        app = FastAPI()
        add_routes(app, lambda: communicators)

        @app.post("/demo/prefill")
        async def prefill(request: Request) -> Any:
            body = await request.json()
            return await self._reply(self.prefill, body["tokens"], int(body.get("seed", 0)))

        @app.post("/demo/serve")
        async def serve(request: Request) -> Any:
            return await self._reply(self.serve, (await request.json())["tokens"])

        @app.on_event("startup")
        async def replies() -> None:
            async def loop() -> None:  # the tokenizer manager's reply loop
                while True:
                    reply = await from_scheduler.recv_pyobj()
                    receivers[type(reply)](reply)

            asyncio.get_running_loop().create_task(loop())
            serving.set()

        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[self.listening])

    async def _reply(self, fn: Callable[..., Any], *args: Any) -> Any:
        from fastapi.responses import JSONResponse

        try:
            return await self._on_scheduler(fn, *args)
        except (ValueError, RuntimeError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)


def _cat(first: Any, second: Any) -> Any:
    import torch

    return torch.cat([first, second.to(first.device)])


def _build_cache(host: str, folder: str) -> tuple[Any, Any, Any, Any]:
    """SGLang's cache as `Scheduler.init_cache_with_memory_pool` builds it, on CPU: the
    server args, device pool, paged allocator, request pool and `HiRadixCache`."""
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    server_args = KVMigrationServerArgs(
        model_path=folder,
        skip_tokenizer_init=True,
        device="cpu",
        page_size=PAGE_SIZE,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_io_backend="direct",
        enable_kv_migration=True,
        kv_migration_hostname=host,
        kv_migration_staging_mb=4,
        host=host,
    )
    heads = TINY_LLAMA["num_attention_heads"]
    device_pool = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=TINY_LLAMA["num_key_value_heads"],
        head_dim=TINY_LLAMA["hidden_size"] // heads,
        layer_num=TINY_LLAMA["num_hidden_layers"],
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        DEVICE_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=device_pool,
        need_sort=False,
    )
    requests = ReqToTokenPool(
        size=4, max_context_len=DEVICE_TOKENS, device="cpu", enable_memory_saver=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE_SIZE,
        tp_cache_group=dist.group.WORLD,
        eviction_policy=server_args.radix_eviction_policy,
    )
    return HiRadixCache(params=params, server_args=server_args), device_pool, allocator, server_args


def _scheduler_stand_in(server_args: Any, cache: Any, sender: Any, receiver: Any) -> Any:
    """What the plugin's hooks read of SGLang's `Scheduler`, for one rank, with the
    plugin's side built on it by its own hooks."""
    from sglang.srt.managers.scheduler import SenderWrapper

    from sglang_kv_migration import sglang_adapter
    from sglang_kv_migration.server.scheduler import hooks

    scheduler = SimpleNamespace(
        server_args=server_args,
        tree_cache=cache,
        tp_rank=0,
        tp_size=1,
        tp_cpu_group=None,
        attn_tp_rank=0,
        attn_tp_size=1,
        attn_tp_cpu_group=None,
        pp_rank=0,
        pp_size=1,
        dp_rank=None,
        dp_size=1,
        world_group=SimpleNamespace(cpu_group=None),
        send_to_tokenizer=SenderWrapper(sender),
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        req_to_token_pool=cache.req_to_token_pool,
        recv_from_tokenizer=receiver,
        is_fully_idle=lambda: True,  # no model runs here: nothing is ever in flight
    )
    sglang_adapter.give_request_dispatcher(scheduler)
    hooks.after_init_ipc_channels(None, scheduler, SimpleNamespace(tokenizer_ipc_name=""))
    hooks.after_init_request_dispatcher(None, scheduler)
    return scheduler


if __name__ == "__main__":
    sys.exit(main())
