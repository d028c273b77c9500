"""Receipt mailbox: a source on the same host hands its receipts straight to the target,
so a migration needs no `/commit` trip (wire feature "source_commit").

A target (TP rank 0 of a single-stage server) keeps one file in shared memory
(`/dev/shm/kvmig-mbox-<pid namespace>-<pid>-<token>`): a file header, then `num_slots`
slots. An allocate that asks for `source_commit` gets a slot and a fresh nonce, named in
rank 0's signed grant (`Grant.mailbox`, `address()`). After a transfer that succeeded on
every rank, the source's rank 0 writes every rank's receipt into that slot (`deliver`)
before it replies to the client. The target reads its slots at the start of each
scheduler iteration, before it dispatches the iteration's requests
(`scheduler_hooks.before_process_input_requests`), and commits what it finds with the
same checks as `/commit`. So any request the client sends after the transfer's reply
finds the prefix committed: the write came first.

Slot layout: `armed (16 bytes) | nonce (16) | length (u32) | crc32 (u32) | payload`, the
payload a JSON list of receipt strings. The target arms a slot with the allocation's
nonce when it grants it and zeroes it when the allocation ends; a source writes only
into a slot armed with its nonce (else the client commits, and learns the outcome), the
payload before the rest of the header. The reader takes a slot only when both nonces
are its allocation's and the crc matches, so a torn, stale or forged slot is never read
as a receipt (and a forged receipt still fails the commit's signature and slot checks).
Nothing here is trusted beyond that.

No dependency on SGLang; the client never imports it.
"""

from __future__ import annotations

import heapq
import json
import logging
import mmap
import os
import re
import secrets
import struct
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NUM_SLOTS = 128
SLOT_BYTES = 8192  # every receipt of a TP=8 server fits several times over
_FILE_MAGIC = b"KVMIGMB1"
_FILE_HEADER = struct.Struct("<8sII16s")  # magic, num_slots, slot_bytes, token
_FILE_HEADER_BYTES = 4096
# armed (the nonce the target waits for; zero: it waits for none), then what the source
# wrote: its nonce, the payload's length and crc32.
_SLOT_HEADER = struct.Struct("<16s16sII")
_DELIVERY = struct.Struct("<16sII")  # the source's part, after `armed`
NONCE_BYTES = 16
# kvmig-mbox-<pid namespace inode>-<pid>-<token>: the namespace tells whose pid it is.
_NAME = re.compile(r"^kvmig-mbox-(\d{1,20})-(\d{1,10})-([0-9a-f]{32})$")
_ADDRESS = re.compile(r"^(kvmig-mbox-\d{1,20}-\d{1,10}-[0-9a-f]{32})/(\d{1,6})/([0-9a-f]{32})$")
# Mailboxes a source keeps open (one per target server it wrote to recently).
MAX_OPEN = 32


def _file_size(num_slots: int, slot_bytes: int) -> int:
    return _FILE_HEADER_BYTES + num_slots * slot_bytes


class Mailbox:
    """The target's mailbox file: created at start-up, unlinked at `close()`."""

    def __init__(self, directory: str = SHM_DIR, num_slots: int = NUM_SLOTS,
                 slot_bytes: int = SLOT_BYTES):  # fmt: skip
        sweep_stale(directory)
        token = secrets.token_hex(16)
        self.name = f"kvmig-mbox-{pid_namespace()}-{os.getpid()}-{token}"
        self.path = os.path.join(directory, self.name)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = _file_size(num_slots, slot_bytes)
        # 0600: only this user's processes (the servers of one fleet) can write it.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        _FILE_HEADER.pack_into(
            self._map, 0, _FILE_MAGIC, num_slots, slot_bytes, bytes.fromhex(token)
        )

    def address(self, slot: int, nonce: bytes) -> str:
        """What a grant names: `name/slot/nonce` (the source writes only there)."""
        return f"{self.name}/{slot}/{nonce.hex()}"

    def read(self, slot: int, nonce: bytes) -> list[str] | None:
        """The receipts in `slot` if they are for `nonce` and whole; else None."""
        offset = _FILE_HEADER_BYTES + slot * self.slot_bytes
        armed, found, length, crc = _SLOT_HEADER.unpack_from(self._map, offset)
        if armed != nonce or found != nonce or length > self.slot_bytes - _SLOT_HEADER.size:
            return None
        start = offset + _SLOT_HEADER.size
        payload = self._map[start : start + length]
        if zlib.crc32(payload) != crc:
            return None  # torn (the writer is mid-way) or forged
        try:
            receipts = json.loads(payload)
        except (ValueError, RecursionError):  # (a slot holds enough `[` to recurse)
            return None
        if not isinstance(receipts, list) or not all(isinstance(r, str) for r in receipts):
            return None
        return receipts

    def arm(self, slot: int, nonce: bytes) -> None:
        """Wait for `nonce`'s delivery in `slot` (a source delivers only into an armed
        slot, so one whose allocation ended is not written: the client commits then)."""
        offset = _FILE_HEADER_BYTES + slot * self.slot_bytes
        _SLOT_HEADER.pack_into(self._map, offset, nonce, bytes(NONCE_BYTES), 0, 0)

    def clear(self, slot: int) -> None:
        offset = _FILE_HEADER_BYTES + slot * self.slot_bytes
        _SLOT_HEADER.pack_into(self._map, offset, bytes(NONCE_BYTES), bytes(NONCE_BYTES), 0, 0)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._map.close()


class MailboxSlots:
    """Which slots are free, on the target's rank 0. The slot free longest is handed out
    first, and one whose allocation ended without a commit is reused only after the
    grant's write window (`not_before`): a late delivery then cannot overwrite a newer
    owner's. Taking and giving back cost O(log n): this runs in every allocate."""

    def __init__(self, num_slots: int, clock: Callable[[], float]):
        self.clock = clock
        self.num_slots = num_slots
        self._ready: deque[int] = deque(range(num_slots))
        self._waiting: list[tuple[float, int]] = []  # heap of (not_before, slot)

    def take(self) -> tuple[int, bytes] | None:
        """(slot, fresh nonce), or None when every slot is taken or still waiting."""
        now = self.clock()
        while self._waiting and self._waiting[0][0] <= now:
            self._ready.append(heapq.heappop(self._waiting)[1])
        if not self._ready:
            return None
        return self._ready.popleft(), secrets.token_bytes(NONCE_BYTES)

    def give_back(self, slot: int, not_before: float | None = None) -> None:
        if not_before:
            heapq.heappush(self._waiting, (not_before, slot))
        else:
            self._ready.append(slot)

    def __len__(self) -> int:
        """Slots in use."""
        return self.num_slots - len(self._ready) - len(self._waiting)


class Deliverer:
    """The source's side: opens target mailboxes by the name a grant gives, checks what
    it opened is one, and writes a slot. Never raises: a failure is a reason (the client
    then sends `/commit` itself)."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self._open: OrderedDict[str, tuple[mmap.mmap, int, int]] = OrderedDict()

    def deliver(self, address: str, receipts: list[str]) -> str | None:
        """Write `receipts` where `address` (a grant's `mailbox`) says; None on success,
        else why not."""
        match = _ADDRESS.match(address) if isinstance(address, str) else None
        if match is None:
            return f"not a mailbox address: {address!r}"
        name, slot, nonce = match.group(1), int(match.group(2)), bytes.fromhex(match.group(3))
        payload = json.dumps(receipts, separators=(",", ":")).encode()
        try:
            mapped, num_slots, slot_bytes = self._mailbox(name)
        except (OSError, ValueError) as e:
            return f"cannot open the target's mailbox {name}: {e}"
        if slot >= num_slots:
            return f"mailbox slot {slot} is outside the {num_slots} slots of {name}"
        if len(payload) > slot_bytes - _SLOT_HEADER.size:
            return f"{len(payload)} bytes of receipts do not fit a {slot_bytes}-byte slot"
        offset = _FILE_HEADER_BYTES + slot * slot_bytes
        start = offset + _SLOT_HEADER.size
        try:
            if mapped[offset : offset + NONCE_BYTES] != nonce:
                # Its allocation ended (aborted, expired, flushed, new weights): the
                # target reads no more; the client's /commit reports why.
                return "the target no longer waits for this migration's receipts"
            # Payload first, header last: the reader checks the header's crc anyway.
            mapped[start : start + len(payload)] = payload
            _DELIVERY.pack_into(
                mapped, offset + NONCE_BYTES, nonce, len(payload), zlib.crc32(payload)
            )
        except (ValueError, OSError) as e:  # the map was closed or shrank under us
            self._open.pop(name, None)
            return f"cannot write the target's mailbox {name}: {e}"
        return None

    def _mailbox(self, name: str) -> tuple[mmap.mmap, int, int]:
        cached = self._open.get(name)
        if cached is not None:
            self._open.move_to_end(name)
            return cached
        path = os.path.join(self.directory, name)
        # O_NOFOLLOW: a link planted under the name does not redirect the write.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < _FILE_HEADER_BYTES:
                raise ValueError("too small to be a mailbox")
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, num_slots, slot_bytes, token = _FILE_HEADER.unpack_from(mapped, 0)
        expected_token = _NAME.match(name).group(3)  # type: ignore[union-attr]
        if (
            magic != _FILE_MAGIC
            or token.hex() != expected_token
            or slot_bytes <= _SLOT_HEADER.size
            or size != _file_size(num_slots, slot_bytes)
        ):
            mapped.close()
            raise ValueError("not a mailbox of this version (header differs)")
        self._open[name] = (mapped, num_slots, slot_bytes)
        while len(self._open) > MAX_OPEN:
            old, _ = self._open.popitem(last=False)
            old.close()
        return mapped, num_slots, slot_bytes

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1][0].close()


def sweep_stale(
    directory: str = SHM_DIR,
    pattern: re.Pattern[str] = _NAME,
    remove: Callable[[str], None] = os.unlink,
) -> list[str]:
    """Remove mailboxes (or, with `pattern` and `remove`, other per-process entries named
    `<prefix>-<pid namespace>-<pid>-...`) whose creating process is gone (a server killed
    before its `close()`); returns their names. Only entries named like ours, and only
    those of this process's pid namespace: a server in another container sharing
    `/dev/shm` has pids this one cannot see, and sweeps its own."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    namespace = str(pid_namespace())
    for name in names:
        match = pattern.match(name)
        if match is None or match.group(1) != namespace or process_alive(int(match.group(2))):
            continue
        try:
            remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


def open_mailbox(directory: str = SHM_DIR) -> Mailbox | None:
    """A new mailbox, or None (logged) where shared memory is not available."""
    try:
        return Mailbox(directory)
    except OSError as e:
        logger.warning("KV migration mailbox off (commits need the client's trip): %s", e)
        return None
