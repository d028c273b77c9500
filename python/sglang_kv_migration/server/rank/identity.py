"""What one rank is to its peers: its host pool's geometry (and, with the host path on,
the layout of its buffers), its layout fingerprint, the server's instance id, its grant
signer, and whether its KV memory is released.

Built once by `server/scheduler/compose.py`; the source and target roles and the session
info read it, the loop's memory hooks change the two memory fields (`kv_memory_released`,
`kv_memory_resumed`)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sglang_kv_migration import grants, sglang_adapter
from sglang_kv_migration.cp_owners import PageOwners, cp_rank_of
from sglang_kv_migration.fingerprint import LayoutFingerprint
from sglang_kv_migration.paths import HostPoolLayout
from sglang_kv_migration.server.rank.context import RankContext

logger = logging.getLogger(__name__)

# What an unsigned fleet exposes. --api-key is named: operators expect it to protect the
# fleet, and it cannot (every client of /generate holds it, so it never signs).
_UNSIGNED_WARNING = (
    "KV migration grants are UNSIGNED (neither --kv-migration-grant-key nor --admin-api-key "
    "is set; --api-key never signs grants, every inference client holds it): any client that "
    "reaches the migration routes, or any peer on the transfer network, can forge a grant and "
    "overwrite KV in this server's host pool, including committed prefixes other requests "
    "reuse. Set --kv-migration-grant-key (the same on every server) or --admin-api-key."
)


@dataclass
class RankIdentity:
    host_pool: Any  # SGLang's host KV pool of this rank
    pool_buffer: sglang_adapter.HostPoolBuffer  # its page size, slot count, bytes per slot
    # Its buffers as the host path's writes address them; None with the host path off.
    layout: HostPoolLayout | None
    # Bytes one token takes over every pool of the host pool (an NSA model's group: the
    # KV and the indexer's keys).
    slot_bytes: int
    fingerprint: LayoutFingerprint  # this rank's layout, model and place in the server
    # A restarted server gets a new id: clients drop their cached session info. One for
    # the whole server: every PP stage's reply carries it.
    server_epoch: str
    signer: grants.Signer
    # Set while SGLang has unmapped the KV pool (memory saver): allocations refused.
    memory_released: bool = False
    # Bumped by every KV memory resume: part of the epoch clients see (`loop.py`).
    memory_generation: int = 0
    # An owner-sharded CP server's owner function (None: every CP rank holds every page)
    # and this rank's CP rank (the pages it holds, sends and writes).
    cp_owners: PageOwners | None = None
    cp_rank: int = 0

    @property
    def page_size(self) -> int:
        return self.pool_buffer.page_size

    @property
    def num_slots(self) -> int:
        """Token slots of the host pool (the most one transfer can name)."""
        return self.pool_buffer.num_slots

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank (every pool a page lives in)."""
        return self.slot_bytes

    def fingerprint_for(self, req: Any) -> LayoutFingerprint:
        """This rank's fingerprint with the weight version the request was stamped with."""
        return self.fingerprint.with_weight_version(req.weight_version)

    def kv_memory_released(self) -> None:
        """SGLang is about to unmap the KV pool: allocations are refused until resumed."""
        self.memory_released = True

    def kv_memory_resumed(self) -> int:
        """The KV pool is mapped again; returns the new memory generation."""
        self.memory_generation += 1
        self.memory_released = False
        return self.memory_generation


def open_identity(
    ctx: RankContext, grant_key: bytes | None, attn_cp_size: int, host_path: bool
) -> RankIdentity:
    """This rank's identity (one start-up collective over every rank: the server's id
    is the first rank's); the host pool's layout only for the host path (`host_path`)."""
    host_pool = sglang_adapter.host_pool(ctx.tree_cache)
    pool_buffer = sglang_adapter.host_pool_buffer(host_pool)
    # Every pool of the host pool, the NSA indexer's too (`paths/host/layout_nsa.py`).
    layout = HostPoolLayout.from_host_pool(host_pool)
    # None on stock SGLang (every CP rank holds every page); a sharding fork's hook.
    cp_owners = sglang_adapter.cp_page_owners(ctx.tree_cache, attn_cp_size)
    fingerprint = LayoutFingerprint.from_shape(
        sglang_adapter.kv_cache_shape(host_pool),
        model=ctx.model,
        tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank,
        pp_size=ctx.pp_size,
        pp_rank=ctx.pp_rank,
        attn_cp_size=attn_cp_size,
        cp_owners=cp_owners,
        model_name=ctx.model_name,
    )
    signer = grants.Signer(grant_key)
    if not signer.signed and ctx.tp_rank == 0:
        logger.warning(_UNSIGNED_WARNING)
    return RankIdentity(
        host_pool=host_pool,
        pool_buffer=pool_buffer,
        layout=layout if host_path else None,
        slot_bytes=sum(layout.item_lens),
        fingerprint=fingerprint,
        server_epoch=ctx.first_rank_value_on_world(ctx.launch_id or uuid.uuid4().hex),
        signer=signer,
        cp_owners=cp_owners,
        cp_rank=cp_rank_of(ctx.tp_rank, ctx.tp_size, attn_cp_size),
    )
