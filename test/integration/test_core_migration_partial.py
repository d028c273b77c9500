"""Partial transfers (feature "partial_transfer", issue 21): the source sends what it holds.

The client allocates on the target for the whole request, without asking the source
first; the transfer (`partial_ok`) sends the whole pages the source holds of the granted
range, into the first granted slots, and its receipts say how many tokens; the commit
inserts only those and gives the other slots back at once. Two processes with real
HiRadixCaches and the real scheduler-side handlers; the bytes cross through Mooncake TCP
on 127.0.0.1 (`core_peers.py`). Named to run beside `test_core_migration.py`: the two
share the session's peer pair, whose processes exit after 300 s without a command.
"""

from __future__ import annotations

import dataclasses

import pytest
from core_peers import LAYERS, Server, abort, allocate, commit, receipts, token_ids, transfer
from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.messages import CommitTransferRequestKVCacheReqInput

# Runs on every supported SGLang (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang

PAGE = 16
CFG = {"attention": "mha", "host_layout": "page_first", "page_size": PAGE}


@pytest.fixture
def servers(migration_peers: tuple[Server, Server]) -> tuple[Server, Server]:
    src, dst = migration_peers
    src.setup(**CFG)
    dst.setup(**CFG)
    return src, dst


def _hold(src: Server, dst: Server, tokens: list[int], common: int, source_held: int) -> None:
    """The target holds `common` tokens, the source the same bytes and more: `source_held`."""
    if common:
        src.do("insert", tokens[:common], 10, True)
        dst.do("insert", tokens[:common], 10, True)
    src.do("insert", tokens[:source_held], 11, True)


def test_a_partial_transfer_moves_and_commits_what_the_source_holds(servers):
    src, dst = servers
    tokens = token_ids(20 * PAGE, start=1_000)
    common, held = 2 * PAGE, 12 * PAGE
    _hold(src, dst, tokens, common, held)
    dst_before, src_before = dst.snapshot(), src.snapshot()

    alloc = allocate(src, dst, tokens, "partial-1")
    assert (alloc.matched_token_size, alloc.extra_token_size) == (common, 20 * PAGE - common)
    sent = transfer(src, dst, tokens, alloc, partial_ok=True)
    assert sent.success, sent.message
    assert sent.transferred_token_size == held - common
    assert sent.transferred_bytes == (held - common) * LAYERS * 2 * 2 * 16 * 2
    (receipt,) = [grants.Signer(None).decode_receipt(r) for r in receipts(sent)]
    assert receipt.success and receipt.settled and receipt.tokens == held - common

    committed = commit(dst, alloc.migration_id, sent)
    assert committed.success, committed.message
    assert committed.matched_after_commit == held
    device_len, host_len = dst.do("match", tokens)
    assert device_len + host_len == held
    assert dst.do("kv_digest", tokens[:held]) == src.do("kv_digest", tokens[:held])
    # The target spent exactly the written slots: the other eight pages went back.
    dst_after = dst.snapshot()
    assert dst_after.host_available == dst_before.host_available - (held - common)
    assert (dst_after.total_lock_ref, dst_after.total_host_ref) == (0, 0)
    assert dst.do("pending") == 0
    assert src.snapshot() == src_before


def test_a_partial_transfer_of_nothing_commits_nothing_and_frees_every_slot(servers):
    src, dst = servers
    tokens = token_ids(6 * PAGE, start=2_000)
    _hold(src, dst, tokens, PAGE, PAGE)  # the source holds no more than the target
    dst_before = dst.snapshot()

    alloc = allocate(src, dst, tokens, "partial-2")
    sent = transfer(src, dst, tokens, alloc, partial_ok=True)
    assert sent.success, sent.message
    assert (sent.transferred_token_size, sent.transferred_bytes) == (0, 0)
    (receipt,) = [grants.Signer(None).decode_receipt(r) for r in receipts(sent)]
    assert receipt.tokens == 0 and receipt.settled
    committed = commit(dst, alloc.migration_id, sent)
    assert committed.success and committed.matched_after_commit == PAGE
    assert dst.snapshot() == dst_before
    assert dst.do("pending") == 0


def test_without_partial_ok_a_source_holding_less_refuses(servers):
    src, dst = servers
    tokens = token_ids(6 * PAGE, start=3_000)
    _hold(src, dst, tokens, 0, 3 * PAGE)
    dst_before = dst.snapshot()
    alloc = allocate(src, dst, tokens, "partial-3")
    sent = transfer(src, dst, tokens, alloc)
    assert not sent.success
    assert sent.error_kind == ErrorKind.CONFLICT.value
    assert "holds only 48 tokens of the prefix, 96 needed" in sent.message
    assert abort(dst, alloc.migration_id, sent).success
    assert dst.snapshot() == dst_before


@pytest.mark.parametrize(
    ("tokens_claimed", "problem"), [(5, "not whole pages"), (7 * PAGE, "not whole pages")]
)
def test_commit_refuses_a_receipt_whose_length_is_not_granted_pages(
    servers, tokens_claimed, problem
):
    """Unsigned servers (no key): a client could rewrite the receipt's length; the target
    inserts only whole pages inside its grant, and nothing is lost when it refuses."""
    src, dst = servers
    tokens = token_ids(6 * PAGE, start=4_000)
    _hold(src, dst, tokens, 0, 3 * PAGE)
    dst_before = dst.snapshot()
    alloc = allocate(src, dst, tokens, f"partial-4-{tokens_claimed}")
    sent = transfer(src, dst, tokens, alloc, partial_ok=True)
    assert sent.success and sent.transferred_token_size == 3 * PAGE
    signer = grants.Signer(None)
    forged = [
        signer.encode(dataclasses.replace(signer.decode_receipt(r), tokens=tokens_claimed))
        for r in receipts(sent)
    ]
    refused = dst.call(
        "commit_transfer_request_kvcache",
        CommitTransferRequestKVCacheReqInput(migration_id=alloc.migration_id, receipts=forged),
    )
    assert not refused.success and refused.error_kind == ErrorKind.FORBIDDEN.value
    assert problem in refused.message and f"{tokens_claimed} tokens" in refused.message
    assert dst.do("pending") == 1  # refused, not lost: the real receipts still commit
    assert commit(dst, alloc.migration_id, sent).matched_after_commit == 3 * PAGE
    assert dst.snapshot().host_available == dst_before.host_available - 3 * PAGE
