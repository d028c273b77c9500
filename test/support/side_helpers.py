"""Helpers for tests that drive a one-rank `MigrationSchedulerSide` directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def one_rank_context(
    cache: Any,
    model: str = "tiny",
    send_output: Callable[[Any, Any], None] | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> Any:
    """The `RankContext` of a server with one TP rank (no process group), over `cache`;
    replies go to `send_output` (dropped when None)."""
    from sglang_kv_migration.server.rank.context import RankContext

    return RankContext(
        tree_cache=cache,
        tp_rank=0,
        tp_size=1,
        pp_rank=pp_rank,
        pp_size=pp_size,
        cpu_group=None,
        model=model,
        send_output=send_output or (lambda out, req: None),
    )


def poll_until(side: Any, done: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Run `side`'s loop iterations (`poll`) until `done()` holds, at most `timeout_s` by
    the clock (not a count of iterations: on a loaded machine the transport's threads
    may get no CPU for many of them). True if it held."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        side.poll()
        if done():
            return True
        time.sleep(0.001)
    return done()


def allocate_on(side: Any, input_ids: list[int], migration_id: str, **fields: Any) -> Any:
    """`side`'s allocate reply for `input_ids` under `migration_id`, as a peer with this
    side's own layout asks it (`fields`: any other allocate field)."""
    from sglang_kv_migration.server.messages import AllocateTokenForTransferReqInput

    return side.allocate_token_for_transfer(
        AllocateTokenForTransferReqInput(
            input_ids=input_ids,
            migration_id=migration_id,
            source_fingerprints=[side.identity.fingerprint.to_dict()],
            **fields,
        )
    )


def transfer_to_self(
    side: object, input_ids: list[int], kv_indices: list[int], grant: str = "", **fields: object
):
    """A transfer request from `side` into its own host slots `kv_indices` (loopback),
    writing under `grant` (the allocate reply's `ranks[0].grant`)."""
    from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
    from targets import host_target

    if grant:
        # Loopback: the slots were allocated for another prefix on this same server (it
        # already holds `input_ids`), so re-issue the grant for the prefix actually sent,
        # as the target would have, signed with this server's key.
        import dataclasses

        from sglang_kv_migration import grants

        original, issued = grant, side.identity.signer.decode_grant(grant)
        grant = side.identity.signer.encode(
            dataclasses.replace(
                issued,
                tokens_digest=grants.tokens_digest(input_ids, fields.get("extra_key")),
                migration_id=fields.get("migration_id", issued.migration_id),
                # The loopback source is this same server, writing where it publishes.
                source=side.identity.server_epoch,
                destination=grants.destination_digest(side.paths["host"].advertise()),
            )
        )
        # The target binds receipts to the grant it issued: this re-issued one.
        pending = side.target.pending.get(issued.migration_id)
        if pending is not None and pending.grant == grants.grant_digest(original):
            pending.grant = grants.grant_digest(grant)
    target = host_target(
        0,
        0,
        side.paths["host"].advertise(),
        kv_indices=kv_indices,
        fingerprint=side.identity.fingerprint.to_dict(),
        grant=grant,
    )
    return TransferRequestKVCacheReqInput(
        input_ids=input_ids,
        matched_token_size=0,
        extra_token_size=len(kv_indices),
        target_per_rank=[target],
        **fields,
    )


def receipts_for(side: object, allocation: object, success: bool = True) -> list[str]:
    """Receipts a source would return for `allocation` (an allocate reply), signed with
    `side`'s key: for tests of what happens after a transfer, without running one."""
    import torch
    from sglang_kv_migration import grants

    # From the source the grant names (this same server, unless allocate named another).
    granted = [side.identity.signer.decode_grant(r.grant) for r in allocation.ranks if r.grant]
    source = granted[0].source if granted else side.identity.server_epoch
    receipts = []
    for rank in allocation.ranks:
        slots = torch.tensor(rank.kv_indices, dtype=torch.int64)
        receipt = grants.Receipt(
            migration_id=allocation.migration_id,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            path=allocation.path or "host",
            slots_digest=grants.slots_digest(slots),
            success=success,
            bytes=0,
            settled=True,
            source=source,
            grant=grants.grant_digest(rank.grant) if rank.grant else "",
        )
        receipts.append(side.identity.signer.encode(receipt))
    return receipts


class SilentTarget:
    """A `ChannelCaller` (feature "source_allocate") whose target answers only when the
    test puts `(call id, reply bytes)` into `answers`."""

    CALL_ID = b"c" * 16

    def __init__(self) -> None:
        self.answers: list[tuple[bytes, bytes]] = []
        self.pending: set[bytes] = set()

    def call(self, address: str, secret: str, allocate: bytes, ids: bytes = b"") -> bytes:
        self.pending.add(self.CALL_ID)
        return self.CALL_ID

    @property
    def waiting(self) -> int:
        return len(self.pending)

    def replies(self) -> list[tuple[bytes, bytes]]:
        found, self.answers = self.answers, []
        return found

    def gone(self) -> list[bytes]:
        return []

    def forget(self, call_id: bytes) -> None:
        self.pending.discard(call_id)

    def close(self) -> None:
        pass
