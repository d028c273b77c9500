"""The receipt mailbox (`server/same_host/mailbox.py`): a real file in a temporary directory, the
target's reads and the source's deliveries, and what either refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_kv_migration.server.same_host import mailbox as mb
from timing import FakeClock

RECEIPTS = ["a" * 400 + ".sig0", "b" * 400 + ".sig1"]


@pytest.fixture
def box(tmp_path: Path) -> mb.Mailbox:
    box = mb.Mailbox(str(tmp_path), num_slots=4, slot_bytes=2048)
    yield box
    box.close()


@pytest.fixture
def deliverer(tmp_path: Path) -> mb.Deliverer:
    d = mb.Deliverer(str(tmp_path))
    yield d
    d.close()


def test_a_delivery_is_read_back_for_its_nonce_only(box: mb.Mailbox, deliverer: mb.Deliverer):
    nonce, other = bytes(range(16)), bytes(range(1, 17))
    box.arm(2, nonce)
    assert box.read(2, nonce) is None  # nothing yet
    assert deliverer.deliver(box.address(2, nonce), RECEIPTS) is None
    assert box.read(2, nonce) == RECEIPTS
    assert box.read(2, other) is None  # a stale or other allocation's nonce
    assert box.read(1, nonce) is None  # another slot
    box.clear(2)
    assert box.read(2, nonce) is None


def test_a_slot_whose_allocation_ended_is_not_written(box: mb.Mailbox, deliverer: mb.Deliverer):
    nonce = os.urandom(16)
    before = open(box.path, "rb").read()
    assert "no longer waits" in deliverer.deliver(box.address(1, nonce), RECEIPTS)  # never armed
    box.arm(1, os.urandom(16))  # armed for another allocation (a reused slot)
    armed = open(box.path, "rb").read()
    assert "no longer waits" in deliverer.deliver(box.address(1, nonce), RECEIPTS)
    assert open(box.path, "rb").read() == armed != before  # nothing written by the source


def test_a_torn_or_forged_slot_is_not_read(box: mb.Mailbox, deliverer: mb.Deliverer):
    nonce = os.urandom(16)
    box.arm(0, nonce)
    assert deliverer.deliver(box.address(0, nonce), RECEIPTS) is None
    # Flip a payload byte behind the header's crc: what a half-written slot looks like.
    with open(box.path, "r+b") as f:
        f.seek(4096 + 40 + 5)
        f.write(b"Z")
    assert box.read(0, nonce) is None
    # Valid crc, but not a list of strings.
    assert deliverer.deliver(box.address(0, nonce), [1, 2]) is None  # type: ignore[list-item]
    assert box.read(0, nonce) is None


def test_the_source_refuses_what_is_not_a_mailbox_slot(
    tmp_path: Path, box: mb.Mailbox, deliverer: mb.Deliverer
):
    nonce = os.urandom(16).hex()
    assert "not a mailbox address" in deliverer.deliver("../../etc/passwd/0/" + nonce, RECEIPTS)
    assert "not a mailbox address" in deliverer.deliver(f"{box.name}/0/zz", RECEIPTS)
    assert "outside the 4 slots" in deliverer.deliver(f"{box.name}/4/{nonce}", RECEIPTS)
    missing = f"kvmig-mbox-7-1-{'0' * 32}/0/{nonce}"
    assert "cannot open" in deliverer.deliver(missing, RECEIPTS)
    # A file with a mailbox's name but not its header (some other program's), and a link.
    impostor = f"kvmig-mbox-7-2-{'1' * 32}"
    (tmp_path / impostor).write_bytes(b"\0" * (4096 + 4 * 2048))
    assert "header differs" in deliverer.deliver(f"{impostor}/0/{nonce}", RECEIPTS)
    assert (tmp_path / impostor).read_bytes() == b"\0" * (4096 + 4 * 2048)  # untouched
    link = f"kvmig-mbox-7-3-{'2' * 32}"
    os.symlink(box.path, tmp_path / link)
    assert "cannot open" in deliverer.deliver(f"{link}/0/{nonce}", RECEIPTS)
    # Receipts larger than a slot (checked before the slot is looked at).
    assert "do not fit" in deliverer.deliver(f"{box.name}/0/{nonce}", ["x" * 4000])


def test_close_unlinks_and_a_source_with_it_open_fails_cleanly(
    tmp_path: Path, deliverer: mb.Deliverer
):
    box = mb.Mailbox(str(tmp_path), num_slots=2, slot_bytes=1024)
    nonce = os.urandom(16)
    box.arm(1, nonce)
    assert deliverer.deliver(box.address(1, nonce), RECEIPTS[:1]) is None
    box.close()
    assert not os.path.exists(box.path)
    fresh = mb.Deliverer(str(tmp_path))
    assert "cannot open" in fresh.deliver(box.address(1, nonce), RECEIPTS[:1])
    fresh.close()


def test_stale_mailboxes_of_dead_processes_are_swept(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    namespace = os.stat("/proc/self/ns/pid").st_ino
    stale = f"kvmig-mbox-{namespace}-{int(dead.stdout)}-{'3' * 32}"
    (tmp_path / stale).write_bytes(b"x")
    # Another pid namespace's (a container sharing /dev/shm): its pids are not ours.
    foreign = f"kvmig-mbox-{namespace + 1}-{int(dead.stdout)}-{'4' * 32}"
    (tmp_path / foreign).write_bytes(b"x")
    (tmp_path / "unrelated-file").write_bytes(b"x")
    live = mb.Mailbox(str(tmp_path), num_slots=1, slot_bytes=1024)  # sweeps first
    try:
        names = set(os.listdir(tmp_path))
        assert stale not in names
        assert {"unrelated-file", foreign, live.name} <= names
        assert mb.sweep_stale(str(tmp_path)) == []  # the live one (this process) stays
    finally:
        live.close()


def test_slots_go_round_robin_and_wait_out_a_write_window():
    clock = FakeClock()
    slots = mb.MailboxSlots(3, clock)
    taken = [slots.take() for _ in range(3)]
    assert [t[0] for t in taken] == [0, 1, 2]
    assert len({t[1] for t in taken}) == 3  # a fresh nonce each time
    assert slots.take() is None and len(slots) == 3
    slots.give_back(1, not_before=clock() + 10)  # ended without a commit
    slots.give_back(2)  # committed: free at once
    assert slots.take()[0] == 2
    assert slots.take() is None  # slot 1's window is still open
    clock.now += 10
    assert slots.take()[0] == 1


def test_open_mailbox_is_none_without_shared_memory(tmp_path: Path):
    assert mb.open_mailbox(str(tmp_path / "missing")) is None
