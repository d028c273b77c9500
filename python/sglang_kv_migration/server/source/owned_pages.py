"""Which pages of a transfer this source rank sends on an owner-sharded CP server
(`cp_owners.py`): the run's owner pattern as this server holds it now, checked against the
one the target allocated with (its grant binds the pattern's digest), before any byte
moves. Each rank then sends only the pages it owns; the target's ranks each receive their
own, and every target rank commits the whole run (the tree is the same on all of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_kv_migration import grants, sglang_adapter
from sglang_kv_migration.cp_owners import PageOwners, pattern_digest
from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput


def run_pattern(
    cache: HiRadixCache,
    owners: PageOwners,
    req: TransferRequestKVCacheReqInput,
    grant: grants.Grant,
    source_slots: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """The owner of each page of the transfer's run on this server (`owners`: its owner
    function), equal to what the target allocated (CONFLICT otherwise, nothing sent).
    `source_slots`: the device slots of a running request's tokens (feature
    "running_slots") instead of the tree's."""
    where = f"cp_owner={owners.describe()}"
    if not grant.owners:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"this source's CP ranks own disjoint pages ({where}) but the target allocated "
            "without page_owners (pass the size query's page_owners to allocate); nothing "
            "was written",
        )
    start = req.matched_token_size
    end = start + req.extra_token_size
    if source_slots is not None:
        page_size = int(cache.page_size)
        pattern = owners.owners((source_slots[start:end:page_size] // page_size).tolist())
    else:
        pattern = sglang_adapter.run_owners(cache, owners, req.input_ids, req.extra_key, start, end)
    if pattern_digest(pattern) != grant.owners:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"the owners ({where}) of tokens [{start}, {end}) on this source are not those "
            "the target allocated for: the prefix moved on this source since its size query "
            "(measure again); nothing was written",
        )
    return tuple(pattern)
