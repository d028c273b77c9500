"""Feature "source_commit" on a real one-rank `MigrationSchedulerSide` (CPU harness): the
loopback transfer delivers its receipts into the side's own mailbox, and the side commits
them before the next iteration's requests; refusals, weight updates and failures."""

from __future__ import annotations

import pytest
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang_kv_migration.server.same_host.mailbox import Deliverer
from side_helpers import allocate_on, poll_until, transfer_to_self
from timing import wait_until

PAGE = 16


def _allocate(side, ids: list[int], migration_id: str, source_commit: bool = True):
    # Loopback: this side is the source, so the grant names its own instance.
    return allocate_on(
        side,
        ids,
        migration_id,
        source_commit=source_commit,
        source_instance=side.identity.server_epoch,
    )


def _send(side, source_ids: list[int], alloc) -> object:
    """A loopback transfer under `alloc`'s grant, polled until it replied."""
    request = transfer_to_self(side, source_ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant)
    request.migration_id = alloc.migration_id
    before = len(side.replies)
    side.transfer_request_kvcache(request)
    assert poll_until(side, lambda: len(side.replies) > before), "no transfer reply"
    return side.replies[-1]


@pytest.fixture
def loaded(side):
    ids = list(range(400, 400 + 4 * PAGE))
    side.harness.insert_random(ids, seed=4)
    side.harness.write_back_all()
    return side, ids


def test_a_delivered_transfer_is_committed_before_the_next_requests(loaded):
    side, ids = loaded
    target_ids = list(range(900, 900 + 4 * PAGE))
    alloc = _allocate(side, target_ids, "m1")
    assert alloc.success and alloc.source_commit, alloc.message
    reply = _send(side, ids, alloc)
    assert reply.success and reply.delivered, reply.message
    assert side.target.pending.get("m1") is not None  # not yet: the next iteration commits
    side.before_requests([])
    assert side.target.pending.get("m1") is None
    held = side.harness.match(target_ids)
    assert held.host_hit_length + len(held.device_indices) == len(target_ids)


def test_without_asking_nothing_is_delivered(loaded):
    side, ids = loaded
    alloc = _allocate(side, list(range(1000, 1000 + 2 * PAGE)), "m2", source_commit=False)
    assert alloc.success and not alloc.source_commit
    reply = _send(side, ids[: 2 * PAGE], alloc)
    assert reply.success and not reply.delivered
    side.before_requests([])
    assert side.target.pending.get("m2") is not None  # waits for the client's /commit


def test_forged_receipts_in_the_slot_are_refused_once_and_the_allocation_stays(loaded):
    side, _ids = loaded
    alloc = _allocate(side, list(range(1100, 1100 + 2 * PAGE)), "m3")
    mailbox = side.identity.signer.decode_grant(alloc.ranks[0].grant).mailbox
    deliverer = Deliverer()
    try:
        assert deliverer.deliver(mailbox, ["forged.receipt"]) is None
    finally:
        deliverer.close()
    side.before_requests([])
    assert side.target.pending.get("m3") is not None
    assert "m3" not in side.target.source_commits.awaiting  # not read again


def test_a_weight_update_drops_what_waits_for_its_source(loaded):
    side, ids = loaded
    waiting = _allocate(side, list(range(1200, 1200 + 2 * PAGE)), "m4")
    plain = _allocate(side, list(range(1300, 1300 + 2 * PAGE)), "m5", source_commit=False)
    assert waiting.success and plain.success
    side.before_requests([UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])])
    assert side.target.pending.get("m4") is None and side.target.pending.get("m5") is not None
    # Its source then finds the slot no longer armed: not delivered (the client commits
    # and learns the allocation is gone).
    reply = _send(side, ids[: 2 * PAGE], waiting)
    assert reply.success and not reply.delivered


def test_an_allocation_failing_after_its_slots_were_reserved_gives_them_back(
    side, monkeypatch: pytest.MonkeyPatch
):
    before = side.harness.snapshot()

    def boom() -> tuple[tuple[int, bytes] | None, str]:
        raise RuntimeError("injected fault after reserving")

    monkeypatch.setattr(side.target.source_commits, "grant_slot", boom)
    out = _allocate(side, list(range(1400, 1400 + 2 * PAGE)), "m6")
    assert not out.success and out.error_kind == "internal"
    assert "injected fault" in out.message
    assert len(side.target.pending) == 0 and side.target.pending.quarantined() == 0
    assert side.harness.snapshot() == before  # the slots went back at once


def test_a_grant_failing_after_its_mailbox_slot_was_taken_gives_it_back(
    side, monkeypatch: pytest.MonkeyPatch
):
    """The grant is made once the slots are reserved and before the migration is
    pending: a failure there gives back what it took (the mailbox slot, the slots) and
    leaves nothing pending."""
    from sglang_kv_migration.server.target.allocations import TargetAllocations

    before = side.harness.snapshot()
    slots = side.target.source_commits.slots
    assert len(slots) == 0

    def boom(*_args: object) -> str:
        assert len(slots) == 1  # the mailbox slot was taken first
        raise RuntimeError("injected fault while signing")

    monkeypatch.setattr(TargetAllocations, "_sign_grant", boom)
    out = _allocate(side, list(range(1500, 1500 + 2 * PAGE)), "m7")
    assert not out.success and "injected fault while signing" in out.message
    assert len(slots) == 0  # given back at once, not after a write window
    assert len(side.target.pending) == 0 and side.target.pending.quarantined() == 0
    assert side.harness.snapshot() == before


# ------------------------------------------------- channel allocations and commits


def _ask_on_channel(side, caller, input_ids: list[int]) -> bytes:
    """An allocate asked on `side`'s own channel, as a source with its layout asks."""
    import orjson
    from sglang_kv_migration.wire import binary_ids

    body = {
        "source_fingerprints": [side.identity.fingerprint.to_dict()],
        "source_instance": side.identity.server_epoch,
        "source_commit": True,
        "path": "host",
    }
    channel = side.target.channel.channel
    return caller.call(
        channel.address, channel.secret, orjson.dumps(body), binary_ids.to_bytes(input_ids)
    )


def _serve_channel_once(side, recorded: list) -> None:
    """One iteration's `before_requests` once the channel has something to read (bounded
    wait), with the order of commits and channel allocations in `recorded`."""
    from sglang_kv_migration.server.messages import GetTransferSessionInfoReqInput

    channel = side.target.channel
    commit, allocate = side.target.commits.commit, channel._allocate

    def recorded_commit(req):
        recorded.append(("commit", req.migration_id))
        return commit(req)

    def recorded_allocate(req):
        output = allocate(req)
        recorded.append(("allocate", output.matched_token_size))
        return output

    side.target.commits.commit, channel._allocate = recorded_commit, recorded_allocate
    try:
        assert wait_until(channel.readable, 30.0, interval_s=0.001)
        side.before_requests([GetTransferSessionInfoReqInput(weight_version="")])
    finally:
        side.target.commits.commit, channel._allocate = commit, allocate


@pytest.fixture
def caller():
    from sglang_kv_migration.server.same_host.allocate_channel import ChannelCaller

    c = ChannelCaller()
    yield c
    c.close()


def test_a_channel_allocate_that_builds_on_nothing_delivered_goes_before_the_commits(
    loaded, caller
):
    side, ids = loaded
    held = list(range(900, 900 + 4 * PAGE))
    reply = _send(side, ids, _allocate(side, held, "m7"))
    assert reply.success and reply.delivered, reply.message
    _ask_on_channel(side, caller, list(range(5000, 5000 + 2 * PAGE)))
    recorded: list = []
    _serve_channel_once(side, recorded)
    assert recorded == [("allocate", 0), ("commit", "m7")]
    assert side.target.pending.get("m7") is None  # still committed before the requests


def test_a_channel_allocate_that_may_build_on_a_delivered_commit_goes_after_it(loaded, caller):
    side, ids = loaded
    held = list(range(900, 900 + 4 * PAGE))
    reply = _send(side, ids, _allocate(side, held, "m8"))
    assert reply.success and reply.delivered, reply.message
    _ask_on_channel(side, caller, held + list(range(7000, 7000 + 2 * PAGE)))
    recorded: list = []
    _serve_channel_once(side, recorded)
    # The continuation found the delivered prefix committed: it needs only its own pages.
    assert recorded == [("commit", "m8"), ("allocate", len(held))]


def test_builds_on_compares_the_ids_where_a_match_could_reach_the_committed_pages(side):
    from sglang_kv_migration.server.messages import AllocateTokenForTransferReqInput
    from sglang_kv_migration.server.target.mailbox_commits import builds_on
    from sglang_kv_migration.wire import binary_ids

    held = list(range(100, 100 + 2 * PAGE))
    side.harness.insert_random(held, seed=1)
    ids = held + list(range(3000, 3000 + 4 * PAGE))  # the target holds `held` already
    alloc = _allocate(side, ids, "m9")
    assert alloc.success and alloc.matched_token_size == len(held)
    pending = side.target.pending.get("m9")

    def request(input_ids: list[int], as_bytes: bool = False, extra_key=None):
        if as_bytes:
            return AllocateTokenForTransferReqInput(
                input_ids=[], input_ids_u32=binary_ids.to_bytes(input_ids), extra_key=extra_key
            )
        return AllocateTokenForTransferReqInput(input_ids=input_ids, extra_key=extra_key)

    longer = ids + [9, 9, 9]
    for as_bytes in (False, True):
        assert builds_on(pending, request(longer, as_bytes))
        assert builds_on(pending, request(ids[: len(held) + 1], as_bytes))
        # Shares only what the target held: branches off before the committed pages.
        assert not builds_on(pending, request(held + [1] * PAGE, as_bytes))
        # Too short to reach them.
        assert not builds_on(pending, request(held, as_bytes))
        # Another first token, another namespace.
        assert not builds_on(pending, request([7] + longer[1:], as_bytes))
        assert not builds_on(pending, request(longer, as_bytes, extra_key="lora-2"))


def test_requests_that_arrive_while_the_channel_is_served_are_served_in_the_same_iteration(
    side, caller
):
    import orjson

    channel = side.target.channel
    allocate = channel._allocate
    asked: list[bytes] = []

    def asking_meanwhile(req):
        if len(asked) < 3:  # each allocate brings the next request (bounded)
            first = 8000 + 100 * len(asked)
            asked.append(_ask_on_channel(side, caller, list(range(first, first + PAGE))))
            assert wait_until(channel.readable, 30.0, interval_s=0.001)
        return allocate(req)

    channel._allocate = asking_meanwhile
    asked.append(_ask_on_channel(side, caller, list(range(6000, 6000 + PAGE))))
    _serve_channel_once(side, [])
    replies: dict[bytes, dict] = {}

    def all_replied() -> bool:
        replies.update((call, orjson.loads(r)) for call, r in caller.replies())
        return len(replies) == len(asked)

    wait_until(all_replied, 30.0, interval_s=0.001)
    assert len(asked) == 3 and set(replies) == set(asked)  # all in one iteration
    for reply in replies.values():
        assert reply["success"], reply["message"]
        steps = reply["steps_ms"]
        assert {"queued", "scheduler", "match_reserve", "slots", "grant"} <= set(steps)
        assert all(v >= 0 for v in steps.values())


def test_requests_taken_off_the_channel_are_answered_even_when_a_commit_fails(
    loaded, caller, monkeypatch: pytest.MonkeyPatch
):
    import orjson

    side, ids = loaded
    reply = _send(side, ids, _allocate(side, list(range(900, 900 + 4 * PAGE)), "m10"))
    assert reply.delivered, reply.message

    def boom(select=None):
        raise RuntimeError("injected commit fault")

    monkeypatch.setattr(side.target.source_commits, "commit_delivered", boom)
    call = _ask_on_channel(side, caller, list(range(5000, 5000 + 2 * PAGE)))
    _serve_channel_once(side, [])  # the fault goes to the poll's failure handling
    answers: dict[bytes, dict] = {}

    def answered() -> bool:
        answers.update((c, orjson.loads(r)) for c, r in caller.replies())
        return call in answers

    wait_until(answered, 30.0, interval_s=0.001)
    assert answers[call]["success"], answers[call]  # answered at once, not after 10 s
