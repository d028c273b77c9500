"""Two migration peer processes (`_migration_peer.py`) and the protocol calls the
two-process tests make through their control pipes: one module, so the session fixture
in conftest.py and both test modules share it instead of importing a test module."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import fork_context
from _migration_peer import peer_main
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    GetRequestExtraTokenSizeReqInput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
    TransferRequestKVCacheReqInput,
)
from targets import host_target, published_host

START_S = 180.0  # spawn + SGLang import, on a slow 2-core machine
REPLY_S = 120.0
LAYERS = 3
_ids = itertools.count()


class PeerError(AssertionError):
    pass


@dataclass
class Server:
    name: str
    conn: Connection
    info: GetTransferSessionInfoReqOutput | None = None

    def do(self, command: str, *args: Any) -> Any:
        self.conn.send((command, *args))
        assert self.conn.poll(REPLY_S), f"{self.name}: no reply to {command}"
        status, value = self.conn.recv()
        if status != "ok":
            raise PeerError(f"{self.name} failed on {command}:\n{value}")
        return value

    def call(self, name: str, request: Any) -> Any:
        return self.do("call", name, request)

    def setup(
        self, watchdog_timeout_s: float = 60.0, side_kwargs: dict | None = None, **cfg: Any
    ) -> None:
        fields = {"layer_num": LAYERS, "load_back_threshold": 1, **cfg}
        self.do("setup", fields, watchdog_timeout_s, side_kwargs)
        self.info = self.call("get_transfer_session_info", GetTransferSessionInfoReqInput())
        assert self.info.success and len(self.info.ranks) == 1
        assert self.info.ranks[0].session_id.startswith("127.0.0.1:")

    def snapshot(self) -> Any:
        return self.do("snapshot")


@contextlib.contextmanager
def peer_pair() -> Iterator[tuple[Server, Server]]:
    """Spawn a source and a target peer process; stop them on exit."""
    ctx = fork_context.context()  # forked with SGLang already imported
    started = [spawn(ctx, "source"), spawn(ctx, "target")]
    try:
        for server, _ in started:
            assert server.conn.poll(START_S), f"{server.name} did not start"
            assert server.conn.recv()[0] == "ready"
        yield started[0][0], started[1][0]
    finally:
        for server, _process in started:
            try:
                server.conn.send(("quit",))
            except OSError:
                pass  # already gone; join/kill below still runs
        for server, process in started:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)
            server.conn.close()


def spawn(ctx: Any, name: str) -> tuple[Server, Any]:
    conn, child = ctx.Pipe()
    process = ctx.Process(target=peer_main, args=(child,), daemon=True, name=name)
    process.start()
    child.close()
    return Server(name, conn), process


# --------------------------------------------------------------------------- protocol


def token_ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def allocate(
    src: Server, dst: Server, tokens: list[int], mid: str, fingerprints: list[dict] | None = None
) -> AllocateTokenForTransferReqOutput:
    size = dst.call(
        "get_request_extra_token_size", GetRequestExtraTokenSizeReqInput(input_ids=tokens)
    )
    assert size.success, size.message
    return dst.call(
        "allocate_token_for_transfer",
        AllocateTokenForTransferReqInput(
            input_ids=tokens,
            extra_token_size=size.extra_token_size,
            migration_id=mid,
            source_fingerprints=fingerprints or [r.fingerprint for r in src.info.ranks],
            source_instance=src.info.instance_id,
        ),
    )


def transfer(
    src: Server,
    dst: Server,
    tokens: list[int],
    alloc: AllocateTokenForTransferReqOutput,
    fingerprint: dict | None = None,
    partial_ok: bool = False,
) -> Any:
    targets = []
    for rank in alloc.ranks:
        info = next(
            r for r in dst.info.ranks if (r.tp_rank, r.pp_rank) == (rank.tp_rank, rank.pp_rank)
        )
        targets.append(
            host_target(
                rank.tp_rank,
                rank.pp_rank,
                published_host(info),
                kv_indices=rank.kv_indices,
                fingerprint=fingerprint or info.fingerprint,
                grant=rank.grant,
            )
        )
    return src.call(
        "transfer_request_kvcache",
        TransferRequestKVCacheReqInput(
            input_ids=tokens,
            matched_token_size=alloc.matched_token_size,
            extra_token_size=alloc.extra_token_size,
            target_per_rank=targets,
            migration_id=alloc.migration_id,
            partial_ok=partial_ok,
        ),
    )


def receipts(sent: Any) -> list[str]:
    return [r.receipt for r in sent.ranks] if sent is not None else []


def commit(dst: Server, mid: str, sent: Any = None) -> Any:
    request = CommitTransferRequestKVCacheReqInput(migration_id=mid, receipts=receipts(sent))
    return dst.call("commit_transfer_request_kvcache", request)


def abort(dst: Server, mid: str, sent: Any = None) -> Any:
    return dst.call(
        "abort_transfer", AbortTransferReqInput(migration_id=mid, receipts=receipts(sent))
    )


def migrate(src: Server, dst: Server, tokens: list[int]) -> tuple[Any, Any, Any]:
    mid = f"mig-{next(_ids)}"
    alloc = allocate(src, dst, tokens, mid)
    assert alloc.success, alloc.message
    sent = transfer(src, dst, tokens, alloc)
    assert sent.success, sent.message
    committed = commit(dst, mid, sent)
    assert committed.success, committed.message
    return alloc, sent, committed


# --------------------------------------------------------------------------- round trip
