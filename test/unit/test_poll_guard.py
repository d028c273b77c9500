"""An exception in `MigrationSchedulerSide.poll()` (the per-iteration hook) never reaches
SGLang's scheduler loop: the transfer it could not finish is answered with an error, the
traceback is logged once per distinct error, and the scheduler side keeps answering
(issue 17: no exception crosses a scheduler handler)."""

from __future__ import annotations

import logging

import pytest
from sglang_kv_migration.server.messages import (
    AbortTransferReqInput,
    AllocateTokenForTransferReqInput,
)
from side_helpers import poll_until, transfer_to_self


def _allocate(side, ids: list[int], migration_id: str):
    out = side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=ids,
            migration_id=migration_id,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
        )
    )
    assert out.success, out.message
    return out


def _start_transfer(side, source_ids: list[int], target_ids: list[int], migration_id: str):
    alloc = _allocate(side, target_ids, migration_id)
    request = transfer_to_self(side, source_ids, alloc.ranks[0].kv_indices, alloc.ranks[0].grant)
    request.migration_id = migration_id
    side.transfer_request_kvcache(request)
    assert len(side.transfers) == 1


def test_poll_exception_fails_the_transfer_and_the_side_keeps_answering(
    side, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ids = list(range(400, 464))
    side.harness.insert_random(ids, seed=4)
    side.harness.write_back_all()

    def boom() -> None:
        raise RuntimeError("injected poll fault")

    monkeypatch.setattr(side.transfers, "_finish_done", boom)
    with caplog.at_level(logging.ERROR, logger="sglang_kv_migration.server.scheduler.loop"):
        for k, target in enumerate((range(500, 564), range(600, 664))):
            _start_transfer(side, ids, list(target), f"t{k}")
            assert side.poll() == []  # raised inside: nothing crossed into the loop
            reply = side.replies[-1]
            assert not reply.success and reply.error_kind == "internal"
            assert "injected poll fault" in reply.message
            assert len(side.transfers) == 0
    tracebacks = [r for r in caplog.records if r.exc_info and "poll failed" in r.getMessage()]
    assert len(tracebacks) == 1  # the same error twice: one traceback

    # The fault is gone: the side answers, and a transfer completes again.
    monkeypatch.undo()
    for k in range(2):
        assert side.abort_transfer(AbortTransferReqInput(migration_id=f"t{k}")).success
    before = len(side.replies)
    _start_transfer(side, ids, list(range(700, 764)), "t2")
    assert poll_until(side, lambda: len(side.replies) > before), "no transfer reply"
    assert side.replies[-1].success, side.replies[-1].message
