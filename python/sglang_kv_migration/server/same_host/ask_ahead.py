"""The source's HTTP layer asks the target's allocate channel itself when its scheduler
is busy, before the transfer goes there (feature "source_allocate").

    client ──HTTP──▶ source HTTP layer ──channel──▶ target scheduler: allocate
                     source HTTP layer ◀──channel── the allocate reply
                     source HTTP layer ──▶ source scheduler: the transfer, the reply in it
                     source scheduler: checks, match, launch (the moves it took up in this
                     loop iteration together), the reply once the copy is done
    client ◀──────── the transfer reply (with the target's allocate reply in it)

Why here: a scheduler running a batch reads its input once per loop iteration, one
forward step of the batch (5-50 ms). A transfer whose scheduler asks the target waits
for three of them: the one that takes it up (and asks), the one that takes the answer
(and launches the copy) and the one that finds the copy done. Asked here, the answer is
in the request when the scheduler takes it up, and the copy launches in that iteration.
An idle scheduler turns its loop in ~0.2 ms and matches and pins the prefix while the
target allocates: there the scheduler asks, as before (`server/source/target_asks.py`).

Busy: the tokenizer manager has generate requests in flight. The scheduler checks the
answer as one it read off the channel (the grant, the slots). A target that does not
answer within `ALLOCATE_TIMEOUT_S`, or whose process exits, fails only its own transfer
(`AllocateOnTarget.error_ahead`). An address that is not a channel of this user on this
host is not asked here: the scheduler asks, and its refusal names the problem.

Replies are read by one task per target channel, on the HTTP layer's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq
import zmq.asyncio

from sglang_kv_migration.server.diag.trace import ms
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.same_host.allocate_channel import (
    ALLOCATE_TIMEOUT_S,
    CALL_ID_BYTES,
    GONE_CHECK_S,
    MAX_OPEN,
    MAX_REPLY_BYTES,
    address_pattern,
    checked_channel,
    request_frames,
)
from sglang_kv_migration.server.same_host.mailbox import SHM_DIR, process_alive


class AskAhead:
    """The source HTTP layer's end of the allocate channels it asks (one socket each)."""

    def __init__(
        self,
        busy: Callable[[], bool],
        directory: str = SHM_DIR,
        timeout_s: float = ALLOCATE_TIMEOUT_S,
    ):
        self.busy = busy  # whether the scheduler runs a batch now
        self.timeout_s = timeout_s
        self._pattern = address_pattern(directory)
        self._context: zmq.asyncio.Context | None = None
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    async def before_transfer(self, request: TransferRequestKVCacheReqInput) -> dict[str, float]:
        """Ask `request`'s target for its slots when the scheduler is busy; the answer,
        or why none came, goes into `request.allocate_on_target`. Returns the trip's
        step (`allocate_ahead`, ms) for the reply's `steps_ms`, or nothing."""
        on_target = request.allocate_on_target
        if on_target is None or not self.busy():
            return {}
        try:
            peer = self._peer(on_target.address)
        except ValueError:
            return {}  # the scheduler asks, and its refusal says why
        asked = time.monotonic()
        on_target.reply_ahead, on_target.error_ahead = await peer.ask(
            request_frames(b"", on_target.secret, on_target.allocate, on_target.ids),
            self.timeout_s,
        )
        return {"allocate_ahead": ms(time.monotonic() - asked)}

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            self._peers.move_to_end(address)
            return peer
        pid = checked_channel(address, self._pattern)
        if self._context is None:
            self._context = zmq.asyncio.Context(io_threads=1)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        socket.setsockopt(zmq.SNDHWM, 256)
        socket.connect(address)
        peer = self._peers[address] = _Peer(socket, pid)
        while len(self._peers) > MAX_OPEN:
            _address, old = self._peers.popitem(last=False)
            old.close()
        return peer


class _Peer:
    """One target channel: its socket, the calls awaiting an answer, the task reading
    the answers."""

    def __init__(self, socket: zmq.asyncio.Socket, pid: int):
        self.socket = socket
        self.pid = pid  # the target's process, where this one can see it (0: not)
        self.waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self.reader: asyncio.Task | None = None

    async def ask(self, frames: list[bytes], timeout_s: float) -> tuple[bytes, str]:
        """Send one allocate (`frames`, their call id left empty: each call gets its
        own); (the answer, "") or (b"", why none came)."""
        loop = asyncio.get_running_loop()
        call_id = secrets.token_bytes(CALL_ID_BYTES)
        answer: asyncio.Future[bytes] = loop.create_future()
        self.waiting[call_id] = answer
        if self.reader is None or self.reader.done():
            self.reader = loop.create_task(self._read())
        try:
            try:
                await self.socket.send_multipart([call_id, *frames[1:]], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                return b"", f"cannot send to the target's allocate channel: {e}"
            return await self._answer(answer, loop.time() + timeout_s, timeout_s)
        finally:
            self.waiting.pop(call_id, None)

    async def _answer(
        self, answer: asyncio.Future[bytes], deadline: float, timeout_s: float
    ) -> tuple[bytes, str]:
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return b"", f"the target did not answer the allocate within {timeout_s:.0f} s"
            done, _ = await asyncio.wait({answer}, timeout=min(left, GONE_CHECK_S))
            if done:
                got = answer.result()
                return (got, "") if got else (b"", "the allocate channel was closed")
            if self.pid and not process_alive(self.pid):
                return b"", "the target's process exited before it answered the allocate"

    async def _read(self) -> None:
        """Hand each answer to its call; unknown ids (a call that gave up) are dropped."""
        while True:
            frames = await self.socket.recv_multipart()
            waiting = self.waiting.get(frames[0]) if len(frames) == 2 else None
            if waiting is not None and not waiting.done():
                waiting.set_result(frames[1])

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        for waiting in self.waiting.values():
            if not waiting.done():
                waiting.set_result(b"")
        with contextlib.suppress(zmq.ZMQError):
            self.socket.close(linger=0)
