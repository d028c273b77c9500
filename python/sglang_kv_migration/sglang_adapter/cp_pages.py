"""The owner pattern of a prefix on an owner-sharded CP server (`cp_owners.py`): which CP
rank holds the bytes of each of its pages, read off the device page ids the radix tree
keeps for it. Called on the scheduler thread.

Only the device part of a prefix has page ids: a page held on host only lost the id its
owner was decided by (a sharding fork keeps that record inside its own host nodes, which
the plugin does not read), so a run that reaches past the device prefix is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_kv_migration.cp_owners import PageOwners
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.sglang_adapter.radix_tree import match_device_prefix

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


def device_prefix_owners(
    cache: HiRadixCache, owners: PageOwners, input_ids: list[int], extra_key: str | None
) -> list[int]:
    """The owner of every page of the page-aligned prefix of `input_ids` held on device,
    in prefix order (what the size query reports)."""
    prefix = match_device_prefix(cache, input_ids, extra_key)
    page_size = int(cache.page_size)
    return owners.owners((prefix.indices[::page_size] // page_size).tolist())


def run_owners(
    cache: HiRadixCache,
    owners: PageOwners,
    input_ids: list[int],
    extra_key: str | None,
    start: int,
    end: int,
) -> list[int]:
    """The owners of the pages of tokens [start, end) (whole pages) of `input_ids`, as
    this server holds them on device now; CONFLICT when it does not hold them all there."""
    prefix = match_device_prefix(cache, input_ids[:end], extra_key)
    if prefix.length < end:
        raise MigrationError(
            ErrorKind.CONFLICT,
            f"owner-sharded source holds {prefix.length} of {end} tokens on device: the "
            f"owners (cp_owner={owners.describe()}) of pages held on host only are not "
            "known here, so they cannot be sent",
        )
    page_size = int(cache.page_size)
    pages = prefix.indices[start:end:page_size] // page_size
    return owners.owners(pages.tolist())
