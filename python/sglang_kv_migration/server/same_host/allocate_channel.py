"""Allocate channel: a source on the same host asks the target's scheduler for slots
directly, so a migration is one HTTP call from the client (wire feature
"source_allocate").

    client ──HTTP──▶ source /transfer_request_kvcache {allocate_on_target: ...}
                     source scheduler ──channel──▶ target scheduler: allocate
                     source scheduler ◀──channel── the allocate reply (slots, grant)
                     source copies, hands its receipts to the target's mailbox
    client ◀──────── the transfer reply (with the target's allocate reply in it)

A single-rank target (TP 1, PP 1) binds one zmq ROUTER socket at
`ipc:///dev/shm/kvmig-alloc-<pid namespace>-<pid>-<token>/s`: the directory is 0700, so
only this user's processes can connect. Its session info names the address and a
per-start secret (`advertise()`); a request must carry that secret, so it takes what an
HTTP allocate takes: the API key that read the session info. The target's scheduler
reads the socket without blocking at the start of each loop iteration and answers with
the same handler, checks and reply as `/allocate_token_for_transfer`
(`target/channel_allocations.py`); the body is JSON, validated like the HTTP body (never unpickled).

The source's scheduler holds one DEALER socket per target it asked recently and reads
the replies in its per-iteration poll: a target that never answers fails only its own
transfer, after `ALLOCATE_TIMEOUT_S`.

Frames: request `[call id (16 bytes), JSON {"secret", "allocate"}, ids]` (the ids as
little-endian uint32 bytes, left out when the JSON lists them), reply `[call id, JSON
reply]`. No dependency on SGLang.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections import OrderedDict
from typing import Any

import orjson
import zmq

from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.server.same_host.mailbox import (
    SHM_DIR,
    pid_namespace,
    process_alive,
    sweep_stale,
)

logger = logging.getLogger(__name__)

# A target that has not answered by then fails the transfer (its slots, if it did
# allocate, are freed by its watchdog).
ALLOCATE_TIMEOUT_S = 10.0
CALL_ID_BYTES = 16
SECRET_HEX = 32
# Largest request the target reads (a 2M-token prefix as base64 ids is ~11 MB) and
# largest reply a source reads (page lists of a fragmented 2M-token allocation).
MAX_REQUEST_BYTES = 16 << 20
MAX_REPLY_BYTES = 64 << 20
# Requests one loop iteration takes up (the rest wait for the next iteration).
MAX_PER_ITERATION = 16
# How often a source looks whether the targets it waits for still run.
GONE_CHECK_S = 0.1
# Targets a source keeps a socket to (one per target server it asked recently).
MAX_OPEN = 32
_DIR_NAME = re.compile(r"^kvmig-alloc-(\d{1,20})-(\d{1,10})-([0-9a-f]{32})$")
_SOCKET = "s"


def address_pattern(directory: str = SHM_DIR) -> re.Pattern[str]:
    """What a channel address in `directory` looks like (a source connects only there);
    groups: the pid namespace and pid of the target's process."""
    return re.compile(
        rf"^ipc://{re.escape(directory)}/kvmig-alloc-(\d{{1,20}})-(\d{{1,10}})-[0-9a-f]{{32}}/{_SOCKET}$"
    )


class ChannelServer:
    """The target's end: bound at start-up, removed at `close()`."""

    def __init__(self, host: str, directory: str = SHM_DIR):
        sweep_stale(directory, _DIR_NAME, _remove_dir)
        name = f"kvmig-alloc-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        self.directory = os.path.join(directory, name)
        os.mkdir(self.directory, 0o700)  # only this user can reach the socket inside
        self.address = f"ipc://{self.directory}/{_SOCKET}"
        self.secret = secrets.token_hex(SECRET_HEX // 2)
        self.host = host
        self._context = zmq.Context(io_threads=1)
        try:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # larger: peer dropped
            socket.setsockopt(zmq.RCVHWM, 256)
            socket.setsockopt(zmq.SNDHWM, 256)
            socket.bind(self.address)
        except BaseException:
            self._context.destroy(linger=0)
            _remove_dir(self.directory)
            raise
        self._socket = socket

    @property
    def socket(self) -> zmq.Socket:
        """The bound socket (for SGLang's idle sleeper to wake on)."""
        return self._socket

    def advertise(self) -> dict[str, str]:
        """Session info's `allocate_channel` (callers with the API key only)."""
        return {"address": self.address, "secret": self.secret, "host": self.host}

    def readable(self) -> bool:
        """A request waits (one zmq socket option read, ~3 us: `ChannelAllocations.due`
        reads it at most every 50 us)."""
        return bool(self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def take(self) -> list[tuple[list[bytes], dict[str, Any] | MigrationError, bytes]]:
        """Up to `MAX_PER_ITERATION` requests: (reply route, allocate body, ids frame or
        b"") for a good one, (reply route, why not, b"") for one to refuse; malformed
        frames are dropped."""
        taken: list[tuple[list[bytes], dict[str, Any] | MigrationError, bytes]] = []
        while len(taken) < MAX_PER_ITERATION:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) not in (3, 4) or len(frames[1]) != CALL_ID_BYTES:
                continue  # not from our caller: nobody to answer
            route = frames[:2]
            body = self._parse(frames[2])
            ids = frames[3] if len(frames) == 4 and not isinstance(body, MigrationError) else b""
            taken.append((route, body, ids))
        return taken

    def _parse(self, payload: bytes) -> dict[str, Any] | MigrationError:
        try:
            message = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return MigrationError(ErrorKind.BAD_REQUEST, "the allocate request is not JSON")
        if not isinstance(message, dict) or not isinstance(message.get("allocate"), dict):
            return MigrationError(
                ErrorKind.BAD_REQUEST, "the allocate request has no 'allocate' object"
            )
        secret = message.get("secret")
        if not isinstance(secret, str) or not secrets.compare_digest(
            secret.encode(), self.secret.encode()
        ):
            return MigrationError(
                ErrorKind.FORBIDDEN,
                "wrong secret for this server's allocate channel (read its session info again)",
            )
        return message["allocate"]

    def reply(self, route: list[bytes], payload: bytes) -> None:
        """Answer one request; a caller gone away is not waited for."""
        try:
            self._socket.send_multipart([*route, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.info("KV migration allocate channel: reply not sent: %s", e)

    def close(self) -> None:
        self._context.destroy(linger=0)
        _remove_dir(self.directory)


class ChannelCaller:
    """The source's end: asks targets' channels, collects their replies."""

    def __init__(self, directory: str = SHM_DIR):
        self._pattern = address_pattern(directory)
        self._context: zmq.Context | None = None
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._waiting: dict[bytes, str] = {}  # call id -> address
        self._pids: dict[str, int] = {}  # address -> its process (0: not ours to see)
        self._checked = 0.0  # when `gone()` last looked

    def call(self, address: str, secret: str, allocate: bytes, ids: bytes = b"") -> bytes:
        """Send one allocate (`allocate`: its JSON object; `ids`: its ids as uint32
        bytes, when the object has none) to the channel at `address`; returns the call
        id. ValueError naming the problem when the address is not a channel of this user
        on this host."""
        socket = self._socket(address)
        call_id = secrets.token_bytes(CALL_ID_BYTES)
        try:
            socket.send_multipart(request_frames(call_id, secret, allocate, ids), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise ValueError(f"cannot send to the target's allocate channel: {e}") from None
        self._waiting[call_id] = address
        return call_id

    def replies(self) -> list[tuple[bytes, bytes]]:
        """(call id, reply JSON) for the replies that arrived; unknown ids are dropped."""
        found: list[tuple[bytes, bytes]] = []
        for address in {*self._waiting.values()}:
            socket = self._sockets.get(address)
            while socket is not None:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and self._waiting.pop(frames[0], None) is not None:
                    found.append((frames[0], frames[1]))
        return found

    def replied(self) -> bool:
        """Whether a reply may wait to be read (`replies`): one socket option read per
        target waited for, without reading anything."""
        for address in {*self._waiting.values()}:
            socket = self._sockets.get(address)
            if socket is not None and socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return True
        return False

    def gone(self) -> list[bytes]:
        """The calls whose target process has exited (a killed server leaves its socket
        file: nothing would answer before the timeout). Looks at most every 0.1 s."""
        now = time.monotonic()
        if now - self._checked < GONE_CHECK_S:
            return []
        self._checked = now
        dead = {
            a
            for a in {*self._waiting.values()}
            if self._pids.get(a) and not process_alive(self._pids[a])
        }
        return [call_id for call_id, address in self._waiting.items() if address in dead]

    def forget(self, call_id: bytes) -> None:
        """Stop waiting for `call_id` (timed out, or its transfer was failed)."""
        self._waiting.pop(call_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        self._waiting.clear()
        self._sockets.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is not None:
            self._sockets.move_to_end(address)
            return socket
        pid = checked_channel(address, self._pattern)
        if self._context is None:
            self._context = zmq.Context(io_threads=1)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        socket.setsockopt(zmq.SNDHWM, 256)
        socket.connect(address)
        self._sockets[address] = socket
        self._pids[address] = pid
        while len(self._sockets) > MAX_OPEN:
            old_address, old = self._sockets.popitem(last=False)
            old.close(linger=0)
            self._pids.pop(old_address, None)
            self._waiting = {k: v for k, v in self._waiting.items() if v != old_address}
        return socket


def checked_channel(address: str, pattern: re.Pattern[str]) -> int:
    """Check that `address` names a channel socket of this user on this host (`pattern`:
    `address_pattern`'s); returns the pid of its process where it is of our pid namespace
    (a caller looks whether it still runs), else 0. ValueError naming the problem."""
    match = pattern.match(address) if isinstance(address, str) else None
    if match is None:
        raise ValueError(f"not an allocate channel address: {address!r}")
    pid = int(match.group(2)) if int(match.group(1)) == pid_namespace() else 0
    if pid and not process_alive(pid):
        raise ValueError("the target's process has exited")
    path = address[len("ipc://") :]
    try:
        info = os.lstat(path)
    except OSError as e:
        raise ValueError(
            f"the target's allocate channel is not on this host (or it stopped): {e}"
        ) from None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise ValueError(f"{path} is not a socket of this user")
    return pid


def request_frames(call_id: bytes, secret: str, allocate: bytes, ids: bytes) -> list[bytes]:
    """One allocate request's frames (the module docstring's layout)."""
    message = b'{"secret":"' + secret.encode("ascii") + b'","allocate":' + allocate + b"}"
    return [call_id, message, ids] if ids else [call_id, message]


def open_channel(host: str, directory: str = SHM_DIR) -> ChannelServer | None:
    """The target's channel, or None (logged) where it cannot be bound."""
    try:
        return ChannelServer(host, directory)
    except (OSError, zmq.ZMQError) as e:
        logger.warning("KV migration allocate channel off (the client allocates): %s", e)
        return None


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
