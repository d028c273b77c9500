"""The pieces of a transfer's reply on a source rank that need no state of the rank:
the reply itself (`transfer_output`), each rank's result and signed receipt, the grants
they claimed, the checks of the gathered statuses, the trace steps of a transfer whose
target allocated (feature "source_allocate") and the log text."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind
from sglang_kv_migration.server.diag.trace import ms
from sglang_kv_migration.server.messages import (
    TransferRequestKVCacheReqInput,
    TransferRequestKVCacheReqOutput,
)
from sglang_kv_migration.server.source.inflight import InflightTransfer, RankTransferStatus
from sglang_kv_migration.wire.messages import RankTransferResult


def transfer_output(
    inflight: InflightTransfer,
    statuses: list[RankTransferStatus],
    failed: RankTransferStatus | None,
    pp_rank: int,
    server_epoch: str,
    delivered: bool,
) -> TransferRequestKVCacheReqOutput:
    """The reply of a transfer every rank of the stage is done with (`statuses`, in
    tp_rank order; `failed`: the failure it reports, None when it succeeded)."""
    req = inflight.request
    return TransferRequestKVCacheReqOutput(
        success=failed is None,
        message=failed.message if failed is not None else "",
        error_kind=failed.error_kind if failed is not None else "",
        transferred_token_size=statuses[0].tokens if failed is None else 0,
        transferred_bytes=sum(s.bytes for s in statuses) if failed is None else 0,
        ranks=rank_results(statuses, pp_rank),
        path=path_name(req),
        server_epoch=server_epoch,
        delivered=delivered,
        allocation=inflight.allocation,
        channel_error=inflight.channel_error,
        destination_unknown=inflight.destination_unknown,
        claims=claims_of(statuses, req.migration_id, pp_rank),
        rid=req.rid,  # the tokenizer side matches concurrent transfers by rid
    )


def signed_receipt(
    inflight: InflightTransfer,
    status: RankTransferStatus,
    signer: grants.Signer,
    tp_rank: int,
    pp_rank: int,
    source: str,
) -> str:
    """This rank's receipt of a transfer that is over here (`status` done), signed;
    `source`: this server's instance id."""
    send, job, claim = inflight.send, inflight.job, inflight.claim
    return signer.encode(
        grants.Receipt(
            migration_id=inflight.request.migration_id,
            tp=tp_rank,
            pp=pp_rank,
            path=send.target.path if send is not None else "",
            slots_digest=inflight.slots_digest,
            success=status.success,
            bytes=status.bytes,
            # Nothing more can land once done, or if no write was ever submitted
            # under the grant: only its claimant knows (a refused replay does not).
            settled=claim is not None
            and (status.success or job is None or not job.started_writing),
            grant=claim.digest if claim is not None else "",
            dp_rank=claim.dp_rank if claim is not None else -1,
            # Told only to a target that granted an extent: it must scatter then.
            plan=status.plan if send is not None and send.target.staging else "",
            digest=status.digest,
            source=source,
            tokens=receipt_tokens(status, inflight.request),
        )
    )


def rank_results(statuses: list[RankTransferStatus], pp_rank: int) -> list[RankTransferResult]:
    """The reply's `ranks`; `statuses` come from one stage's TP group, in tp_rank order."""
    return [
        RankTransferResult(
            tp_rank=i,
            pp_rank=pp_rank,
            success=s.success,
            bytes=s.bytes,
            seconds=s.seconds,
            message=s.message,
            receipt=s.receipt,
            plan=s.plan,
            entries=s.entries,
            steps_ms={k: round(v * 1e3, 2) for k, v in s.steps.items()},
        )
        for i, s in enumerate(statuses)
    ]


def claims_of(statuses: list[RankTransferStatus], migration_id: str, pp_rank: int) -> list:
    """The reply's `claims` (internal): per rank of the stage, its grant of the migration
    and until when the rank's request holds it (0: it claimed none). The HTTP layer of a
    server with DP ranks lets no other DP rank claim them (`server/http/grant_claims.py`)."""
    return [[migration_id, tp, pp_rank, s.claimed_until] for tp, s in enumerate(statuses)]


def allocate_steps(inflight: InflightTransfer, handled: float, now: float) -> dict[str, float]:
    """Feature "source_allocate": the target's part of the reply's `waited` (`allocate`),
    ms, and the steps after its answer; none for a transfer that did not allocate."""
    times = inflight.timings
    if not times.allocated:
        return {}
    steps = {"allocate": ms(times.allocated - handled)}
    if times.answered and times.launched and times.finished:
        # After the answer: its poll up to it (`answer`), the checks, match and launch
        # (`start`), until the copy was seen done (`copy_wait`), then the receipts, the
        # mailbox and the reply (`finish`).
        steps["answer"] = ms(times.answered - max(times.allocated, handled))
        steps["start"] = ms(times.launched - times.answered)
        steps["copy_wait"] = ms(times.finished - times.launched)
        steps["finish"] = ms(now - times.finished)
    # ... and of it the target's own steps (`queued`: behind other work there).
    checked = inflight.allocate.reply if inflight.allocate is not None else None
    if checked is not None:
        steps.update(_target_steps(checked.steps_ms))
    return steps


_TARGET_STEPS = ("queued", "scheduler", "match_reserve", "slots", "grant", "iteration")


def _target_steps(steps: dict[str, Any]) -> dict[str, float]:
    """The target's allocate steps as `target_<step>` (only known ones, as numbers: the
    reply is the target's word)."""
    return {
        f"target_{k}": float(steps[k])
        for k in _TARGET_STEPS
        if isinstance(steps.get(k), int | float) and not isinstance(steps[k], bool)
    }


def uneven_lengths(statuses: list[RankTransferStatus]) -> list[RankTransferStatus]:
    """A failure when the ranks wrote different lengths: identical trees cut a partial
    send alike on every rank, and no reply may name a length some rank did not write
    (the target's commit checks the receipts too)."""
    lengths = sorted({s.tokens for s in statuses})
    if len(lengths) == 1:
        return []
    message = f"ranks wrote different lengths of a partial transfer: {lengths}"
    return [
        dataclasses.replace(
            statuses[0], success=False, message=message, error_kind=ErrorKind.INTERNAL.value
        )
    ]


def receipt_tokens(status: RankTransferStatus, req: TransferRequestKVCacheReqInput) -> int:
    """The receipt's `tokens`: how many were written when a partial transfer wrote fewer
    than granted (only a target that lists "partial_transfer" gets one), else -1."""
    if status.success and req.partial_ok and status.tokens < req.extra_token_size:
        return status.tokens
    return -1


def steps_text(steps: Mapping[str, float]) -> str:
    """ ", this rank: host_copies 1.2 ms, probe 0.0 ms, ..." for the log line."""
    if not steps:
        return ""
    return ", this rank: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in steps.items())


def path_name(req: TransferRequestKVCacheReqInput) -> str:
    return req.target_per_rank[0].path if req.target_per_rank else ""
