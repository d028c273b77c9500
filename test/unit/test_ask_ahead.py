"""The source HTTP layer's own allocate calls (`server/same_host/ask_ahead.py`): asked
only while the scheduler is busy, answers matched to their calls, and a target that
does not answer failing only its own transfer. Real zmq sockets in a private directory,
a real `ChannelServer` as the target's end, driven from a thread."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from sglang_kv_migration.errors import MigrationError
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.same_host import ask_ahead
from sglang_kv_migration.server.same_host.allocate_channel import ChannelServer
from sglang_kv_migration.server.same_host.ask_ahead import AskAhead
from sglang_kv_migration.server.source.target_asks import TargetAsks
from sglang_kv_migration.server.source.transfers import InflightTransfer
from sglang_kv_migration.wire.messages import AllocateOnTarget
from side_helpers import SilentTarget

DEADLINE_S = 10.0


@pytest.fixture
def directory() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvah-", dir="/tmp")  # short: a unix socket path
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


class _Target:
    """The target's scheduler: takes what waits on the channel and answers each request
    with its own ids (reversed order within a take, so answers come out of order)."""

    def __init__(self, server: ChannelServer, answer: bool = True):
        self.server, self.answer = server, answer
        self.taken: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            taken = self.server.take() if self.server.readable() else []
            self.taken += [body for _, body, _ in taken]
            if self.answer:
                for route, body, ids in reversed(taken):
                    reply = {"success": True, "echo": body, "ids": ids.hex()}
                    self.server.reply(route, orjson.dumps(reply))
            time.sleep(0.001)

    def __enter__(self) -> _Target:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _request(server: ChannelServer, tag: int, secret: str | None = None):
    on_target = AllocateOnTarget(
        server.address,
        secret if secret is not None else server.secret,
        orjson.dumps({"tag": tag}),
        tag.to_bytes(4, "little"),
    )
    return TransferRequestKVCacheReqInput(input_ids=[], allocate_on_target=on_target)


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, DEADLINE_S))


def test_a_busy_scheduler_gets_each_answer_in_its_own_request(server, directory) -> None:
    ahead = AskAhead(lambda: True, directory)
    requests = [_request(server, tag) for tag in range(6)]

    async def six() -> list[dict]:
        return await asyncio.gather(*(ahead.before_transfer(r) for r in requests))

    try:
        with _Target(server) as target:
            steps = _run(six())
    finally:
        ahead.close()
    assert sorted(body["tag"] for body in target.taken) == list(range(6))
    for tag, (request, step) in enumerate(zip(requests, steps, strict=True)):
        on_target = request.allocate_on_target
        answer = orjson.loads(on_target.reply_ahead)
        # Each answer reached the call that asked for it, ids frame and all.
        assert answer["echo"] == {"tag": tag} and answer["ids"] == tag.to_bytes(4, "little").hex()
        assert on_target.error_ahead == "" and step["allocate_ahead"] >= 0.0


def test_an_idle_scheduler_or_a_bad_address_is_left_to_the_scheduler(server, directory) -> None:
    idle = AskAhead(lambda: False, directory)
    busy = AskAhead(lambda: True, directory)
    request = _request(server, 1)
    elsewhere = _request(server, 2)
    elsewhere.allocate_on_target.address = "ipc:///tmp/not-a-channel/s"
    try:
        with _Target(server) as target:
            assert _run(idle.before_transfer(request)) == {}
            assert _run(busy.before_transfer(elsewhere)) == {}
            assert _run(busy.before_transfer(TransferRequestKVCacheReqInput(input_ids=[]))) == {}
            time.sleep(0.05)
    finally:
        idle.close()
        busy.close()
    assert target.taken == []  # nothing was asked
    for r in (request, elsewhere):
        assert r.allocate_on_target.reply_ahead == b"" and r.allocate_on_target.error_ahead == ""


def test_a_target_that_does_not_answer_fails_only_its_own_transfer(
    server, directory, monkeypatch
) -> None:
    ahead = AskAhead(lambda: True, directory, timeout_s=0.2)
    late = _request(server, 1)
    try:
        with _Target(server, answer=False) as target:
            _run(ahead.before_transfer(late))
            assert "did not answer the allocate within" in late.allocate_on_target.error_ahead
            # A target whose process exits while the call waits: told within ~0.1 s.
            gone = _request(server, 2)
            monkeypatch.setattr(ask_ahead, "process_alive", lambda pid: False)
            ahead.timeout_s = DEADLINE_S / 2
            started = time.monotonic()
            _run(ahead.before_transfer(gone))
            assert time.monotonic() - started < DEADLINE_S / 2
    finally:
        ahead.close()
    assert len(target.taken) == 2
    assert "exited before it answered" in gone.allocate_on_target.error_ahead
    assert late.allocate_on_target.reply_ahead == gone.allocate_on_target.reply_ahead == b""


def test_the_scheduler_takes_an_answer_asked_ahead_in_its_poll_without_asking() -> None:
    """A transfer that comes with its answer asks nothing; the answer waits for the
    poll (`take`), which starts it like one read off the channel."""
    caller = SilentTarget()
    asks = TargetAsks(caller, lambda: {})
    on_target = AllocateOnTarget("ipc:///x/s", "0" * 32, b"{}", reply_ahead=b'{"success":true}')
    request = TransferRequestKVCacheReqInput(input_ids=[1, 2], allocate_on_target=on_target)
    inflight = InflightTransfer(request=request)
    asks.ask(request, inflight)
    assert caller.waiting == 0 and asks.waiting and asks.to_prepare == []
    assert asks.ready_test() is None  # the poll has it: nothing to wait for
    started: list[bytes] = []
    taken = asks.take([inflight], time.monotonic(), lambda one, reply: started.append(reply))
    assert taken == [inflight] and started == [b'{"success":true}'] and not asks.waiting
    # Why the target did not answer, as the HTTP layer found: the transfer fails with it.
    failed = AllocateOnTarget("ipc:///x/s", "0" * 32, b"{}", error_ahead="it did not answer")
    request = TransferRequestKVCacheReqInput(input_ids=[1, 2], allocate_on_target=failed)
    inflight = InflightTransfer(request=request)
    with pytest.raises(MigrationError, match="it did not answer"):
        asks.ask(request, inflight)
    assert inflight.channel_error == "it did not answer" and not asks.waiting
