"""What a rank publishes to its peers and clients: its session info (the data paths'
addresses, its layout fingerprint, the server's epoch and features) and how much of a
prefix it already holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths.base import HOST, DataPath, TargetStaging
from sglang_kv_migration.server.messages import (
    GetRequestExtraTokenSizeReqInput,
    GetRequestExtraTokenSizeReqOutput,
    GetTransferSessionInfoReqInput,
    GetTransferSessionInfoReqOutput,
)
from sglang_kv_migration.server.rank.context import RankContext, guarded
from sglang_kv_migration.server.rank.identity import RankIdentity
from sglang_kv_migration.server.source.running_slots import RunningSlots
from sglang_kv_migration.wire import features as wire_features
from sglang_kv_migration.wire.host_fields import HOST_FIELD_NAMES
from sglang_kv_migration.wire.messages import RankSessionInfo
from sglang_kv_migration.wire.version import PROTOCOL_VERSION


class SessionInfo:
    """The two read-only operations of one rank."""

    def __init__(
        self,
        ctx: RankContext,
        identity: RankIdentity,
        paths: dict[str, DataPath],
        epoch_for: Callable[[Any], str],
        *,
        features: list[str],
        allocate_channel: dict[str, str],
        staging: TargetStaging | None,
        running_slots: RunningSlots | None,
    ):
        self.ctx = ctx
        self.identity = identity
        self.paths = paths
        self.epoch_for = epoch_for
        # The optional features the roles offer (`SourceTransfers.features`,
        # `TargetRole.features`), after those every server lists.
        self.features = [*wire_features.ALWAYS, *features]
        # Feature "source_allocate": the target's allocate channel ({}: none).
        self.allocate_channel = allocate_channel
        self.staging = staging  # the host path's staging arena (None: off)
        self.running_slots = running_slots  # feature "running_slots" (None: off)

    def get_transfer_session_info(
        self, req: GetTransferSessionInfoReqInput
    ) -> GetTransferSessionInfoReqOutput:
        host = self.paths[HOST].advertise() if HOST in self.paths else {}
        staging = self.staging
        local = RankSessionInfo(
            tp_rank=self.ctx.tp_rank,
            pp_rank=self.ctx.pp_rank,
            **{name: host[name] for name in HOST_FIELD_NAMES if name in host},
            page_size=self.identity.page_size,
            fingerprint=self.identity.fingerprint_for(req).to_dict(),
            paths={name: path.advertise() for name, path in self.paths.items()},
            server_epoch=self.epoch_for(req),
            stage_writer=HOST in self.paths,
            staging_region=staging.region if staging is not None else [],
        )
        ranks = self.ctx.all_gather(local)
        return GetTransferSessionInfoReqOutput(
            success=True,
            ranks=ranks,
            protocol_version=PROTOCOL_VERSION,
            server_epoch=self.epoch_for(req),
            features=list(self.features),
            instance_id=self.identity.server_epoch,
            allocate_channel=dict(self.allocate_channel),
        )

    def get_request_extra_token_size(
        self, req: GetRequestExtraTokenSizeReqInput
    ) -> GetRequestExtraTokenSizeReqOutput:
        def run() -> GetRequestExtraTokenSizeReqOutput:
            cache = self.ctx.tree_cache
            total = len(sglang_adapter.make_key(cache, req.input_ids, req.extra_key))
            held = sglang_adapter.match_held_prefix(cache, req.input_ids, req.extra_key)
            return GetRequestExtraTokenSizeReqOutput(
                success=True,
                matched_token_size=held.length,
                extra_token_size=total - held.length,
                total_token_size=total,
                device_token_size=held.device_length,
                host_headroom_tokens=(
                    sglang_adapter.host_headroom_tokens(cache) if req.headroom else -1
                ),
                server_epoch=self.epoch_for(req),
                running_token_size=self._running_held(req),
                page_owners=self._page_owners(req),
            )

        # The tree is identical on every TP rank: no exchange needed.
        return guarded(run, GetRequestExtraTokenSizeReqOutput)

    def _page_owners(self, req: GetRequestExtraTokenSizeReqInput) -> list[int] | None:
        """Feature "owner_pattern": on an owner-sharded CP server, the owner of each page
        of the device prefix (identical on every rank: one allocator state); else None."""
        owners = self.identity.cp_owners
        if owners is None:
            return None
        return sglang_adapter.device_prefix_owners(
            self.ctx.tree_cache, owners, req.input_ids, req.extra_key
        )

    def _running_held(self, req: GetRequestExtraTokenSizeReqInput) -> int:
        """Feature "running_slots": what the running request `running_rid` holds of the
        ids in its own slots (-1: not asked, or it does not run here)."""
        running = self.running_slots
        if not req.running_rid or running is None:
            return -1
        return running.held(req.running_rid, req.input_ids)
