"""Across hosts, as far as one machine allows: two servers in two network namespaces.

The test creates a network namespace and a veth pair with private addresses (and removes
them afterwards): the source runs in this namespace at 10.231.N.1, the target inside the
new one at 10.231.N.2, both advertising those addresses to each other. A migration moves
over the veth link with byte-identical KV; then the link is cut after allocate, so the
transfer fails, only that migration fails, and once the link is back every pool returns
to its baseline and the next migration works. Needs root (CI has it) and iproute2.

With bytes really on the wire (the source's side of the link throttled with a `tc tbf`
token bucket, so 1 MiB takes about a second): an abort and a target cache flush
mid-transfer keep the slots out of the free list until the source has answered, and no
byte lands in them after the write window; a cut mid-transfer fails only that migration.
A stream that resumes after Mooncake timed it out writes nothing into freed slots: the
target shuts its inbound streams down before the slots leave quarantine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import cpu_harness
import httpx
import pytest
from mini_server import ServerHandle, ServerSpec, start_servers
from multi_rank import host_transfer_body
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed
from timing import wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)

PAGE = 16
FIRST = list(range(70_000, 70_000 + 32 * PAGE))
SECOND = list(range(80_000, 80_000 + 32 * PAGE))
THIRD = list(range(90_000, 90_000 + 8 * PAGE))
# 1 MiB of KV each (2048 tokens x 512 bytes): ~1 s on the wire through the throttled link.
BIG = [list(range(base, base + 128 * PAGE)) for base in (100_000, 110_000, 120_000)]
AFTER_CUT = list(range(130_000, 130_000 + 8 * PAGE))
THROTTLE = "8mbit"
# The target's write window: 1 s grant + 2 x 2 s transfer timeout (late-write margin 4 s).
LATE_WRITE_MARGIN_S = 4.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str, str, str]]:
    n = os.getpid() % 250 + 1
    ns, here, there = f"kvmig-{os.getpid()}", f"kvma{os.getpid()}", f"kvmb{os.getpid()}"
    here_ip, there_ip = f"10.231.{n}.1", f"10.231.{n}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here[:15], "type", "veth", "peer", "name", there[:15])
        _ip("link", "set", there[:15], "netns", ns)
        _ip("addr", "add", f"{here_ip}/24", "dev", here[:15])
        _ip("link", "set", here[:15], "up")
        _ip("-n", ns, "addr", "add", f"{there_ip}/24", "dev", there[:15])
        _ip("-n", ns, "link", "set", there[:15], "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, here[:15], here_ip, there_ip
    finally:
        subprocess.run(["ip", "link", "del", here[:15]], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def servers(hosts) -> Iterator[tuple[ServerHandle, ServerHandle]]:
    ns, _link, here_ip, there_ip = hosts
    # Mooncake's own per-batch timeout, so a write into a cut link fails in seconds; no
    # longer than the servers' 2 s transfer timeout (start-up refuses a longer one).
    os.environ["MC_TRANSFER_TIMEOUT"] = "2"
    try:
        big = cpu_harness.HarnessConfig(device_tokens=8192)
        preload = [(FIRST, 1), (SECOND, 2), (THIRD, 3), (AFTER_CUT, 4)]
        preload += [(ids, 10 + i) for i, ids in enumerate(BIG)]
        source, target = start_servers(
            [
                ServerSpec(harness=big, host=here_ip, preload=preload),
                ServerSpec(
                    harness=big, host=there_ip, netns=ns, watchdog_timeout_s=4.0, grant_ttl_s=1.0
                ),
            ]
        )
    finally:
        os.environ.pop("MC_TRANSFER_TIMEOUT", None)
    try:
        yield source, target
    finally:
        source.stop()
        target.stop()


def test_migration_over_private_addresses(hosts, servers) -> None:
    _ns, _link, here_ip, there_ip = hosts
    source, target = servers
    with MigrationClient(timeout=30.0) as client:
        info = client.call(source.url, "/get_transfer_session_info")
        assert info["ranks"][0]["session_id"].startswith(here_ip + ":")  # advertised
        info = client.call(target.url, "/get_transfer_session_info")
        assert info["ranks"][0]["session_id"].startswith(there_ip + ":")
        result = client.migrate(source.url, target.url, FIRST)
    assert result.path == "host" and result.migrated_token_size == len(FIRST)
    assert _same_kv(source, target, FIRST)


def test_a_cut_link_fails_only_that_migration(hosts, servers) -> None:
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")

    def cut_after_allocate(request) -> None:
        if request.url.path == "/transfer_request_kvcache":
            _ip("link", "set", link, "down")

    try:
        with httpx.Client(timeout=15.0, event_hooks={"request": [cut_after_allocate]}) as h:
            with pytest.raises(MigrationFailed) as info:
                MigrationClient(http_client=h).migrate(source.url, target.url, SECOND)
        assert info.value.phase == "transfer"
    finally:
        _ip("link", "set", link, "up")
    # The source gave back its pins; the target's allocation is freed by the watchdog (the
    # abort could not reach it) and its slots after the write window.
    assert wait_until(lambda: source.ask(0, "snapshot") == source_base, 30.0)
    assert wait_until(lambda: target.ask(0, "snapshot") == target_base, 60.0)
    assert sum(target.ask(0, "held", SECOND)) == 0
    # The link is back: migrations work again once TCP has retransmitted on the old
    # connection (its back-off can outlast the first attempts), within a bounded wait.
    results: list = []

    def migrated() -> bool:
        with MigrationClient(timeout=30.0) as client:
            try:
                results.append(client.migrate(source.url, target.url, THIRD))
            except MigrationFailed:
                return False
        return True

    assert wait_until(migrated, 90.0), "no migration succeeded after the link came back"
    assert results[-1].migrated_token_size == len(THIRD)
    assert _same_kv(source, target, THIRD)


def _same_kv(source: ServerHandle, target: ServerHandle, ids: list[int]) -> bool:
    import torch

    got, want = target.ask(0, "kv", ids), source.ask(0, "kv", ids)
    # Random KV bytes include NaN patterns: compare bytes, not values.
    return len(got) == len(want) and all(
        torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        for g, w in zip(got, want, strict=True)
    )


# --------------------------------------------------------------------------- bytes on the wire


@contextlib.contextmanager
def _throttled(link: str) -> Iterator[None]:
    """Slow the source's side of the link so a 1 MiB transfer takes about 1 s."""
    subprocess.run(
        # A token bucket (netem is not in every kernel): excess packets queue or drop.
        ["tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", THROTTLE]
        + ["burst", "32kbit", "latency", "400ms"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", link, "root"], capture_output=True, timeout=30)


def _start_transfer(source: ServerHandle, target: ServerHandle, ids: list[int]):
    """Allocate on the target and start the transfer on a thread; returns the slots,
    the migration id, the thread and a dict that receives the reply."""
    with MigrationClient(timeout=30.0) as client:
        source_info = client.call(source.url, "/get_transfer_session_info")
        target_info = client.call(target.url, "/get_transfer_session_info")
        alloc = client.call(
            target.url,
            "/allocate_token_for_transfer",
            {
                "input_ids": ids,
                "source_fingerprints": [r["fingerprint"] for r in source_info["ranks"]],
                "source_instance": source_info["instance_id"],
            },
        )
    body = host_transfer_body(ids, alloc, target_info)
    result: dict = {}

    def send() -> None:
        reply = httpx.post(source.url + "/transfer_request_kvcache", json=body, timeout=60.0)
        result["reply"] = reply.json()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return alloc["ranks"][0]["kv_indices"], alloc["migration_id"], thread, result


def _guard_quarantine(target: ServerHandle, slots: list[int], thread: threading.Thread) -> int:
    """Until the source answers, the freed slots must not be in the free list; returns
    how many times that was checked. Checked at least once: on a loaded box the write
    may be over by now, and the slots stay quarantined past that (until the write
    window closes, seconds later: no receipt came with the abort)."""
    checks = 0
    deadline = time.monotonic() + 60.0
    while checks == 0 or (thread.is_alive() and time.monotonic() < deadline):
        assert target.ask(0, "free_overlap", slots) == 0, (
            "slots handed out before the source settled"
        )
        checks += 1
        time.sleep(0.1)
    assert not thread.is_alive(), "the source never answered"
    return checks


def _assert_no_late_write(target: ServerHandle, slots: list[int]) -> None:
    """Once the write window is over, the freed slots' bytes stay as they are."""
    assert wait_until(lambda: target.ask(0, "free_overlap", slots) == len(slots), 30.0)
    before = target.ask(0, "slot_digest", slots)
    time.sleep(LATE_WRITE_MARGIN_S + 1.0)
    assert target.ask(0, "slot_digest", slots) == before, "a late write landed in freed slots"


def test_abort_while_bytes_are_on_the_wire_leaves_freed_slots_alone(hosts, servers) -> None:
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")
    with _throttled(link):
        slots, mid, thread, result = _start_transfer(source, target, BIG[0])
        time.sleep(0.4)  # bytes are on the wire (the whole write takes ~1 s)
        assert thread.is_alive(), "the throttled transfer finished too early"
        aborted = httpx.post(target.url + "/abort_transfer", json={"migration_id": mid}, timeout=10)
        assert aborted.status_code == 200, aborted.text
        # No receipt came with the abort: the slots stay out of the free list.
        assert target.ask(0, "snapshot").total_lock_ref == target_base.total_lock_ref
        assert _guard_quarantine(target, slots, thread) >= 1
    assert "reply" in result
    _assert_no_late_write(target, slots)
    assert wait_until(lambda: target.ask(0, "snapshot") == target_base, 30.0)
    assert wait_until(lambda: source.ask(0, "snapshot") == source_base, 30.0)
    assert sum(target.ask(0, "held", BIG[0])) == 0


def test_a_link_cut_while_bytes_are_on_the_wire_fails_only_that_migration(hosts, servers) -> None:
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")
    started = time.monotonic()
    with _throttled(link):
        slots, mid, thread, result = _start_transfer(source, target, BIG[1])
        time.sleep(0.4)
        assert thread.is_alive(), "the throttled transfer finished too early"
        _ip("link", "set", link, "down")
        try:
            thread.join(30.0)  # fails by Mooncake's 2 s batch timeout / the grant deadline
            assert not thread.is_alive(), "the transfer did not fail with the link down"
        finally:
            _ip("link", "set", link, "up")
    assert not result["reply"]["success"], result["reply"]
    # The abort could not reach the target: its watchdog frees the allocation and its
    # slots come back after the write window. (Whether bytes of the cut stream land
    # after that is `test_a_stream_resumed_after_its_timeout_writes_nothing_into_freed_slots`.)
    assert wait_until(lambda: source.ask(0, "snapshot") == source_base, 30.0)
    assert wait_until(lambda: target.ask(0, "snapshot") == target_base, 30.0)
    assert sum(target.ask(0, "held", BIG[1])) == 0
    results: list = []

    def migrated() -> bool:
        with MigrationClient(timeout=30.0) as client:
            try:
                results.append(client.migrate(source.url, target.url, AFTER_CUT))
            except MigrationFailed:
                return False
        return True

    assert wait_until(migrated, 90.0), "no migration succeeded after the link came back"
    assert _same_kv(source, target, AFTER_CUT)
    assert time.monotonic() - started < 120.0


def test_flush_while_bytes_are_on_the_wire_leaves_freed_slots_alone(hosts, servers) -> None:
    """A target /flush_cache (e.g. after a weight update) mid-transfer: the reset frees
    every slot, but the migration's stay quarantined until the source is done."""
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    source_base = source.ask(0, "snapshot")
    with _throttled(link):
        slots, mid, thread, result = _start_transfer(source, target, BIG[2])
        time.sleep(0.4)
        assert thread.is_alive(), "the throttled transfer finished too early"
        assert target.ask(0, "flush") is True
        assert _guard_quarantine(target, slots, thread) >= 1
    assert "reply" in result
    _assert_no_late_write(target, slots)
    flushed = target.ask(0, "snapshot")
    assert flushed.host_available == target.ask(0, "host_slots")["size"]  # all free again
    assert flushed.total_lock_ref == 0 and flushed.total_host_ref == 0
    committed = httpx.post(target.url + "/commit", json={"migration_id": mid}, timeout=10)
    assert committed.status_code == 410, committed.text
    assert wait_until(lambda: source.ask(0, "snapshot") == source_base, 30.0)


def test_a_stream_resumed_after_its_timeout_writes_nothing_into_freed_slots(hosts, servers) -> None:
    """Mooncake TCP (0.3.13) reports a timed-out write as failed (-2) but does not close
    its stream: when the link comes back, TCP retransmits the rest. The target shuts the
    inbound streams down before the slots leave quarantine (`tcp_streams.py`), so
    nothing of it lands in slots that may be reused."""
    _ns, link, _here_ip, _there_ip = hosts
    source, target = servers
    with _throttled(link):
        slots, _mid, thread, result = _start_transfer(source, target, BIG[2])
        time.sleep(0.4)
        _ip("link", "set", link, "down")
        try:
            thread.join(30.0)
            assert not result["reply"]["success"]
            # The link stays down until the write window closed and the slots are free.
            assert wait_until(lambda: target.ask(0, "free_overlap", slots) == len(slots), 30.0)
            before = target.ask(0, "slot_digest", slots)
        finally:
            _ip("link", "set", link, "up")
    time.sleep(12.0)  # TCP's retransmission back-off after ~10 s down
    assert target.ask(0, "slot_digest", slots) == before, "a late write landed in freed slots"


# --------------------------------------------------------------------------- receipts as an attack

# Signed servers (admin key: grants and receipts carry an HMAC), so a receipt cannot be
# forged: the attacks below use only receipts the servers themselves signed.
ADMIN_KEY = "netns-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
RETRIED = list(range(140_000, 140_000 + 128 * PAGE))
ABORTED_TWICE = list(range(150_000, 150_000 + 128 * PAGE))


@pytest.fixture(scope="module")
def signed_servers(hosts) -> Iterator[tuple[ServerHandle, ServerHandle, ServerHandle]]:
    """A source here, a target across the link and a second source (on loopback: it
    never reaches the target, it only answers transfer requests)."""
    ns, _link, here_ip, there_ip = hosts
    big = cpu_harness.HarnessConfig(device_tokens=8192)
    handles = start_servers(
        [
            ServerSpec(
                harness=big,
                host=here_ip,
                admin_api_key=ADMIN_KEY,
                preload=[(RETRIED, 21), (ABORTED_TWICE, 22)],
            ),
            ServerSpec(harness=big, host=there_ip, netns=ns, admin_api_key=ADMIN_KEY),
            ServerSpec(harness=big, admin_api_key=ADMIN_KEY, preload=[(ABORTED_TWICE, 22)]),
        ]
    )
    try:
        yield tuple(handles)
    finally:
        for handle in handles:
            handle.stop()


def _signed_post(server: ServerHandle, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=AUTH, timeout=60.0)


def _start_signed_transfer(source: ServerHandle, target: ServerHandle, ids: list[int]):
    """As `_start_transfer`, on signed servers; also returns the transfer body."""
    source_info = _signed_post(source, "/get_transfer_session_info", {}).json()
    target_info = _signed_post(target, "/get_transfer_session_info", {}).json()
    allocated = _signed_post(
        target,
        "/allocate_token_for_transfer",
        {
            "input_ids": ids,
            "source_fingerprints": [r["fingerprint"] for r in source_info["ranks"]],
            "source_instance": source_info["instance_id"],
        },
    )
    assert allocated.status_code == 200, allocated.text
    alloc = allocated.json()
    body = host_transfer_body(ids, alloc, target_info)
    result: dict = {}

    def send() -> None:
        result["reply"] = _signed_post(source, "/transfer_request_kvcache", body).json()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return alloc["ranks"][0]["kv_indices"], alloc["migration_id"], thread, result, body


def _receipts(reply: dict) -> list[str]:
    return [rank["receipt"] for rank in reply["ranks"]]


def _settle_and_check_books(source, target, mid, result, source_base, target_base) -> None:
    """The first transfer's own receipts (its claimant's, the write over) settle the
    quarantine at once, on a repeat abort; then both servers are at their baselines."""
    aborted = _signed_post(
        target, "/abort_transfer", {"migration_id": mid, "receipts": _receipts(result["reply"])}
    )
    assert aborted.status_code == 200, aborted.text
    assert wait_until(lambda: target.ask(0, "snapshot") == target_base, 30.0)
    assert wait_until(lambda: source.ask(0, "snapshot") == source_base, 30.0)


def test_a_retried_transfer_s_receipt_does_not_free_slots_still_being_written(
    hosts, signed_servers
) -> None:
    """A client retries a transfer while the first is on the wire: the retry is refused
    as a replay, and its receipt (signed, naming the migration, its slots and the grant's
    source) must not let an abort free the slots the first transfer is still writing."""
    _ns, link, _here_ip, _there_ip = hosts
    source, target, _other = signed_servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")
    with _throttled(link):
        slots, mid, thread, result, body = _start_signed_transfer(source, target, RETRIED)
        time.sleep(0.4)
        assert thread.is_alive(), "the throttled transfer finished too early"
        retry = _signed_post(source, "/transfer_request_kvcache", body)
        assert retry.status_code == 403 and "replay" in retry.text, retry.text
        aborted = _signed_post(
            target, "/abort_transfer", {"migration_id": mid, "receipts": _receipts(retry.json())}
        )
        assert aborted.status_code == 200, aborted.text
        assert _guard_quarantine(target, slots, thread) >= 1
    assert result["reply"]["success"], result["reply"]
    _settle_and_check_books(source, target, mid, result, source_base, target_base)


def test_a_foreign_receipt_does_not_free_an_aborted_migration_s_slots(
    hosts, signed_servers
) -> None:
    """Abort after abort: the first (no receipts) quarantines the slots while the source
    writes; a second abort with the receipt of a transfer that named the same migration
    at another source (refused there: the grant is not its own) must not free them."""
    _ns, link, _here_ip, _there_ip = hosts
    source, target, other = signed_servers
    source_base, target_base = source.ask(0, "snapshot"), target.ask(0, "snapshot")
    with _throttled(link):
        slots, mid, thread, result, body = _start_signed_transfer(source, target, ABORTED_TWICE)
        time.sleep(0.4)
        assert thread.is_alive(), "the throttled transfer finished too early"
        first = _signed_post(target, "/abort_transfer", {"migration_id": mid})
        assert first.status_code == 200, first.text
        foreign = _signed_post(other, "/transfer_request_kvcache", body)
        assert foreign.status_code == 403 and "another source" in foreign.text, foreign.text
        again = _signed_post(
            target, "/abort_transfer", {"migration_id": mid, "receipts": _receipts(foreign.json())}
        )
        assert again.status_code == 200, again.text
        assert _guard_quarantine(target, slots, thread) >= 1
    _settle_and_check_books(source, target, mid, result, source_base, target_base)
