"""One server of test_core_migration.py: a harness cache plus the real scheduler-side code.

Runs in a spawned process. The parent drives it over a multiprocessing Pipe with
``(command, *args)`` tuples; every command is answered with ``("ok", value)`` or
``("error", traceback_text)``. The only other link between the two servers is the
Mooncake transfer engine (TCP on 127.0.0.1) that `MigrationSchedulerSide` owns.

Commands:
    setup(cfg_fields, watchdog_timeout_s)  build a fresh harness + scheduler side
    insert(tokens, seed, write_back)       insert_random (then write back and drain)
    evict_device()                         back everything up, evict every device page
    call(name, request)                    run a handler; transfer waits (bounded) for its reply
    expire_by_polling(max_iterations)      poll() until nothing is pending (watchdog)
    end_quarantine()                       free quarantined slots as if their window closed
    snapshot()                             HarnessSnapshot
    match(tokens)                          (device length, host hit length)
    kv_digest(tokens)                      load back, then per-layer sha256 of the KV bytes
    host_digest(slots)                     sha256 of every host buffer's bytes (untouched checks)
    pending()                              number of pending migrations
    quit()
"""

from __future__ import annotations

import hashlib
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

IDLE_EXIT_S = 300.0
TRANSFER_WAIT_S = 60.0


class _Server:
    def __init__(self) -> None:
        self.harness: Any = None
        self.side: Any = None
        self.outputs: list[Any] = []

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
            self.side = None
        if self.harness is not None:
            self.harness.close()
            self.harness = None

    # -- commands -------------------------------------------------------------

    def setup(self, cfg_fields: dict, watchdog_timeout_s: float) -> dict:
        import cpu_harness
        from sglang_kv_migration.rank_context import RankContext
        from sglang_kv_migration.scheduler_side import MigrationSchedulerSide
        from sglang_kv_migration.transfer import TransportConfig

        self.close()
        self.outputs = []
        self.harness = cpu_harness.build_harness(cpu_harness.HarnessConfig(**cfg_fields))
        ctx = RankContext(
            tree_cache=self.harness.cache,
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            cpu_group=None,
            model="tiny-llama",
            send_output=lambda output, req: self.outputs.append(output),
        )
        self.side = MigrationSchedulerSide(
            ctx,
            watchdog_timeout_s=watchdog_timeout_s,
            transport_config=TransportConfig(hostname="127.0.0.1"),
        )
        return {"host_size": int(self.harness.host_pool.size)}

    def insert(self, tokens: list[int], seed: int, write_back: bool) -> int:
        held = self.harness.insert_random(tokens, seed=seed)
        if write_back:
            self.harness.write_back_all()
        else:
            self.harness.drain_writes()
        return len(held)

    def evict_device(self) -> int:
        return self.harness.evict_device_all()

    def call(self, name: str, request: Any) -> Any:
        handler = getattr(self.side, name)
        self.outputs.clear()
        reply = handler(request)
        if reply is not None:
            return reply
        # Deferred reply (transfer): the scheduler loop would call poll() each iteration.
        deadline = time.monotonic() + TRANSFER_WAIT_S
        while not self.outputs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no reply within {TRANSFER_WAIT_S}s")
            self.side.poll()
            if not self.outputs:
                time.sleep(0.0005)
        assert len(self.outputs) == 1, self.outputs
        return self.outputs.pop()

    def expire_by_polling(self, max_iterations: int) -> int:
        """Run the scheduler loop's poll() until the watchdog freed everything."""
        for i in range(max_iterations):
            if len(self.side.pending) == 0:
                return i
            self.side.poll()
            time.sleep(0.001)
        return -1

    def end_quarantine(self) -> list[str]:
        return self.side.pending.release_quarantine(now=float("inf"))

    def snapshot(self) -> Any:
        return self.harness.snapshot()

    def match(self, tokens: list[int]) -> tuple[int, int]:
        m = self.harness.match(tokens)
        return len(m.device_indices), int(m.host_hit_length)

    def kv_digest(self, tokens: list[int]) -> tuple[int, list[str]]:
        loaded = self.harness.load_back(tokens)
        layers = self.harness.read_device_kv(loaded)
        return len(loaded), [_digest(t) for t in layers]

    def host_digest(self) -> str:
        hp = self.harness.host_pool
        return _digest(hp.kv_buffer)

    def pending(self) -> int:
        return len(self.side.pending)


def _digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes()).hexdigest()


def _u8() -> Any:
    import torch

    return torch.uint8


def peer_main(conn: Connection) -> None:
    import cpu_harness

    cpu_harness.install_cpu_shims()
    import sglang_kv_migration.scheduler_side  # noqa: F401  (the slow sglang import, up front)

    server = _Server()
    conn.send(("ready", None))
    try:
        while conn.poll(IDLE_EXIT_S):
            command, *args = conn.recv()
            if command == "quit":
                break
            try:
                conn.send(("ok", getattr(server, command)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        server.close()
        conn.close()
