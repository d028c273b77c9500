"""One side of test_cross_version.py, run by the Python of one SGLang version's venv.

A harness cache of the installed SGLang (0.5.12's HiRadixCache or 0.5.23's
UnifiedRadixCache), its host pool registered with a real Mooncake engine (TCP on
127.0.0.1), and the adapter functions the host path runs on each side: the source pins a
prefix's host pages and writes them into the target's host slots; the target allocates
those slots under a lock on its held prefix, then inserts them as host-only tree nodes.
Driven over a pipe (`pipe_rpc.serve`); the only data link is the Mooncake engine. One
process serves every case of the test module (its start, an SGLang import, is most of
the module's time): `setup` rebuilds the cache and engine per case.
"""

from __future__ import annotations

import hashlib
from multiprocessing.connection import Connection
from typing import Any

IDLE_EXIT_S = 300.0


class _Peer:
    """One process for every case of the module: `setup` builds a fresh harness cache and
    Mooncake engine for each (what a case's configuration asks), closing the last."""

    def __init__(self) -> None:
        self.harness: Any = None
        self.transport: Any = None
        self.pending: dict[str, Any] = {}

    def setup(self, cfg_fields: dict) -> dict:
        import cpu_harness
        from sglang_kv_migration import sglang_adapter
        from sglang_kv_migration.fingerprint import LayoutFingerprint
        from sglang_kv_migration.paths.host.layout import HostPoolLayout
        from sglang_kv_migration.paths.host.mooncake import (
            MemoryRegion,
            MooncakeTransport,
            TransportConfig,
        )

        self.close()
        self.harness = cpu_harness.build_harness(cpu_harness.HarnessConfig(**cfg_fields))
        host_pool = sglang_adapter.host_pool(self.harness.cache)
        self.layout = HostPoolLayout.from_host_pool(host_pool)
        self.regions = [MemoryRegion(b.ptr, b.length) for b in self.layout.buffers]
        self.transport = MooncakeTransport(TransportConfig(hostname="127.0.0.1"))
        self.transport.register(self.regions)
        self.fingerprint = LayoutFingerprint.from_shape(
            sglang_adapter.kv_cache_shape(host_pool),
            model="tiny-llama",
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
        )
        return self.info()

    def close(self) -> None:
        self.pending.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.harness is not None:
            self.harness.close()
            self.harness = None

    # -- both sides ---------------------------------------------------------

    def info(self) -> dict:
        from sglang_kv_migration import sglang_adapter

        return {
            "sglang": sglang_adapter.sglang_version(),
            "session_id": self.transport.session_id,
            "layout": self.layout,
            "regions": self.regions,
            "fingerprint": self.fingerprint.to_dict(),
        }

    def insert(self, tokens: list[int], seed: int) -> str:
        """Fill and insert the prefix; the sha256 of its KV bytes, layer by layer."""
        return _digest(self.harness.read_device_kv(self.harness.insert_random(tokens, seed=seed)))

    def loaded_digest(self, tokens: list[int]) -> tuple[int, int, str]:
        """(held tokens, of them held on host only) before, then the KV's digest after
        SGLang's own load-back (what the next request with this prefix is served)."""
        from sglang_kv_migration import sglang_adapter

        held = sglang_adapter.match_held_prefix(self.harness.cache, tokens, None)
        digest = _digest(self.harness.read_device_kv(self.harness.load_back(tokens)))
        return held.length, held.length - held.device_length, digest

    # -- target -------------------------------------------------------------

    def allocate(self, mid: str, tokens: list[int], source_fingerprint: dict) -> dict:
        """Refuse a source whose fingerprint differs (naming the field), else lock the held
        prefix and allocate host slots for the rest."""
        from sglang_kv_migration import sglang_adapter
        from sglang_kv_migration.fingerprint import LayoutFingerprint

        source = LayoutFingerprint.from_dict(source_fingerprint)
        mismatch = source.first_mismatch(self.fingerprint)
        if mismatch is not None:
            return {"refused": mismatch}
        cache = self.harness.cache
        held = sglang_adapter.match_held_prefix(cache, tokens, None)
        key = sglang_adapter.make_key(cache, tokens, None)
        lock = sglang_adapter.lock_node(cache, held.last_node)
        slots = sglang_adapter.alloc_host_slots(cache, len(key) - held.length)
        self.pending[mid] = (key, held, lock, slots)
        return {"matched": held.length, "slots": slots.tolist()}

    def commit(self, mid: str) -> int:
        from sglang_kv_migration import sglang_adapter

        cache = self.harness.cache
        key, held, lock, slots = self.pending.pop(mid)
        present = sglang_adapter.insert_host_pages(cache, held.last_node, key, held.length, slots)
        if present:
            sglang_adapter.free_host_slots(cache, slots[:present])
        sglang_adapter.unlock_node(cache, lock)
        return present

    # -- source -------------------------------------------------------------

    def send(self, tokens: list[int], start: int, target: dict, slots: list[int]) -> int:
        """Pin the host pages of tokens [start, len) and write them into the target's
        slots; the bytes written."""
        import torch
        from sglang_kv_migration import sglang_adapter

        cache = self.harness.cache
        pinned = sglang_adapter.pin_host_pages(cache, tokens, None, start, len(tokens))
        try:
            while not sglang_adapter.host_pages_ready(cache, pinned):
                cache.writing_check()
            handle = self.transport.write_pages(
                target["session_id"],
                self.layout,
                pinned.host_indices,
                target["layout"],
                torch.tensor(slots, dtype=torch.int64),
                target["regions"],
            )
            return handle.result(timeout=60).bytes
        finally:
            sglang_adapter.unpin_host_pages(pinned)


def _digest(layers: list[Any]) -> str:
    import torch

    h = hashlib.sha256()
    for layer in layers:
        h.update(layer.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(address: str, authkey_hex: str) -> None:
    """Entry point of `python -c` in a version's venv: connect back, then serve every
    case (`setup` each)."""
    from multiprocessing.connection import Client

    import cpu_harness
    from pipe_rpc import serve
    from sglang_kv_migration import sglang_adapter

    cpu_harness.install_cpu_shims()
    import sglang_kv_migration.paths.host.mooncake  # noqa: F401  (slow imports, up front)

    conn: Connection = Client(address, authkey=bytes.fromhex(authkey_hex))
    peer = _Peer()
    conn.send(("ready", sglang_adapter.sglang_version()))
    try:
        serve(conn, peer, IDLE_EXIT_S)
    finally:
        peer.close()
