"""What a transfer request must pass on a source rank before any byte moves: its size,
its target entries (slots, layout, data path) and the grant each carries; and the target's
allocate reply (feature "source_allocate"), read through the wire model.

The body's shape was checked where it arrived (`wire/bodies.py`, or
`AllocateReply.from_dict` for what a target's channel answered); what is checked here
needs this rank: its pools' size, its page size, its layout, its paths and its key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from sglang_kv_migration import grants
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.fingerprint import LayoutFingerprint
from sglang_kv_migration.paths.base import DEVICE, DataPath, SendRange
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.rank.context import RankContext, check_peer_fingerprint
from sglang_kv_migration.server.source.inflight import (
    GrantClaim,
    InflightTransfer,
    OwnSlots,
    SourceCommit,
    TokensDigest,
)
from sglang_kv_migration.server.source.known_destinations import KnownDestinations
from sglang_kv_migration.server.source.running_slots import RunningSlots
from sglang_kv_migration.wire import page_ranges
from sglang_kv_migration.wire.messages import AllocateReply, TransferRequestKVCacheTarget

if TYPE_CHECKING:
    import torch


# (transfer, its verified grant, a running request's slots or None) -> the owner of each
# page of the transfer's run on this source.
OwnerPatternOf = Callable[
    [TransferRequestKVCacheReqInput, grants.Grant, "torch.Tensor | None"], tuple[int, ...]
]


@dataclass(frozen=True)
class CheckedTarget:
    """A target entry that passed `TransferChecks.check_target`."""

    slots: torch.Tensor
    digest: str  # of the slots
    grant: grants.Grant


class TransferChecks:
    """The checks of one source rank; `paths` may be replaced (a test adds a path)."""

    def __init__(
        self,
        ctx: RankContext,
        fingerprint: LayoutFingerprint,
        server_fingerprints: Mapping[tuple[int, int], LayoutFingerprint],
        paths: Mapping[str, DataPath],
        signer: grants.Signer,
        server_epoch: str,
        max_tokens: int,
        destinations: KnownDestinations | None,
        delivers: bool,
        running_slots: RunningSlots | None = None,
        owner_pattern: OwnerPatternOf | None = None,
        cp_rank: int = 0,
    ):
        self.ctx = ctx
        self.fingerprint = fingerprint
        # Every (tp, pp) rank's layout, for stage 0's checks of later stages' entries.
        self.server_fingerprints = server_fingerprints
        self.paths = paths
        self.signer = signer
        self.server_epoch = server_epoch
        self.max_tokens = max_tokens  # the most slots one transfer can name (host pool)
        self.destinations = destinations
        self.delivers = delivers  # feature "source_commit": a mailbox deliverer exists
        self.running_slots = running_slots  # feature "running_slots" (None: off)
        self.used_grants = grants.UsedGrants()
        # Owner-sharded CP: the owner of each page of a transfer's run, checked against
        # its grant (`owned_pages.run_pattern`), and this rank's CP rank, whose pages it
        # sends. None: every CP rank holds every page.
        self.owner_pattern = owner_pattern
        self.cp_rank = cp_rank

    def check_size(self, req: TransferRequestKVCacheReqInput) -> None:
        """Refuse, before any per-token work, a range no pool of this server could hold
        (the host pool is larger than the device pool, and holds every page sent)."""
        end = req.matched_token_size + req.extra_token_size
        if req.extra_token_size > self.max_tokens or end > len(req.input_ids):
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"extra_token_size={req.extra_token_size} from {req.matched_token_size} is "
                f"more than this server can send ({self.max_tokens} slots) or than "
                f"input_ids holds ({len(req.input_ids)})",
            )

    def parse_own_slots(
        self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer
    ) -> None:
        """This rank's slots, parsed once: even a refused transfer's receipt names them."""
        for target in req.target_per_rank:
            if (target.tp, target.pp) == (self.ctx.tp_rank, self.ctx.pp_rank):
                self.check_size(req)
                slots = target_slots(target, self.fingerprint.shape.page_size, req.extra_token_size)
                inflight.slots_parsed(OwnSlots(slots, grants.slots_digest(slots)))
                return

    def validate(self, req: TransferRequestKVCacheReqInput, inflight: InflightTransfer) -> None:
        """Check this rank's entry (and, on stage 0, every later stage's), claim the
        grant and describe this rank's part of the send in `inflight`."""
        self.check_size(req)
        by_rank = {(t.tp, t.pp): t for t in req.target_per_rank}
        me = (self.ctx.tp_rank, self.ctx.pp_rank)
        target = by_rank.get(me)
        # One digest of the prefix for every entry checked (one pass over the tokens),
        # or the one taken while the target allocated.
        end = req.matched_token_size + req.extra_token_size
        taken = inflight.tokens
        if taken is None or taken.count != end:
            taken = TokensDigest(end, grants.request_tokens_digest(req, end))
        if self.ctx.first_stage:
            # IMPORTANT: stage 0 checks every later stage's entry too (structure,
            # fingerprint, grant), so a later stage cannot refuse after this one pinned
            # and wrote: stages see the request one after the other (`pp_stages.py`).
            for position, fingerprint in sorted(self.server_fingerprints.items()):
                if position != me and position[1] != self.ctx.pp_rank:
                    self.check_target(
                        req, by_rank.get(position), position, fingerprint, taken.digest
                    )
        checked = self.check_target(
            req, target, me, self.fingerprint, taken.digest, inflight.own_slots
        )
        grant = checked.grant
        # IMPORTANT: a running request is looked at only now, with the grant verified:
        # a caller without one learns nothing about it. And before the grant is claimed:
        # a refusal here (or below) leaves it for a correct retry.
        source_slots, slots_lost = self._running_source_slots(req)
        owner_pattern = None
        if self.owner_pattern is not None:
            owner_pattern = self.owner_pattern(req, grant, source_slots)
        self.used_grants.claim(grant)
        inflight.claimed(
            GrantClaim(
                grants.grant_digest(target.grant),
                grant.expires_at,
                self.ctx.dp_rank if grant.source_dp_rank >= 0 else -1,
            )
        )
        if self.destinations is not None and DEVICE in self.paths:
            # Kept only now that a verified grant names it: a refused body keeps nothing.
            self.destinations.remember(target, grant.destination)
        commit = None
        if grant.mailbox and self.delivers and self.ctx.pp_size == 1:
            commit = SourceCommit(grant.mailbox, grant.write_until or grant.expires_at)
        start = req.matched_token_size
        send = SendRange(
            input_ids=req.input_ids,
            extra_key=req.extra_key,
            start=start,
            end=start + req.extra_token_size,
            target=target,
            target_slots=checked.slots,
            migration_id=req.migration_id,
            start_by=grant.expires_at,
            write_until=grant.write_until or float("inf"),
            verify=grant.verify,
            partial_ok=req.partial_ok,
            prepared=inflight.prepared,
            source_slots=source_slots,
            owner_pattern=owner_pattern,
            cp_rank=self.cp_rank,
        )
        inflight.checked(self.paths[target.path], send, commit, slots_lost)

    def _running_source_slots(
        self, req: TransferRequestKVCacheReqInput
    ) -> tuple[torch.Tensor | None, Callable[[], MigrationError | None] | None]:
        """Feature "running_slots": the device slots of the range, read from the running
        request the body names (checked against its ids), and the test of whether they
        may no longer be its own (the transfer fails, once its copy is done, unless the
        request still holds them); (None, None) without `running_rid`."""
        if not req.running_rid:
            return None, None
        if self.running_slots is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                "running_rid needs a source with one PP stage and one DP rank (feature "
                '"running_slots"): migrate from the radix tree instead',
            )
        end = req.matched_token_size + req.extra_token_size
        running_slots = self.running_slots
        running = running_slots.check(req.running_rid, req.input_ids, end)
        slots = running_slots.slots(running, 0, end)
        return slots, lambda: running_slots.lost(running, end)

    def check_target(
        self,
        req: TransferRequestKVCacheReqInput,
        target: TransferRequestKVCacheTarget | None,
        position: tuple[int, int],
        fingerprint: LayoutFingerprint,
        tokens_digest: str,
        own: OwnSlots | None = None,
    ) -> CheckedTarget:
        """Check the target entry of source rank `position` (whose layout is
        `fingerprint`) against the prefix's `tokens_digest` (`own`: its slots, parsed)."""
        tp, pp = position
        if target is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST, f"target_per_rank has no entry for tp={tp} pp={pp}"
            )
        if own is None:
            slots = target_slots(target, fingerprint.shape.page_size, req.extra_token_size)
            own = OwnSlots(slots, grants.slots_digest(slots))
        if target.path not in self.paths:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"data path {target.path!r} is not available on this source (available: "
                f"{', '.join(self.paths) or 'none'})",
            )
        mine = fingerprint.with_weight_version(req.weight_version)
        check_peer_fingerprint(mine, [target.fingerprint], role="target")
        # IMPORTANT: write only what the target granted, checked without trusting the
        # client: this migration, this rank, this path, exactly these slots, in time, once.
        if not target.grant:
            raise MigrationError(
                ErrorKind.FORBIDDEN,
                f"write refused: no grant for tp={tp} pp={pp} (pass the allocate "
                "reply's grant); nothing was written",
            )
        grant = self.signer.check_grant(
            target.grant,
            migration_id=req.migration_id,
            tp=tp,
            pp=pp,
            path=target.path,
            num_slots=len(own.slots),
            slots=own.digest,
            tokens=tokens_digest,
            # A staging extent is written only if granted (its shape: `wire/bodies.py`).
            staging=(target.staging[0], target.staging[1]) if target.staging else None,
            # Where the body says the bytes go must be what the target published, and
            # the grant must have been issued to this server.
            destination=self._destination_digest(target),
            source=self.server_epoch,
            dp_rank=self.ctx.dp_rank,
        )
        return CheckedTarget(own.slots, own.digest, grant)

    def _destination_digest(self, target: TransferRequestKVCacheTarget) -> str:
        descriptor = self.paths[target.path].destination_of(target)
        if self.destinations is not None:
            return self.destinations.digest_of(descriptor)
        return grants.destination_digest(descriptor)


def target_slots(
    target: TransferRequestKVCacheTarget, page_size: int, num_tokens: int
) -> torch.Tensor:
    """The target rank's token slots, from `kv_indices` or from whole pages: `kv_pages`,
    or `kv_page_ranges` runs (`wire/page_ranges.py`); exactly `num_tokens` of them. (That it
    names one of them, and each run's shape: `wire/bodies.py`, `AllocatedRank.from_dict`.)

    IMPORTANT: the count is checked from the lists' lengths and the runs' counts before
    anything is expanded: a few bytes of runs can name gigabytes of slots."""
    _check_slot_count(target, page_size, num_tokens)
    if target.kv_pages or target.kv_page_ranges:
        try:
            pages = (
                page_ranges.pages_from_ranges(target.kv_page_ranges)
                if target.kv_page_ranges
                else _int64_tensor(target.kv_pages, "kv_pages")
            )
        except ValueError as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, str(e)) from None
        return page_ranges.slots_from_pages(pages, page_size)
    return _int64_tensor(target.kv_indices, "kv_indices")


def _check_slot_count(
    target: TransferRequestKVCacheTarget, page_size: int, num_tokens: int
) -> None:
    """BAD_REQUEST unless the entry names exactly `num_tokens` slots, by arithmetic."""
    if target.kv_page_ranges:
        name = "kv_page_ranges"
        count = page_ranges.count_pages(target.kv_page_ranges) * page_size
    elif target.kv_pages:
        name, count = "kv_pages", len(target.kv_pages) * page_size
    else:
        name, count = "kv_indices", len(target.kv_indices)
    if count != num_tokens:
        raise MigrationError(
            ErrorKind.BAD_REQUEST,
            f"target rank tp={target.tp} pp={target.pp}: {name} name {count} slots "
            f"(page_size={page_size}) for extra_token_size={num_tokens}",
        )


def _int64_tensor(values: list[int], name: str) -> torch.Tensor:
    """An int64 tensor of a list of ints (the HTTP layer checked they are). Through numpy:
    a third of `torch.tensor`'s time on a list, and this runs on the scheduler thread."""
    import numpy as np
    import torch

    try:
        return torch.from_numpy(np.array(values, dtype=np.int64))
    except OverflowError as e:  # a bad request, as torch.tensor's ValueError was
        raise ValueError(f"{name}: {e}") from None


# --------------------------------------------------------------------------- source_allocate


def read_allocation(reply: bytes) -> tuple[dict, AllocateReply]:
    """The target's allocate reply: as it answered (the transfer's reply echoes it) and
    checked (`AllocateReply.from_dict`; the grant and slots are checked by
    `TransferChecks.check_target` as for any client-relayed allocation)."""
    try:
        answer = orjson.loads(reply)
    except orjson.JSONDecodeError:
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED, "the target's allocate reply is not JSON"
        ) from None
    try:
        return answer, AllocateReply.from_dict(answer)
    except ValueError as e:
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED, f"the target's allocate reply is malformed: {e}"
        ) from None


def refusal_of(allocation: AllocateReply) -> MigrationError:
    """The target refused the allocate: its error kind, as ours (INTERNAL for one we
    do not know)."""
    try:
        kind = ErrorKind(allocation.error_kind)
    except ValueError:
        kind = ErrorKind.INTERNAL
    return MigrationError(kind, f"the target refused the allocate: {allocation.message}")


def granted_target(
    template: TransferRequestKVCacheTarget, allocation: AllocateReply
) -> TransferRequestKVCacheTarget:
    """The body's one target rank with the slots, grant and staging the target's reply
    gave it (counts and the grant are checked by `check_target`)."""
    if len(allocation.ranks) != 1:
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED,
            f"the target's allocate reply is malformed: {len(allocation.ranks)} ranks for one",
        )
    [granted] = allocation.ranks
    if (granted.tp_rank, granted.pp_rank) != (template.tp, template.pp):
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED, "the target's allocate reply names another rank"
        )
    if granted.staging and template.path != "host":
        raise MigrationError(
            ErrorKind.TRANSFER_FAILED,
            f"the target's allocate reply grants staging on path {template.path!r}",
        )
    return dataclasses.replace(
        template,
        grant=granted.grant,
        kv_indices=granted.kv_indices,
        kv_pages=granted.kv_pages,
        kv_page_ranges=granted.kv_page_ranges,
        staging=granted.staging,
    )
