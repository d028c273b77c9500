"""The target's allocate: reserve slots for the tokens a rank lacks on every rank of a
stage, all or nothing; each rank's part carries its slots, a staging extent when the host
path's slots are fragmented, a mailbox slot for a same-host source, and its signed write
grant."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration import grants
from sglang_kv_migration.cp_owners import OwnerRun, owned_pages, pattern_digest
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import HOST, DataPath, TargetStaging
from sglang_kv_migration.server.diag.metrics import MigrationMetrics
from sglang_kv_migration.server.diag.trace import ms
from sglang_kv_migration.server.messages import (
    AllocateTokenForTransferReqInput,
    AllocateTokenForTransferReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext, check_peer_fingerprint, guarded
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.rank.pp_stages import refusal_of, refused_output
from sglang_kv_migration.server.target.mailbox_commits import SourceCommits
from sglang_kv_migration.server.target.pending import Allocation, GrantTerms, PendingMigrations
from sglang_kv_migration.wire.messages import (
    AllocatedRank,
)
from sglang_kv_migration.wire.moments import Moment, Phase
from sglang_kv_migration.wire.page_ranges import to_page_ranges

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Granted:
    """What one rank granted with an allocation's slots: what the pending migration keeps
    (`terms`), what the reply tells (the signed grant, the mailbox address), and how long
    granting took (the reply's `steps_ms`)."""

    terms: GrantTerms
    token: str  # the signed `grants.Grant`
    mailbox: str  # the grant's mailbox address ("": none granted)
    seconds: float


class TargetAllocations:
    """One rank's allocations, and the grants it signs for them."""

    def __init__(
        self,
        ctx: RankContext,
        identity: RankIdentity,
        paths: dict[str, DataPath],
        pending: PendingMigrations,
        source_commits: SourceCommits,
        metrics: MigrationMetrics,
        epoch_for: Callable[[Any], str],
        *,
        grant_ttl_s: float,
        verify_all: bool,
        staging: TargetStaging | None,
    ):
        self.ctx = ctx
        self.identity = identity
        self.paths = paths
        self.pending = pending
        self.source_commits = source_commits
        self.metrics = metrics
        self.epoch_for = epoch_for
        # Grants must expire well before the watchdog frees the slots they name.
        self.grant_ttl_s = min(grant_ttl_s, pending.timeout_s / 2)
        self.verify_all = verify_all  # --kv-migration-verify: check every commit's digest
        self.staging = staging  # the host path's staging arena (None: off)
        self.destinations: dict[str, str] = {}  # path name -> destination digest

    def allocate_token_for_transfer(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        """Reserve slots for the tokens it lacks on every rank, all or nothing."""
        if req.stage_refusal is not None:  # an earlier PP stage refused: so do we
            return refused_output(AllocateTokenForTransferReqOutput, req.stage_refusal)
        started = time.monotonic()
        local = guarded(lambda: self._allocate_on_rank(req), AllocateTokenForTransferReqOutput)
        outputs, first = self.ctx.first_failure_on_any_rank(local)
        if first is not None:
            # All or nothing: ranks that did allocate give it back (also a rank whose
            # own part failed after its slots were reserved).
            if self.pending.get(req.migration_id) is not None:
                self.pending.abort(req.migration_id, settled=True)
            self.metrics.outcome("target", Moment.ALLOCATE_FAILED)
            req.stage_refusal = refusal_of(first)  # later PP stages do not allocate
            return AllocateTokenForTransferReqOutput(
                success=False,
                migration_id=req.migration_id,
                message=first.message,
                error_kind=first.error_kind,
                server_epoch=self.epoch_for(req),  # a stale caller learns it is
            )
        self.metrics.outcome("target", Moment.ALLOCATED)
        self.metrics.phase(Phase.ALLOCATE, time.monotonic() - started)
        if req.source_commit:  # rank 0 says whether it granted a mailbox slot
            self.source_commits.mark(req.migration_id, outputs[0].source_commit)
        return AllocateTokenForTransferReqOutput(
            success=True,
            migration_id=outputs[0].migration_id,
            matched_token_size=outputs[0].matched_token_size,
            extra_token_size=outputs[0].extra_token_size,
            ranks=[rank for o in outputs for rank in o.ranks],
            path=outputs[0].path,
            page_size=outputs[0].page_size,
            server_epoch=self.epoch_for(req),
            source_commit=outputs[0].source_commit,
            steps_ms=outputs[0].steps_ms,
        )

    def _allocate_on_rank(
        self, req: AllocateTokenForTransferReqInput
    ) -> AllocateTokenForTransferReqOutput:
        """This rank's part of an allocate (raises; the caller turns errors into replies)."""
        self._check_allocatable(req)
        page_owners = self._checked_page_owners(req)
        path = self._path(req.path)
        started = time.perf_counter()
        granted: list[Granted] = []  # what the slots were granted with, once reserved

        def grant(alloc: Allocation) -> GrantTerms:
            granted.append(self._grant(req, alloc, path))
            return granted[0].terms

        alloc = self.pending.allocate(
            req.migration_id,
            req.input_ids,
            req.extra_key,
            req.extra_token_size,
            path=path,
            nothing_ok=req.nothing_ok,
            weight_version=req.weight_version,
            write_window_s=self.grant_ttl_s + path.late_write_margin_s,
            owners=page_owners,
            grant=grant,
        )
        allocated = time.perf_counter()
        given = granted[0] if granted else None
        granting_s = given.seconds if given is not None else 0.0
        rank = self._allocated_rank(req, alloc, given)
        return AllocateTokenForTransferReqOutput(
            # This rank's part (rank 0's is the reply's): the radix match and the
            # reservation, the slots listed, the grant signed.
            steps_ms={
                "match_reserve": ms(allocated - started - granting_s),
                "slots": ms(time.perf_counter() - allocated),
                "grant": ms(granting_s),
            },
            success=True,
            source_commit=bool(given is not None and given.mailbox),
            migration_id=alloc.migration_id if alloc.extra_length else "",
            matched_token_size=alloc.matched_length,
            extra_token_size=alloc.extra_length,
            ranks=[rank],
            path=path.name,
            page_size=self.identity.page_size,
            server_epoch=self.epoch_for(req),
        )

    def _grant(
        self, req: AllocateTokenForTransferReqInput, alloc: Allocation, path: DataPath
    ) -> Granted:
        """What this rank grants with the slots just reserved: the pages it owns (on an
        owner-sharded server), a staging extent for a fragmented host allocation, a
        mailbox slot for a same-host source, and the signed grant that binds them. When
        it raises, what it took goes back (the slots too: `PendingMigrations.allocate`)."""
        started = time.perf_counter()
        owned_tokens = None
        if alloc.owner_pattern is not None:
            # Owner-sharded: the source's twin of this rank writes only its own pages.
            owned_tokens = owned_pages(
                alloc.owner_pattern,
                self.identity.cp_rank,
                self.identity.page_size,
                alloc.extra_length,
            )
        verify = req.verify or self.verify_all
        # Feature "source_dp_rank": only that DP rank of the source may claim the grant,
        # and only its receipts settle or commit these slots.
        source_dp_rank = -1 if req.source_dp_rank is None else req.source_dp_rank
        with contextlib.ExitStack() as undo:
            extent = self._grant_staging(req, alloc, path)
            if extent is not None:
                undo.callback(self.staging.release, extent, None)
            mailbox, address = None, ""
            if req.source_commit and extent is None and not verify:
                # No mailbox for a staged write (it commits after a scatter, not in one
                # iteration) nor for a verified one: a mailbox commit has no reply, and the
                # client must hear when what landed fails its digest.
                mailbox, address = self.source_commits.grant_slot()
                if mailbox is not None:
                    undo.callback(self.source_commits.give_back, mailbox[0], None)
            token = self._sign_grant(req, alloc, path, extent, address, verify, source_dp_rank)
            undo.pop_all()  # kept with the pending migration from here on
        terms = GrantTerms(
            verify=verify,
            staging=extent,
            source=req.source_instance,
            grant=grants.grant_digest(token),
            source_dp_rank=source_dp_rank,
            mailbox=mailbox,
            owned_tokens=owned_tokens,
        )
        return Granted(terms, token, address, time.perf_counter() - started)

    def _check_allocatable(self, req: AllocateTokenForTransferReqInput) -> None:
        """Refuse a source of another layout, a released KV pool and a stale epoch."""
        fingerprint = self.identity.fingerprint_for(req)
        check_peer_fingerprint(fingerprint, req.source_fingerprints, role="source")
        if self.identity.memory_released:
            raise MigrationError(
                ErrorKind.UNAVAILABLE,
                "this server released its KV cache memory (/release_memory_occupation); "
                "migrate to it after /resume_memory_occupation",
            )
        if req.expect_epoch and req.expect_epoch != self.epoch_for(req):
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"this server's epoch is {self.epoch_for(req)}, not {req.expect_epoch}: it "
                "restarted, updated its weights or resumed its KV memory since that session "
                "info was read (read /get_transfer_session_info again)",
            )

    def _checked_page_owners(self, req: AllocateTokenForTransferReqInput) -> OwnerRun | None:
        """The source's owner of every page of the request (feature "owner_pattern"),
        checked as hostile input before anything is reserved: only an owner-sharded
        server takes it, and it must take it; one CP rank of this server per page."""
        owners, pattern = self.identity.cp_owners, req.page_owners
        if owners is None:
            if pattern is not None:
                raise MigrationError(
                    ErrorKind.BAD_REQUEST,
                    "page_owners is only for a target whose CP ranks own disjoint pages "
                    f"(attn_cp_mode=sharded); this server's is "
                    f"{self.identity.fingerprint.attn_cp_mode or 'not CP'!r}",
                )
            return None
        if pattern is None:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"page_owners is required: this server's CP ranks own disjoint pages "
                f"(cp_owner={owners.describe()}), and each page must land on its owner's "
                "twin (pass the source's size query page_owners)",
            )
        pages = len(req.input_ids) // self.identity.page_size
        if len(pattern) != pages:
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"page_owners has {len(pattern)} entries for the {pages} whole pages of "
                "input_ids: give one owner per page",
            )
        try:
            owners.check_pattern(pattern)
        except ValueError as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, f"page_owners: {e}") from None
        return OwnerRun(owners, tuple(pattern))

    def _allocated_rank(
        self, req: AllocateTokenForTransferReqInput, alloc: Allocation, granted: Granted | None
    ) -> AllocatedRank:
        """This rank's reserved slots, in the index format the request asks for, with
        what it granted for them."""
        tp, pp, page_size = self.ctx.tp_rank, self.ctx.pp_rank, self.identity.page_size
        token = granted.token if granted is not None else ""
        extent = granted.terms.staging if granted is not None else None
        staging = list(extent) if extent is not None else []
        if req.index_format == "pages":
            pages = alloc.kv_pages(page_size)
            return AllocatedRank(tp, pp, [], pages, grant=token, staging=staging)
        elif req.index_format == "ranges":  # [first_page, count] runs: page_ranges.py
            ranges = to_page_ranges(alloc.host_slots, page_size)
            return AllocatedRank(tp, pp, [], grant=token, staging=staging, kv_page_ranges=ranges)
        else:
            return AllocatedRank(tp, pp, alloc.kv_indices, grant=token, staging=staging)

    def _grant_staging(
        self, req: AllocateTokenForTransferReqInput, alloc: Allocation, path: DataPath
    ) -> tuple[int, int] | None:
        """A staging extent for a fragmented host allocation, kept with the pending
        migration; None when not asked, not fragmented or no room (never a failure)."""
        if self.staging is None or path.name != HOST or not (req.staging and alloc.extra_length):
            return None
        return self.staging.grant(alloc.slots, self.pending.clock())

    def _sign_grant(
        self,
        req: AllocateTokenForTransferReqInput,
        alloc: Allocation,
        path: DataPath,
        extent: tuple[int, int] | None,
        mailbox: str,
        verify: bool,
        source_dp_rank: int,
    ) -> str:
        """The signed write grant of this rank's slots."""
        expires_at = time.time() + self.grant_ttl_s
        return self.identity.signer.encode(
            grants.Grant(
                migration_id=alloc.migration_id,
                tp=self.ctx.tp_rank,
                pp=self.ctx.pp_rank,
                path=path.name,
                slots_digest=grants.slots_digest(alloc.host_slots),
                num_tokens=alloc.extra_length,
                expires_at=expires_at,
                tokens_digest=grants.request_tokens_digest(
                    req, alloc.matched_length + alloc.extra_length
                ),
                staging_addr=extent[0] if extent else 0,
                staging_length=extent[1] if extent else 0,
                # The source stops submitting bytes halfway through the late-write
                # margin; the other half bounds a batch already in flight.
                write_until=expires_at + path.late_write_margin_s / 2,
                verify=verify,
                destination=self._destination(path),
                source=req.source_instance,
                mailbox=mailbox,
                owners=_owners_digest(alloc.owner_pattern),
                source_dp_rank=source_dp_rank,
            )
        )

    def _destination(self, path: DataPath) -> str:
        """`grants.destination_digest` of what this rank publishes for `path` (fixed until
        the KV memory is resumed: buffers are registered and exported at start-up)."""
        digest = self.destinations.get(path.name)
        if digest is None:
            digest = self.destinations[path.name] = grants.destination_digest(path.advertise())
        return digest

    def _path(self, name: str) -> DataPath:
        path = self.paths.get(name)
        if path is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"data path {name!r} is not available on this server (available: "
                f"{', '.join(self.paths) or 'none'})",
            )
        return path


def _owners_digest(pattern: tuple[int, ...] | None) -> str:
    """What the grant binds of the reserved pages' owners ("" when not sharded)."""
    return "" if pattern is None else pattern_digest(pattern)
