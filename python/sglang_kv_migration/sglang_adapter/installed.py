"""Which SGLang this process runs on, decided once, by what the installed package has.

The plugin runs on two lines of SGLang whose caches differ in kind, not in detail:

- ``0.5.12``: ``HiRadixCache`` (``mem_cache/hiradix_cache.py``), a radix tree of Python
  ``TreeNode`` objects with their device and host values, and the host pools of
  ``mem_cache/memory_pool_host.py``. What this line needs is in ``radix_tree.py`` and
  ``pools.py``.
- ``0.5.23``: ``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``) with HiCache
  attached by ``init_hicache``; its tree lives in a tree core (a Rust extension by
  default) reached only by node ids, and every host pool sits in a ``HostPoolGroup`` of
  ``mem_cache/pool_host/``. What this line needs is in ``unified_tree.py`` and
  ``unified_pools.py``.

The line is read off the installed package's files (never by importing it, so the
check is free in every SGLang process): ``sglang_adapter/__init__.py`` binds each
version-dependent function once, from here. Nothing outside `sglang_adapter/` asks
which line runs; what one line lacks is refused at start (`server_args_refusal`,
`device_path_missing`, `unified_tree.cache_unsupported`), naming it.

How the plugin behaves differently on 0.5.23, and why each is safe:

- IPC (`ipc_messages.py`): messages are msgspec structs registered with SGLang's msgpack
  decoder; they cross pickled (SGLang's default) or msgpack-encoded alike.
- Server args (`server_config.py`): the record keeps the operator's input; the plugin
  reads what resolution decided, and the weight version from the serving config (a
  weight update changes it there only: read from the record, a source's KV computed
  with old weights would pass the weight-version check).
- Pinning a source's host pages (`unified_tree.pin_host_pages`) backs the path up to
  host and waits for the copy before it returns, on the scheduler thread (0.5.23 has no
  public call that starts one node's copy to poll later): a device-only prefix costs its
  device -> host copy in that iteration instead of overlapping later ones. Every TP
  rank runs it in the same order (its write-back check may all-reduce over them).
- Host headroom (`unified_pools.host_headroom_tokens`) counts free host slots only: the
  tree core does not say what host eviction would free, so planners see a lower bound;
  an allocate still evicts unlocked host-only pages when it needs them, and when even
  that is not enough it fails after evicting them (cached pages lost, nothing wrong).
- The cache generation (`unified_tree.cache_generation`) is the identity of the cache's
  write-through table, which only a reset replaces (`_reset_full`); the contract tests
  check that it changes on a reset and on nothing else.
- Inserts: 0.5.23's tree frees the duplicates of an insert itself (device) and keeps one
  page hash per host page; `unified_tree` passes what each needs (`prev_prefix_len`,
  the hashes), so no slot is freed twice and no node split fails.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

HIRADIX_LINE = "0.5.12"
UNIFIED_LINE = "0.5.23"
SUPPORTED_LINES = (HIRADIX_LINE, UNIFIED_LINE)

# The file that defines each line's cache, under the sglang package (one per line).
_LINE_FILES = {
    HIRADIX_LINE: ("srt", "mem_cache", "hiradix_cache.py"),
    UNIFIED_LINE: ("srt", "mem_cache", "unified_radix_cache.py"),
}


@cache
def sglang_line() -> str:
    """The line of the installed SGLang: ``HIRADIX_LINE`` or ``UNIFIED_LINE``. Where no
    SGLang is installed (a client-only environment) the 0.5.12 line: nothing runs it."""
    package = _sglang_package_dir()
    for line in (HIRADIX_LINE, UNIFIED_LINE):
        if package is not None and os.path.isfile(os.path.join(package, *_LINE_FILES[line])):
            return line
    return HIRADIX_LINE


def is_unified_line() -> bool:
    return sglang_line() == UNIFIED_LINE


def sglang_version() -> str:
    """The installed SGLang's version string ("" when none is installed)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ""


def _sglang_package_dir() -> str | None:
    """Where the sglang package lies; found without importing it (its import is heavy)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])


@dataclass(frozen=True)
class HostPoolClasses:
    """Where the installed line keeps the host pool classes migration reads."""

    mha: type
    mla: type
    group: type
    nsa_indexer: type | None  # 0.5.23's DSA indexer pool is not migrated (refused)
    mha_has_v_head_dim: bool  # 0.5.23's MHA host pool may hold V rows of another width


@cache
def host_pool_classes() -> HostPoolClasses:
    if is_unified_line():
        from sglang.srt.mem_cache.pool_host import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        return HostPoolClasses(
            MHATokenToKVPoolHost, MLATokenToKVPoolHost, HostPoolGroup, None, True
        )
    from sglang.srt.mem_cache import memory_pool_host as pools

    return HostPoolClasses(
        pools.MHATokenToKVPoolHost,
        pools.MLATokenToKVPoolHost,
        pools.HostPoolGroup,
        pools.NSAIndexerPoolHost,
        False,
    )


# What the plugin does on 0.5.12 and not on the 0.5.23 line, each with why. Start-up
# refuses them by these texts (`server_args_refusal`, `device_path_missing`, and
# `unified_tree.cache_unsupported` for what only the built cache shows).
DEVICE_PATH_MISSING = (
    "SGLang 0.5.23 has no Scheduler._session_held_tokens, through which the device path "
    "counts its pending device slots: the device path runs on SGLang 0.5.12 only"
)
MEMORY_SAVER_MISSING = (
    "--enable-memory-saver with --enable-kv-migration runs on SGLang 0.5.12 only: 0.5.23 "
    "releases and resumes KV memory outside the scheduler methods the plugin hooks"
)
DATA_PARALLEL_MISSING = (
    "--dp-size / --attn-dp-size > 1 with --enable-kv-migration runs on SGLang 0.5.12 "
    "only: 0.5.23 counts DP ranks differently (dp_size x attn_dp_size, ranks in its "
    "parallel context), and the plugin's DP routing is built and tested for 0.5.12"
)
CONTEXT_PARALLEL_MISSING = (
    "--attn-cp-size / --dcp-size > 1 with --enable-kv-migration runs on SGLang 0.5.12 "
    "only: which pages each CP rank holds on 0.5.23 (KV cache sharding) is not read by "
    "the plugin"
)
STORAGE_BACKEND_MISSING = (
    "--hicache-storage-backend with --enable-kv-migration runs on SGLang 0.5.12 only: "
    "on 0.5.23 the plugin does not compute the page hashes a storage backend keys pages by"
)


SHARED_HOST_PATH_MISSING = (
    "the shared-host path maps the target's host pool from a memory file that the plugin "
    "has SGLang 0.5.12's host pools allocate: it runs on SGLang 0.5.12 only"
)


def shared_host_path_missing() -> str | None:
    """Why the installed SGLang cannot run the shared-host path (None: it can); left
    out at start with this reason, as the device path is."""
    return SHARED_HOST_PATH_MISSING if is_unified_line() else None


def device_path_missing() -> str | None:
    """Why the installed SGLang cannot run the device path (None: it can). A server that
    also serves the host path leaves the device path out, naming this (`paths/factory.py`);
    one that asks for the device path alone is refused at start (`server/server_args.py`)."""
    return DEVICE_PATH_MISSING if is_unified_line() else None


def server_args_refusal(args: Any) -> str | None:
    """A start-up refusal for what the installed SGLang line cannot migrate with (None
    when there is none), read off the flags as the operator gave them (`args`: SGLang's
    `ServerArgs` with the plugin's fields)."""
    if not is_unified_line():
        return None
    if args.enable_memory_saver:
        return MEMORY_SAVER_MISSING
    if max(args.dp_size or 1, args.attn_dp_size or 1) > 1 or args.enable_dp_attention:
        return DATA_PARALLEL_MISSING
    if max(args.attn_cp_size or 1, args.dcp_size or 1) > 1:
        return CONTEXT_PARALLEL_MISSING
    if args.hicache_storage_backend:
        return STORAGE_BACKEND_MISSING
    return None
