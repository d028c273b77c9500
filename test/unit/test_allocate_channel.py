"""The allocate channel (`server/same_host/allocate_channel.py`) and the target's weight-version
rule for channel allocations (`server/target/channel_allocations.py`), with real zmq sockets
in a private directory."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator

import orjson
import pytest
import zmq
from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqOutput,
    CommitTransferRequestKVCacheReqInput,
    GetTransferSessionInfoReqInput,
)
from sglang_kv_migration.server.same_host import allocate_channel
from sglang_kv_migration.server.same_host.allocate_channel import ChannelCaller, ChannelServer
from sglang_kv_migration.server.target.channel_allocations import ChannelAllocations
from side_helpers import SilentTarget

DEADLINE_S = 5.0


@pytest.fixture
def directory() -> Iterator[str]:
    # Short: a unix socket's path has ~107 bytes (pytest's tmp_path can be longer).
    path = tempfile.mkdtemp(prefix="kvch-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(directory: str) -> Iterator[ChannelServer]:
    channel = ChannelServer("host-a", directory)
    try:
        yield channel
    finally:
        channel.close()


@pytest.fixture
def caller(directory: str) -> Iterator[ChannelCaller]:
    ends = ChannelCaller(directory)
    try:
        yield ends
    finally:
        ends.close()


def _take_within(server: ChannelServer) -> list:
    deadline = time.monotonic() + DEADLINE_S
    while not server.readable() and time.monotonic() < deadline:
        time.sleep(0.001)
    return server.take()


def _replies_within(caller: ChannelCaller, count: int = 1) -> list:
    found: list = []
    deadline = time.monotonic() + DEADLINE_S
    while len(found) < count and time.monotonic() < deadline:
        found += caller.replies()
        time.sleep(0.001)
    return found


def test_a_request_and_its_reply_round_trip(server: ChannelServer, caller: ChannelCaller) -> None:
    advertised = server.advertise()
    assert advertised["host"] == "host-a" and advertised["address"] == server.address
    # Only this user can reach the socket: the directory holding it is 0700.
    assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
    assert not server.readable()

    call_id = caller.call(server.address, server.secret, b'{"path":"device"}', b"\x01\0\0\0")
    assert caller.waiting == 1
    [(route, body, ids)] = _take_within(server)
    assert body == {"path": "device"} and ids == b"\x01\0\0\0"
    server.reply(route, b'{"success":true}')
    assert _replies_within(caller) == [(call_id, b'{"success":true}')]
    assert caller.waiting == 0
    # An answer nobody waits for any more is dropped.
    server.reply(route, b'{"success":true}')
    time.sleep(0.05)
    assert caller.replies() == []


def test_replied_says_a_reply_waits_without_reading_it(
    server: ChannelServer, caller: ChannelCaller
) -> None:
    assert not caller.replied()  # nothing asked
    call_id = caller.call(server.address, server.secret, b'{"path":"device"}')
    [(route, _, _)] = _take_within(server)
    assert not caller.replied()  # asked, not answered
    server.reply(route, b'{"success":true}')
    deadline = time.monotonic() + DEADLINE_S
    while not caller.replied() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert caller.replied()
    assert caller.replied()  # still there: `replied` reads nothing
    assert caller.replies() == [(call_id, b'{"success":true}')]
    assert not caller.replied()


def test_a_wrong_secret_or_a_malformed_request_is_refused_by_name(
    server: ChannelServer, caller: ChannelCaller
) -> None:
    caller.call(server.address, "0" * 32, b"{}")
    [(_, refused, ids)] = _take_within(server)
    assert isinstance(refused, MigrationError) and refused.kind is ErrorKind.FORBIDDEN
    assert "secret" in refused.message and ids == b""

    caller.call(server.address, server.secret, b"[1, 2]")  # not an object
    [(_, refused, ids)] = _take_within(server)
    assert isinstance(refused, MigrationError) and refused.kind is ErrorKind.BAD_REQUEST

    raw = zmq.Context.instance().socket(zmq.DEALER)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        raw.send_multipart([b"short-id", b"{}"])  # not our caller's frames: dropped
        raw.send_multipart([b"x" * 16, b"not json"])
        [(_, refused, ids)] = _take_within(server)
        assert isinstance(refused, MigrationError) and "not JSON" in refused.message
    finally:
        raw.close()


@pytest.mark.parametrize(
    "address, problem",
    [
        ("ipc:///tmp/elsewhere/s", "not an allocate channel address"),
        ("tcp://127.0.0.1:5555", "not an allocate channel address"),
        (None, "not an allocate channel address"),
    ],
)
def test_a_source_connects_only_to_channels_named_like_ours(
    caller: ChannelCaller, address: object, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        caller.call(address, "0" * 32, b"{}")  # type: ignore[arg-type]
    assert caller.waiting == 0


def test_a_source_refuses_a_missing_channel_and_a_file_that_is_no_socket(
    directory: str, caller: ChannelCaller
) -> None:
    name = f"kvmig-alloc-1-{os.getpid()}-{'a' * 32}"
    address = f"ipc://{directory}/{name}/s"
    with pytest.raises(ValueError, match="not on this host"):
        caller.call(address, "0" * 32, b"{}")
    os.mkdir(os.path.join(directory, name))
    with open(os.path.join(directory, name, "s"), "w") as f:
        f.write("x")
    with pytest.raises(ValueError, match="not a socket"):
        caller.call(address, "0" * 32, b"{}")


def test_close_removes_the_channel_and_a_dead_servers_channel_is_swept(directory: str) -> None:
    server = ChannelServer("h", directory)
    path = server.directory
    assert os.path.exists(path)
    server.close()
    assert not os.path.exists(path)

    namespace = allocate_channel.pid_namespace()
    dead_pid = _a_dead_pid()
    stale = os.path.join(directory, f"kvmig-alloc-{namespace}-{dead_pid}-{'b' * 32}")
    os.mkdir(stale)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(stale, "s"))
    unix.close()
    mine = os.path.join(directory, f"kvmig-alloc-{namespace}-{os.getpid()}-{'c' * 32}")
    os.mkdir(mine)
    fresh = ChannelServer("h", directory)
    try:
        assert not os.path.exists(stale)  # its process is gone
        assert os.path.exists(mine)  # a live process's: kept
    finally:
        fresh.close()


def _a_dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# --------------------------------------------------------------------------- weights


class _FakeServer:
    """A channel that hands out the given requests once (the weight rule's test)."""

    def __init__(self, requests: list) -> None:
        self.requests = requests
        self.replies: list[tuple[list[bytes], dict]] = []

    def take(self) -> list:
        taken, self.requests = self.requests, []
        return taken

    def reply(self, route: list[bytes], payload: bytes) -> None:
        self.replies.append((route, orjson.loads(payload)))

    def close(self) -> None:
        pass


def _allocations(requests: list, seen: list) -> tuple[ChannelAllocations, _FakeServer]:
    def allocate(req: object) -> AllocateTokenForTransferReqOutput:
        seen.append(req)
        return AllocateTokenForTransferReqOutput(success=True, migration_id=req.migration_id)

    fake = _FakeServer(requests)
    return ChannelAllocations(fake, (UpdateWeightFromDiskReqInput,), allocate), fake  # type: ignore[arg-type]


BODY = {"input_ids": [1, 2, 3], "source_fingerprints": [{"k": 1}], "path": "host"}


def test_a_channel_allocate_takes_the_last_stamped_weight_version_until_new_weights() -> None:
    seen: list = []
    channel, fake = _allocations([], seen)
    assert channel.weight_version() is None  # nothing stamped yet: unknown

    channel.observe([GetTransferSessionInfoReqInput(weight_version="v1")])
    assert channel.weight_version() == "v1"
    fake.requests = [([b"r", b"1"], dict(BODY), b"")]
    channel.answer(channel.take())
    assert [r.weight_version for r in seen] == ["v1"]
    assert seen[0].input_ids == [1, 2, 3]
    assert fake.replies[-1][1]["success"] is True
    assert fake.replies[-1][1]["migration_id"] == seen[0].migration_id != ""

    # A stamp before the update in the same iteration does not count; one after does.
    channel.observe([CommitTransferRequestKVCacheReqInput(weight_version="v1"),
                     UpdateWeightFromDiskReqInput("new")])  # fmt: skip
    assert channel.weight_version() is None
    fake.requests = [([b"r", b"2"], dict(BODY), b"")]
    channel.answer(channel.take())
    assert len(seen) == 1  # refused before the handler
    reply = fake.replies[-1][1]
    assert reply["success"] is False and reply["error_kind"] == "conflict"
    assert "new weights" in reply["message"]

    channel.observe([GetTransferSessionInfoReqInput(weight_version="v2")])
    assert channel.weight_version() == "v2"


def test_a_channel_allocate_is_validated_like_the_routes_body() -> None:
    seen: list = []
    channel, fake = _allocations([], seen)
    channel.observe([GetTransferSessionInfoReqInput(weight_version="")])
    bad = [
        {**BODY, "migration_id": "mine"},  # minted by the target, never taken
        {**BODY, "input_ids": [1, True]},
        {"input_ids": [1]},  # no source_fingerprints
        {**BODY, "path": "elsewhere"},
    ]
    fake.requests = [([b"r", str(i).encode()], body, b"") for i, body in enumerate(bad)]
    fake.requests.append(([b"r", b"e"], MigrationError(ErrorKind.FORBIDDEN, "wrong secret"), b""))
    channel.answer(channel.take())
    assert seen == []
    kinds = [reply["error_kind"] for _, reply in fake.replies]
    assert kinds == ["bad_request"] * 4 + ["forbidden"]
    assert "migration_id" in fake.replies[0][1]["message"]
    assert "input_ids.1" in fake.replies[1][1]["message"]


class _CountingServer(_FakeServer):
    def __init__(self, requests: list) -> None:
        super().__init__(requests)
        self.reads = 0

    def readable(self) -> bool:
        self.reads += 1
        return bool(self.requests)


def test_an_idle_loop_reads_the_channel_at_most_every_check_interval(monkeypatch) -> None:
    from sglang_kv_migration.server.target import channel_allocations

    clock = [100.0]
    monkeypatch.setattr(channel_allocations.time, "monotonic", lambda: clock[0])
    seen: list = []
    fake = _CountingServer([])
    channel = ChannelAllocations(fake, (UpdateWeightFromDiskReqInput,), lambda r: seen.append(r))  # type: ignore[arg-type]
    channel.answer(channel.due())
    channel.answer(channel.due())  # the same instant: not read again
    assert fake.reads == 1
    clock[0] += channel_allocations.CHECK_EVERY_S
    channel.answer(channel.due())
    assert fake.reads == 2

    # A full take: more may wait, so the next iteration reads again at once.
    channel.observe([GetTransferSessionInfoReqInput(weight_version="")])
    full = allocate_channel.MAX_PER_ITERATION
    fake.requests = [([b"r", str(i).encode()], MigrationError(ErrorKind.FORBIDDEN, "x"), b"")
                     for i in range(full)]  # fmt: skip
    clock[0] += channel_allocations.CHECK_EVERY_S
    channel.answer(channel.due())
    assert len(fake.replies) == full
    channel.answer(channel.due())  # the same instant, but read: the take was full
    assert fake.reads == 4


def test_ids_in_their_own_frame_are_checked_and_go_to_the_handler_as_bytes() -> None:
    seen: list = []
    channel, fake = _allocations([], seen)
    channel.observe([GetTransferSessionInfoReqInput(weight_version="")])
    fields = {k: v for k, v in BODY.items() if k != "input_ids"}
    fake.requests = [
        ([b"r", b"1"], dict(fields), b"\x07\0\0\0\x08\0\0\0"),
        ([b"r", b"2"], dict(fields), b"\x07\0\0"),  # not whole 4-byte ids
        ([b"r", b"3"], dict(BODY), b"\x07\0\0\0"),  # ids twice: in the JSON and the frame
    ]
    channel.answer(channel.take())
    assert [r.input_ids_u32 for r in seen] == [b"\x07\0\0\0\x08\0\0\0"]
    assert seen[0].input_ids == []  # the list is made on the scheduler thread, once
    kinds = [reply["error_kind"] for _, reply in fake.replies]
    assert kinds == ["", "bad_request", "bad_request"]
    assert "4-byte ids" in fake.replies[1][1]["message"]
    assert "input_ids" in fake.replies[2][1]["message"]


# --------------------------------------------------------------------------- the source


def _one_trip_request() -> object:
    from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
    from sglang_kv_migration.wire.messages import AllocateOnTarget, TransferRequestKVCacheTarget

    target = TransferRequestKVCacheTarget(tp=0, pp=0, path="host", session_id="127.0.0.1:1")
    return TransferRequestKVCacheReqInput(
        input_ids=list(range(32)),
        target_per_rank=[target],
        allocate_on_target=AllocateOnTarget("ipc:///dev/shm/x/s", "0" * 32, b"{}"),
    )


def test_a_transfer_failed_while_it_waits_still_reports_the_allocation(side_factory) -> None:
    """A cache flush fails the transfer while its target allocates; when the answer comes
    in the same poll, the failure names the allocation, so the client aborts it."""
    side = side_factory(page_size=16)
    fake = side.transfers.asks.caller = SilentTarget()
    side.transfer_request_kvcache(_one_trip_request())
    assert fake.waiting == 1 and len(side.transfers) == 1
    side.prepare_for_cache_flush()
    allocation = {"success": True, "migration_id": "m-1", "matched_token_size": 0,
                  "extra_token_size": 32, "ranks": [{"tp_rank": 0, "pp_rank": 0}]}  # fmt: skip
    fake.answers = [(b"c" * 16, orjson.dumps(allocation))]
    side.poll()
    [reply] = side.replies
    assert not reply.success and "flushed" in reply.message
    assert reply.allocation["migration_id"] == "m-1"
    assert fake.waiting == 0 and len(side.transfers) == 0


def test_a_target_that_does_not_answer_in_time_fails_only_with_a_channel_error(
    side_factory,
) -> None:
    side = side_factory(page_size=16)
    fake = side.transfers.asks.caller = SilentTarget()
    side.transfers.asks.timeout_s = 0.0
    side.transfer_request_kvcache(_one_trip_request())
    side.poll()
    [reply] = side.replies
    assert not reply.success and reply.error_kind == "unavailable"
    assert "did not answer the allocate" in reply.channel_error == reply.message
    assert reply.allocation == {} and fake.waiting == 0
    # A failure before the answer (and before the time-out): the call is not waited for
    # any more once the failure is the reply.
    side.transfers.asks.timeout_s = 60.0
    side.transfer_request_kvcache(_one_trip_request())
    side.prepare_for_cache_flush()
    side.poll()
    assert len(side.replies) == 2 and "flushed" in side.replies[-1].message
    assert fake.waiting == 0 and len(side.transfers) == 0


def test_the_channel_validates_with_the_wire_bodies_loaded_at_start_up_not_the_routes():
    """The channel's validation (`wire/bodies.py`) is loaded with the channel, not in its
    first allocate (pydantic's import held that allocate 27-40 ms on the H200), and the
    HTTP route module never comes into the scheduler's process for it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang_kv_migration.server.target.channel_allocations import ChannelAllocations\n"
        "ChannelAllocations(None, (), lambda r: r)\n"
        "assert 'sglang_kv_migration.wire.bodies' in sys.modules\n"
        "assert 'sglang_kv_migration.server.http.routes' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
